"""iptables backend: render of the example state, probability cascade, minimal diffs, observe parsing.

RECORDED_SAVE is `iptables-nft-save -t filter; -t nat; ip6tables-nft-save -t nat` (iptables 1.8.9) taken in a
throwaway netns after applying state/ with the options of example_state(), plus a foreign chain and
foreign rules (FOREIGN-NAT, the ACCEPT for port 22) that observe must ignore.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from helpers import HTTP, STATE_DIR, build, endpoint, endpoint_slice, service

from reconciler.backends.iptables.backend import IptablesBackend, service_view
from reconciler.backends.iptables.observed import read_our_tables
from reconciler.backends.iptables.diff import diff, restore_inputs, script
from reconciler.backends.iptables.render import (
    CLUSTER_IPS, ENDPOINTS_CHECK, EXTERNAL_CHECK, FILTER, FILTER_INPUT, FILTER_OUTPUT, FIREWALL, MAX_CHAIN_NAME,
    NODEPORTS, NON_POD_MASQ, SERVICES, IptablesModel, TableState, ext_chain, fw_chain, render, sep_chain, svc_chain,
)
from reconciler.backends.iptables.save import Rule, format_probability, parse_save
from reconciler.backends.nftables.backend import NftablesBackend
from reconciler.desired import BuildOptions, build_desired_state
from reconciler.sources.manifests import load_directory
from reconciler.state import DesiredState, Endpoint, ServicePort

OPTS = BuildOptions("node-a", ("10.244.0.0/16",), ("10.96.0.0/16",))


def example_state(opts: BuildOptions = OPTS) -> DesiredState:
    return build_desired_state(load_directory(STATE_DIR).objects, opts)


def sp(desired: DesiredState, sid: str) -> ServicePort:
    return desired.by_id()[sid]


def specs(model: IptablesModel, chain: str, family: str = "ipv4", table: str = "nat") -> list[str]:
    return [r.spec() for r in model.table(family, table).chains[chain]]


def C(sid: str) -> str:
    return f'-m comment --comment "{sid}"'


# --------------------------------------------------------------------------- the example


def test_clusterip_chain_masquerades_non_pods_and_balances():
    d = example_state()
    m = render(d)
    web = sp(d, "default/web:http/TCP")
    c = C(web.id)
    seps = [sep_chain(web, Endpoint(ip, 8080)) for ip in ("10.244.1.5", "10.244.2.7", "10.244.3.4")]
    assert specs(m, svc_chain(web)) == [
        f"! -s 10.244.0.0/16 {c} -j RECONCILER-MARK-MASQ",
        f"{c} -m statistic --mode random --probability 0.33333333349 -j {seps[0]}",
        f"-p tcp {c} -m statistic --mode random --probability 0.50000000000 -m tcp "
        "-j DNAT --to-destination 10.244.2.7:8080",
        f"-p tcp {c} -m tcp -j DNAT --to-destination 10.244.3.4:8080",
    ]
    # 10.244.1.5 is on this node: hairpin traffic is masqueraded, only when that endpoint is chosen
    assert specs(m, seps[0]) == [
        f"-s 10.244.1.5/32 {c} -j RECONCILER-MARK-MASQ",
        f"-p tcp {c} -m tcp -j DNAT --to-destination 10.244.1.5:8080",
    ]
    # the remote endpoints are DNATed inline: no chain of their own
    nat = m.table("ipv4", "nat").chains
    assert seps[1] not in nat and seps[2] not in nat
    assert f"-d 10.96.10.20/32 -p tcp {c} -m tcp --dport 80 -j {svc_chain(web)}" in specs(m, SERVICES)
    udp = sp(d, "kube-system/kube-dns:dns/UDP")
    assert (f"-d 10.96.0.10/32 -p udp {C(udp.id)} -m udp --dport 53 -j {svc_chain(udp)}"
            in specs(m, SERVICES))


def test_nodeport_cluster_policy_masquerades_everything():
    d = example_state()
    m = render(d)
    web = sp(d, "default/web:http/TCP")
    c = C(web.id)
    assert specs(m, NODEPORTS)[0] == f"-p tcp {c} -m tcp --dport 30080 -j {ext_chain(web)}"
    ext = specs(m, ext_chain(web))
    assert ext[0] == f"{c} -j RECONCILER-MARK-MASQ"
    assert [r.split(" -j ")[-1] for r in ext[1:]] == [
        sep_chain(web, Endpoint("10.244.1.5", 8080)),
        "DNAT --to-destination 10.244.2.7:8080", "DNAT --to-destination 10.244.3.4:8080"]
    # the jump to the nodeports chain is the last rule, for local destinations but loopback
    assert specs(m, SERVICES)[-1] == "! -d 127.0.0.0/8 -m addrtype --dst-type LOCAL -j RECONCILER-NODEPORTS"
    assert specs(m, SERVICES, "ipv6")[-1] == "! -d ::1/128 -m addrtype --dst-type LOCAL -j RECONCILER-NODEPORTS"


def test_etp_local_short_circuits_pods_and_node_and_keeps_client_ips():
    d = example_state()
    m = render(d)
    fe = sp(d, "shop/frontend:https/TCP")
    c = C(fe.id)
    local = sep_chain(fe, Endpoint("10.244.1.20", 8443))  # hairpin: a chain; the remote one is DNATed inline
    remote = "-m tcp -j DNAT --to-destination 10.244.2.20:8443"
    half = "-m statistic --mode random --probability 0.50000000000"
    addrtype = "-m addrtype --src-type LOCAL"
    assert specs(m, ext_chain(fe)) == [
        f"-s 10.244.2.20/32 {c} -j RECONCILER-MARK-MASQ",  # a pod of node-b may be sent back to itself
        f"-s 10.244.0.0/16 {c} {half} -j {local}",
        f"-s 10.244.0.0/16 -p tcp {c} {remote}",
        f"{c} {addrtype} -j RECONCILER-MARK-MASQ",
        f"{c} {addrtype} {half} -j {local}",
        f"-p tcp {c} {addrtype} {remote}",
        f"{c} -j {local}",  # everyone else: local endpoints only, not masqueraded
    ]
    assert sep_chain(fe, Endpoint("10.244.2.20", 8443)) not in m.table("ipv4", "nat").chains
    # IPv6 has no cluster CIDR: no pod short circuit, like the nftables backend
    v6 = specs(m, ext_chain(fe), "ipv6")
    assert not any(r.startswith("-s ") for r in v6) and len(v6) == 4
    assert v6[2] == f"-p tcp {c} {addrtype} -m tcp -j DNAT --to-destination [fd00:244:2::20]:8443"
    services = specs(m, SERVICES)
    assert f"-d 172.30.1.50/32 -p tcp {c} -m tcp --dport 443 -j {ext_chain(fe)}" in services
    # the LB IP with source ranges goes through the firewall chain; the rest is dropped in filter
    assert f"-d 172.30.1.10/32 -p tcp {c} -m tcp --dport 443 -g {fw_chain(fe)}" in services
    assert specs(m, fw_chain(fe)) == [f"-s 172.30.0.0/24 {c} -j {ext_chain(fe)}",
                                      f"-s 198.51.100.0/24 {c} -j {ext_chain(fe)}"]
    assert specs(m, FIREWALL, table="filter") == [f"-d 172.30.1.10/32 -p tcp {c} -m tcp --dport 443 -j DROP"]
    assert specs(m, FIREWALL, "ipv6", "filter") == [f"-d fd00:31::10/128 -p tcp {c} -m tcp --dport 443 -j DROP"]
    assert "-j DNAT --to-destination [fd00:244:1::20]:8443" in specs(
        m, sep_chain(fe, Endpoint("fd00:244:1::20", 8443)), "ipv6")[-1]


def test_reject_and_service_cidr_checks_in_filter():
    d = example_state()
    m = render(d)
    prom = sp(d, "monitoring/prometheus:web/TCP")
    check = specs(m, ENDPOINTS_CHECK, table="filter")
    assert check == [f"-d 10.96.30.9/32 -p tcp {C(prom.id)} -m tcp --dport 9090 "
                     "-j REJECT --reject-with icmp-port-unreachable"]
    assert svc_chain(prom) not in m.table("ipv4", "nat").chains
    assert not any(prom.id in r for r in specs(m, SERVICES))
    # unused ports of used ClusterIPs are rejected, unallocated service IPs dropped (after the per-service
    # rules), from FORWARD and OUTPUT only (as kube-proxy's nftables mode): a ClusterIP that is a local
    # address keeps what listens on it
    ips = specs(m, CLUSTER_IPS, table="filter")
    assert "-d 10.96.0.10/32 -j REJECT --reject-with icmp-port-unreachable" in ips
    assert ips[-1] == "-d 10.96.0.0/16 -j DROP"
    # hooked as kube-proxy's iptables mode hooks KUBE-SERVICES (ClusterIPs: FORWARD, OUTPUT) and
    # KUBE-EXTERNAL-SERVICES (external addresses, nodePorts: INPUT, FORWARD)
    assert specs(m, FILTER, table="filter") == [f"-j {FIREWALL}", f"-j {ENDPOINTS_CHECK}", f"-j {EXTERNAL_CHECK}",
                                                f"-j {CLUSTER_IPS}"]
    assert specs(m, FILTER_OUTPUT, table="filter") == [f"-j {FIREWALL}", f"-j {ENDPOINTS_CHECK}", f"-j {CLUSTER_IPS}"]
    assert specs(m, FILTER_INPUT, table="filter") == [f"-j {FIREWALL}", f"-j {EXTERNAL_CHECK}"]
    hooks = {r.chain: r.target for r in m.table("ipv4", "filter").jumps}
    assert hooks == {"INPUT": FILTER_INPUT, "FORWARD": FILTER, "OUTPUT": FILTER_OUTPUT}
    assert specs(m, CLUSTER_IPS, "ipv6", "filter") == []  # no IPv6 service CIDR given


def test_affinity_uses_recent_per_endpoint():
    d = example_state()
    m = render(d)
    cart = sp(d, "shop/cart:http/TCP")
    c = C(cart.id)
    a, b = (sep_chain(cart, Endpoint(ip, 8080)) for ip in ("10.244.1.31", "10.244.1.32"))
    mask = "--mask 255.255.255.255 --rsource"
    assert specs(m, svc_chain(cart)) == [
        f"! -s 10.244.0.0/16 {c} -j RECONCILER-MARK-MASQ",
        f"{c} -m recent --rcheck --seconds 600 --reap --name {a} {mask} -j {a}",
        f"{c} -m recent --rcheck --seconds 600 --reap --name {b} {mask} -j {b}",
        f"{c} -m statistic --mode random --probability 0.50000000000 -j {a}",
        f"{c} -j {b}",
    ]
    assert specs(m, a)[-1] == f"-p tcp {c} -m recent --set --name {a} {mask} -m tcp -j DNAT --to-destination 10.244.1.31:8080"


def test_sep_chains_only_for_hairpin_and_affinity_endpoints():
    objs = [service("aff", "10.96.0.10", HTTP, sessionAffinity="ClientIP"),
            endpoint_slice("aff", [endpoint("10.244.2.1", node="node-b"), endpoint("10.244.1.1")]),
            service("udp", "10.96.0.11", [{"name": "dns", "port": 53, "targetPort": 5353, "protocol": "UDP"}]),
            endpoint_slice("udp", [endpoint("10.244.2.2", node="node-b"), endpoint("10.244.1.2")],
                           port=5353, port_name="dns", protocol="UDP")]
    d = build(objs)
    m = render(d)
    aff, udp = d.by_id()["default/aff:http/TCP"], d.by_id()["default/udp:dns/UDP"]
    nat = m.table("ipv4", "nat").chains
    seps = {n for n in nat if n.startswith("RECONCILER-SEP-")}
    # affinity: every endpoint (the remote one only sets the recent entry); no affinity: only the hairpin one
    assert seps == {sep_chain(aff, Endpoint("10.244.2.1", 8080)), sep_chain(aff, Endpoint("10.244.1.1", 8080)),
                    sep_chain(udp, Endpoint("10.244.1.2", 5353))}
    remote = sep_chain(aff, Endpoint("10.244.2.1", 8080))
    assert specs(m, remote) == [f"-p tcp {C(aff.id)} -m recent --set --name {remote} --mask 255.255.255.255 "
                                "--rsource -m tcp -j DNAT --to-destination 10.244.2.1:8080"]
    assert specs(m, svc_chain(udp))[1:] == [
        f"{C(udp.id)} -m statistic --mode random --probability 0.50000000000 "
        f"-j {sep_chain(udp, Endpoint('10.244.1.2', 5353))}",
        f"-p udp {C(udp.id)} -m udp -j DNAT --to-destination 10.244.2.2:5353",
    ]
    assert service_view(m)[udp.id]["endpoints"] == ["10.244.1.2:5353", "10.244.2.2:5353"]
    nft = NftablesBackend()
    assert service_view(m) == nft.service_view(nft.render(d))


def test_skeleton_and_jumps():
    m = render(example_state())
    nat = m.table("ipv4", "nat")
    assert [r.spec() for r in nat.chains["RECONCILER-POSTROUTING"]] == [
        "-m mark ! --mark 0x4000/0x4000 -j RETURN",
        "-j MARK --set-xmark 0x4000/0x0",
        "-j MASQUERADE --random-fully",
    ]
    assert [r.spec() for r in nat.chains["RECONCILER-MARK-MASQ"]] == ["-j MARK --set-xmark 0x4000/0x4000"]
    assert [r.to_text() for r in nat.jumps] == [
        '-A PREROUTING -m comment --comment "service-reconciler service portals" -j RECONCILER-SERVICES',
        '-A OUTPUT -m comment --comment "service-reconciler service portals" -j RECONCILER-SERVICES',
        '-A POSTROUTING -m comment --comment "service-reconciler masquerading" -j RECONCILER-POSTROUTING',
    ]
    assert [r.chain for r in m.table("ipv4", "filter").jumps] == ["INPUT", "FORWARD", "OUTPUT"]
    assert all(r.args[:4] == ("-m", "conntrack", "--ctstate", "NEW") for r in m.table("ipv4", "filter").jumps)
    for fam in m.families.values():
        for t in fam.values():
            assert all(len(name) <= MAX_CHAIN_NAME and re.fullmatch(r"RECONCILER-[A-Z0-9-]+", name) for name in t.chains)


def test_service_view_reads_the_same_as_nftables():
    d = example_state()
    want = NftablesBackend().service_view(NftablesBackend().render(d))
    assert service_view(render(d)) == want
    assert want["monitoring/prometheus:web/TCP"]["addresses"] == ["10.96.30.9:9090/tcp (reject)"]
    # node-c has no local endpoint of the ETP Local frontend: its external addresses are listed
    # with their DROP alone (the DNAT beside it serves nothing new), the ClusterIP as it is
    d = example_state(BuildOptions("node-c", ("10.244.0.0/16",), ("10.96.0.0/16",)))
    want = NftablesBackend().service_view(NftablesBackend().render(d))
    assert service_view(render(d)) == want
    assert want["shop/frontend:https/TCP"]["addresses"] == [
        "10.96.20.30:443/tcp", "172.30.1.10:443/tcp (drop)", "172.30.1.50:443/tcp (drop)",
        "[fd00:31::10]:443/tcp (drop)", "[fd00:96::20:30]:443/tcp", "nodePort 31443/tcp (drop)"]


def test_first_apply_script_is_one_restore_per_family():
    m = render(example_state())
    ops = diff(m, IptablesModel())
    inputs = restore_inputs(ops)
    assert list(inputs) == ["iptables", "ip6tables"]
    v4 = inputs["iptables"].splitlines()
    assert v4[0] == "*filter" and v4.count("COMMIT") == 2 and "*nat" in v4
    nat = v4[v4.index("*nat"):]
    # declarations, then rules, then the jumps at the top of the built-in chains
    phases = [0 if line.startswith(":") else 1 if line.startswith("-A ") else 2 for line in nat[1:-1]]
    assert phases == sorted(phases) and set(phases) == {0, 1, 2}
    assert '-I PREROUTING 1 -m comment --comment "service-reconciler service portals" -j RECONCILER-SERVICES' in nat
    assert script(ops).startswith("# iptables-restore --noflush -w 5\n*filter\n")
    # every per-service chain operation is attributed to its service port
    for op in ops:
        if op.name.split()[-1].startswith(("RECONCILER-SVC-", "RECONCILER-SEP-", "RECONCILER-EXT-")):
            assert op.service is not None


# --------------------------------------------------------------------------- probabilities


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 10])
def test_probability_cascade(n):
    objs = [service("web", "10.96.0.10", HTTP),
            endpoint_slice("web", [endpoint(f"10.244.1.{i + 1}") for i in range(n)])]
    m = render(build(objs))
    rules = specs(m, svc_chain(build(objs).services[0]))[1:]  # after the masquerade rule
    assert len(rules) == n
    probs = [re.search(r"--probability (\S+)", r) for r in rules]
    assert probs[-1] is None  # the last endpoint takes what is left
    assert [p.group(1) for p in probs[:-1] if p] == [format_probability(1.0 / (n - i)) for i in range(n - 1)]
    # each endpoint ends up equally likely
    left, shares = 1.0, []
    for p in probs[:-1]:
        assert p is not None
        shares.append(left * float(p.group(1)))
        left -= shares[-1]
    shares.append(left)
    assert all(abs(s - 1.0 / n) < 1e-9 for s in shares)
    if n == 4:
        assert [p.group(1) for p in probs[:-1] if p] == ["0.25000000000", "0.33333333349", "0.50000000000"]


# --------------------------------------------------------------------------- minimal diffs


def many_services(changed: bool = False, n: int = 40, node: str = "node-b"):
    """Endpoints on node-b are remote (DNATed inline); on node-a (this node) they are hairpin (SEP chains)."""
    objs = []
    for i in range(n):
        name = f"svc{i:02d}"
        objs.append(service(name, f"10.96.1.{i + 1}", [{**HTTP[0], "nodePort": 30000 + i}], type="NodePort"))
        ips = [f"10.244.{i}.{j + 1}" for j in range(3)]
        if changed and i == 17:
            ips[1] = "10.244.99.99"
        objs.append(endpoint_slice(name, [endpoint(ip, node=node) for ip in ips]))
    return build(objs, service_cidrs=("10.96.0.0/16",))


def test_one_changed_endpoint_rewrites_only_that_service():
    old, new = render(many_services()), render(many_services(changed=True))
    assert diff(old, old) == []
    ops = diff(new, old)
    sid = "default/svc17:http/TCP"
    assert {op.service for op in ops} == {sid}
    s = many_services(changed=True).by_id()[sid]
    assert {op.name.split()[-1] for op in ops} == {svc_chain(s), ext_chain(s)}
    # SVC: redeclare + masquerade + 3 endpoints; EXT: redeclare + mark + 3; no chain created or deleted
    assert len(ops) == 5 + 5
    assert not [op for op in ops if op.action == "-"]
    assert all(o.name.startswith("iptables nat ") for o in ops)
    # the new endpoint sorts last: the unconditional end of the cascade
    assert (f"-A {svc_chain(s)} -p tcp {C(sid)} -m tcp -j DNAT --to-destination 10.244.99.99:8080"
            in [op.text for op in ops])


def test_one_changed_hairpin_endpoint_replaces_its_sep_chain_after_the_rewrite():
    old, new = render(many_services(node="node-a")), render(many_services(changed=True, node="node-a"))
    ops = diff(new, old)
    sid = "default/svc17:http/TCP"
    assert {op.service for op in ops} == {sid}
    s = many_services(changed=True, node="node-a").by_id()[sid]
    gone, added = sep_chain(s, Endpoint("10.244.17.2", 8080)), sep_chain(s, Endpoint("10.244.99.99", 8080))
    assert {op.name.split()[-1] for op in ops} == {svc_chain(s), ext_chain(s), gone, added}
    # SVC + EXT as above; new SEP: declare + hairpin masquerade + DNAT; old SEP: flush + delete
    assert len(ops) == 5 + 5 + 3 + 2
    assert [op.text for op in ops if op.action == "-"] == [f"-X {gone}"]
    text = restore_inputs(ops)["iptables"]
    assert text.startswith("*nat\n") and text.rstrip().endswith(f"-X {gone}\nCOMMIT")
    lines = text.splitlines()
    # the old chain is flushed, the SVC/EXT chains that jumped to it rewritten, and only then is it deleted
    assert lines.index(f":{gone} - [0:0]") < lines.index(f"-X {gone}")
    assert max(i for i, line in enumerate(lines) if line.startswith("-A ")) < lines.index(f"-X {gone}")


def test_removed_service_and_verdict_change_touch_shared_chains():
    old = render(many_services())
    d = many_services()
    fewer = DesiredState(d.node, d.masqueradeAll, d.families, tuple(s for s in d.services if s.name != "svc03"))
    ops = diff(render(fewer), old)
    s = d.by_id()["default/svc03:http/TCP"]
    deleted = {op.text for op in ops if op.action == "-" and op.kind == "chain"}
    assert deleted == {f"-X {svc_chain(s)}", f"-X {ext_chain(s)}"}  # remote endpoints have no SEP chains
    rewritten = {op.name.split()[-1] for op in ops if op.kind == "chain" and op.action == "~" and op.text.startswith(":")}
    assert rewritten == {svc_chain(s), ext_chain(s)}  # flushed before -X; the long shared chains are not rewritten
    # ... they lose just its rules, named by their spec
    removed = {op.name.split()[-1]: op.text for op in ops if op.kind == "rule"}
    assert set(removed) == {SERVICES, NODEPORTS, CLUSTER_IPS}
    assert all(t.startswith(f"-D {c} ") and ("svc03" in t or "10.96.1.4/32" in t) for c, t in removed.items())
    assert diff(old, old) == []


def test_rules_a_rewritten_shared_chain_restates_change_no_service_port():
    """A short shared chain is rewritten whole when one service port is added to it: the rules
    it already held belong to the chain in the plan, so only the added port counts as touched."""
    from reconciler.reconcile import touched_services
    old = render(many_services(n=4))
    d = many_services(n=5)
    ops = diff(render(d), old)
    rewritten = {op.name.split()[-1] for op in ops if op.kind == "chain" and op.action == "~"}
    assert SERVICES in rewritten  # (4 -> 5 rules: too short to edit in place)
    restated = [op for op in ops if op.kind == "rule" and op.name.endswith(f" {SERVICES}") and "svc00" in op.text]
    assert restated and all(op.service is None for op in restated)
    assert touched_services(ops) == {"default/svc04:http/TCP"}


def _apply_edits(chain: list[tuple[str, ...]], name: str, ops) -> list[tuple[str, ...]]:
    """What iptables-restore does with our -D/-I lines on one chain (a tiny model of it)."""
    from reconciler.backends.iptables.save import split_args
    chain = list(chain)
    for op in ops:
        args = split_args(op.text)
        if args[:2] == ["-D", name]:
            chain.remove(tuple(args[2:]))
        elif args[:2] == ["-I", name]:
            chain.insert(int(args[2]) - 1, tuple(args[3:]))
        else:
            raise AssertionError(op.text)
    return chain


def test_long_chains_change_in_place_and_the_edits_give_the_desired_chain():
    from reconciler.backends.iptables.diff import _edit_in_place
    from reconciler.backends.iptables.save import Rule

    base = [Rule("C", ("-d", f"10.0.0.{i}/32", "-j", f"T{i}")) for i in range(60)]
    dup = Rule("C", ("-j", "SAME"))
    cases = [
        base[:10] + [Rule("C", ("-j", "NEW"))] + base[10:],  # one inserted
        base[:30] + base[31:],  # one removed
        base[:5] + [Rule("C", ("-j", "X")), Rule("C", ("-j", "Y"))] + base[8:],  # a stretch replaced
        [dup] + base + [dup],  # duplicates around
    ]
    for old in ([*base], [dup] + base[:40] + [dup] + base[40:]):
        for new in cases:
            ops = _edit_in_place("iptables", "nat", "C", tuple(old), tuple(new))
            if ops is None:
                continue
            assert _apply_edits([r.args for r in old], "C", ops) == [r.args for r in new]
    apart = base[:10] + base[11:50] + [Rule("C", ("-j", "NEW"))] + base[50:]  # two edits far apart
    ops = _edit_in_place("iptables", "nat", "C", tuple(base), tuple(apart))
    assert [op.text for op in ops] == ["-D C -d 10.0.0.10/32 -j T10", "-I C 50 -j NEW"]
    assert _apply_edits([r.args for r in base], "C", ops) == [r.args for r in apart]
    twice = base[:40] + [dup] + base[40:] + [dup]  # a rule twice: a delete could not name it
    assert _edit_in_place("iptables", "nat", "C", tuple(twice), tuple(base + [dup])) is None
    swapped = base[:20] + [base[21], base[20]] + base[22:]
    assert _edit_in_place("iptables", "nat", "C", tuple(base), tuple(swapped)) is None  # reordered
    assert _edit_in_place("iptables", "nat", "C", tuple(base), tuple(reversed(base))) is None  # too much: rewrite
    assert _edit_in_place("iptables", "nat", "C", tuple(base[:10]), tuple(base[:9])) is None  # short: rewrite


# --------------------------------------------------------------------------- options


def test_options_masquerade_all_several_cidrs_nodeport_addresses():
    objs = [service("web", "10.96.0.10", [{**HTTP[0], "nodePort": 30080}], type="NodePort"),
            endpoint_slice("web", [endpoint("10.244.1.1")])]
    d = build(objs, cluster_cidrs=("10.244.0.0/16", "10.246.0.0/16"), nodeport_cidrs=("192.168.0.0/24",))
    m = render(d)
    s = d.services[0]
    assert specs(m, svc_chain(s))[0] == f"{C(s.id)} -j {NON_POD_MASQ}"
    assert specs(m, NON_POD_MASQ) == ["-s 10.244.0.0/16 -j RETURN", "-s 10.246.0.0/16 -j RETURN",
                                      "-j RECONCILER-MARK-MASQ"]
    # (CIDRs that make one are one: 10.244.0.0/16 and 10.245.0.0/16 are 10.244.0.0/15)
    merged = render(build(objs, cluster_cidrs=("10.244.0.0/16", "10.245.0.0/16")))
    assert specs(merged, svc_chain(s))[0] == f"! -s 10.244.0.0/15 {C(s.id)} -j RECONCILER-MARK-MASQ"
    assert specs(m, SERVICES)[-1] == "-d 192.168.0.0/24 -m addrtype --dst-type LOCAL -j RECONCILER-NODEPORTS"
    d = build(objs, masquerade_all=True)
    m = render(d)
    assert specs(m, svc_chain(s))[0] == f"{C(s.id)} -j RECONCILER-MARK-MASQ"
    assert NON_POD_MASQ not in m.table("ipv4", "nat").chains
    # a family the flag names no CIDR of, or a zero CIDR: every local address (as kube-proxy)
    everywhere = "! -d 127.0.0.0/8 -m addrtype --dst-type LOCAL -j RECONCILER-NODEPORTS"
    for cidrs in ((), ("fd00::/64",), ("0.0.0.0/0", "192.168.0.0/24")):
        assert specs(render(build(objs, nodeport_cidrs=cidrs)), SERVICES)[-1] == everywhere, cidrs
    # a CIDR holding loopback serves all of it but loopback (kube-proxy's nftables mode never serves it)
    assert specs(render(build(objs, nodeport_cidrs=("0.0.0.0/1", "192.168.0.0/24"))), SERVICES)[-2:] == [
        "-d 0.0.0.0/1 -m iprange ! --dst-range 127.0.0.0-127.255.255.255 -m addrtype --dst-type LOCAL "
        "-j RECONCILER-NODEPORTS",
        "-d 192.168.0.0/24 -m addrtype --dst-type LOCAL -j RECONCILER-NODEPORTS"]


def test_local_policies_without_local_endpoints_drop():
    objs = [service("web", "10.96.0.10", [{**HTTP[0], "nodePort": 30080}], type="NodePort",
                    externalTrafficPolicy="Local"),
            service("itp", "10.96.0.11", HTTP, internalTrafficPolicy="Local"),
            endpoint_slice("web", [endpoint("10.244.2.1", node="node-b")]),
            endpoint_slice("itp", [endpoint("10.244.2.2", node="node-b")])]
    d = build(objs)
    m = render(d)
    web, itp = d.by_id()["default/web:http/TCP"], d.by_id()["default/itp:http/TCP"]
    assert specs(m, ENDPOINTS_CHECK, table="filter") == [f"-d 10.96.0.11/32 -p tcp {C(itp.id)} -m tcp --dport 80 -j DROP"]
    # a nodePort on any local address, as kube-proxy's KUBE-EXTERNAL-SERVICES (not only --nodeport-addresses)
    assert specs(m, EXTERNAL_CHECK, table="filter") == [
        f"! -d 127.0.0.0/8 -p tcp {C(web.id)} -m addrtype --dst-type LOCAL -m tcp --dport 30080 -j DROP"]
    narrowed = render(build(objs, nodeport_cidrs=("192.168.1.0/24",)))
    assert specs(narrowed, EXTERNAL_CHECK, table="filter") == specs(m, EXTERNAL_CHECK, table="filter")
    # pods and the node itself still reach the remote endpoint through the nodePort
    ext = specs(m, ext_chain(web))
    # the remote endpoint pod's own traffic masqueraded (it may be sent back to itself), then the
    # pod and node short-circuits
    assert len(ext) == 4 and ext[0].startswith("-s 10.244.2.1/32 ") and ext[0].endswith("-j RECONCILER-MARK-MASQ")
    assert ext[1].startswith("-s 10.244.0.0/16 ") and all("LOCAL" in r for r in ext[2:])
    view = service_view(m)
    assert view[web.id]["addresses"] == ["10.96.0.10:80/tcp", "nodePort 30080/tcp (drop)"]
    assert view[itp.id]["addresses"] == ["10.96.0.11:80/tcp (drop)"]
    nft = NftablesBackend()
    assert view == nft.service_view(nft.render(d))


# --------------------------------------------------------------------------- observe / parse

def save_runs() -> list[tuple[str, str, str]]:
    """(family, table, text) per iptables-save run in RECORDED_SAVE."""
    runs = []
    for chunk in RECORDED_SAVE.split("# Generated by ")[1:]:
        header, body = chunk.split("\n", 1)
        body = body.split("# Completed", 1)[0]
        table = body[1:body.index("\n")]
        runs.append(("ipv6" if header.startswith("ip6tables") else "ipv4", table, body))
    return runs


def recorded() -> dict[tuple[str, str], TableState]:
    """(family, table) -> our part of it, from the recorded save output."""
    return {(fam, table): read_our_tables(body.splitlines(True))[table] for fam, table, body in save_runs()}


def test_recorded_save_output_parses_back_to_the_rendered_model():
    want = render(example_state())
    have = recorded()
    assert set(have) == {("ipv4", "filter"), ("ipv4", "nat"), ("ipv6", "nat")}
    for (fam, table), state in have.items():
        w = want.table(fam, table)
        assert {n: [r.args for r in rules] for n, rules in state.chains.items()} == \
               {n: [r.args for r in rules] for n, rules in w.chains.items()}
        assert [r.args for r in state.jumps] == [r.args for r in w.jumps]
    # foreign chains and rules are not ours
    assert "FOREIGN-NAT" not in have[("ipv4", "nat")].chains
    assert {r.target for r in have[("ipv4", "filter")].jumps} == {"RECONCILER-FILTER", "RECONCILER-FILTER-INPUT",
                                                                  "RECONCILER-FILTER-OUTPUT"}


def test_recorded_output_round_trips_through_the_parser():
    for _, _, body in save_runs():
        assert parse_save(body).to_text() == body


def test_observed_model_diffs_empty_and_cleanup_removes_only_ours():
    want = render(example_state())
    have_parts = recorded()
    have = IptablesModel({})
    for (fam, table), state in have_parts.items():
        have.families.setdefault(fam, {})[table] = state
    # the v6 filter table was not recorded: only it is (re)created
    ops = diff(want, have)
    assert ops and all(op.name.startswith("ip6tables filter ") for op in ops)
    # the save reads as our rendering, ETP Local's endpoints of external traffic too (SEP chains)
    frontend = "shop/frontend:https/TCP"
    assert service_view(have, {frontend}) == service_view(want, {frontend})
    assert service_view(have, {frontend})[frontend]["externalEndpoints"] == ["10.244.1.20:8443", "[fd00:244:1::20]:8443"]
    ops = diff(IptablesModel(), have)
    text = restore_inputs(ops)["iptables"]
    assert "FOREIGN" not in text and "--dport 22" not in text
    nat = text[text.index("*nat"):].splitlines()
    # flush everything, remove our jumps, then delete the (now unreferenced) chains
    first_d = next(i for i, line in enumerate(nat) if line.startswith("-D "))
    first_x = next(i for i, line in enumerate(nat) if line.startswith("-X "))
    assert all(line.startswith(":") for line in nat[1:first_d])
    assert first_d < first_x and nat[-1] == "COMMIT"
    assert '-D PREROUTING -m comment --comment "service-reconciler service portals" -j RECONCILER-SERVICES' in nat
    assert sum(line.startswith("-X ") for line in nat) == len(have_parts[("ipv4", "nat")].chains)


def test_jumps_are_inserted_once_and_duplicates_removed():
    want = render(example_state())
    have = render(example_state())
    nat = have.families["ipv4"]["nat"]
    extra = Rule("PREROUTING", ("-m", "comment", "--comment", "x", "-j", "RECONCILER-SERVICES"))
    have.families["ipv4"]["nat"] = TableState(nat.chains, (nat.jumps[0], nat.jumps[0], *nat.jumps[1:], extra))
    ops = diff(want, have)
    assert [op.text for op in ops] == [  # (the rule commented x is somebody else's: left alone)
        '-D PREROUTING -m comment --comment "service-reconciler service portals" -j RECONCILER-SERVICES',
    ]
    have.families["ipv4"]["nat"] = TableState(nat.chains, nat.jumps[1:])
    assert [op.text for op in diff(want, have)] == [
        '-I PREROUTING 1 -m comment --comment "service-reconciler service portals" -j RECONCILER-SERVICES']


def test_a_rule_that_is_not_ours_jumping_to_our_chain_is_left_alone_and_the_chain_kept(caplog):
    """Somebody's rule in a built-in chain that jumps to one of our chains is never deleted (the
    tool touches only its own objects): a chain it jumps to that is to go is emptied, not deleted,
    with a warning naming the rule; emptied, it needs nothing more (the plan converges)."""
    have = render(example_state())
    nat = have.families["ipv4"]["nat"]
    svc = next(n for n in nat.chains if n.startswith("RECONCILER-SVC-"))
    theirs = Rule("PREROUTING", ("-s", "192.0.2.0/24", "-m", "comment", "--comment", "ops: canary", "-j", svc))
    have.families["ipv4"]["nat"] = TableState(nat.chains, (*nat.jumps, theirs))
    ops = diff(IptablesModel(), have)  # (cleanup)
    texts = [op.text for op in ops if op.name == f"iptables nat {svc}" or op.name == "iptables nat PREROUTING"]
    assert f":{svc} - [0:0]" in texts and f"-X {svc}" not in texts
    assert not any("canary" in op.text for op in ops)
    assert any(op.text == "-X RECONCILER-SERVICES" for op in ops)  # (what nobody else references still goes)
    assert f"chain {svc} is kept (emptied), not deleted: a rule that is not ours jumps to it: -A PREROUTING " \
           f'-s 192.0.2.0/24 -m comment --comment "ops: canary" -j {svc}' in caplog.text
    emptied = IptablesModel()
    emptied.families["ipv4"] = {"filter": TableState(), "nat": TableState({svc: ()}, (theirs,))}
    assert diff(IptablesModel(), emptied) == []


def test_read_our_tables_ignores_kube_proxy_rules():
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "data" / "iptables" / "save.txt").read_text()
    tables = read_our_tables(text.splitlines(True))
    assert set(tables) == {"filter", "nat"} and all(t.empty for t in tables.values())


def test_backend_interface_and_model_dict():
    b = IptablesBackend(flavour="legacy")
    assert b.mode == "iptables" and b.flavour == "legacy"
    m = b.render(example_state())
    d = b.model_to_dict(m)
    assert set(d) == {"ipv4", "ipv6"} and set(d["ipv4"]) == {"filter", "nat"}
    assert d["ipv4"]["nat"]["jumps"][0].startswith("-A PREROUTING ")
    with pytest.raises(ValueError):
        IptablesBackend(flavour="bogus")


RECORDED_SAVE = r"""# Generated by iptables-nft-save v1.8.9 (nf_tables) on Wed Dec  2 18:02:41 2026
*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:RECONCILER-CLUSTER-IPS - [0:0]
:RECONCILER-ENDPOINTS-CHECK - [0:0]
:RECONCILER-EXTERNAL-CHECK - [0:0]
:RECONCILER-FILTER - [0:0]
:RECONCILER-FILTER-INPUT - [0:0]
:RECONCILER-FILTER-OUTPUT - [0:0]
:RECONCILER-FIREWALL - [0:0]
-A INPUT -m conntrack --ctstate NEW -m comment --comment "service-reconciler service checks" -j RECONCILER-FILTER-INPUT
-A INPUT -p tcp -m tcp --dport 22 -j ACCEPT
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "service-reconciler service checks" -j RECONCILER-FILTER
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "service-reconciler service checks" -j RECONCILER-FILTER-OUTPUT
-A RECONCILER-CLUSTER-IPS -d 10.96.10.20/32 -j REJECT --reject-with icmp-port-unreachable
-A RECONCILER-CLUSTER-IPS -d 10.96.0.10/32 -j REJECT --reject-with icmp-port-unreachable
-A RECONCILER-CLUSTER-IPS -d 10.96.30.9/32 -j REJECT --reject-with icmp-port-unreachable
-A RECONCILER-CLUSTER-IPS -d 10.96.20.40/32 -j REJECT --reject-with icmp-port-unreachable
-A RECONCILER-CLUSTER-IPS -d 10.96.20.30/32 -j REJECT --reject-with icmp-port-unreachable
-A RECONCILER-CLUSTER-IPS -d 10.96.0.0/16 -j DROP
-A RECONCILER-ENDPOINTS-CHECK -d 10.96.30.9/32 -p tcp -m comment --comment "monitoring/prometheus:web/TCP" -m tcp --dport 9090 -j REJECT --reject-with icmp-port-unreachable
-A RECONCILER-FILTER -j RECONCILER-FIREWALL
-A RECONCILER-FILTER -j RECONCILER-ENDPOINTS-CHECK
-A RECONCILER-FILTER -j RECONCILER-EXTERNAL-CHECK
-A RECONCILER-FILTER -j RECONCILER-CLUSTER-IPS
-A RECONCILER-FILTER-INPUT -j RECONCILER-FIREWALL
-A RECONCILER-FILTER-INPUT -j RECONCILER-EXTERNAL-CHECK
-A RECONCILER-FILTER-OUTPUT -j RECONCILER-FIREWALL
-A RECONCILER-FILTER-OUTPUT -j RECONCILER-ENDPOINTS-CHECK
-A RECONCILER-FILTER-OUTPUT -j RECONCILER-CLUSTER-IPS
-A RECONCILER-FIREWALL -d 172.30.1.10/32 -p tcp -m comment --comment "shop/frontend:https/TCP" -m tcp --dport 443 -j DROP
COMMIT
# Completed on Wed Dec  2 18:02:41 2026
# Generated by iptables-nft-save v1.8.9 (nf_tables) on Wed Dec  2 18:02:41 2026
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:FOREIGN-NAT - [0:0]
:RECONCILER-EXT-35H3VJFRPKQ2M - [0:0]
:RECONCILER-EXT-PK5WNJDG7QFFB - [0:0]
:RECONCILER-FW-35H3VJFRPKQ2M - [0:0]
:RECONCILER-MARK-MASQ - [0:0]
:RECONCILER-NODEPORTS - [0:0]
:RECONCILER-POSTROUTING - [0:0]
:RECONCILER-SEP-CSFVUMPCY4P2I - [0:0]
:RECONCILER-SEP-JFN6BS5IC4XZD - [0:0]
:RECONCILER-SEP-LAK2HJHCY5WZK - [0:0]
:RECONCILER-SEP-LE34NP4PQFRZ6 - [0:0]
:RECONCILER-SEP-UWUX6W6NP5UVU - [0:0]
:RECONCILER-SEP-Y55YNKWFOFFQG - [0:0]
:RECONCILER-SERVICES - [0:0]
:RECONCILER-SVC-35H3VJFRPKQ2M - [0:0]
:RECONCILER-SVC-PK5WNJDG7QFFB - [0:0]
:RECONCILER-SVC-R32OLB4X65WJ2 - [0:0]
:RECONCILER-SVC-WCH7PXWOE4XNM - [0:0]
:RECONCILER-SVC-ZMRO3S6EELJCK - [0:0]
-A PREROUTING -m comment --comment "service-reconciler service portals" -j RECONCILER-SERVICES
-A PREROUTING -j FOREIGN-NAT
-A OUTPUT -m comment --comment "service-reconciler service portals" -j RECONCILER-SERVICES
-A POSTROUTING -m comment --comment "service-reconciler masquerading" -j RECONCILER-POSTROUTING
-A RECONCILER-EXT-35H3VJFRPKQ2M -s 10.244.2.20/32 -m comment --comment "shop/frontend:https/TCP" -j RECONCILER-MARK-MASQ
-A RECONCILER-EXT-35H3VJFRPKQ2M -s 10.244.0.0/16 -m comment --comment "shop/frontend:https/TCP" -m statistic --mode random --probability 0.50000000000 -j RECONCILER-SEP-UWUX6W6NP5UVU
-A RECONCILER-EXT-35H3VJFRPKQ2M -s 10.244.0.0/16 -p tcp -m comment --comment "shop/frontend:https/TCP" -m tcp -j DNAT --to-destination 10.244.2.20:8443
-A RECONCILER-EXT-35H3VJFRPKQ2M -m comment --comment "shop/frontend:https/TCP" -m addrtype --src-type LOCAL -j RECONCILER-MARK-MASQ
-A RECONCILER-EXT-35H3VJFRPKQ2M -m comment --comment "shop/frontend:https/TCP" -m addrtype --src-type LOCAL -m statistic --mode random --probability 0.50000000000 -j RECONCILER-SEP-UWUX6W6NP5UVU
-A RECONCILER-EXT-35H3VJFRPKQ2M -p tcp -m comment --comment "shop/frontend:https/TCP" -m addrtype --src-type LOCAL -m tcp -j DNAT --to-destination 10.244.2.20:8443
-A RECONCILER-EXT-35H3VJFRPKQ2M -m comment --comment "shop/frontend:https/TCP" -j RECONCILER-SEP-UWUX6W6NP5UVU
-A RECONCILER-EXT-PK5WNJDG7QFFB -m comment --comment "default/web:http/TCP" -j RECONCILER-MARK-MASQ
-A RECONCILER-EXT-PK5WNJDG7QFFB -m comment --comment "default/web:http/TCP" -m statistic --mode random --probability 0.33333333349 -j RECONCILER-SEP-JFN6BS5IC4XZD
-A RECONCILER-EXT-PK5WNJDG7QFFB -p tcp -m comment --comment "default/web:http/TCP" -m statistic --mode random --probability 0.50000000000 -m tcp -j DNAT --to-destination 10.244.2.7:8080
-A RECONCILER-EXT-PK5WNJDG7QFFB -p tcp -m comment --comment "default/web:http/TCP" -m tcp -j DNAT --to-destination 10.244.3.4:8080
-A RECONCILER-FW-35H3VJFRPKQ2M -s 172.30.0.0/24 -m comment --comment "shop/frontend:https/TCP" -j RECONCILER-EXT-35H3VJFRPKQ2M
-A RECONCILER-FW-35H3VJFRPKQ2M -s 198.51.100.0/24 -m comment --comment "shop/frontend:https/TCP" -j RECONCILER-EXT-35H3VJFRPKQ2M
-A RECONCILER-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A RECONCILER-NODEPORTS -p tcp -m comment --comment "default/web:http/TCP" -m tcp --dport 30080 -j RECONCILER-EXT-PK5WNJDG7QFFB
-A RECONCILER-NODEPORTS -p tcp -m comment --comment "shop/frontend:https/TCP" -m tcp --dport 31443 -j RECONCILER-EXT-35H3VJFRPKQ2M
-A RECONCILER-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A RECONCILER-POSTROUTING -j MARK --set-xmark 0x4000/0x0
-A RECONCILER-POSTROUTING -j MASQUERADE --random-fully
-A RECONCILER-SEP-CSFVUMPCY4P2I -s 10.244.1.31/32 -m comment --comment "shop/cart:http/TCP" -j RECONCILER-MARK-MASQ
-A RECONCILER-SEP-CSFVUMPCY4P2I -p tcp -m comment --comment "shop/cart:http/TCP" -m recent --set --name RECONCILER-SEP-CSFVUMPCY4P2I --mask 255.255.255.255 --rsource -m tcp -j DNAT --to-destination 10.244.1.31:8080
-A RECONCILER-SEP-JFN6BS5IC4XZD -s 10.244.1.5/32 -m comment --comment "default/web:http/TCP" -j RECONCILER-MARK-MASQ
-A RECONCILER-SEP-JFN6BS5IC4XZD -p tcp -m comment --comment "default/web:http/TCP" -m tcp -j DNAT --to-destination 10.244.1.5:8080
-A RECONCILER-SEP-LAK2HJHCY5WZK -s 10.244.1.32/32 -m comment --comment "shop/cart:http/TCP" -j RECONCILER-MARK-MASQ
-A RECONCILER-SEP-LAK2HJHCY5WZK -p tcp -m comment --comment "shop/cart:http/TCP" -m recent --set --name RECONCILER-SEP-LAK2HJHCY5WZK --mask 255.255.255.255 --rsource -m tcp -j DNAT --to-destination 10.244.1.32:8080
-A RECONCILER-SEP-LE34NP4PQFRZ6 -s 10.244.1.2/32 -m comment --comment "kube-system/kube-dns:dns/UDP" -j RECONCILER-MARK-MASQ
-A RECONCILER-SEP-LE34NP4PQFRZ6 -p udp -m comment --comment "kube-system/kube-dns:dns/UDP" -m udp -j DNAT --to-destination 10.244.1.2:53
-A RECONCILER-SEP-UWUX6W6NP5UVU -s 10.244.1.20/32 -m comment --comment "shop/frontend:https/TCP" -j RECONCILER-MARK-MASQ
-A RECONCILER-SEP-UWUX6W6NP5UVU -p tcp -m comment --comment "shop/frontend:https/TCP" -m tcp -j DNAT --to-destination 10.244.1.20:8443
-A RECONCILER-SEP-Y55YNKWFOFFQG -s 10.244.1.2/32 -m comment --comment "kube-system/kube-dns:dns-tcp/TCP" -j RECONCILER-MARK-MASQ
-A RECONCILER-SEP-Y55YNKWFOFFQG -p tcp -m comment --comment "kube-system/kube-dns:dns-tcp/TCP" -m tcp -j DNAT --to-destination 10.244.1.2:53
-A RECONCILER-SERVICES -d 10.96.10.20/32 -p tcp -m comment --comment "default/web:http/TCP" -m tcp --dport 80 -j RECONCILER-SVC-PK5WNJDG7QFFB
-A RECONCILER-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "kube-system/kube-dns:dns-tcp/TCP" -m tcp --dport 53 -j RECONCILER-SVC-R32OLB4X65WJ2
-A RECONCILER-SERVICES -d 10.96.0.10/32 -p udp -m comment --comment "kube-system/kube-dns:dns/UDP" -m udp --dport 53 -j RECONCILER-SVC-WCH7PXWOE4XNM
-A RECONCILER-SERVICES -d 10.96.20.40/32 -p tcp -m comment --comment "shop/cart:http/TCP" -m tcp --dport 80 -j RECONCILER-SVC-ZMRO3S6EELJCK
-A RECONCILER-SERVICES -d 10.96.20.30/32 -p tcp -m comment --comment "shop/frontend:https/TCP" -m tcp --dport 443 -j RECONCILER-SVC-35H3VJFRPKQ2M
-A RECONCILER-SERVICES -d 172.30.1.50/32 -p tcp -m comment --comment "shop/frontend:https/TCP" -m tcp --dport 443 -j RECONCILER-EXT-35H3VJFRPKQ2M
-A RECONCILER-SERVICES -d 172.30.1.10/32 -p tcp -m comment --comment "shop/frontend:https/TCP" -m tcp --dport 443 -g RECONCILER-FW-35H3VJFRPKQ2M
-A RECONCILER-SERVICES ! -d 127.0.0.0/8 -m addrtype --dst-type LOCAL -j RECONCILER-NODEPORTS
-A RECONCILER-SVC-35H3VJFRPKQ2M ! -s 10.244.0.0/16 -m comment --comment "shop/frontend:https/TCP" -j RECONCILER-MARK-MASQ
-A RECONCILER-SVC-35H3VJFRPKQ2M -m comment --comment "shop/frontend:https/TCP" -m statistic --mode random --probability 0.50000000000 -j RECONCILER-SEP-UWUX6W6NP5UVU
-A RECONCILER-SVC-35H3VJFRPKQ2M -p tcp -m comment --comment "shop/frontend:https/TCP" -m tcp -j DNAT --to-destination 10.244.2.20:8443
-A RECONCILER-SVC-PK5WNJDG7QFFB ! -s 10.244.0.0/16 -m comment --comment "default/web:http/TCP" -j RECONCILER-MARK-MASQ
-A RECONCILER-SVC-PK5WNJDG7QFFB -m comment --comment "default/web:http/TCP" -m statistic --mode random --probability 0.33333333349 -j RECONCILER-SEP-JFN6BS5IC4XZD
-A RECONCILER-SVC-PK5WNJDG7QFFB -p tcp -m comment --comment "default/web:http/TCP" -m statistic --mode random --probability 0.50000000000 -m tcp -j DNAT --to-destination 10.244.2.7:8080
-A RECONCILER-SVC-PK5WNJDG7QFFB -p tcp -m comment --comment "default/web:http/TCP" -m tcp -j DNAT --to-destination 10.244.3.4:8080
-A RECONCILER-SVC-R32OLB4X65WJ2 ! -s 10.244.0.0/16 -m comment --comment "kube-system/kube-dns:dns-tcp/TCP" -j RECONCILER-MARK-MASQ
-A RECONCILER-SVC-R32OLB4X65WJ2 -m comment --comment "kube-system/kube-dns:dns-tcp/TCP" -m statistic --mode random --probability 0.50000000000 -j RECONCILER-SEP-Y55YNKWFOFFQG
-A RECONCILER-SVC-R32OLB4X65WJ2 -p tcp -m comment --comment "kube-system/kube-dns:dns-tcp/TCP" -m tcp -j DNAT --to-destination 10.244.2.2:53
-A RECONCILER-SVC-WCH7PXWOE4XNM ! -s 10.244.0.0/16 -m comment --comment "kube-system/kube-dns:dns/UDP" -j RECONCILER-MARK-MASQ
-A RECONCILER-SVC-WCH7PXWOE4XNM -m comment --comment "kube-system/kube-dns:dns/UDP" -m statistic --mode random --probability 0.50000000000 -j RECONCILER-SEP-LE34NP4PQFRZ6
-A RECONCILER-SVC-WCH7PXWOE4XNM -p udp -m comment --comment "kube-system/kube-dns:dns/UDP" -m udp -j DNAT --to-destination 10.244.2.2:53
-A RECONCILER-SVC-ZMRO3S6EELJCK ! -s 10.244.0.0/16 -m comment --comment "shop/cart:http/TCP" -j RECONCILER-MARK-MASQ
-A RECONCILER-SVC-ZMRO3S6EELJCK -m comment --comment "shop/cart:http/TCP" -m recent --rcheck --seconds 600 --reap --name RECONCILER-SEP-CSFVUMPCY4P2I --mask 255.255.255.255 --rsource -j RECONCILER-SEP-CSFVUMPCY4P2I
-A RECONCILER-SVC-ZMRO3S6EELJCK -m comment --comment "shop/cart:http/TCP" -m recent --rcheck --seconds 600 --reap --name RECONCILER-SEP-LAK2HJHCY5WZK --mask 255.255.255.255 --rsource -j RECONCILER-SEP-LAK2HJHCY5WZK
-A RECONCILER-SVC-ZMRO3S6EELJCK -m comment --comment "shop/cart:http/TCP" -m statistic --mode random --probability 0.50000000000 -j RECONCILER-SEP-CSFVUMPCY4P2I
-A RECONCILER-SVC-ZMRO3S6EELJCK -m comment --comment "shop/cart:http/TCP" -j RECONCILER-SEP-LAK2HJHCY5WZK
COMMIT
# Completed on Wed Dec  2 18:02:41 2026
# Generated by ip6tables-nft-save v1.8.9 (nf_tables) on Wed Dec  2 18:02:41 2026
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:RECONCILER-EXT-35H3VJFRPKQ2M - [0:0]
:RECONCILER-FW-35H3VJFRPKQ2M - [0:0]
:RECONCILER-MARK-MASQ - [0:0]
:RECONCILER-NODEPORTS - [0:0]
:RECONCILER-POSTROUTING - [0:0]
:RECONCILER-SEP-UMIPCQNHJJPPV - [0:0]
:RECONCILER-SERVICES - [0:0]
:RECONCILER-SVC-35H3VJFRPKQ2M - [0:0]
-A PREROUTING -m comment --comment "service-reconciler service portals" -j RECONCILER-SERVICES
-A OUTPUT -m comment --comment "service-reconciler service portals" -j RECONCILER-SERVICES
-A POSTROUTING -m comment --comment "service-reconciler masquerading" -j RECONCILER-POSTROUTING
-A RECONCILER-EXT-35H3VJFRPKQ2M -m comment --comment "shop/frontend:https/TCP" -m addrtype --src-type LOCAL -j RECONCILER-MARK-MASQ
-A RECONCILER-EXT-35H3VJFRPKQ2M -m comment --comment "shop/frontend:https/TCP" -m addrtype --src-type LOCAL -m statistic --mode random --probability 0.50000000000 -j RECONCILER-SEP-UMIPCQNHJJPPV
-A RECONCILER-EXT-35H3VJFRPKQ2M -p tcp -m comment --comment "shop/frontend:https/TCP" -m addrtype --src-type LOCAL -m tcp -j DNAT --to-destination [fd00:244:2::20]:8443
-A RECONCILER-EXT-35H3VJFRPKQ2M -m comment --comment "shop/frontend:https/TCP" -j RECONCILER-SEP-UMIPCQNHJJPPV
-A RECONCILER-FW-35H3VJFRPKQ2M -s fd00:30::/64 -m comment --comment "shop/frontend:https/TCP" -j RECONCILER-EXT-35H3VJFRPKQ2M
-A RECONCILER-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A RECONCILER-NODEPORTS -p tcp -m comment --comment "shop/frontend:https/TCP" -m tcp --dport 31443 -j RECONCILER-EXT-35H3VJFRPKQ2M
-A RECONCILER-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A RECONCILER-POSTROUTING -j MARK --set-xmark 0x4000/0x0
-A RECONCILER-POSTROUTING -j MASQUERADE --random-fully
-A RECONCILER-SEP-UMIPCQNHJJPPV -s fd00:244:1::20/128 -m comment --comment "shop/frontend:https/TCP" -j RECONCILER-MARK-MASQ
-A RECONCILER-SEP-UMIPCQNHJJPPV -p tcp -m comment --comment "shop/frontend:https/TCP" -m tcp -j DNAT --to-destination [fd00:244:1::20]:8443
-A RECONCILER-SERVICES -d fd00:96::20:30/128 -p tcp -m comment --comment "shop/frontend:https/TCP" -m tcp --dport 443 -j RECONCILER-SVC-35H3VJFRPKQ2M
-A RECONCILER-SERVICES -d fd00:31::10/128 -p tcp -m comment --comment "shop/frontend:https/TCP" -m tcp --dport 443 -g RECONCILER-FW-35H3VJFRPKQ2M
-A RECONCILER-SERVICES ! -d ::1/128 -m addrtype --dst-type LOCAL -j RECONCILER-NODEPORTS
-A RECONCILER-SVC-35H3VJFRPKQ2M -m comment --comment "shop/frontend:https/TCP" -m statistic --mode random --probability 0.50000000000 -j RECONCILER-SEP-UMIPCQNHJJPPV
-A RECONCILER-SVC-35H3VJFRPKQ2M -p tcp -m comment --comment "shop/frontend:https/TCP" -m tcp -j DNAT --to-destination [fd00:244:2::20]:8443
COMMIT
# Completed on Wed Dec  2 18:02:41 2026
"""


def test_model_matches_its_schema() -> None:
    import json as _json
    import os as _os

    import jsonschema

    from reconciler.backends.iptables.backend import IptablesBackend
    from reconciler.desired import BuildOptions as _BO, build_desired_state as _build
    from reconciler.sources.manifests import load_directory as _load

    root = _os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
    with open(_os.path.join(root, "schemas", "iptables-model.schema.json")) as fh:
        schema = _json.load(fh)
    state = _build(_load(_os.path.join(root, "state")).objects, _BO("node-a", ("10.244.0.0/16", "fd00:244::/32")))
    backend = IptablesBackend(flavour="nft")
    doc = backend.model_to_dict(backend.render(state))
    jsonschema.validate(doc, schema)
    assert doc["ipv4"]["nat"]["chains"] and doc["ipv6"]["nat"]["chains"]


def test_rule_counts_for_kube_proxys_iptables_total_and_last():
    """sync_proxy_rules_iptables_total{table}: our rules now; ..._last{table}: the rules the last
    restore wrote — read off the restore input itself (-A / -I lines per table)."""
    backend = IptablesBackend(flavour="nft")
    d = example_state()
    model = backend.render(d)
    ops = diff(model, IptablesModel())

    def written_lines(ops) -> dict[str, int]:
        out = {"filter": 0, "nat": 0}
        for text in restore_inputs(ops).values():
            table = None
            for line in text.splitlines():
                if line.startswith("*"):
                    table = line[1:]
                elif line.startswith(("-A ", "-I ")):
                    out[table] += 1
        return out

    cold = written_lines(ops)
    assert cold["nat"] > 0 and cold["filter"] > 0
    assert backend.rules_written(ops) == cold
    assert backend.rule_counts(model) == cold  # (cold: everything written is everything we own)
    # one endpoint fewer of one service (among twenty): only that service's chains are written
    others = [o for i in range(20) for o in (service(f"s{i}", f"10.96.1.{i + 1}", HTTP),
                                             endpoint_slice(f"s{i}", [endpoint("10.244.1.1"), endpoint("10.244.1.2")]))]
    before = backend.render(build(others))
    after = backend.render(build(others[:-1] + [endpoint_slice("s19", [endpoint("10.244.1.1")])]))
    change = diff(after, before)
    assert backend.rules_written(change) == written_lines(change)
    assert 0 < backend.rules_written(change)["nat"] < backend.rule_counts(after)["nat"] // 10
    assert backend.rule_counts(after)["nat"] < backend.rule_counts(before)["nat"]


def test_the_text_plan_names_each_restore_line_s_tool_and_table():
    """A restore line does not say which family or table it is for; the text plan puts them first."""
    from reconciler.plan import Plan
    text = Plan("iptables", "node-a", operations=diff(render(example_state()), IptablesModel())).to_text(10_000)
    assert f"  + [iptables filter] :{FILTER} - [0:0]" in text
    assert f"  + [ip6tables nat] :{SERVICES} - [0:0]" in text
    assert not any(line.startswith(("  + :", "  + -A")) for line in text.splitlines())


@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_a_plan_names_the_source_ranges_and_the_affinity_that_change(mode):
    """Source ranges and session affinity are read back from each backend's rules into the
    service views, so a plan says what changed rather than "its rules"."""
    import copy

    from reconciler.plan import service_changes

    objects = load_directory(STATE_DIR).objects
    changed = copy.deepcopy(objects)
    for obj in changed:
        if obj.kind == "Service" and obj.name == "frontend":
            obj.body["spec"]["loadBalancerSourceRanges"] = ["172.30.0.0/24", "10.0.0.0/8", "fd00:30::/64"]
        if obj.kind == "Service" and obj.name == "cart":
            obj.body["spec"]["sessionAffinityConfig"]["clientIP"]["timeoutSeconds"] = 900
    backend = NftablesBackend() if mode == "nftables" else IptablesBackend()
    views = [backend.service_view(backend.render(build_desired_state(objs, OPTS))) for objs in (objects, changed)]
    changes = {c.service: c.details for c in service_changes(*views)}
    assert changes == {
        "shop/frontend:https/TCP": ("- source range 198.51.100.0/24", "+ source range 10.0.0.0/8"),
        "shop/cart:http/TCP": ("- session affinity ClientIP 600s", "+ session affinity ClientIP 900s"),
    }


@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_a_plan_lists_external_traffic_only_where_it_changes_and_an_opened_source_range(mode):
    """internalTrafficPolicy: Local changes where cluster traffic goes, not external traffic:
    no external lines; removing every source range lets every source in, which the plan says
    (the ranges' own '-' lines read as a tighter rule)."""
    import copy

    from reconciler.plan import service_changes

    objects = load_directory(STATE_DIR).objects
    changed = copy.deepcopy(objects)
    for obj in changed:
        if obj.kind == "Service" and obj.name == "web":
            obj.body["spec"]["internalTrafficPolicy"] = "Local"
        if obj.kind == "Service" and obj.name == "frontend":
            del obj.body["spec"]["loadBalancerSourceRanges"]
    backend = NftablesBackend() if mode == "nftables" else IptablesBackend()
    views = [backend.service_view(backend.render(build_desired_state(objs, OPTS))) for objs in (objects, changed)]
    changes = {c.service: c.details for c in service_changes(*views)}
    assert changes == {
        "default/web:http/TCP": ("- endpoint 10.244.2.7:8080", "- endpoint 10.244.3.4:8080"),
        "shop/frontend:https/TCP": ("- source range 172.30.0.0/24", "- source range 198.51.100.0/24",
                                    "- source range fd00:30::/64",
                                    "+ source range any (no range: every source reaches the load balancer IPs)"),
    }
    back = {c.service: c.details for c in service_changes(*reversed(views))}
    assert back["shop/frontend:https/TCP"][0].startswith("- source range any")


@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_a_plan_names_the_endpoints_external_traffic_reaches(mode):
    """externalTrafficPolicy: Local sends traffic to a service port's external addresses
    (nodePort, externalIPs, LB IPs) to this node's endpoints alone: its view lists them beside
    the endpoints its cluster traffic reaches, read back from the rules for external traffic.
    An ordinary service port's view has no such list; a plan turning the policy Local adds it."""
    import copy
    import json
    import os

    import jsonschema
    from helpers import REPO

    from reconciler.plan import Plan, service_changes

    objects = load_directory(STATE_DIR).objects
    local = copy.deepcopy(objects)
    for obj in local:
        if obj.kind == "Service" and obj.name == "web":
            obj.body["spec"]["externalTrafficPolicy"] = "Local"
    backend = NftablesBackend() if mode == "nftables" else IptablesBackend()
    before, after = (backend.render(build_desired_state(objs, OPTS)) for objs in (objects, local))
    views = [backend.service_view(m) for m in (before, after)]
    frontend = views[0]["shop/frontend:https/TCP"]
    assert frontend["endpoints"] == ["10.244.1.20:8443", "10.244.2.20:8443", "[fd00:244:1::20]:8443",
                                     "[fd00:244:2::20]:8443"]
    assert frontend["externalEndpoints"] == ["10.244.1.20:8443", "[fd00:244:1::20]:8443"]
    assert [sid for sid, v in views[0].items() if "externalEndpoints" in v] == ["shop/frontend:https/TCP"]
    web = "default/web:http/TCP"
    assert backend.service_view(after, {web}) == {web: views[1][web]}
    plan = Plan(mode, "node-a", service_changes(*views), backend.diff(after, before))
    assert [(s.service, s.action, s.details) for s in plan.services] == [  # (where it goes no more)
        (web, "~", ("- external traffic to endpoint 10.244.2.7:8080", "- external traffic to endpoint 10.244.3.4:8080"))]
    assert "      - external traffic to endpoint 10.244.3.4:8080" in plan.to_text().splitlines()
    added = Plan(mode, "node-a", service_changes({}, views[0]), backend.diff(before, type(before)()))
    assert "+ external traffic only to endpoint [fd00:244:1::20]:8443" in added.to_dict()["services"][-1]["changes"]
    with open(os.path.join(REPO, "schemas", "plan.schema.json")) as fh:
        schema = json.load(fh)
    for p in (plan, added):
        jsonschema.validate(json.loads(p.to_json()), schema)


@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_the_endpoints_external_traffic_reaches_under_each_policy(mode):
    """internalTrafficPolicy: Local the other way round (cluster traffic to this node's endpoints,
    external traffic to all); both Local, or external traffic of one family where cluster traffic
    of both, or no local endpoint (its external addresses then show their DROP): no list."""
    def nodeport(name: str, ip: str, port: int, **spec: str) -> object:
        return service(name, ip, [{**HTTP[0], "nodePort": port}], type="NodePort", **spec)

    objs = [
        nodeport("itp", "10.96.0.1", 30001, internalTrafficPolicy="Local"),
        endpoint_slice("itp", [endpoint("10.244.1.1"), endpoint("10.244.2.1", node="node-b")]),
        nodeport("sticky", "10.96.0.2", 30002, externalTrafficPolicy="Local", sessionAffinity="ClientIP"),
        endpoint_slice("sticky", [endpoint("10.244.1.2"), endpoint("10.244.2.2", node="node-b")]),
        nodeport("both", "10.96.0.3", 30003, externalTrafficPolicy="Local", internalTrafficPolicy="Local"),
        endpoint_slice("both", [endpoint("10.244.1.3"), endpoint("10.244.2.3", node="node-b")]),
        nodeport("none", "10.96.0.4", 30004, externalTrafficPolicy="Local"),
        endpoint_slice("none", [endpoint("10.244.2.4", node="node-b")]),
        service("dual", "10.96.0.5", HTTP, clusterIPs=["10.96.0.5", "fd00:96::5"], ipFamilies=["IPv4", "IPv6"],
                ipFamilyPolicy="RequireDualStack", externalIPs=["172.30.1.5"]),
        endpoint_slice("dual", [endpoint("10.244.1.5")]),
        endpoint_slice("dual", [endpoint("fd00:244:1::5")], family="IPv6"),
    ]
    backend = NftablesBackend() if mode == "nftables" else IptablesBackend()
    model = backend.render(build(objs))
    view = backend.service_view(model)
    assert {sid: (v["endpoints"], v.get("externalEndpoints")) for sid, v in view.items()} == {
        "default/itp:http/TCP": (["10.244.1.1:8080"], ["10.244.1.1:8080", "10.244.2.1:8080"]),
        "default/sticky:http/TCP": (["10.244.1.2:8080", "10.244.2.2:8080"], ["10.244.1.2:8080"]),
        "default/both:http/TCP": (["10.244.1.3:8080"], None),
        "default/none:http/TCP": (["10.244.2.4:8080"], None),
        "default/dual:http/TCP": (["10.244.1.5:8080", "[fd00:244:1::5]:8080"], None),
    }
    assert view["default/sticky:http/TCP"]["affinity"] == ["ClientIP 10800s"]
    assert "nodePort 30004/tcp (drop)" in view["default/none:http/TCP"]["addresses"]
    assert backend.service_view(model, set(view)) == view


@pytest.mark.parametrize("mode", ["nftables", "iptables"])
@pytest.mark.parametrize("change", ["externalIP removed", "LB IP removed", "service without endpoints deleted"])
def test_a_plan_names_a_change_that_only_takes_rules_out_of_a_shared_chain(mode, change):
    """A change that only removes a service port's rule from a short shared chain (iptables
    rewrites it whole: a flush names no service port) is listed under that service port as in
    nftables mode, with what goes."""
    import copy

    from reconciler.reconcile import make_plan

    objects = load_directory(STATE_DIR).objects
    changed = copy.deepcopy(objects)
    if change == "service without endpoints deleted":
        changed = [o for o in changed if not (o.kind == "Service" and o.name == "prometheus")]
        sid, details = "monitoring/prometheus:web/TCP", "- address 10.96.30.9:9090/tcp (reject)"
    for obj in changed:
        if obj.kind == "Service" and obj.name == "frontend" and change == "externalIP removed":
            obj.body["spec"]["externalIPs"] = []
            sid, details = "shop/frontend:https/TCP", "- address 172.30.1.50:443/tcp"
        if obj.kind == "Service" and obj.name == "frontend" and change == "LB IP removed":
            del obj.body["status"]
            sid, details = "shop/frontend:https/TCP", "- address 172.30.1.10:443/tcp"
    backend = NftablesBackend() if mode == "nftables" else IptablesBackend()
    before = backend.render(build_desired_state(objects, OPTS))
    planned = make_plan(backend, build_desired_state(changed, OPTS), observed_model=before, other_mode=False)
    services = {s.service: s for s in planned.plan.services}
    assert sid in services and details in services[sid].details, planned.plan.to_text()
    assert not any("source range any" in d for d in services[sid].details)  # (its LB IPs went too: no "any")
    assert "0 service ports to add" in planned.plan.summary()
    undescribed = make_plan(backend, build_desired_state(changed, OPTS), observed_model=before, other_mode=False,
                            describe=False)
    assert sum(undescribed.count_services(backend).values()) == len(planned.plan.services)


def test_the_json_plan_has_each_change_as_data_and_the_counts():
    """-o json: beside each change line, the same as {action, kind, value[, verdict]}, and the
    summary's numbers, so that a machine need not parse the text."""
    import json
    import os

    import jsonschema
    from helpers import REPO

    from reconciler.plan import Plan, ServiceChange

    plan = Plan("nftables", "node-a", [
        ServiceChange("shop/frontend:https/TCP", "~", (
            "- address 172.30.1.10:443/tcp", "+ address 172.30.1.10:443/tcp (drop)", "+ endpoint 10.244.1.5:8080",
            "- external traffic to endpoint 10.244.2.7:8080", "- source range 10.0.0.0/8",
            "+ source range any (no range: every source reaches the load balancer IPs)",
            "+ session affinity ClientIP 600s")),
        ServiceChange("default/web:http/TCP", "~", ("~ its rules (traffic policy, masquerading...): see its kernel "
                                                    "operations",)),
        ServiceChange("default/new:http/TCP", "+", ("+ external traffic only to endpoint [fd00::5]:80",))])
    doc = plan.to_dict()
    with open(os.path.join(REPO, "schemas", "plan.schema.json")) as fh:
        jsonschema.validate(json.loads(json.dumps(doc)), json.load(fh))
    assert doc["services"][0]["items"] == [
        {"action": "-", "kind": "address", "value": "172.30.1.10:443/tcp"},
        {"action": "+", "kind": "address", "value": "172.30.1.10:443/tcp", "verdict": "drop"},
        {"action": "+", "kind": "endpoint", "value": "10.244.1.5:8080"},
        {"action": "-", "kind": "externalEndpoint", "value": "10.244.2.7:8080"},
        {"action": "-", "kind": "sourceRange", "value": "10.0.0.0/8"},
        {"action": "+", "kind": "sourceRange", "value": "any"},
        {"action": "+", "kind": "affinity", "value": "ClientIP 600s"}]
    assert doc["services"][1]["items"] == [{"action": "~", "kind": "rules"}]
    assert doc["services"][2]["items"] == [{"action": "+", "kind": "externalEndpoint", "value": "[fd00::5]:80"}]
    assert doc["counts"] == {"add": 1, "change": 2, "remove": 0, "operations": 0}


@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_external_traffic_that_goes_nowhere_now_is_no_external_endpoint(mode):
    """Policy Local, its local endpoint gone: external traffic drops; the plan says so by the
    address's verdict and the endpoint that went, and lists no endpoint external traffic would
    now reach (it reaches none)."""
    from reconciler.plan import service_changes

    def objs(*eps: object) -> list:
        return [service("x", "10.96.0.5", [{**HTTP[0], "nodePort": 30005}], type="NodePort",
                        externalTrafficPolicy="Local"), endpoint_slice("x", list(eps))]

    backend = NftablesBackend() if mode == "nftables" else IptablesBackend()
    views = [backend.service_view(backend.render(build(o))) for o in (
        objs(endpoint("10.244.1.5"), endpoint("10.244.2.5", node="node-b")), objs(endpoint("10.244.2.5", node="node-b")))]
    assert [c.details for c in service_changes(*views)] == [(
        "- address nodePort 30005/tcp", "+ address nodePort 30005/tcp (drop)", "- endpoint 10.244.1.5:8080")]


@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_a_dual_stack_nodeport_dropped_in_one_family_is_listed_per_family(mode):
    """externalTrafficPolicy Local with this node's endpoints in one family only: its NodePort
    drops in the other; the view says which (one '(drop)' entry hid that the other works)."""
    def nodeport(name: str, ip: str, port: int, **spec: object) -> object:
        return service(name, ip, [{**HTTP[0], "nodePort": port}], type="NodePort", **spec)

    objs = [
        nodeport("dual", "10.96.0.5", 30005, externalTrafficPolicy="Local", clusterIPs=["10.96.0.5", "fd00:96::5"],
                 ipFamilies=["IPv4", "IPv6"], ipFamilyPolicy="RequireDualStack"),
        endpoint_slice("dual", [endpoint("10.244.2.5", node="node-b")]),  # (IPv4: none on this node)
        endpoint_slice("dual", [endpoint("fd00:244:1::5")], family="IPv6"),
        nodeport("both", "10.96.0.6", 30006, clusterIPs=["10.96.0.6", "fd00:96::6"], ipFamilies=["IPv4", "IPv6"],
                 ipFamilyPolicy="RequireDualStack"),
        endpoint_slice("both", [endpoint("10.244.1.6")]),
        endpoint_slice("both", [endpoint("fd00:244:1::6")], family="IPv6"),
    ]
    backend = NftablesBackend() if mode == "nftables" else IptablesBackend()
    view = backend.service_view(backend.render(build(objs)))
    nodeports = {sid: [a for a in v["addresses"] if "nodePort" in a] for sid, v in view.items()}
    assert nodeports == {
        "default/dual:http/TCP": ["IPv4 nodePort 30005/tcp (drop)", "IPv6 nodePort 30005/tcp"],
        "default/both:http/TCP": ["nodePort 30006/tcp"],  # (the same in both families: one entry)
    }


def test_a_rule_in_a_chain_of_others_is_theirs_whatever_its_comment():
    """A rule of somebody else's chain that jumps to ours, even one carrying our comment (copied
    from ours), is not one of our jumps: the chain it jumps to is kept, not deleted (the restore
    would fail on it, after the filter table was committed)."""
    have = render(example_state())
    nat = have.families["ipv4"]["nat"]
    copied = Rule("FOREIGN", ("-m", "comment", "--comment", "service-reconciler service portals", "-j", SERVICES))
    have.families["ipv4"]["nat"] = TableState(nat.chains, nat.jumps, (copied,))
    texts = [op.text for op in diff(IptablesModel(), have) if op.name.startswith("iptables nat ")]
    assert f":{SERVICES} - [0:0]" in texts and f"-X {SERVICES}" not in texts  # (IPv4's: the family it is in)
    assert not any("FOREIGN" in t for t in texts)


@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_a_chain_rewritten_whole_reads_as_the_rules_it_loses_and_those_it_keeps(mode):
    """A chain flushed and filled again (one endpoint of web replaced) lists, under its flush, the
    rules it loses; the rules it held and gets back are marked `=`, the new ones `+` (in the
    text; as `drops` and `restates` in -o json), and a legend says so."""
    import copy
    import json
    import os

    import jsonschema
    from helpers import REPO

    from reconciler.plan import DROPS_SHOWN, REWRITE_LEGEND, Plan, service_changes

    objects = load_directory(STATE_DIR).objects
    moved = copy.deepcopy(objects)
    for obj in moved:
        if obj.kind == "EndpointSlice" and obj.body["metadata"]["labels"].get("kubernetes.io/service-name") == "web":
            for ep in obj.body["endpoints"]:
                if ep["addresses"] == ["10.244.1.5"]:
                    ep["addresses"] = ["10.244.1.99"]
    backend = NftablesBackend() if mode == "nftables" else IptablesBackend()
    before, after = (backend.render(build_desired_state(objs, OPTS)) for objs in (objects, moved))
    ops = backend.diff(after, before)
    flushes = [op for op in ops if op.kind == "chain" and op.action == "~" and op.drops]
    assert flushes and all(op.service == "default/web:http/TCP" for op in flushes)
    # what each rewritten chain loses is the old endpoint's rule, and only that
    assert all(len(op.drops) == 1 and ("10.244.1.5:8080" in op.drops[0] or "RECONCILER-SEP-" in op.drops[0])
               for op in flushes)
    rules = [op for op in ops if op.kind == "rule" and op.name in {f.name for f in flushes}]
    new = [op.text for op in rules if not op.restates]
    assert new and all("10.244.1.99" in t or "RECONCILER-SEP-" in t for t in new)
    kept = [op.text for op in rules if op.restates]
    assert any("10.244.3.4:8080" in t for t in kept) and not any("10.244.1.99" in t for t in kept)
    # a chain created new restates nothing
    assert not any(op.restates for op in ops if op.kind == "rule" and op.name not in {f.name for f in flushes})

    plan = Plan(mode, "node-a", service_changes(backend.service_view(before), backend.service_view(after)), ops)
    lines = plan.to_text().splitlines()
    assert REWRITE_LEGEND in lines
    flush_line = next(i for i, line in enumerate(lines) if line.startswith("  ~ ") and
                      (flushes[0].text in line))
    assert lines[flush_line + 1] == f"      - {flushes[0].drops[0]}"
    assert sum(line.startswith("  = ") for line in lines) == len(kept)
    assert sum(line.startswith("  + ") for line in lines) == sum(op.action == "+" for op in ops) - len(kept)
    data = json.loads(plan.to_json())
    with open(os.path.join(REPO, "schemas", "plan.schema.json")) as fh:
        jsonschema.validate(data, json.load(fh))
    assert [o["drops"] for o in data["operations"] if "drops" in o] == [list(op.drops) for op in flushes]
    assert sum(o.get("restates", False) for o in data["operations"]) == len(kept)
    # a plan with no rewritten chain has no legend; a long list of lost rules is cut in the text
    assert REWRITE_LEGEND not in Plan(mode, "node-a", operations=[o for o in ops if not (o.drops or o.restates)]
                                      ).to_text().splitlines()
    many = dataclasses.replace(flushes[0], drops=tuple(f"rule {i}" for i in range(DROPS_SHOWN + 3)))
    text = Plan(mode, "node-a", operations=[many]).to_text().splitlines()
    assert f"      - rule {DROPS_SHOWN - 1}" in text and f"      - rule {DROPS_SHOWN}" not in text
    assert "      ... 3 more rules it loses" in text


def test_etp_local_masquerades_only_remote_endpoints_a_pod_short_circuit_can_pick_for_itself():
    """The ETP Local pod short-circuit (`-s clusterCIDR`) may send a pod of another node back to
    itself, so that pod's traffic there is masqueraded; an endpoint outside every cluster CIDR (a
    hostNetwork pod: its node's own IP) never takes that path, and its node's traffic keeps its
    source: no rule for it."""
    objs = [service("ingress", "10.96.0.30", [{**HTTP[0], "nodePort": 30100}], type="NodePort",
                    externalTrafficPolicy="Local"),
            endpoint_slice("ingress", [endpoint("10.244.1.5"), endpoint("10.244.2.5", node="node-b"),
                                       endpoint("192.168.1.11", node="node-b")])]
    ext = next(rules for name, rules in render(build(objs)).table("ipv4", "nat").chains.items()
               if name.startswith("RECONCILER-EXT-"))
    masq_sources = {r.args[1] for r in ext if r.target == "RECONCILER-MARK-MASQ" and r.args[0] == "-s"}
    assert masq_sources == {"10.244.2.5/32"}


@pytest.mark.parametrize("ranges,view", [(["0.0.0.0/0"], ["0.0.0.0/0"]), (["0.0.0.0/1", "128.0.0.0/1"], ["0.0.0.0/0"]),
                                         (["10.0.0.0/8", "0.0.0.0/0"], ["0.0.0.0/0"])])
def test_a_source_range_of_every_address_is_written_as_iptables_save_prints_it(ranges, view):
    """iptables-save prints no `-s 0.0.0.0/0`: the firewall chain's rule for such a range has no
    `-s` (else it never reads back as written), and the view reads it as that range again, as
    nftables mode's does."""
    objs = [service("any", "10.96.0.40", [{**HTTP[0], "nodePort": 30140}], type="LoadBalancer",
                    loadBalancerSourceRanges=ranges),
            endpoint_slice("any", [endpoint("10.244.2.9", node="node-b")])]
    objs[0].body["status"] = {"loadBalancer": {"ingress": [{"ip": "198.51.100.40"}]}}  # type: ignore[index]
    desired = build(objs)
    model = render(desired)
    fw = [r for name, rules in model.table("ipv4", "nat").chains.items() if name.startswith("RECONCILER-FW-")
          for r in rules]
    assert fw and all("-s" not in r.args for r in fw)
    views = [b.service_view(b.render(desired)) for b in (IptablesBackend(), NftablesBackend())]
    assert views[0]["default/any:http/TCP"]["sourceRanges"] == view
    assert views[0] == views[1]


def test_a_cluster_cidr_of_every_address_masquerades_no_clusterip_traffic():
    """A cluster CIDR of every address: every source is a pod, so nothing is masqueraded for being
    outside it (as nftables mode reads it), and no `! -s 0.0.0.0/0`, which iptables refuses."""
    for cidrs in (("0.0.0.0/0",), ("10.244.0.0/16", "0.0.0.0/0")):  # (the second merged into the first)
        model = render(build([service("web", "10.96.0.10", HTTP), endpoint_slice("web", [endpoint("10.244.1.5")])],
                             cluster_cidrs=cidrs))
        nat = model.table("ipv4", "nat").chains
        assert not any("0.0.0.0/0" in r.args for rules in nat.values() for r in rules)
        svc = next(rs for name, rs in nat.items() if name.startswith("RECONCILER-SVC-"))
        assert not any(r.target in ("RECONCILER-MARK-MASQ", NON_POD_MASQ) for r in svc) and NON_POD_MASQ not in nat


@pytest.mark.parametrize("cidrs", [("10.244.0.0/16", "fd00:244::/32"), ("0.0.0.0/0", "::/0")])
def test_both_backends_read_the_example_the_same_whatever_the_cluster_cidrs(cidrs):
    """The service views (what a plan says of each service port) of the example state are the same
    in both modes; with a cluster CIDR of every address the iptables pod short-circuit has no -s
    and was read as the external path (shop/frontend's externalEndpoints went missing)."""
    desired = build_desired_state(load_directory(STATE_DIR).objects, BuildOptions("node-a", cidrs))
    views = [b.service_view(b.render(desired)) for b in (IptablesBackend(), NftablesBackend())]
    assert views[0] == views[1]
    assert "externalEndpoints" in views[0]["shop/frontend:https/TCP"]

"""iptables mode in real network namespaces: apply/plan round trip (nft and legacy flavours), foreign
chains and rules surviving apply and cleanup, partial updates, flavour detection, switching modes.

Each test gets its own throwaway netns (deleted in a finally, even on failure); the host's rules are
never touched. No packets are sent here: traffic behaviour is covered by the shared lab tests.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import netns

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
RECONCILER = str(REPO / ".venv" / "bin" / "reconciler")
STATE = str(REPO / "state")
FLAGS = ("--source", STATE, "--node-name", "node-a", "--cluster-cidr", "10.244.0.0/16")
FLAVOURS = ("nft", "legacy")
_seq = itertools.count()


def _skip_reason() -> str | None:
    reason = netns.skip_reason("iptables-nft-save", "iptables-legacy-save", "nft")
    if reason:
        return reason
    if not os.access(RECONCILER, os.X_OK):
        return f"{RECONCILER} missing (install the package into .venv)"
    return None


def run(argv: list[str], *, check: bool = True, env: dict[str, str] | None = None,
        input: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, input=input, timeout=120, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


class Netns:
    def __init__(self, name: str):
        self.name = name

    def run(self, *argv: str, check: bool = True, env: dict[str, str] | None = None,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        return run(["ip", "netns", "exec", self.name, *argv], check=check, env=env, input=input)

    def reconciler(self, *args: str, flavour: str | None = None, check: bool = True
                   ) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ)
        env.pop("RECONCILER_IPTABLES_FLAVOUR", None)
        if flavour:
            env["RECONCILER_IPTABLES_FLAVOUR"] = flavour
        return self.run(RECONCILER, *args, check=check, env=env)

    def save(self, flavour: str, cmd: str = "iptables") -> str:
        """Save output of nat + filter without '#' lines (comparable across calls)."""
        out = []
        for table in ("filter", "nat"):
            text = self.run(f"{cmd}-{flavour}-save", "-t", table).stdout
            out += [line for line in text.splitlines() if not line.startswith("#")]
        return "\n".join(out) + "\n"


@pytest.fixture
def ns() -> Iterator[Netns]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    with netns.throwaway(f"ipt-e2e-{os.getpid()}-{next(_seq)}") as name:
        yield Netns(name)


def our_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "RECONCILER" in line]


def foreign_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "RECONCILER" not in line]


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_apply_then_plan_is_in_sync(ns: Netns, flavour: str) -> None:
    res = ns.reconciler("apply", "--mode", "iptables", *FLAGS, "-v", flavour=flavour)
    # the nft flavour's commits are counted in the generation (legacy keeps none: read back)
    assert ("Applied. Verified by the ruleset generation" if flavour == "nft"
            else "Applied. Verified by reading the kernel back.") in res.stdout
    timings = re.findall(r"(ip6?tables)-restore \((\w+)\): (\d+) lines in ([\d.]+)s", res.stderr)
    assert {t[0] for t in timings} == {"iptables", "ip6tables"} and {t[1] for t in timings} == {flavour}
    print("restore timings:", timings)
    plan = ns.reconciler("plan", "--mode", "iptables", *FLAGS, flavour=flavour, check=False)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert "No changes" in plan.stdout
    v4, v6 = ns.save(flavour), ns.save(flavour, "ip6tables")
    assert ":RECONCILER-SERVICES - [0:0]" in v4 and ":RECONCILER-SERVICES - [0:0]" in v6
    assert "--to-destination [fd00:244:1::20]:8443" in v6
    other = "legacy" if flavour == "nft" else "nft"
    assert "RECONCILER" not in ns.save(other)  # only the chosen flavour is written
    observed = json.loads(ns.reconciler("observe", "--mode", "iptables", "-o", "json", flavour=flavour).stdout)
    assert observed["flavour"] == flavour and set(observed["ipv4"]) == {"filter", "nat"}
    again = ns.reconciler("apply", "--mode", "iptables", *FLAGS, flavour=flavour)
    assert "Nothing to do." in again.stdout


VARIANT_MANIFESTS = """\
apiVersion: v1
kind: Service
metadata: {name: mixed, namespace: extra}
spec:
  type: NodePort
  clusterIP: 10.96.40.1
  clusterIPs: [10.96.40.1, "fd00:96::40:1"]
  ipFamilies: [IPv4, IPv6]
  externalTrafficPolicy: Local
  internalTrafficPolicy: Local
  sessionAffinity: ClientIP
  ports:
    - {name: sctp, port: 3868, protocol: SCTP, nodePort: 31868}
    - {name: dns, port: 53, protocol: UDP}  # a UDP NodePort frontend (no IP) for the conntrack cleanup
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: mixed-v4, namespace: extra, labels: {kubernetes.io/service-name: mixed}}
addressType: IPv4
ports: [{name: sctp, port: 3868, protocol: SCTP}, {name: dns, port: 5353, protocol: UDP}]
endpoints:
  - {addresses: [10.244.2.40], nodeName: node-b, conditions: {ready: true}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: mixed-v6, namespace: extra, labels: {kubernetes.io/service-name: mixed}}
addressType: IPv6
ports: [{name: sctp, port: 3868, protocol: SCTP}, {name: dns, port: 5353, protocol: UDP}]
endpoints:
  - {addresses: ["fd00:244:1::40"], nodeName: node-a, conditions: {ready: true}}
  - {addresses: ["fd00:244:2::40"], nodeName: node-b, conditions: {ready: true}}
"""

VARIANTS = {
    "dual-cidrs": ("--cluster-cidr", "10.244.0.0/16,10.245.0.0/16,fd00:244::/32",
                   "--service-cidr", "10.96.0.0/16,fd00:96::/64"),
    "nodeport-addresses": ("--cluster-cidr", "10.244.0.0/16", "--nodeport-addresses", "192.168.0.0/16,fd00:1::/64"),
    "masquerade-all": ("--cluster-cidr", "10.244.0.0/16", "--masquerade-all"),
    "no-cidrs": (),
}


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_rendered_form_reads_back_identically(ns: Netns, tmp_path: Path, flavour: str, variant: str) -> None:
    """SCTP/UDP, ITP+ETP Local without local endpoints (drop), affinity in both families, several cluster
    CIDRs, service CIDRs, nodePort addresses, masquerade-all: the kernel prints back what we render."""
    src = tmp_path / "state"
    shutil.copytree(STATE, src)
    (src / "extra.yaml").write_text(VARIANT_MANIFESTS)
    flags = ("--source", str(src), "--node-name", "node-a", *VARIANTS[variant])
    ns.reconciler("apply", "--mode", "iptables", *flags, flavour=flavour)
    plan = ns.reconciler("plan", "--mode", "iptables", *flags, flavour=flavour, check=False)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    v4 = ns.save(flavour)
    assert "-p sctp" in v4 and "-m sctp --dport 31868" in v4
    ns.reconciler("cleanup", "--mode", "iptables", flavour=flavour)
    assert not our_lines(ns.save(flavour)) and not our_lines(ns.save(flavour, "ip6tables"))


# --------------------------------------------------------------------------- foreign state


FOREIGN = {
    "filter": """*filter
:FORWARD DROP [0:0]
:FOREIGN-FILTER - [0:0]
-A INPUT -p tcp -m tcp --dport 22 -j ACCEPT
-A INPUT -j FOREIGN-FILTER
-A FORWARD -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A FOREIGN-FILTER -s 192.0.2.0/24 -m comment --comment "keep me" -j DROP
COMMIT
""",
    "nat": """*nat
:FOREIGN-NAT - [0:0]
-A PREROUTING -j FOREIGN-NAT
-A POSTROUTING -o eth9 -j MASQUERADE
-A FOREIGN-NAT -p tcp -m tcp --dport 2222 -j DNAT --to-destination 192.0.2.5:22
COMMIT
""",
}


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_foreign_chains_and_rules_survive_apply_and_cleanup(ns: Netns, tmp_path: Path, flavour: str) -> None:
    for table in ("filter", "nat"):
        ns.run(f"iptables-{flavour}-restore", "--noflush", input=FOREIGN[table])
    before = ns.save(flavour)
    ns.reconciler("apply", "--mode", "iptables", *FLAGS, flavour=flavour)
    applied = ns.save(flavour)
    assert foreign_lines(applied) == foreign_lines(before)
    # our jumps come first in each built-in chain; the foreign rules keep their relative order
    for chain in ("PREROUTING", "INPUT"):
        rules = [line for line in applied.splitlines() if line.startswith(f"-A {chain} ")]
        assert "RECONCILER" in rules[0] and "RECONCILER" not in "".join(rules[1:])

    # a changed state (one service gone, another endpoint) is applied around the foreign rules
    src = tmp_path / "state"
    shutil.copytree(STATE, src)
    (src / "monitoring" / "prometheus.yaml").unlink()
    web = src / "default" / "web.yaml"
    web.write_text(web.read_text().replace("10.244.3.4", "10.244.3.9"))
    flags = ("--source", str(src), "--node-name", "node-a", "--cluster-cidr", "10.244.0.0/16")
    ns.reconciler("apply", "--mode", "iptables", *flags, flavour=flavour)
    assert foreign_lines(ns.save(flavour)) == foreign_lines(before)
    assert ns.reconciler("plan", "--mode", "iptables", *flags, flavour=flavour, check=False).returncode == 0

    out = ns.reconciler("cleanup", "--mode", "iptables", flavour=flavour)
    assert "operations removed what service-reconciler owned" in out.stdout
    after = ns.save(flavour)
    assert not our_lines(after) and not our_lines(ns.save(flavour, "ip6tables"))
    assert after == before
    out = ns.reconciler("cleanup", "--mode", "iptables", flavour=flavour)  # nothing left: a no-op
    assert "cleanup (iptables): nothing of ours to remove" in out.stdout
    assert ns.save(flavour) == before


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_rules_of_others_jumping_to_our_chains_are_kept_and_so_are_those_chains(
        ns: Netns, tmp_path: Path, flavour: str) -> None:
    """Somebody's rules that jump to one of our service chains (one in a chain of theirs, one in a
    built-in chain without our comment) survive an apply that no longer wants that chain, and
    cleanup: the chain is emptied and kept, with a warning naming the rule, and the plan converges.
    (Deleting it failed the restore, after the other tables had been committed.)"""
    ns.reconciler("apply", "--mode", "iptables", *FLAGS, flavour=flavour)
    saved = ns.save(flavour)
    svc = next(m.group(1) for m in re.finditer(r'^-A (RECONCILER-SVC-\w+) .*"default/web:', saved, re.M))
    theirs = (f"*nat\n:OPS-CANARY - [0:0]\n-A OPS-CANARY -s 192.0.2.0/24 -j {svc}\n"
              f"-A OUTPUT -d 192.0.2.9/32 -j {svc}\nCOMMIT\n")
    ns.run(f"iptables-{flavour}-restore", "--noflush", input=theirs)

    def not_ours(text: str) -> list[str]:  # (foreign_lines, and the rules of others naming our chain)
        return foreign_lines(text) + [line for line in text.splitlines()
                                      if svc in line and not line.startswith(("-A RECONCILER-", ":RECONCILER-"))]
    before = not_ours(ns.save(flavour))

    src = tmp_path / "state"
    shutil.copytree(STATE, src)
    (src / "default" / "web.yaml").unlink()
    flags = ("--source", str(src), "--node-name", "node-a", "--cluster-cidr", "10.244.0.0/16")
    out = ns.reconciler("apply", "--mode", "iptables", *flags, flavour=flavour)
    assert f"chain {svc} is kept (emptied), not deleted: a rule that is not ours jumps to it" in out.stderr
    after = ns.save(flavour)
    assert f":{svc} - " in after and f"-A {svc} " not in after
    assert not_ours(after) == before
    assert ns.reconciler("plan", "--mode", "iptables", *flags, flavour=flavour, check=False).returncode == 0
    observed = json.loads(ns.reconciler("observe", "--mode", "iptables", "-o", "json", flavour=flavour).stdout)
    assert sorted(observed["ipv4"]["nat"]["foreignReferences"]) == [
        f"-A OPS-CANARY -s 192.0.2.0/24 -j {svc}", f"-A OUTPUT -d 192.0.2.9/32 -j {svc}"]
    import jsonschema
    jsonschema.validate(observed, json.loads((REPO / "schemas" / "iptables-model.schema.json").read_text()))

    out = ns.reconciler("cleanup", "--mode", "iptables", flavour=flavour)
    assert f"; kept 1 emptied chain(s) that rules of others jump to: {svc}" in out.stdout
    again = ns.reconciler("cleanup", "--mode", "iptables", flavour=flavour)
    assert f"nothing more of ours to remove; kept 1 emptied chain(s) that rules of others jump to: {svc}" \
        in again.stdout
    left = ns.save(flavour)
    assert [line for line in our_lines(left) if svc not in line] == []
    assert f"-A OPS-CANARY -s 192.0.2.0/24 -j {svc}" in left and f"-A OUTPUT -d 192.0.2.9/32 -j {svc}" in left


def test_cleanup_on_an_empty_namespace_is_a_no_op(ns: Netns) -> None:
    out = ns.reconciler("cleanup", "--mode", "iptables")
    assert "cleanup (iptables): nothing of ours to remove" in out.stdout
    assert ns.reconciler("plan", "--mode", "iptables", *FLAGS, check=False).returncode == 2


def test_cleanup_without_mode_removes_both_modes(ns: Netns) -> None:
    ns.reconciler("apply", "--mode", "iptables", *FLAGS, flavour="nft")
    assert our_lines(ns.save("nft"))
    out = ns.reconciler("cleanup", flavour="nft")  # no --mode: the default nftables and iptables
    assert "cleanup (nftables): nothing of ours to remove" in out.stdout
    assert "cleanup (iptables):" in out.stdout and not our_lines(ns.save("nft"))


def _rule_handles(ns: Netns, chain: str) -> list[str]:
    text = ns.run("nft", "-a", "list", "chain", "ip", "nat", chain).stdout
    return re.findall(r"# handle (\d+)", text)


def test_endpoint_change_rewrites_only_that_service(ns: Netns, tmp_path: Path) -> None:
    src = tmp_path / "state"
    shutil.copytree(STATE, src)
    flags = ("--source", str(src), "--node-name", "node-a", "--cluster-cidr", "10.244.0.0/16")
    ns.reconciler("apply", "--mode", "iptables", *flags, flavour="nft")
    chains = re.findall(r"^:(RECONCILER-\S+)", ns.save("nft"), re.M)
    filter_chains = ("RECONCILER-FILTER", "RECONCILER-FILTER-INPUT", "RECONCILER-FILTER-OUTPUT",
                     "RECONCILER-FIREWALL", "RECONCILER-ENDPOINTS-CHECK", "RECONCILER-EXTERNAL-CHECK",
                     "RECONCILER-CLUSTER-IPS")
    before = {c: _rule_handles(ns, c) for c in chains if c not in filter_chains}  # (the nat table's)
    cart = src / "shop" / "cart.yaml"
    cart.write_text(cart.read_text().replace("10.244.1.32", "10.244.1.33"))
    plan = ns.reconciler("plan", "--mode", "iptables", *flags, "-o", "json", flavour="nft", check=False)
    assert plan.returncode == 2
    doc = json.loads(plan.stdout)
    assert {s["service"] for s in doc["services"]} == {"shop/cart:http/TCP"}
    assert {o.get("service") for o in doc["operations"]} == {"shop/cart:http/TCP"}
    ns.reconciler("apply", "--mode", "iptables", *flags, flavour="nft")
    after = {c: _rule_handles(ns, c) for c in before if f":{c} " in ns.save("nft")}
    changed = {c for c in after if after[c] != before[c]} | (set(before) - set(after))
    # the cart ClusterIP chain and its two endpoint chains (one replaced); nothing else was rewritten
    assert len(changed) == 2 and any(c.startswith("RECONCILER-SVC-") for c in changed)
    assert ns.reconciler("plan", "--mode", "iptables", *flags, flavour="nft", check=False).returncode == 0


def test_a_service_added_to_rewritten_shared_chains_is_the_only_one_planned(ns: Netns, tmp_path: Path) -> None:
    """Adding one service rewrites the short shared chains whole; the rules they already held (read
    back from the kernel) are the chains', so the plan lists that one service, not every other."""
    src = tmp_path / "state"
    shutil.copytree(STATE, src)
    flags = ("--source", str(src), "--node-name", "node-a", "--cluster-cidr", "10.244.0.0/16")
    ns.reconciler("apply", "--mode", "iptables", *flags, flavour="nft")
    (src / "api.yaml").write_text(
        "apiVersion: v1\nkind: Service\nmetadata: {name: api, namespace: default}\n"
        "spec:\n  clusterIP: 10.96.10.99\n  ports: [{name: http, port: 80, protocol: TCP}]\n---\n"
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n"
        "metadata: {name: api-1, namespace: default, labels: {kubernetes.io/service-name: api}}\n"
        "addressType: IPv4\nports: [{name: http, port: 8080, protocol: TCP}]\n"
        "endpoints: [{addresses: [10.244.1.77], nodeName: node-b}]\n")
    plan = ns.reconciler("plan", "--mode", "iptables", *flags, "-o", "json", flavour="nft", check=False)
    doc = json.loads(plan.stdout)
    assert any(op["command"].startswith(":RECONCILER-SERVICES ") for op in doc["operations"])  # rewritten
    assert [(s["service"], s["action"]) for s in doc["services"]] == [("default/api:http/TCP", "+")]
    assert doc["summary"].startswith("Plan: 1 service port to add, 0 to change, 0 to remove;")


@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_the_plan_names_source_ranges_affinity_and_external_endpoints_read_back_from_the_kernel(
        ns: Netns, tmp_path: Path, mode: str) -> None:
    """The service views of what the kernel holds carry the source ranges, the affinity and the
    endpoints of external traffic (ETP Local: frontend's, unchanged, are not listed) as the
    rendered ones do: a plan lists just what changed, in those terms."""
    src = tmp_path / "state"
    shutil.copytree(STATE, src)
    flags = ("--source", str(src), "--node-name", "node-a", "--cluster-cidr", "10.244.0.0/16,fd00:244::/32",
             "--mode", mode)
    ns.reconciler("apply", *flags, flavour="nft")
    for name, old, new in (("shop/frontend", "198.51.100.0/24", "10.0.0.0/8"),
                           ("shop/cart", "timeoutSeconds: 600", "timeoutSeconds: 900"),
                           ("default/web", "type: NodePort\n", "type: NodePort\n  externalTrafficPolicy: Local\n")):
        path = src / f"{name}.yaml"
        assert old in path.read_text()
        path.write_text(path.read_text().replace(old, new))
    doc = json.loads(ns.reconciler("plan", *flags, "-o", "json", flavour="nft", check=False).stdout)
    assert {s["service"]: s["changes"] for s in doc["services"]} == {
        "shop/cart:http/TCP": ["- session affinity ClientIP 600s", "+ session affinity ClientIP 900s"],
        "shop/frontend:https/TCP": ["- source range 198.51.100.0/24", "+ source range 10.0.0.0/8"],
        "default/web:http/TCP": ["- external traffic to endpoint 10.244.2.7:8080",
                                 "- external traffic to endpoint 10.244.3.4:8080"],
    }


def test_flavour_follows_the_kubelet_hint(ns: Netns) -> None:
    ns.run("iptables-legacy", "-t", "mangle", "-N", "KUBE-IPTABLES-HINT")
    ns.reconciler("apply", "--mode", "iptables", *FLAGS)  # no override: detected
    assert our_lines(ns.save("legacy")) and not our_lines(ns.save("nft"))
    observed = json.loads(ns.reconciler("observe", "--mode", "iptables", "-o", "json").stdout)
    assert observed["flavour"] == "legacy"
    ns.reconciler("cleanup", "--mode", "iptables")
    assert not our_lines(ns.save("legacy"))
    assert ":KUBE-IPTABLES-HINT" in ns.run("iptables-legacy-save", "-t", "mangle").stdout


@pytest.mark.parametrize("marks, expected", [
    ((), "nft"),
    ((("ip6tables-nft", "KUBE-KUBELET-CANARY"),), "nft"),
    ((("iptables-legacy", "KUBE-IPTABLES-HINT"), ("iptables-nft", "KUBE-IPTABLES-HINT")), "nft"),  # nft first
    ((("ip6tables-legacy", "KUBE-KUBELET-CANARY"),), "legacy"),
])
def test_flavour_detection_reads_kubelets_marks_and_creates_nothing(ns: Netns, marks, expected) -> None:
    for tool, chain in marks:
        ns.run(tool, "-t", "mangle", "-N", chain)

    def tables() -> tuple[str, ...]:
        return (ns.run("nft", "list", "ruleset").stdout,
                *(ns.run("cat", f"/proc/net/{t}_tables_names").stdout for t in ("ip", "ip6")))

    before = tables()
    observed = json.loads(ns.reconciler("observe", "--mode", "iptables", "-o", "json").stdout)
    assert observed["flavour"] == expected
    assert tables() == before  # looking loaded no legacy table and made no nft table or chain


# --------------------------------------------------------------------------- switching modes




def test_switch_iptables_to_nftables_removes_our_chains(ns: Netns) -> None:
    ns.reconciler("apply", "--mode", "iptables", *FLAGS, flavour="nft")
    assert our_lines(ns.save("nft"))
    ns.reconciler("apply", "--mode", "nftables", *FLAGS, flavour="nft")
    assert "table ip reconciler" in ns.run("nft", "list", "tables").stdout
    assert not our_lines(ns.save("nft")) and not our_lines(ns.save("nft", "ip6tables"))


def test_switch_nftables_to_iptables_removes_our_tables(ns: Netns) -> None:
    ns.reconciler("apply", "--mode", "nftables", *FLAGS, flavour="nft")
    # the plan says what it removes of the other mode, in its summary and under its own heading
    text = ns.reconciler("plan", "--mode", "iptables", *FLAGS, flavour="nft", check=False).stdout
    doc = json.loads(ns.reconciler("plan", "--mode", "iptables", *FLAGS, "-o", "json", flavour="nft",
                                   check=False).stdout)
    import jsonschema
    jsonschema.validate(doc, json.loads((REPO / "schemas" / "plan.schema.json").read_text()))
    left = doc["otherMode"]["operations"]
    assert doc["otherMode"]["mode"] == "nftables" and left >= 2
    assert all(op["command"].startswith("delete table ") for op in doc["operations"][-left:])
    assert f"kernel operations, {left} of them removing what nftables mode left." in text
    assert "  # (what nftables mode left)\n  - delete table ip reconciler" in text
    ns.reconciler("apply", "--mode", "iptables", *FLAGS, flavour="nft")
    tables = ns.run("nft", "list", "tables").stdout.splitlines()
    assert not [t for t in tables if re.fullmatch(r"table ip6? reconciler(-\d\d)?", t.strip())], tables
    assert our_lines(ns.save("nft"))


def test_leftover_tables_are_listed_over_netlink_and_only_ours_removed(ns: Netns) -> None:
    """The other mode's leftovers are looked for by one netlink dump of the table list (not a
    `nft list table` per name): it must see every table, and cleanup must remove only ours."""
    for family, name in (("ip6", "reconciler-03"), ("ip", "reconciler-x"), ("inet", "reconciler"),
                         ("ip", "reconciler-16")):
        ns.run("nft", "add", "table", family, name)
    listed = ns.run(str(REPO / ".venv" / "bin" / "python"), "-c",
                    "from reconciler.backends.nftables.kernel import existing_tables; print(sorted(existing_tables()))")
    assert listed.stdout.strip() == str(sorted([("ip6", "reconciler-03"), ("ip", "reconciler-x"),
                                                ("inet", "reconciler"), ("ip", "reconciler-16")]))
    out = ns.reconciler("cleanup", "--mode", "nftables")
    assert "1 operations removed" in out.stdout
    tables = sorted(line.strip() for line in ns.run("nft", "list", "tables").stdout.splitlines())
    assert tables == ["table inet reconciler", "table ip reconciler-16", "table ip reconciler-x"]


# --------------------------------------------------------------------------- the run loop


def _full_syncs(log: Path) -> list[dict]:
    out = []
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if str(rec.get("msg", "")).startswith("sync full"):
            out.append(rec)
    return out


def _wait_full_syncs(log: Path, n: int, proc: subprocess.Popen, timeout: float = 30) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        syncs = _full_syncs(log)
        if len(syncs) >= n:
            return syncs
        time.sleep(0.1)
    raise AssertionError(f"not {n} full syncs in {timeout}s (exit {proc.poll()}): {log.read_text()[-3000:]}")


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_run_resyncs_read_the_kernel_only_after_a_foreign_commit(ns: Netns, tmp_path: Path, flavour: str) -> None:
    """nft flavour: a resync trusts the generation until somebody else commits (here an unrelated
    chain), then reads; our own table damaged is found and repaired. Legacy: every resync reads."""
    log = tmp_path / "run.log"
    env = {k: v for k, v in os.environ.items() if k != "RECONCILER_IPTABLES_FLAVOUR"}
    env["RECONCILER_IPTABLES_FLAVOUR"] = flavour
    with open(log, "w") as fh:
        proc = subprocess.Popen(["ip", "netns", "exec", ns.name, RECONCILER, "run", "--mode", "iptables", *FLAGS,
                                 "--sync-period", "0.5s", "--min-sync-period", "0s", "--log-format", "json", "-v",
                                 "--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0"],
                                stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        syncs = _wait_full_syncs(log, 4, proc)
        assert syncs[0]["kernel_read"] and syncs[0]["operations"] > 0
        assert [s["kernel_read"] for s in syncs[1:4]] == [flavour == "legacy"] * 3
        # (the first sync logged after a command may have started before it: look at two)
        ns.run(f"iptables-{flavour}", "-t", "filter", "-N", "BYSTANDER")  # somebody else's commit
        n = len(_full_syncs(log))
        after = _wait_full_syncs(log, n + 2, proc)[n:n + 2]
        assert any(s["kernel_read"] for s in after) and all(s["operations"] == 0 for s in after)
        ns.run(f"iptables-{flavour}", "-t", "nat", "-F", "RECONCILER-SERVICES")  # damage
        n = len(_full_syncs(log))
        after = _wait_full_syncs(log, n + 2, proc)[n:n + 2]
        assert any(s["kernel_read"] and s["operations"] > 0 for s in after), after
        assert "repaired drift" in log.read_text()
        plan = ns.reconciler("plan", "--mode", "iptables", *FLAGS, flavour=flavour, check=False)
        assert plan.returncode == 0, plan.stdout + plan.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_a_saved_plan_is_applied_as_it_was_reviewed_and_only_on_the_kernel_it_was_made_on(
        ns: Netns, tmp_path: Path, mode: str) -> None:
    """`plan -o json > FILE`, reviewed, then `apply --plan FILE`: exactly those operations, while the
    kernel is still at the ruleset generation the plan read it at; after any other commit (ours
    included) it is refused, and nothing is changed."""
    flags = (*FLAGS, "--mode", mode)
    saved = tmp_path / "plan.json"
    saved.write_text(ns.reconciler("plan", *flags, "-o", "json", flavour="nft", check=False).stdout)
    doc = json.loads(saved.read_text())
    assert isinstance(doc["observedGeneration"], int) and doc["operations"]
    out = ns.reconciler("apply", "--plan", str(saved), flavour="nft")
    assert f"Applied the saved plan: {len(doc['operations'])} operations. Verified by the ruleset generation" \
        in out.stdout
    assert ns.reconciler("plan", *flags, flavour="nft", check=False).returncode == 0  # (what was planned: all of it)
    again = ns.reconciler("apply", "--plan", str(saved), flavour="nft", check=False)
    assert again.returncode == 1 and "the kernel has changed since the plan was made" in again.stderr

    src = tmp_path / "state"
    shutil.copytree(STATE, src)
    (src / "monitoring" / "prometheus.yaml").unlink()
    changed = ("--source", str(src), *flags[2:])
    saved.write_text(ns.reconciler("plan", *changed, "-o", "json", flavour="nft", check=False).stdout)
    ns.run("nft", "add", "table", "ip", "somebody-else")  # (a commit after the plan was made)
    before = ns.run("nft", "list", "ruleset").stdout
    refused = ns.reconciler("apply", "--plan", str(saved), flavour="nft", check=False)
    assert refused.returncode == 1 and "not applied; plan again" in refused.stderr
    assert ns.run("nft", "list", "ruleset").stdout == before

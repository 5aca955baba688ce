"""nftables backend: render, parse of recorded `nft -j` output, minimal diffs, plan output."""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import jsonschema
import pytest
from helpers import HTTP, REPO, STATE_DIR, build, endpoint, endpoint_slice, service

from reconciler.backends.nftables.diff import diff, script
from reconciler.backends.nftables.objects import BaseHook, Ruleset, duration_seconds, nft_duration
from reconciler.backends.nftables.observe import parse_table
from reconciler.backends.nftables.render import interval_set, render, shard_of
from reconciler.desired import BuildOptions, build_desired_state
from reconciler.plan import RULES_ONLY, Plan, service_changes
from reconciler.backends.nftables.backend import service_view
from reconciler.sources.manifests import load_directory

DATA = os.path.join(REPO, "tests", "data", "nftables")


def example_state():
    opts = BuildOptions("node-a", ("10.244.0.0/16", "fd00:244::/32"), ("10.96.0.0/16", "fd00:96::/64"))
    return build_desired_state(load_directory(STATE_DIR).objects, opts)


def recorded() -> Ruleset:
    """`nft list table` of every table of ours, recorded after `reconciler apply` of state/
    (tests/data/nftables/record.sh)."""
    tables = {}
    for path in sorted(glob.glob(os.path.join(DATA, "state-example-*.nft"))):
        fam, name = os.path.basename(path)[len("state-example-"):-len(".nft")].split("-", 1)
        with open(path) as fh:
            t = parse_table(fh.read(), fam, name)
        tables[t.ref] = t
    assert len(tables) == 9
    return Ruleset(tables)


def chain(model: Ruleset, name: str, family: str = "ip"):
    """A chain wherever it lives (service chains are in the shard tables)."""
    found = [t.chains[name] for t in model.tables.values() if t.family == family and name in t.chains]
    assert len(found) == 1, (name, len(found))
    return found[0]


def elements(model: Ruleset, set_name: str, family: str = "ip") -> dict:
    out: dict = {}
    for t in model.tables.values():
        if t.family == family and set_name in t.sets:
            out.update(t.sets[set_name].elements)
    return out


def test_recorded_kernel_output_parses_back_to_the_rendered_model():
    want = render(example_state())
    have = recorded()
    assert {"ip reconciler", "ip6 reconciler"} <= set(want.tables)
    assert set(want.tables) == set(have.tables)
    assert all(ref.split()[1].startswith("reconciler-") for ref in set(want.tables) - {"ip reconciler", "ip6 reconciler"})
    for ref in want.tables:
        assert want.tables[ref].chains == have.tables[ref].chains
        assert want.tables[ref].sets == have.tables[ref].sets
    assert diff(want, have) == []
    # the kernel's listing reads as our rendering, ETP Local's endpoints of external traffic too
    assert service_view(have) == service_view(want)
    assert service_view(have)["shop/frontend:https/TCP"]["externalEndpoints"] == [
        "10.244.1.20:8443", "[fd00:244:1::20]:8443"]


def test_rule_text_matches_nft_listing():
    have = recorded()
    assert chain(have, "svc-default/web/http/tcp").rules == (
        "ip saddr != @cluster-cidrs jump mark-for-masquerade",
        "meta l4proto tcp numgen random mod 3 0 dnat to 10.244.1.5:8080",
        "meta l4proto tcp numgen random mod 2 0 dnat to 10.244.2.7:8080",
        "meta l4proto tcp dnat to 10.244.3.4:8080",
    )
    assert chain(have, "masquerading").rules[1] == "meta mark & 0x00004000 == 0x00000000 return"
    no_ep = elements(have, "no-endpoint-services")
    assert no_ep["10.96.30.9 . tcp . 9090"] == ("goto reject-chain", "monitoring/prometheus:web/TCP")
    assert any("dnat to [fd00:244:1::20]:8443" in r for r in chain(have, "ext-shop/frontend/https/tcp", "ip6").rules)


FOREIGN_TABLE = """table ip reconciler-03 {
\tcomment "somebody's note"
\tflags dormant
\tflowtable ft {
\t\thook ingress priority filter
\t\tdevices = { lo }
\t}

\tcounter seen {
\t\tpackets 0 bytes 0
\t}

\tset aff-x {
\t\ttype ipv4_addr
\t\tsize 65535
\t\tflags dynamic,timeout
\t\ttimeout 3h
\t\telements = { 10.0.0.1 timeout 3h expires 2h59m58s }
\t}

\tset odd {
\t\ttype ipv4_addr
\t\tcomment "a, set } with { braces"
\t\telements = { 10.0.0.1 comment "one, with : a comma }",
\t\t\t     10.0.0.2 }
\t}

\tmap service-ips {
\t\ttype ipv4_addr . inet_proto . inet_service : verdict
\t\telements = { 10.96.0.10 . tcp . 80 comment "default/web:http/TCP" : goto svc-default/web/http/tcp,
\t\t\t     10.96.0.11 . udp . 53 : drop }
\t}

\tchain services {
\t\tcomment "hooked"
\t\ttype nat hook prerouting priority dstnat - 10; policy accept;
\t\tip daddr . meta l4proto . th dport vmap @service-ips
\t\tcounter packets 1 bytes 60 accept comment "added by hand {"
\t}

\tchain odd-hook {
\t\ttype nat hook output priority somewhere; policy accept;
\t}

\tchain empty {
\t}
}
"""


def test_foreign_content_parses_without_crashing_and_shows_as_it_is():
    t = parse_table(FOREIGN_TABLE, "ip", "reconciler-03")
    assert set(t.chains) == {"services", "odd-hook", "empty"} and set(t.sets) == {"aff-x", "odd", "service-ips"}
    assert t.flags == ("dormant",)
    services = t.chains["services"]
    assert services.base is not None and services.base.priority == -110 and services.base.type == "nat"
    # a rule we never render is kept as nft prints it, so it never equals a rendered one
    assert services.rules == ("ip daddr . meta l4proto . th dport vmap @service-ips",
                              'counter packets 1 bytes 60 accept comment "added by hand {"')
    assert t.chains["odd-hook"].base is not None and t.chains["odd-hook"].base.type.startswith("<unparsed")
    assert t.chains["empty"].rules == () and t.chains["empty"].base is None
    aff = t.sets["aff-x"]
    assert aff.flags == ("dynamic", "timeout") and aff.timeout == 10800 and aff.elements == {}
    assert t.sets["odd"].elements == {"10.0.0.1": (None, "one, with : a comma }"), "10.0.0.2": (None, None)}
    assert t.sets["service-ips"].elements == {
        "10.96.0.10 . tcp . 80": ("goto svc-default/web/http/tcp", "default/web:http/TCP"),
        "10.96.0.11 . udp . 53": ("drop", None)}


def test_a_dormant_table_is_woken_and_nothing_else_is_touched():
    want = render(example_state())
    have = recorded()
    ref = "ip reconciler"
    have.tables[ref] = dataclasses.replace(have.tables[ref], flags=("dormant",))
    assert [(op.action, op.text) for op in diff(want, have)] == [("~", "add table ip reconciler")]


@pytest.mark.parametrize(("text", "seconds"), [("10m", 600), ("3h", 10800), ("1d2h3m4s", 93784), ("10800s", 10800),
                                               ("1h30m", 5400), ("2s500ms", 2), ("soon", -1)])
def test_set_timeouts_as_nft_prints_them(text, seconds):
    doc = f"table ip t {{\n\tset s {{\n\t\ttype ipv4_addr\n\t\tflags timeout\n\t\ttimeout {text}\n\t}}\n}}\n"
    s = parse_table(doc, "ip", "t").sets["s"]
    assert s.timeout == seconds and s.flags == ("dynamic", "timeout")


@pytest.mark.parametrize(("seconds", "text"), [(10800, "3h"), (600, "10m"), (90, "1m30s"), (86400, "1d"),
                                               (3661, "1h1m1s"), (1, "1s")])
def test_affinity_timeouts_are_written_as_nft_prints_them(seconds, text):
    """The per-entry timeout of `update @aff-… { ip saddr timeout T }` is compared as nft lists the
    rule: written the way nft prints it, it reads back equal."""
    assert nft_duration(seconds) == text and duration_seconds(text) == seconds


def test_a_timeout_flag_alone_reads_as_dynamic():
    """Older nft list a dynamic set with timeouts as `flags timeout` alone: it is still the set
    render writes (`flags dynamic,timeout`), not one to recreate at every read."""
    doc = "table ip t {\n\tset aff-x {\n\t\ttype ipv4_addr\n\t\tsize 65535\n\t\tflags timeout\n\t}\n}\n"
    s = parse_table(doc, "ip", "t").sets["aff-x"]
    assert s.flags == ("dynamic", "timeout") and s.dynamic and s.timeout is None


def test_an_affinity_set_of_an_earlier_version_is_still_read_in_service_terms():
    """Earlier versions put the timeout on the set (`timeout 10m`, `update @aff { ip saddr }`):
    a plan against such a kernel still reads its affinity (then moves it to the entries)."""
    old = (
        "table ip reconciler-01 {\n\tset aff-ns/a/http/tcp/10.244.1.5/80 {\n\t\ttype ipv4_addr\n\t\tsize 65535\n"
        "\t\tflags dynamic,timeout\n\t\ttimeout 10m\n\t}\n\n"
        "\tchain ep-ns/a/http/tcp/10.244.1.5/80 {\n\t\tupdate @aff-ns/a/http/tcp/10.244.1.5/80 { ip saddr }\n"
        "\t\tmeta l4proto tcp dnat to 10.244.1.5:80\n\t}\n\n"
        "\tchain svc-ns/a/http/tcp {\n\t\tip saddr @aff-ns/a/http/tcp/10.244.1.5/80 goto ep-ns/a/http/tcp/10.244.1.5/80\n"
        "\t\tgoto ep-ns/a/http/tcp/10.244.1.5/80\n\t}\n}\n")
    new = old.replace("\t\ttimeout 10m\n", "").replace("{ ip saddr }", "{ ip saddr timeout 10m }")
    for text in (old, new):
        model = Ruleset({"ip reconciler-01": parse_table(text, "ip", "reconciler-01")})
        assert service_view(model)["ns/a:http/TCP"]["affinity"] == ["ClientIP 600s"], text


@pytest.mark.parametrize(("text", "priority"), [("dstnat", -100), ("srcnat", 100), ("filter - 10", -10),
                                                ("dstnat - 10", -110), ("-110", -110), ("mangle + 5", -145),
                                                ("0", 0)])
def test_hook_priorities_as_nft_prints_them(text, priority):
    doc = f"table ip t {{\n\tchain c {{\n\t\ttype filter hook output priority {text}; policy drop;\n\t}}\n}}\n"
    assert parse_table(doc, "ip", "t").chains["c"].base == BaseHook("filter", "output", priority, "drop")


def many_services(n: int, changed: int | None = None, skip: int | None = None):
    objs = []
    for i in range(n):
        if i == skip:
            continue
        name = f"svc{i}"
        objs.append(service(name, f"10.96.{i // 250}.{i % 250 + 1}", HTTP))
        eps = [endpoint(f"10.244.{i // 250}.{j + 10}", node="node-b") for j in range(3)]
        if changed == i:
            eps[1] = endpoint("10.244.99.99", node="node-b")
        objs.append(endpoint_slice(name, eps))
    return build(objs)


def test_one_endpoint_change_touches_only_that_service():
    before = render(many_services(300))
    after = render(many_services(300, changed=42))
    ops = diff(after, before)
    assert {op.service for op in ops} == {"default/svc42:http/TCP"}
    # flush the service chain, re-add its rules: masquerade check + a 3-step endpoint cascade
    assert [op.text.split(" ")[0:2] for op in ops] == [["flush", "chain"]] + [["add", "rule"]] * 4
    assert len(ops) == 5
    assert any("dnat to 10.244.99.99:8080" in op.text for op in ops)


def test_removed_service_removes_its_objects_in_safe_order():
    ids = [f"default/svc{i}:http/TCP" for i in range(40)]
    shards = [shard_of(i) for i in ids]
    gone = next(i for i, s in enumerate(shards) if shards.count(s) > 1)  # its shard table stays
    before = render(many_services(40))
    after = render(many_services(40, skip=gone))
    ops = diff(after, before)
    texts = [o.text for o in ops]
    name = f"svc-default/svc{gone}/http/tcp"
    table = next(o.name.split(" chain ")[0] for o in ops if o.name.endswith(name))
    elem = next(i for i, t in enumerate(texts) if t.startswith(f"delete element {table} service-ips"))
    deleted = texts.index(f"delete chain {table} {name}")
    assert texts.index(f"flush chain {table} {name}") < elem < deleted
    # all its own but its ClusterIP leaving the shared set of them (an address, not a port's)
    assert {o.service for o in ops if "cluster-ips" not in o.text} == {f"default/svc{gone}:http/TCP"}
    assert [o.text for o in ops if o.service is None] == [f"delete element ip reconciler cluster-ips {{ 10.96.0.{gone + 1} }}"]


def test_a_service_alone_in_its_shard_takes_the_shard_table_with_it():
    ids = [f"default/svc{i}:http/TCP" for i in range(40)]
    shards = [shard_of(i) for i in ids]
    lonely = next(i for i, s in enumerate(shards) if shards.count(s) == 1)
    ops = diff(render(many_services(40, skip=lonely)), render(many_services(40)))
    assert [o.text for o in ops if o.kind == "table"] == [f"delete table ip reconciler-{shards[lonely]:02d}"]


def test_a_plan_names_the_service_ports_that_go_with_a_whole_table():
    """A `delete table` names no service port: the plan (its description, its count, the run
    loop's count) still lists those its objects held, read from the table as observed."""
    from reconciler.backends import get_backend
    from reconciler.reconcile import make_plan

    shards = [shard_of(f"default/svc{i}:http/TCP") for i in range(40)]
    lonely = next(i for i, s in enumerate(shards) if shards.count(s) == 1)
    backend = get_backend("nftables")
    before = backend.render(many_services(40))
    planned = make_plan(backend, many_services(40, skip=lonely), observed_model=before, other_mode=False)
    assert [(s.action, s.service) for s in planned.plan.services] == [("-", f"default/svc{lonely}:http/TCP")]
    assert "0 to change, 1 to remove" in planned.plan.to_text()
    undescribed = make_plan(backend, many_services(40, skip=lonely), observed_model=before, other_mode=False,
                            describe=False)
    assert undescribed.count_services(backend) == {"-": 1}
    everything = make_plan(backend, many_services(0), observed_model=before, other_mode=False)
    assert {o.text.split()[0] for o in everything.plan.operations} == {"delete"}
    assert len(everything.plan.services) == 40 and {s.action for s in everything.plan.services} == {"-"}


def test_plan_reads_in_service_terms_and_json_matches_schema():
    before = render(many_services(5))
    after = render(many_services(5, changed=3))
    plan = Plan("nftables", "node-a", service_changes(service_view(before), service_view(after)), diff(after, before))
    text = plan.to_text()
    assert "~ default/svc3:http/TCP" in text
    assert "- endpoint 10.244.0.11:8080" in text and "+ endpoint 10.244.99.99:8080" in text
    assert text.strip().endswith("Plan: 0 service ports to add, 1 to change, 0 to remove; 5 kernel operations.")
    with open(os.path.join(REPO, "schemas", "plan.schema.json")) as fh:
        schema = json.load(fh)
    jsonschema.validate(json.loads(plan.to_json()), schema)
    assert "verifiedBy" not in json.loads(plan.to_json())  # a plan; apply says how it verified
    plan.verified_by = "generation"
    jsonschema.validate(json.loads(plan.to_json()), schema)
    plan.verified_by = "guessed"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(plan.to_json()), schema)
    # a service port whose rules alone change (affinity timeout, a policy): its views are the same
    same = service_view(before)
    rules_only = Plan("nftables", "node-a", service_changes(same, same, {"default/svc1:http/TCP"}), diff(after, before))
    assert [s.details for s in rules_only.services] == [(RULES_ONLY,)]
    jsonschema.validate(json.loads(rules_only.to_json()), schema)


def test_script_batches_elements_and_is_one_transaction_text():
    ops = diff(render(many_services(4)), Ruleset())
    text = script(ops)
    assert len([line for line in text.splitlines() if line.startswith("add element") and " service-ips { " in line]) == len(
        {shard_of(sp.id) for sp in many_services(4).services})  # one batch per shard table
    assert text.splitlines()[0] == "add table ip reconciler"


def _blocks(text: str) -> dict[str, list[str]]:
    """`add chain T C {` … `}` blocks of a script: chain reference -> its rules."""
    blocks: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("add chain ") and line.endswith(" {"):
            current = blocks.setdefault(line[len("add chain "):-2], [])
        elif line == "}":
            current = None
        elif current is not None:
            current.append(line.strip())
    return blocks


def test_script_with_the_model_writes_service_changes_without_rule_or_element_adds():
    before = render(many_services(30))
    after = render(many_services(30, changed=7))
    ops = diff(after, before)
    plain, light = script(ops), script(ops, after)
    lines = light.splitlines()
    assert not [line for line in lines if line.startswith(("add rule", "add element"))]
    # the chain block holds exactly the rules the plain form adds, in their order
    added = [op.text.split(" ", 5)[5] for op in ops if op.kind == "rule"]
    assert [r for rules in _blocks(light).values() for r in rules] == added
    assert len(added) == 4 and "add rule" in plain
    # the named set those rules use is declared (without elements) before its block
    decl = next(i for i, line in enumerate(lines) if line.startswith("add set") and "cluster-cidrs" in line)
    assert "elements" not in lines[decl]
    assert decl < next(i for i, line in enumerate(lines) if line.endswith(" {"))
    # flushes come first, as in the plain form
    assert [line for line in lines if line.startswith("flush")] == [
        line for line in plain.splitlines() if line.startswith("flush")]


def test_script_with_the_model_adds_map_elements_as_a_declaration():
    skipped = 11
    before = render(many_services(30, skip=skipped))
    after = render(many_services(30))
    ops = diff(after, before)
    light = script(ops, after)
    assert "add element" not in light
    maps = [line for line in light.splitlines() if line.startswith("add map") and " service-ips " in line]
    assert len(maps) == 1
    assert maps[0].endswith(f'comment "default/svc{skipped}:http/TCP" : goto svc-default/svc{skipped}/http/tcp }}; }}')
    assert "type ipv4_addr . inet_proto . inet_service : verdict; elements = {" in maps[0]


def test_script_keeps_the_plain_form_where_it_cannot_declare():
    model = render(many_services(4))
    ops = diff(model, Ruleset())
    assert script(ops, Ruleset()) == script(ops)  # a model that does not know the tables
    light = script(ops, model)
    # rules of base chains (a block would have to restate the hook) and interval sets stay plain
    lines = set(light.splitlines())
    base_rules = [op.text for op in ops if op.kind == "rule" and
                  model.tables[" ".join(op.name.split()[:2])].chains[op.name.split(" chain ")[1]].base]
    assert base_rules and all(text in lines for text in base_rules)
    assert any(line.startswith("add element") and "cluster-cidrs" in line for line in lines)


def test_observed_model_matches_schema():
    with open(os.path.join(REPO, "schemas", "nftables-model.schema.json")) as fh:
        jsonschema.validate(recorded().to_dict(), json.load(fh))


def test_masquerade_options():
    objs = [service("web", "10.96.0.1", HTTP), endpoint_slice("web", [endpoint("10.244.1.5")])]
    rules = lambda **o: chain(render(build(objs, **o)), "svc-default/web/http/tcp").rules
    assert rules()[0] == "ip saddr != @cluster-cidrs jump mark-for-masquerade"
    assert rules(masquerade_all=True)[0] == "jump mark-for-masquerade"
    assert rules(cluster_cidrs=())[0].startswith("meta l4proto tcp dnat")  # no local detector: no masquerade


def test_nodeport_addresses_narrow_the_match():
    objs = [service("web", "10.96.0.1", [{**HTTP[0], "nodePort": 30001}], type="NodePort"),
            endpoint_slice("web", [endpoint("10.244.1.5")])]
    nodeports = lambda **o: chain(render(build(objs, **o)), "nodeports").rules
    assert nodeports()[0].startswith("ip daddr != 127.0.0.0/8 fib daddr type local ")
    assert nodeports(nodeport_cidrs=("172.30.0.0/24", "10.1.0.0/16"))[0].startswith(
        "ip daddr { 10.1.0.0/16, 172.30.0.0/24 } fib daddr type local ")
    # a family the flag names no CIDR of, or a zero CIDR: every local address (as kube-proxy)
    for cidrs in (("fd00::/64",), ("0.0.0.0/0", "10.1.0.0/16")):
        assert nodeports(nodeport_cidrs=cidrs)[0].startswith("ip daddr != 127.0.0.0/8 fib daddr type local "), cidrs


@pytest.mark.parametrize("cidrs,listed", [
    (["10.0.0.0/9", "10.128.0.0/9"], "10.0.0.0/8"),  # touching: merged into one CIDR
    (["10.0.0.0/23", "10.0.2.0/24"], "10.0.0.0-10.0.2.255"),  # merged, not a CIDR: a range
    (["10.0.0.5/32", "10.0.0.1/32", "10.0.0.0/30"], "{ 10.0.0.0/30, 10.0.0.5 }"),  # overlapping: one
    (["fd00::/64", "::/128", "::2/127"], "{ ::, ::2/127, fd00::/64 }"),  # apart: as they are, in order
])
def test_inline_cidr_sets_are_written_as_nft_lists_them(cidrs, listed):
    """nft 1.0.6 listed exactly these for the inline sets (the kernel merges their intervals);
    written otherwise, a rule would never read back as written (a plan never empty)."""
    assert interval_set(cidrs) == listed


def test_a_nodeport_cidr_holding_loopback_leaves_loopback_out():
    objs = [service("web", "10.96.0.1", [{**HTTP[0], "nodePort": 30001}], type="NodePort"),
            endpoint_slice("web", [endpoint("10.244.1.5")])]
    nodeports = chain(render(build(objs, nodeport_cidrs=("0.0.0.0/1", "172.30.0.0/24"))), "nodeports").rules
    assert nodeports[0].startswith("ip daddr != 127.0.0.0/8 ip daddr { 0.0.0.0/1, 172.30.0.0/24 } fib daddr type local ")
    drop = chain(render(build(objs, service_cidrs=("10.96.0.0/13", "10.104.0.0/13"))), "cluster-ips-check").rules
    assert drop[-1] == "ip daddr 10.96.0.0/12 drop"


def test_nodeports_are_looked_up_after_every_shards_service_ips():
    """kube-proxy looks a packet up in @service-ips, then in @service-nodeports, in one chain. Our
    shards have a chain each: the NodePorts go a priority later than every shard's service IPs, so
    a service IP that is also a local address (an externalIP on the node) wins over another
    shard's NodePort on the same port."""
    objs = [service("web", "10.96.0.1", [{**HTTP[0], "nodePort": 30001}], type="NodePort"),
            endpoint_slice("web", [endpoint("10.244.1.5")])]
    table = next(t for t in render(build(objs)).tables.values() if "nodeports" in t.chains)
    assert table.chains["services"].rules == ("ip daddr . meta l4proto . th dport vmap @service-ips",)
    hooks = {c.base.hook: c.base.priority for c in table.chains.values() if c.base and c.rules == ("jump services",)}
    later = {c.base.hook: c.base.priority for c in table.chains.values() if c.base and c.rules == ("jump nodeports",)}
    assert hooks == {"prerouting": -100, "output": -100} and later == {"prerouting": -99, "output": -99}
    # no NodePort address in a family (only loopback named): no NodePort chains in it
    dual = [service("web", "10.96.0.1", [{**HTTP[0], "nodePort": 30001}], type="NodePort",
                    clusterIPs=["10.96.0.1", "fd00:96::1"]),
            endpoint_slice("web", [endpoint("10.244.1.5")]),
            endpoint_slice("web", [endpoint("fd00:244::5")], family="IPv6")]
    shards = [t for t in render(build(dual, nodeport_cidrs=("::1/128", "10.1.0.0/16"))).tables.values()
              if "service-ips" in t.sets]
    assert {t.family: "nodeports" in t.chains for t in shards} == {"ip": True, "ip6": False}


def test_service_traffic_is_rejected_at_priority_filter_as_kube_proxy_promises():
    """kube-proxy (since #132456) rejects/drops service traffic from `type filter` chains at
    `priority filter`: other components order their own chains against that."""
    main = render(build([service("web", "10.96.0.1", HTTP)])).tables["ip reconciler"]
    hooks = {c.base.hook: c.base.priority for n, c in main.chains.items() if n.startswith("filter-")}
    assert hooks == {"input": 0, "forward": 0, "output": 0}


def test_hairpin_is_an_endpoint_reaching_itself_on_its_own_port():
    """As kube-proxy's hairpin-connections: source, destination, protocol and port of the
    endpoint; a pod DNATed back to itself on another port by someone else is not masqueraded."""
    objs = [service("web", "10.96.0.1", HTTP), endpoint_slice("web", [endpoint("10.244.1.5")])]
    main = render(build(objs)).tables["ip reconciler"]
    assert main.sets["hairpin"].key_type == "ipv4_addr . ipv4_addr . inet_proto . inet_service"
    assert set(main.sets["hairpin"].elements) == {"10.244.1.5 . 10.244.1.5 . tcp . 8080"}
    assert main.chains["masquerading"].rules[0] == (
        "ct status dnat ip saddr . ip daddr . meta l4proto . th dport @hairpin jump mark-for-masquerade")


def test_apply_retries_plainly_when_the_kernel_refuses_the_fast_form(monkeypatch):
    from reconciler.backends.base import KernelError
    from reconciler.backends.nftables import backend as nft_backend

    b = nft_backend.NftablesBackend()
    before = b.render(many_services(30))
    ops = diff(b.render(many_services(30, changed=7)), before)
    ran = []
    failing = {"first": 1}

    def run_script(text):
        ran.append(text if isinstance(text, str) else text.text())  # (the fast form is written to a SpooledInput)
        if len(ran) <= failing["first"]:
            raise KernelError(f"nft -f failed (nothing was changed): attempt {len(ran)}")
        return nft_backend.kernel.Ran(0.001, [7])

    monkeypatch.setattr(nft_backend.kernel, "run_script", run_script)
    assert b.apply(ops) == [7]  # the generation the plain form's commit produced
    assert ran == [b.script(ops), script(ops)] and ran[0] != ran[1]
    once = b.prepare(ops)
    assert once() == [7]
    with pytest.raises(RuntimeError, match="runs once"):  # (its text is let go once run)
        once()
    ran.clear()
    failing["first"] = 2
    with pytest.raises(KernelError, match="attempt 2"):  # the plain form failed too: its error
        b.apply(ops)
    assert len(ran) == 2


@pytest.mark.parametrize("limit", [1 << 30, 4096])
def test_a_transaction_written_as_it_is_made_is_the_same_text(limit):
    """The run loop writes its transaction into a SpooledInput (kept in pieces while small, else
    in a memory file: a 10k-service text is never one string): the text, what `nft -f` reads,
    and whether it is certain to commit are those of the whole string."""
    from reconciler.backends.base import SpooledInput, run_tool
    from reconciler.backends.nftables.kernel import _ALWAYS_CHANGES, certain_to_commit

    desired = render(many_services(60))
    ops = diff(desired, Ruleset())
    whole = script(ops, desired)
    out = SpooledInput(limit, _ALWAYS_CHANGES)
    assert script(ops, desired, out) == ""
    assert out.in_memory == (limit > len(whole)) and out.size == len(whole) > 4096
    assert out.text() == whole and out.noticed == certain_to_commit(whole) is True
    assert run_tool(["cat"], out).stdout == whole
    assert run_tool(["cat"], out).stdout == whole  # (read from its start again)
    out.close()
    with pytest.raises(ValueError, match="after close"):
        out.text()
    table_only = SpooledInput(limit, _ALWAYS_CHANGES)
    table_only.write("add table ip t\n")  # (may change nothing)
    assert not table_only.noticed


@pytest.mark.parametrize("tools_at_once", [1, 3])
def test_a_read_beside_other_work_runs_one_nft_at_a_time(monkeypatch, tools_at_once):
    """each_table: up to `tools_at_once` `nft list table` at once (the one-shot commands' read,
    beside the manifests loading, keeps to one), and every table still read, parsed and in order."""
    import threading
    import time

    from reconciler.backends.nftables import kernel, observe

    running, most = 0, 0
    lock = threading.Lock()

    def list_table(family: str, name: str) -> str:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.01)
        with lock:
            running -= 1
        return f"table {family} {name} {{\n\tchain c {{\n\t\tcounter\n\t}}\n}}\n"

    monkeypatch.setattr(kernel, "list_table", list_table)
    tables = list(observe.each_table(tools_at_once=tools_at_once))
    names = observe.table_names()
    assert [t.ref for t in tables] == [f"{f} {n}" for f in ("ip", "ip6") for n in names]
    assert all(t.chains["c"].rules == ("counter",) for t in tables)
    assert most == tools_at_once


def test_external_traffic_without_a_local_endpoint_ends_in_its_own_chain():
    """ETP Local, no endpoint on this node: pods and the node still short-circuit to the others;
    anything else is dropped in the ext chain itself. Falling through, it would meet later lookups:
    another shard's NodePort on the port of this service's (local) external IP. kube-proxy's goto
    ends its one services chain there; filter then drops it."""
    objs = [service("web", "10.96.0.1", [{**HTTP[0], "nodePort": 30001}], type="NodePort",
                    externalTrafficPolicy="Local", externalIPs=["172.30.1.52"]),
            endpoint_slice("web", [endpoint("10.244.2.5", node="node-b")])]
    rules = chain(render(build(objs)), "ext-default/web/http/tcp").rules
    assert rules[0].startswith("ip saddr @cluster-cidrs ") and "dnat to 10.244.2.5:8080" in rules[0]
    assert rules[-1] == "drop"
    assert elements(render(build(objs)), "service-ips")["172.30.1.52 . tcp . 80"][0] == "goto ext-default/web/http/tcp"

"""Stale UDP conntrack cleanup (reconciler/conntrack.py), as kube-proxy's conntrack reconciler:
which entries go (a pure selection over entries and the desired state's frontends and serving
endpoints), when a process runs it, and how apply() and the run loop reach it."""

from __future__ import annotations

import json
import os
from typing import Any

import jsonschema
from helpers import REPO, FakeConntrack, build, endpoint, endpoint_slice, node, service

from reconciler import conntrack
from reconciler.backends.base import Operation
from reconciler.conntrack import Entry, Reconciler, select_stale, serving_by_frontend
from reconciler.reconcile import apply, clean_conntrack, make_plan
from reconciler.state import DesiredState, Endpoint, Family

CLIENT = "10.244.9.9"
P, Q, R = "10.244.1.5", "10.244.1.6", "10.244.2.7"  # pods (R on node-b)
DNS = {"name": "dns", "port": 53, "targetPort": 5353, "protocol": "UDP"}


def dns_slice(svc: str, endpoints: list[dict[str, Any]], family: str = "IPv4") -> Any:
    return endpoint_slice(svc, endpoints, port=5353, port_name="dns", protocol="UDP", family=family)


def flow(dst: str, dport: int, reply: str, reply_port: int = 5353, sport: int = 40000) -> Entry:
    """An entry from the client's port `sport` to dst:dport, answered from reply:reply_port."""
    src = "fd00:244:9::9" if ":" in dst else CLIENT
    return Entry(src, sport, dst, dport, reply, reply_port)


def stale(desired: DesiredState, entries: list[Entry], family: Family = "ipv4") -> list[Entry]:
    udp = [sp for sp in desired.services if sp.protocol == "UDP"]
    return select_stale(entries, serving_by_frontend(udp).get(family, {}))


def internal(desired: DesiredState, sid: str) -> list[str]:
    return [str(e) for e in desired.by_id()[sid].families[0].internal.endpoints]


# ---------------------------------------------------------------------------------------------
# Which entries go


def test_flows_to_any_serving_endpoint_stay_whatever_the_rules_chose() -> None:
    """Bug 1: a terminating endpoint that still serves, one that topology hints leave out, and a
    remote one that externalTrafficPolicy Local leaves out of the NodePort keep their flows; the
    old cleanup took the rules' DNAT targets for the endpoints and deleted those."""
    d = build([node(zone="zone-a"),
               service("term", "10.96.0.10", [DNS]),
               dns_slice("term", [endpoint(P), endpoint(Q, ready=False, serving=True, terminating=True),
                                  endpoint(R, node="node-b", ready=False, serving=False, terminating=True)]),
               service("zoned", "10.96.0.11", [DNS]),
               dns_slice("zoned", [endpoint(P, hints=["zone-a"]), endpoint(R, node="node-b", hints=["zone-b"])]),
               service("local", "10.96.0.12", [{**DNS, "nodePort": 30053}], type="NodePort",
                       externalTrafficPolicy="Local"),
               dns_slice("local", [endpoint(P), endpoint(R, node="node-b")])])
    assert internal(d, "default/term:dns/UDP") == internal(d, "default/zoned:dns/UDP") == [f"{P}:5353"]
    assert [str(e) for e in d.by_id()["default/local:dns/UDP"].families[0].external.endpoints] == [f"{P}:5353"]
    kept = [flow("10.96.0.10", 53, Q), flow("10.96.0.11", 53, R), flow("172.30.0.2", 30053, R)]
    not_serving, no_dnat = flow("10.96.0.10", 53, R, sport=1), flow("10.96.0.10", 53, "10.96.0.10", 53, sport=2)
    assert stale(d, [*kept, not_serving, no_dnat]) == [not_serving, no_dnat]
    # the document says so, in a shape its schema allows
    block = d.by_id()["default/term:dns/UDP"].to_dict()["ipv4"]
    assert block["servingEndpoints"] == [{"ip": P, "port": 5353}, {"ip": Q, "port": 5353}]
    with open(os.path.join(REPO, "schemas", "desired-state.schema.json")) as fh:
        jsonschema.validate(d.to_dict(), json.load(fh))


def test_only_flows_sent_to_the_service_that_lost_the_endpoint_are_deleted() -> None:
    """Bug 2: service a moved from P to Q while service b still uses P. Only a's flows to P go (by
    its ClusterIP and port, and by its NodePort on any address); b's flows to P and direct
    traffic to P stay. The old cleanup deleted every flow answered by P:5353."""
    d = build([service("a", "10.96.0.10", [{**DNS, "nodePort": 30053}], type="NodePort"),
               dns_slice("a", [endpoint(Q)]),
               service("b", "10.96.0.11", [DNS]), dns_slice("b", [endpoint(P)])])
    via_a, via_a_nodeport = flow("10.96.0.10", 53, P, sport=1), flow("172.30.0.2", 30053, P, sport=2)
    via_b, direct, not_a_frontend = flow("10.96.0.11", 53, P, sport=3), flow(P, 5353, P, sport=4), flow(
        "10.96.0.11", 54, P, sport=5)
    assert stale(d, [via_a, via_a_nodeport, via_b, direct, not_a_frontend]) == [via_a, via_a_nodeport]


def test_a_cold_start_deletes_only_what_no_serving_endpoint_answers() -> None:
    """Bug 3: a process's first run (cold start, mode switch) keeps healthy flows, in both
    families; the old cleanup took every frontend for new and deleted all of its flows."""
    d = build([service("dns", "10.96.0.10", [{**DNS, "nodePort": 30053}], type="NodePort",
                       clusterIPs=["10.96.0.10", "fd00:96::10"], ipFamilies=["IPv4", "IPv6"],
                       ipFamilyPolicy="RequireDualStack"),
               dns_slice("dns", [endpoint(P)]), dns_slice("dns", [endpoint("fd00:244:1::5")], family="IPv6")])
    healthy = [flow("10.96.0.10", 53, P), flow("172.30.0.2", 30053, P, sport=1),
               flow("fd00:96::10", 53, "fd00:244:1::5")]
    gone, unanswered = flow("10.96.0.10", 53, R, sport=2), flow("fd00:96::10", 53, "fd00:96::10", 53, sport=3)
    table = FakeConntrack([*healthy, gone, unanswered])
    ct = Reconciler(table)
    ct.take(d)
    result = ct.run()
    assert table.entries == healthy
    assert result is not None and result.ok
    assert [(r.family, r.deleted, r.error) for r in result.runs] == [("ipv4", 1, None), ("ipv6", 1, None)]
    assert all(r.seconds >= 0 for r in result.runs)


def test_a_service_without_endpoints_loses_every_flow_to_it() -> None:
    """kubernetes#139629: a service scaled to zero is cleaned with no serving endpoint at all."""
    d = build([service("dns", "10.96.0.10", [DNS])])
    assert stale(d, [flow("10.96.0.10", 53, P)]) == [flow("10.96.0.10", 53, P)]


def test_a_reply_from_the_endpoints_address_on_another_port_is_stale() -> None:
    """The endpoint's port counts too: after a targetPort change the old flows go."""
    d = build([service("dns", "10.96.0.10", [DNS]), dns_slice("dns", [endpoint(P)])])
    assert stale(d, [flow("10.96.0.10", 53, P, reply_port=53)]) == [flow("10.96.0.10", 53, P, reply_port=53)]


def test_a_service_ip_and_port_is_looked_up_before_another_services_nodeport() -> None:
    """As in the data path: an externalIP on port 30053, and another service's NodePort 30053."""
    d = build([service("xip", "10.96.0.10", [{**DNS, "port": 30053}], externalIPs=["172.30.1.60"]),
               dns_slice("xip", [endpoint(P)]),
               service("np", "10.96.0.11", [{**DNS, "nodePort": 30053}], type="NodePort"),
               dns_slice("np", [endpoint(Q)])])
    to_xip, to_node = flow("172.30.1.60", 30053, P), flow("172.30.0.2", 30053, P, sport=1)
    assert stale(d, [to_xip, to_node]) == [to_node]


def test_the_frontends_of_a_deleted_udp_service_are_cleaned() -> None:
    """kubernetes#141371: the frontends a UDP service port had before are cleaned as having no
    endpoints, once (and a frontend another service still has stays that one's)."""
    one = build([service("old", "10.96.0.20", [{**DNS, "nodePort": 30054}], type="NodePort"),
                 dns_slice("old", [endpoint(P)]), service("dns", "10.96.0.10", [DNS]), dns_slice("dns", [endpoint(P)])])
    two = build([service("dns", "10.96.0.10", [DNS]), dns_slice("dns", [endpoint(P)])])
    kept = flow("10.96.0.10", 53, P)
    table = FakeConntrack([kept])
    ct = Reconciler(table)
    ct.take(one)
    ct.run()
    table.entries += [flow("10.96.0.20", 53, P, sport=1), flow("172.30.0.2", 30054, P, sport=2)]
    ct.take(two)
    result = ct.run()
    assert table.entries == [kept] and result is not None and result.runs[0].deleted == 2
    table.entries.append(flow("10.96.0.20", 53, Q, sport=3))  # no frontend any more: not ours
    ct.take(two)
    assert ct.run() is None and len(table.entries) == 2


# ---------------------------------------------------------------------------------------------
# When a process runs it


def test_a_run_is_due_first_then_when_udp_frontends_or_serving_endpoints_change() -> None:
    tcp = service("web", "10.96.0.30", [{"name": "http", "port": 80, "protocol": "TCP"}])
    term = endpoint(Q, ready=False, serving=True, terminating=True)
    first = build([service("dns", "10.96.0.10", [DNS]), dns_slice("dns", [endpoint(P), term]), tcp])
    table = FakeConntrack()
    seen: list[conntrack.Result] = []
    ct = Reconciler(table)
    ct.listeners.append(seen.append)
    ct.take(first)
    assert ct.run() is not None and table.dumps == 1
    ct.take(first)
    assert ct.run() is None  # nothing changed
    web_moved = build([service("dns", "10.96.0.10", [DNS]), dns_slice("dns", [endpoint(P), term]), tcp,
                       endpoint_slice("web", [endpoint(R, node="node-b")])])
    ct.take(web_moved)
    assert ct.run() is None  # TCP only
    gone = build([service("dns", "10.96.0.10", [DNS]), dns_slice("dns", [endpoint(P)]), tcp])
    assert internal(gone, "default/dns:dns/UDP") == internal(first, "default/dns:dns/UDP")  # same rules
    ct.take(gone)
    assert ct.run() is not None and table.dumps == 2  # but the terminating endpoint has gone
    assert len(seen) == 2 and ct.last is seen[-1]


def test_no_udp_service_no_kernel() -> None:
    table = FakeConntrack()
    ct = Reconciler(table)
    ct.take(build([service("web", "10.96.0.30", [{"name": "http", "port": 80}])]))
    result = ct.run()
    assert result is not None and result.runs == () and table.dumps == 0


def test_a_failed_run_stays_due_and_the_next_run_retries_it() -> None:
    one = build([service("old", "10.96.0.20", [DNS]), dns_slice("old", [endpoint(P)]),
                 service("dns", "10.96.0.10", [DNS]), dns_slice("dns", [endpoint(P)])])
    two = build([service("dns", "10.96.0.10", [DNS]), dns_slice("dns", [endpoint(Q)])])
    table = FakeConntrack()
    ct = Reconciler(table)
    ct.take(one)
    ct.run()
    stale_flows = [flow("10.96.0.10", 53, P), flow("10.96.0.20", 53, P, sport=1)]
    table.entries, table.failures = list(stale_flows), 1
    ct.take(two)
    failed = ct.run()
    assert failed is not None and not failed.ok and failed.runs[0].error == "conntrack netlink unavailable"
    assert ct.due and table.entries == stale_flows
    ct.take(two)  # nothing changed since, but the failed run is still due (with the deleted service's frontend)
    retried = ct.run()
    assert retried is not None and retried.ok and retried.runs[0].deleted == 2 and table.entries == []
    assert not ct.due


class ScopedConntrack(FakeConntrack):
    """FakeConntrack that records what each dump asked for."""

    def __init__(self, entries: list[Entry] | None = None) -> None:
        super().__init__(entries)
        self.asked: list[tuple[Family, Any]] = []

    def udp_entries(self, family: Family, to: Any = None) -> list[Entry]:
        self.asked.append((family, to))
        return super().udp_entries(family, to)


def test_after_the_first_run_only_the_frontends_that_lost_endpoints_are_read() -> None:
    """A busy node holds many UDP entries (DNS): after the first, full pass, an endpoint leaving
    one service reads only the entries sent to that service's frontends (the kernel filters
    them), and deletes only those its lost endpoint answered; recheck() (drift) makes the next
    pass full again."""
    one = build([service("dns", "10.96.0.10", [{**DNS, "nodePort": 30053}], type="NodePort"),
                 dns_slice("dns", [endpoint(P), endpoint(Q)]),
                 service("other", "10.96.0.11", [DNS]), dns_slice("other", [endpoint(P)])])
    two = build([service("dns", "10.96.0.10", [{**DNS, "nodePort": 30053}], type="NodePort"),
                 dns_slice("dns", [endpoint(Q)]),
                 service("other", "10.96.0.11", [DNS]), dns_slice("other", [endpoint(P)])])
    table = ScopedConntrack()
    ct = Reconciler(table)
    ct.take(one)
    ct.run()
    assert table.asked == [("ipv4", None)]
    to_p, to_q, nodeport_p = flow("10.96.0.10", 53, P, sport=1), flow("10.96.0.10", 53, Q, sport=2), flow(
        "172.30.0.2", 30053, P, sport=3)
    other_p, unanswered_other = flow("10.96.0.11", 53, P, sport=4), flow("10.96.0.11", 53, "10.96.0.11", 53, sport=5)
    table.entries = [to_p, to_q, nodeport_p, other_p, unanswered_other]
    table.asked.clear()
    ct.take(two)
    result = ct.run()
    assert result is not None and result.ok and result.runs[0].deleted == 2
    assert sorted(table.asked, key=str) == [("ipv4", ("10.96.0.10", 53)), ("ipv4", (None, 30053))]
    assert table.entries == [to_q, other_p, unanswered_other]  # (the last is not this change's)
    ct.take(two)
    assert ct.run() is None
    ct.recheck()
    table.asked.clear()
    assert ct.run() is not None and table.asked == [("ipv4", None)] and table.entries == [to_q, other_p]


def test_a_frontend_that_appears_loses_the_flows_sent_to_it_before() -> None:
    """A client sent to a NodePort (or LB IP) before it forwarded: its entry answers from the
    node itself and would keep the client there. The pass that the new frontend makes due deletes
    it, reading only that frontend's entries; more than TARGETED_MAX new frontends in a family
    are read in one listing."""
    dns = [service("dns", "10.96.0.10", [DNS]), dns_slice("dns", [endpoint(P)])]
    table = ScopedConntrack()
    ct = Reconciler(table)
    ct.take(build(dns))
    ct.run()
    early = flow("172.30.0.2", 30055, "172.30.0.2", 30055, sport=7)
    table.entries = [early]
    table.asked.clear()
    ct.take(build([*dns, service("np", "10.96.0.12", [{**DNS, "nodePort": 30055}], type="NodePort"),
                   dns_slice("np", [endpoint(Q)])]))
    result = ct.run()
    assert result is not None and result.runs[0].deleted == 1 and table.entries == []
    assert sorted(table.asked, key=str) == [("ipv4", ("10.96.0.12", 53)), ("ipv4", (None, 30055))]
    many = [o for i in range(5) for o in (service(f"s{i}", f"10.96.1.{i + 1}", [DNS]), dns_slice(f"s{i}", [endpoint(P)]))]
    table.asked.clear()
    ct.take(build([*dns, *many]))
    ct.run()
    assert table.asked == [("ipv4", None)]


def test_conntrack_tool_listing_lines() -> None:
    """Lines as conntrack-tools 1.4.7 prints them (recorded): the first tuple is the original,
    the second the reply; zone, flags and counters around them."""
    assert conntrack.parse_entry(
        "udp      17 599 src=10.0.0.1 dst=10.96.0.10 sport=1000 dport=53 [UNREPLIED] src=10.96.0.10 "
        "dst=10.0.0.1 sport=53 dport=1000 mark=0 use=1") == Entry("10.0.0.1", 1000, "10.96.0.10", 53,
                                                                  "10.96.0.10", 53)
    assert conntrack.parse_entry(
        "udp      17 599 src=fd00::1 dst=fd00:96::10 sport=1000 dport=53 [UNREPLIED] src=fd00:244:1::5 "
        "dst=fd00::1 sport=8080 dport=1000 mark=0 zone=3 use=1") == Entry("fd00::1", 1000, "fd00:96::10", 53,
                                                                          "fd00:244:1::5", 8080, 3)
    assert conntrack.parse_entry(
        "udp      17 28 src=10.0.0.1 dst=10.96.0.10 sport=1000 dport=53 packets=2 bytes=90 src=10.244.1.5 "
        "dst=10.0.0.1 sport=5353 dport=1000 packets=2 bytes=120 [ASSURED] mark=0 use=1") == Entry(
        "10.0.0.1", 1000, "10.96.0.10", 53, "10.244.1.5", 5353)
    assert conntrack.parse_entry("conntrack v1.4.7 (conntrack-tools): 1 flow entries have been shown.") is None


# ---------------------------------------------------------------------------------------------
# apply() and the run loop


class ViewBackend:
    """A backend whose kernel model is the service views themselves."""

    mode = "fake"

    def __init__(self, views: dict[str, dict[str, Any]] | None = None) -> None:
        self.kernel: dict[str, dict[str, Any]] = dict(views or {})
        self.want: dict[str, dict[str, Any]] = {}

    def render(self, desired: DesiredState) -> dict[str, dict[str, Any]]:
        self.want = {sp.id: {"addresses": [f"{b.clusterIP}:{sp.port}/{sp.protocol.lower()}" for b in sp.families],
                             "endpoints": [str(e) for b in sp.families for e in b.internal.endpoints]}
                     for sp in desired.services}
        return self.want

    def observe(self, beside_work: bool = False) -> dict[str, dict[str, Any]]:
        return dict(self.kernel)

    def diff(self, want: dict[str, Any], have: dict[str, Any]) -> list[Operation]:
        return [Operation("+", "service", s, f"add {s}", s) for s in sorted(want) if have.get(s) != want[s]] + [
            Operation("-", "service", s, f"delete {s}", s) for s in sorted(have) if s not in want]

    def apply(self, ops: list[Operation]) -> None:
        for op in ops:
            if op.action == "-":
                del self.kernel[op.name]
            else:
                self.kernel[op.name] = self.want[op.name]

    def generation(self) -> None:
        return None

    def unconverged(self, want: dict[str, Any]) -> list[Operation]:
        return self.diff(want, self.kernel)

    def service_view(self, model: dict[str, Any], only: set[str] | None = None) -> dict[str, dict[str, Any]]:
        return {s: v for s, v in model.items() if only is None or s in only}

    def removed_unnamed(self, observed, operations) -> set:  # (every operation names its service port)
        return set()


def test_apply_cleans_and_a_sync_with_nothing_to_apply_retries_a_failed_cleanup(
        conntrack_in_memory: FakeConntrack) -> None:
    table = conntrack_in_memory
    stale_flow = flow("10.96.0.10", 53, P)
    table.entries, table.failures = [stale_flow], 1
    backend = ViewBackend()
    desired = build([service("dns", "10.96.0.10", [DNS]), dns_slice("dns", [endpoint(Q)])])
    apply(backend, make_plan(backend, desired, observed_model=backend.observe()))
    assert conntrack.RECONCILER.due and table.entries == [stale_flow]  # failed: not an error of the apply
    again = make_plan(backend, desired, observed_model=backend.observe())
    assert again.plan.operations == []
    result = clean_conntrack(again)
    assert result is not None and result.ok and table.entries == []
    assert clean_conntrack(again) is None


def test_a_process_first_apply_cleans_the_frontends_of_udp_services_removed_before_it(
        conntrack_in_memory: FakeConntrack) -> None:
    """What was a frontend before this process started is what the kernel's rules had."""
    table = conntrack_in_memory
    old = {"addresses": ["10.96.0.20:53/udp (reject)", "[fd00:96::20]:53/udp", "nodePort 30054/udp"],
           "endpoints": []}
    backend = ViewBackend({"default/old:dns/UDP": old})
    to_old = [flow("10.96.0.20", 53, P), flow("fd00:96::20", 53, "fd00:244:1::5"),
              flow("172.30.0.2", 30054, P, sport=1)]
    elsewhere = flow("10.96.0.21", 53, P, sport=2)
    table.entries = [*to_old, elsewhere]
    desired = build([service("web", "10.96.0.30", [{"name": "http", "port": 80}])])
    apply(backend, make_plan(backend, desired, observed_model=backend.observe()))
    assert "default/old:dns/UDP" not in backend.kernel and table.entries == [elsewhere]
    assert conntrack.view_frontends({"x": old}) == {
        ("ipv4", ("10.96.0.20", 53)), ("ipv6", ("fd00:96::20", 53)), ("ipv4", (None, 30054)), ("ipv6", (None, 30054))}


def test_a_process_first_apply_cleans_the_frontends_a_udp_service_port_lost_before_it(
        conntrack_in_memory: FakeConntrack) -> None:
    """A UDP service port that is still there but lost a frontend (its externalIP, its nodePort)
    since what the kernel holds: on a process's first apply those frontends are cleaned as ones
    without endpoints (only the run loop, which saw them, did), its remaining ones kept."""
    table = conntrack_in_memory
    old = {"addresses": ["10.96.0.20:53/udp", "172.30.1.70:53/udp", "nodePort 30054/udp"], "endpoints": [f"{P}:5353"]}
    backend = ViewBackend({"default/dns:dns/UDP": old})
    to_lost = [flow("172.30.1.70", 53, P), flow("172.30.0.2", 30054, P, sport=1)]
    kept = flow("10.96.0.20", 53, P, sport=2)
    table.entries = [*to_lost, kept]
    desired = build([service("dns", "10.96.0.20", [DNS]), dns_slice("dns", [endpoint(P)])])
    apply(backend, make_plan(backend, desired, observed_model=backend.observe()))
    assert table.entries == [kept]


def test_a_process_first_apply_leaves_the_other_familys_flows_to_a_single_stack_nodeport(
        conntrack_in_memory: FakeConntrack) -> None:
    """A single-stack (IPv4) UDP NodePort that changed before this process: its view names the
    nodePort without a family, read as both; the IPv6 flows to that port number are no service
    traffic and stay."""
    from reconciler.reconcile import _unseen_udp_frontends

    old = {"addresses": ["10.96.0.20:53/udp", "nodePort 30054/udp"], "endpoints": [f"{P}:5353"]}
    backend = ViewBackend({"default/dns:dns/UDP": old})
    desired = build([service("dns", "10.96.0.20", [{**DNS, "nodePort": 30054}], type="NodePort"),
                     dns_slice("dns", [endpoint(Q)])])
    planned = make_plan(backend, desired, observed_model=backend.observe())
    assert _unseen_udp_frontends(backend, planned) == set()
    # a dual-stack port that keeps its nodePort in IPv4 only: the IPv6 one went
    old["addresses"].append("[fd00:96::20]:53/udp")
    planned = make_plan(backend, desired, observed_model=backend.observe())
    assert _unseen_udp_frontends(backend, planned) == {("ipv6", ("fd00:96::20", 53)), ("ipv6", (None, 30054))}


def test_serving_sets_are_per_family_and_shared_frontends_take_both() -> None:
    d = build([service("a", "10.96.0.10", [DNS], externalIPs=["172.30.1.60"]), dns_slice("a", [endpoint(P)]),
               service("b", "10.96.0.11", [DNS], externalIPs=["172.30.1.60"]), dns_slice("b", [endpoint(Q)])])
    serving = serving_by_frontend(d.services)
    assert set(serving) == {"ipv4"}
    assert serving["ipv4"][("172.30.1.60", 53)] == {Endpoint(P, 5353), Endpoint(Q, 5353)}
    assert serving["ipv4"][("10.96.0.10", 53)] == {Endpoint(P, 5353)}


def test_a_dual_stack_nodeport_whose_families_differ_is_a_frontend_of_each() -> None:
    """A dual-stack UDP NodePort with externalTrafficPolicy Local, its IPv4 endpoint on this node and
    its IPv6 one elsewhere, is listed once per family ("IPv4 nodePort 30053/udp", "IPv6 nodePort
    30053/udp (drop)"): each is that family's frontend (apply removing it failed, after its commit,
    reading "IPv4 nodePort 30053" as a port number)."""
    from reconciler.backends import get_backend

    n = node()
    n.body["status"] = {"addresses": [{"type": "InternalIP", "address": "192.168.50.2"},  # type: ignore[index]
                                      {"type": "InternalIP", "address": "fd00:50::2"}]}
    objs = [n, service("dns", "10.96.0.50", [{**DNS, "nodePort": 30053}], type="NodePort",
                       clusterIPs=["10.96.0.50", "fd00:96::50"], ipFamilies=["IPv4", "IPv6"],
                       ipFamilyPolicy="RequireDualStack", externalTrafficPolicy="Local"),
            dns_slice("dns", [endpoint("10.244.1.53")]),
            endpoint_slice("dns", [endpoint("fd00:244:2::53", node="node-b")], port=5353, port_name="dns",
                           family="IPv6", protocol="UDP")]
    desired = build(objs, cluster_cidrs=("10.244.0.0/16", "fd00:244::/32"))
    for mode in ("nftables", "iptables"):
        backend = get_backend(mode)
        views = backend.service_view(backend.render(desired))
        assert {"IPv4 nodePort 30053/udp", "IPv6 nodePort 30053/udp (drop)"} <= set(
            views["default/dns:dns/UDP"]["addresses"]), mode
        assert {fe for fe in conntrack.view_frontends(views) if fe[1][0] is None} == {
            ("ipv4", (None, 30053)), ("ipv6", (None, 30053))}, mode

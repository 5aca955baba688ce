"""kube-proxy Service semantics, proven by real packets (issue: full Service semantics).

Each service below exercises one rule; pod1/pod2 run on node-a (the node under test), pod3 on node-b.
"""

from __future__ import annotations

import pytest

from lab import ADDR
from manifests import Applied, common_flags, eps, node_object, reconciler, svc, write_state
from traffic import concurrently, outcomes, servers

pytestmark = pytest.mark.e2e

HTTP = [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]


def http(node_port: int) -> list[dict]:
    return [{**HTTP[0], "nodePort": node_port}]


def lb(ip: str) -> dict:
    return {"loadBalancer": {"ingress": [{"ip": ip}]}}


NOT_READY_SERVING = {"ready": False, "serving": True, "terminating": True}
GONE = {"ready": False, "serving": False, "terminating": True}


def docs(udp_pod: str = "pod1") -> list[dict]:
    return [
        node_object("zone-a", addresses=(ADDR["node"][4], ADDR["node"][6])),
        # ETP Local with a local endpoint (pod1) and a remote one (pod3), dual-stack.
        svc("etp-local", ["10.96.1.10", "fd00:96::1:10"], http(31001), type="LoadBalancer",
            externalTrafficPolicy="Local", healthCheckNodePort=32001, externalIPs=["172.30.1.51"],
            ipFamilies=["IPv4", "IPv6"], status=lb("172.30.1.11")),
        eps("etp-local", ["pod1", "pod3"]), eps("etp-local", ["pod1", "pod3"], 6),
        # ETP Local with a hostNetwork endpoint on node-b (node2's own address, outside every
        # cluster CIDR) beside pod1: node2's traffic to the NodePort is no pod's (no short-circuit)
        # and keeps its source to the local endpoint.
        svc("etp-hostnet", ["10.96.1.21"], http(31004), type="NodePort", externalTrafficPolicy="Local"),
        hostnet_eps("etp-hostnet"),
        # ETP Local without a local endpoint.
        svc("etp-none", ["10.96.1.20"], http(31002), type="NodePort", externalTrafficPolicy="Local",
            externalIPs=["172.30.1.52"]),
        eps("etp-none", ["pod3"]),
        # ITP Local, with and without local endpoints.
        svc("itp-local", ["10.96.1.30"], HTTP, internalTrafficPolicy="Local"),
        eps("itp-local", ["pod1", "pod3"]),
        svc("itp-none", ["10.96.1.40"], HTTP, internalTrafficPolicy="Local"),
        eps("itp-none", ["pod3"]),
        # loadBalancerSourceRanges: only ext1 may use the LB IP; the NodePort is not filtered.
        svc("ranges", ["10.96.1.50"], http(31003), type="LoadBalancer", status=lb("172.30.1.13"),
            loadBalancerSourceRanges=["172.30.0.100/32"]),
        eps("ranges", ["pod1", "pod2"]),
        # The node's IP (172.30.0.2) is inside the (overlapping) ranges: its LB IP, routed to the
        # node as a local address, may then be the source too (kube-proxy's "allowFromNode").
        svc("ranges-node", ["10.96.1.51"], HTTP, type="LoadBalancer", status=lb("172.30.1.14"),
            loadBalancerSourceRanges=["172.30.0.0/30", "172.30.0.2/32"]),
        eps("ranges-node", ["pod1", "pod2"]),
        # Two Services on one LB IP and port (the API server allows it), with overlapping ranges:
        # the first by name serves it, with its own ranges alone (nftables refused both sets).
        svc("shared-a", ["10.96.1.53"], HTTP, type="LoadBalancer", status=lb("172.30.1.18"),
            loadBalancerSourceRanges=["172.30.0.100/32"]),
        eps("shared-a", ["pod1"]),
        svc("shared-b", ["10.96.1.54"], HTTP, type="LoadBalancer", status=lb("172.30.1.18"),
            loadBalancerSourceRanges=["172.30.0.0/24"]),
        eps("shared-b", ["pod2"]),
        # Source ranges and no endpoints: a source in the ranges is refused, any other dropped.
        svc("ranges-empty", ["10.96.1.52"], HTTP, type="LoadBalancer", status=lb("172.30.1.15"),
            loadBalancerSourceRanges=["172.30.0.100/32"]),
        # Topology: zone hints usable (all have them, one for zone-a) / unusable (one lacks hints).
        svc("zoned", ["10.96.1.60"], HTTP, trafficDistribution="PreferClose"),
        eps("zoned", ["pod2", "pod3"], hints={"pod2": ["zone-a"], "pod3": ["zone-b"]}),
        svc("zoned-partial", ["10.96.1.61"], HTTP),
        eps("zoned-partial", ["pod2", "pod3"], hints={"pod3": ["zone-b"]}),
        # Terminating endpoints: used only when nothing is ready; never when not serving.
        svc("terminating", ["10.96.1.70"], HTTP),
        eps("terminating", ["pod1", "pod2"], conditions={"pod1": NOT_READY_SERVING, "pod2": GONE}),
        # `serving` unset reads as serving (as kube-proxy reads it): a terminating fallback.
        svc("terminating-unset", ["10.96.1.72"], HTTP),
        eps("terminating-unset", ["pod2"], conditions={"pod2": {"ready": False, "terminating": True}}),
        svc("terminating-ready", ["10.96.1.71"], HTTP),
        eps("terminating-ready", ["pod1", "pod3"], conditions={"pod1": NOT_READY_SERVING}),
        # A dual-stack service with IPv4 endpoints only: IPv6 is refused.
        svc("v4-only-eps", ["10.96.1.80", "fd00:96::1:80"], HTTP, ipFamilies=["IPv4", "IPv6"]),
        eps("v4-only-eps", ["pod1"]),
        # TCP and SCTP on the same port number are distinct service ports.
        svc("multi", ["10.96.1.90"], [{"name": "t", "port": 5000, "protocol": "TCP"},
                                      {"name": "s", "port": 5000, "protocol": "SCTP"}]),
        eps("multi", ["pod1"], ports=(("t", 8080, "TCP"), ("s", 8080, "SCTP"))),
        # An externalIP that is a local address of the node, on a port that is another service's
        # nodePort: the service IP wins, as kube-proxy looks service IPs up before NodePorts
        # (their nftables shards, 1 and 13, hook in that order: the later table's chain runs first).
        svc("extip-local", ["10.96.1.110"], [{**HTTP[0], "port": 31050}], externalIPs=["172.30.1.60"]),
        eps("extip-local", ["pod1"]),
        svc("np-same-port", ["10.96.1.111"], http(31050), type="NodePort"),
        eps("np-same-port", ["pod2"]),
        # The same with externalTrafficPolicy Local and no endpoint on this node: dropped, never
        # passed on to that NodePort.
        svc("etp-none-xip", ["10.96.1.112"], [{**HTTP[0], "port": 31050, "nodePort": 31052}], type="NodePort",
            externalTrafficPolicy="Local", externalIPs=["172.30.1.61"]),
        eps("etp-none-xip", ["pod3"]),
        # Two Services on one externalIP and port, the first by id with externalTrafficPolicy Local
        # and no endpoint on this node: it decides (external clients dropped), never the second.
        svc("xip-shared-a", ["10.96.1.113"], HTTP, externalTrafficPolicy="Local", externalIPs=["172.30.1.62"]),
        eps("xip-shared-a", ["pod3"]),
        svc("xip-shared-b", ["10.96.1.114"], HTTP, externalIPs=["172.30.1.62"]),
        eps("xip-shared-b", ["pod2"]),
        # A load balancer IP that is also one of the Service's externalIPs: its source ranges hold.
        svc("ranges-xip", ["10.96.1.55"], HTTP, type="LoadBalancer", status=lb("172.30.1.19"),
            externalIPs=["172.30.1.19"], loadBalancerSourceRanges=["172.30.0.100/32"]),
        eps("ranges-xip", ["pod1"]),
        # UDP whose endpoint moves: stale conntrack entries must go.
        svc("udp-move", ["10.96.1.100"], [{"name": "dns", "port": 53, "protocol": "UDP"}]),
        eps("udp-move", [udp_pod], ports=(("dns", 8080, "UDP"),)),
    ]


def hostnet_eps(name: str) -> dict:
    """pod1 (node-a) and node2's own IP as an endpoint of node-b (a hostNetwork pod)."""
    slice_ = eps(name, ["pod1"])
    slice_["endpoints"].append({"addresses": [ADDR["node2"][4]], "nodeName": "node-b", "conditions": {"ready": True}})
    return slice_


EXTRA = ["--service-cidr", "10.96.0.0/16,fd00:96::/64"]


@pytest.fixture(scope="module", params=["nftables", "iptables"])
def applied(lab, tmp_path_factory, request):
    mode = request.param
    src = str(tmp_path_factory.mktemp("semantics"))
    write_state(src, docs())
    reconciler(lab, "apply", *common_flags(src, mode, extra=EXTRA))
    yield Applied(src, mode)
    reconciler(lab, "cleanup", "--mode", mode, check=False)


def test_in_sync_after_apply(lab, applied):
    assert reconciler(lab, "plan", *common_flags(applied.source, applied.mode, extra=EXTRA), check=False).returncode == 0


@pytest.mark.parametrize("family,target,port", [(4, "node", 31001), (4, "172.30.1.11", 80),
                                                 (4, "172.30.1.51", 80), (6, "node", 31001)])
def test_etp_local_external_clients_reach_local_endpoints_with_their_source(lab, applied, family, target, port):
    ip = ADDR["node"][family] if target == "node" else target
    res = lab.tcp("ext1", ip, port, count=30)
    assert outcomes(res) == {"ok": 30}
    assert set(servers(res)) == {"pod1"}
    assert {r.seen_ip for r in res} == {ADDR["ext1"][family]}


def test_etp_local_pod_traffic_short_circuits_to_all_endpoints(lab, applied):
    res = lab.tcp("pod2", "172.30.1.11", 80, count=40)
    assert outcomes(res) == {"ok": 40}
    assert set(servers(res)) == {"pod1", "pod3"}
    assert {r.seen_ip for r in res} == {ADDR["pod2"][4]}


def test_etp_local_pod_of_another_node_reaching_itself_is_masqueraded(lab, applied):
    """pod3 (node-b) to the LB IP routed to node-a: the pod short-circuit may pick pod3 itself,
    which then needs masquerading (hairpin), or the answer would come from itself. nftables
    masquerades exactly that (a hairpin set element); iptables all of pod3's traffic on this path
    (a rule, where exactness would take a chain per endpoint)."""
    res = lab.tcp("pod3", "172.30.1.11", 80, count=40)
    assert outcomes(res) == {"ok": 40}
    assert set(servers(res)) == {"pod1", "pod3"}
    assert ADDR["pod3"][4] not in {r.seen_ip for r in res if r.server == "pod3"}
    kept = {r.seen_ip for r in res if r.server == "pod1"}
    assert kept == ({ADDR["pod3"][4]} if applied.mode == "nftables" else {ADDR["node"][4]})


def test_etp_local_keeps_the_source_of_a_node_that_hosts_an_endpoint(lab, applied):
    """node2 hosts a hostNetwork endpoint of the service (its own IP, in no cluster CIDR): its
    traffic to node-a's NodePort takes the Local path, as any outside client's, and pod1 sees
    node2's address (iptables mode masqueraded all of it: a hairpin rule per remote endpoint,
    which only pods sent back to themselves by the pod short-circuit need)."""
    res = lab.tcp("node2", ADDR["node"][4], 31004, count=20)
    assert outcomes(res) == {"ok": 20}
    assert set(servers(res)) == {"pod1"}
    assert {r.seen_ip for r in res} == {ADDR["node2"][4]}


def test_etp_local_node_traffic_is_masqueraded_and_may_use_all(lab, applied):
    res = lab.tcp("node", "172.30.1.11", 80, count=40)
    assert outcomes(res) == {"ok": 40}
    assert set(servers(res)) == {"pod1", "pod3"}


def test_etp_local_without_local_endpoints_drops_external_but_not_internal(lab, applied):
    ext_node, ext_ip = concurrently([lambda: lab.tcp("ext1", ADDR["node"][4], 31002, count=2, timeout=1.0),
                                     lambda: lab.tcp("ext1", "172.30.1.52", 80, count=2, timeout=1.0)])
    assert outcomes(ext_node) == {"timeout": 2}  # DROP: no answer at all
    assert outcomes(ext_ip) == {"timeout": 2}
    pod = lab.tcp("pod1", "172.30.1.52", 80, count=5)
    assert outcomes(pod) == {"ok": 5} and set(servers(pod)) == {"pod3"}
    assert outcomes(lab.tcp("pod1", "10.96.1.20", 80, count=5)) == {"ok": 5}


def test_a_local_service_ip_wins_over_a_nodeport_on_its_port(lab, applied):
    lab.add_node_address("172.30.1.60")
    try:
        to_ip, to_node = concurrently([lambda: lab.tcp("ext1", "172.30.1.60", 31050, count=10),
                                       lambda: lab.tcp("ext1", ADDR["node"][4], 31050, count=10)])
    finally:
        lab.del_node_address("172.30.1.60")
    assert outcomes(to_ip) == {"ok": 10} and set(servers(to_ip)) == {"pod1"}
    assert outcomes(to_node) == {"ok": 10} and set(servers(to_node)) == {"pod2"}


def test_a_local_service_ip_without_local_endpoints_is_dropped_not_passed_to_a_nodeport(lab, applied):
    lab.add_node_address("172.30.1.61")
    try:
        res = lab.tcp("ext1", "172.30.1.61", 31050, count=2, timeout=1.0)
        pod = lab.tcp("pod1", "172.30.1.61", 31050, count=5)  # pods short-circuit to the others
    finally:
        lab.del_node_address("172.30.1.61")
    # as kube-proxy's nftables mode, whose goto ends the lookups, in both backends (kube-proxy's
    # iptables mode passes it on to the NodePort rule at the end of its services chain)
    assert outcomes(res) == {"timeout": 2}
    assert outcomes(pod) == {"ok": 5} and set(servers(pod)) == {"pod3"}


def test_two_services_on_one_external_ip_the_first_without_local_endpoints_drops(lab, applied):
    external = lab.tcp("ext1", "172.30.1.62", 80, count=2, timeout=1.0)
    pod = lab.tcp("pod1", "172.30.1.62", 80, count=5)  # pods short-circuit to the first's endpoints
    assert outcomes(external) == {"timeout": 2}
    assert outcomes(pod) == {"ok": 5} and set(servers(pod)) == {"pod3"}


def test_source_ranges_hold_on_a_load_balancer_ip_that_is_also_an_external_ip(lab, applied):
    allowed, blocked = concurrently([lambda: lab.tcp("ext1", "172.30.1.19", 80, count=5),
                                     lambda: lab.tcp("ext2", "172.30.1.19", 80, count=2, timeout=1.0)])
    assert outcomes(allowed) == {"ok": 5}
    assert outcomes(blocked) == {"timeout": 2}


def test_itp_local(lab, applied):
    res = lab.tcp("pod2", "10.96.1.30", 80, count=30)
    assert outcomes(res) == {"ok": 30} and set(servers(res)) == {"pod1"}
    none = lab.tcp("pod1", "10.96.1.40", 80, count=2, timeout=1.0)
    assert outcomes(none) == {"timeout": 2}  # DROP, not REJECT


def test_load_balancer_source_ranges(lab, applied):
    allowed, blocked, nodeport = concurrently([
        lambda: lab.tcp("ext1", "172.30.1.13", 80, count=5),
        lambda: lab.tcp("ext2", "172.30.1.13", 80, count=2, timeout=1.0),
        lambda: lab.tcp("ext2", ADDR["node"][4], 31003, count=5),
    ])
    assert outcomes(allowed) == {"ok": 5}
    assert outcomes(blocked) == {"timeout": 2}
    assert outcomes(nodeport) == {"ok": 5}


def test_two_services_on_one_load_balancer_ip_and_port_the_first_with_its_own_ranges(lab, applied):
    ok, dropped = concurrently([lambda: lab.tcp("ext1", "172.30.1.18", 80, count=10),
                                lambda: lab.tcp("ext2", "172.30.1.18", 80, count=2, timeout=1.0)])
    assert outcomes(ok) == {"ok": 10} and set(servers(ok)) == {"pod1"}
    assert outcomes(dropped) == {"timeout": 2}  # (in shared-b's range, not in shared-a's)


def test_load_balancer_source_ranges_without_endpoints(lab, applied):
    allowed, blocked = concurrently([
        lambda: lab.tcp("ext1", "172.30.1.15", 80, count=3, timeout=2.0),
        lambda: lab.tcp("ext2", "172.30.1.15", 80, count=2, timeout=1.0),
    ])
    assert outcomes(allowed) == {"refused": 3}  # REJECT: the service exists, it has no endpoints
    assert outcomes(blocked) == {"timeout": 2}  # outside the ranges: dropped before that


def test_load_balancer_ip_is_an_allowed_source_when_the_node_is_in_range(lab, applied):
    lab.add_node_address("172.30.1.14")  # the LB IP as a local address: node traffic to it has it as source
    try:
        from_node, blocked = concurrently([
            lambda: lab.tcp("node", "172.30.1.14", 80, count=5),
            lambda: lab.tcp("ext1", "172.30.1.14", 80, count=2, timeout=1.0),  # .100: outside the ranges
        ])
    finally:
        lab.del_node_address("172.30.1.14")
    assert outcomes(from_node) == {"ok": 5}
    assert set(servers(from_node)) <= {"pod1", "pod2"}
    assert outcomes(blocked) == {"timeout": 2}


def test_topology_hints(lab, applied):
    res = lab.tcp("pod1", "10.96.1.60", 80, count=30)
    assert set(servers(res)) == {"pod2"}
    res = lab.tcp("pod1", "10.96.1.61", 80, count=30)
    assert set(servers(res)) == {"pod2", "pod3"}


def test_terminating_fallback(lab, applied):
    res = lab.tcp("node", "10.96.1.70", 80, count=20)
    assert outcomes(res) == {"ok": 20} and set(servers(res)) == {"pod1"}
    res = lab.tcp("node", "10.96.1.71", 80, count=20)
    assert set(servers(res)) == {"pod3"}
    res = lab.tcp("node", "10.96.1.72", 80, count=10)
    assert outcomes(res) == {"ok": 10} and set(servers(res)) == {"pod2"}


def test_ipv6_reject_when_family_has_no_endpoints(lab, applied):
    v4 = lab.tcp("pod2", "10.96.1.80", 80, count=3)
    v6 = lab.tcp("pod2", "fd00:96::1:80", 80, count=3, timeout=2.0)
    assert outcomes(v4) == {"ok": 3}
    assert outcomes(v6) == {"refused": 3} and max(r.elapsed for r in v6) < 0.5


def test_service_cidr_unused_port_rejected_unallocated_ip_dropped(lab, applied):
    port = lab.tcp("pod1", "10.96.1.10", 81, count=2, timeout=2.0)
    assert outcomes(port) == {"refused": 2}
    unallocated = lab.tcp("pod1", "10.96.200.200", 80, count=2, timeout=1.0)
    assert outcomes(unallocated) == {"timeout": 2}


def test_sctp_beside_tcp_on_the_same_port(lab, applied):
    assert outcomes(lab.tcp("pod2", "10.96.1.90", 5000, count=5)) == {"ok": 5}
    # SCTP traffic cannot be sent on this kernel (no SCTP sockets); its rules must be installed.
    observed = reconciler(lab, "observe", "--mode", applied.mode, "-o", "json").stdout
    if applied.mode == "nftables":
        assert "10.96.1.90 . sctp . 5000" in observed and "10.96.1.90 . tcp . 5000" in observed
        assert "meta l4proto sctp dnat to 10.244.1.10:8080" in observed
    else:
        assert "-d 10.96.1.90/32 -p sctp" in observed and "-d 10.96.1.90/32 -p tcp" in observed
        assert "--to-destination 10.244.1.10:8080" in observed


def test_udp_client_follows_moved_endpoint(lab, applied):
    """Same UDP source port before and after the endpoint moves: conntrack must not pin pod1."""
    before = lab.udp("pod2", "10.96.1.100", 53, count=3, source_port=40053)
    assert outcomes(before) == {"ok": 3} and set(servers(before)) == {"pod1"}
    write_state(applied.source, docs(udp_pod="pod3"))
    reconciler(lab, "apply", *common_flags(applied.source, applied.mode, extra=EXTRA))
    after = lab.udp("pod2", "10.96.1.100", 53, count=3, source_port=40053)
    assert outcomes(after) == {"ok": 3} and set(servers(after)) == {"pod3"}
    write_state(applied.source, docs())
    reconciler(lab, "apply", *common_flags(applied.source, applied.mode, extra=EXTRA))

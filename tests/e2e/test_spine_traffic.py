"""The spine end to end: manifests -> `reconciler apply` in a node namespace -> real TCP/UDP packets.

Topology: tests/e2e/lab.py (node-a with pod1+pod2, node-b with pod3, external clients ext1/ext2).
"""

from __future__ import annotations

import pytest

from lab import ADDR
from manifests import Applied, common_flags, eps, reconciler, svc, write_state
from traffic import outcomes, servers

pytestmark = pytest.mark.e2e

ALL = {"pod1", "pod2", "pod3"}
WEB = ["10.96.0.10", "fd00:96::10"]
PORTS = [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP", "nodePort": 30080},
         {"name": "dns", "port": 53, "targetPort": 8080, "protocol": "UDP", "nodePort": 30053}]


def state_docs(web_pods=("pod1", "pod2", "pod3"), sticky_seconds: int = 60) -> list[dict]:
    ports = (("http", 8080, "TCP"), ("dns", 8080, "UDP"))
    return [
        svc("web", WEB, PORTS, type="LoadBalancer", externalIPs=["172.30.1.50"],
            ipFamilies=["IPv4", "IPv6"], status={"loadBalancer": {"ingress": [{"ip": "172.30.1.10"}]}}),
        eps("web", web_pods, 4, ports), eps("web", web_pods, 6, ports),
        svc("empty", ["10.96.0.20"], [{"name": "http", "port": 80, "protocol": "TCP"}]),
        svc("sticky", ["10.96.0.30"], [{"name": "http", "port": 80, "protocol": "TCP"}],
            sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {"timeoutSeconds": sticky_seconds}}),
        eps("sticky", ["pod1", "pod2", "pod3"]),
    ]


@pytest.fixture(scope="module", params=["nftables", "iptables"])
def applied(lab, tmp_path_factory, request):
    mode = request.param
    src = str(tmp_path_factory.mktemp("state"))
    write_state(src, state_docs())
    first = reconciler(lab, "plan", *common_flags(src, mode), check=False)
    assert first.returncode == 2, first.stderr  # changes pending
    reconciler(lab, "apply", *common_flags(src, mode))
    yield Applied(src, mode)
    reconciler(lab, "cleanup", "--mode", mode, check=False)


def test_plan_is_empty_after_apply(lab, applied):
    again = reconciler(lab, "plan", *common_flags(applied.source, applied.mode), check=False)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "No changes" in again.stdout


@pytest.mark.parametrize("client", ["node", "pod1", "pod2"])
def test_clusterip_tcp_reaches_every_endpoint(lab, applied, client):
    res = lab.tcp(client, WEB[0], 80, count=40)
    assert outcomes(res) == {"ok": 40}
    assert set(servers(res)) == ALL


def test_clusterip_udp_and_ipv6(lab, applied):
    res = lab.udp("pod1", WEB[0], 53, count=40)
    assert outcomes(res) == {"ok": 40} and set(servers(res)) == ALL
    res6 = lab.tcp("pod1", WEB[1], 80, count=40)
    assert outcomes(res6) == {"ok": 40} and set(servers(res6)) == ALL
    # a pod's IPv6 source is kept (it is inside the IPv6 cluster CIDR), except when it hairpins
    assert {r.seen_ip for r in res6 if r.server != "pod1"} == {ADDR["pod1"][6]}
    assert all(r.seen_ip != ADDR["pod1"][6] for r in res6 if r.server == "pod1")


def test_pod_source_kept_and_hairpin_masqueraded(lab, applied):
    res = lab.tcp("pod1", WEB[0], 80, count=40)
    for r in res:
        if r.server == "pod1":  # a pod reaching itself through its service: masqueraded
            assert r.seen_ip != ADDR["pod1"][4]
        else:
            assert r.seen_ip == ADDR["pod1"][4]
    assert "pod1" in servers(res)


@pytest.mark.parametrize("family", [4, 6])
def test_nodeport_from_external_client_is_masqueraded(lab, applied, family):
    res = lab.tcp("ext1", ADDR["node"][family], 30080, count=40)
    assert outcomes(res) == {"ok": 40} and set(servers(res)) == ALL
    assert all(r.seen_ip != ADDR["ext1"][family] for r in res)
    udp = lab.udp("ext1", ADDR["node"][family], 30053, count=20)
    assert outcomes(udp) == {"ok": 20}


@pytest.mark.parametrize("client", ["pod1", "node"])
def test_nodeport_from_a_pod_and_from_the_node(lab, applied, client):
    res = lab.tcp(client, ADDR["node"][4], 30080, count=30)
    assert outcomes(res) == {"ok": 30} and set(servers(res)) == ALL


@pytest.mark.parametrize("address", ["172.30.1.50", "172.30.1.10"])
def test_external_ip_and_load_balancer_ip(lab, applied, address):
    res = lab.tcp("ext1", address, 80, count=40)
    assert outcomes(res) == {"ok": 40} and set(servers(res)) == ALL
    from_pod = lab.tcp("pod1", address, 80, count=10)
    assert outcomes(from_pod) == {"ok": 10}


def test_session_affinity_sticks_per_client(lab, applied):
    for client in ("pod1", "pod2", "node"):
        res = lab.tcp(client, "10.96.0.30", 80, count=15)
        assert outcomes(res) == {"ok": 15}
        assert len(servers(res)) == 1, (client, servers(res))


def test_a_changed_affinity_timeout_keeps_each_client_with_its_endpoint(lab, applied):
    """The timeout goes with the rules, not with what the kernel remembers of the clients: in
    nftables mode each entry carries it (the sets stay), in iptables mode `recent --seconds`."""
    before = {}
    for client in ("pod1", "pod2", "node"):
        res = lab.tcp(client, "10.96.0.30", 80, count=5)
        assert outcomes(res) == {"ok": 5} and len(servers(res)) == 1, (client, servers(res))
        before[client] = servers(res)
    write_state(applied.source, state_docs(sticky_seconds=120))
    try:
        plan = reconciler(lab, "plan", *common_flags(applied.source, applied.mode), check=False)
        assert plan.returncode == 2
        assert "+ session affinity ClientIP 120s" in plan.stdout
        assert "delete set" not in plan.stdout and "-X " not in plan.stdout
        reconciler(lab, "apply", *common_flags(applied.source, applied.mode))
        for client, seen in before.items():
            res = lab.tcp(client, "10.96.0.30", 80, count=5)
            assert outcomes(res) == {"ok": 5} and servers(res) == seen, (client, seen, servers(res))
    finally:
        write_state(applied.source, state_docs())
        reconciler(lab, "apply", *common_flags(applied.source, applied.mode))


def test_service_without_endpoints_is_refused_at_once(lab, applied):
    for client in ("pod1", "node", "ext1"):
        res = lab.tcp(client, "10.96.0.20", 80, count=3, timeout=2.0)
        assert outcomes(res) == {"refused": 3}, client
        assert max(r.elapsed for r in res) < 0.5


def test_endpoint_change_is_followed(lab, applied):
    write_state(applied.source, state_docs(web_pods=("pod1", "pod2")))
    plan = reconciler(lab, "plan", *common_flags(applied.source, applied.mode), check=False)
    assert plan.returncode == 2
    assert "- endpoint 10.244.2.10:8080" in plan.stdout
    reconciler(lab, "apply", *common_flags(applied.source, applied.mode))
    res = lab.tcp("ext1", ADDR["node"][4], 30080, count=30)
    assert outcomes(res) == {"ok": 30} and set(servers(res)) == {"pod1", "pod2"}
    write_state(applied.source, state_docs())
    reconciler(lab, "apply", *common_flags(applied.source, applied.mode))
    res = lab.tcp("pod2", WEB[0], 80, count=40)
    assert set(servers(res)) == ALL

"""Node options with real packets: --nodeport-addresses and --masquerade-all, in both modes."""

from __future__ import annotations

import pytest

from lab import ADDR
from manifests import common_flags, eps, node_object, reconciler, svc, write_state
from traffic import outcomes, servers

pytestmark = pytest.mark.e2e


@pytest.fixture(params=["nftables", "iptables"])
def mode(lab, request):
    yield request.param
    reconciler(lab, "cleanup", "--mode", request.param, check=False)


def docs() -> list[dict]:
    return [svc("np", ["10.96.2.10"], [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 31080}],
                type="NodePort"),
            eps("np", ["pod1", "pod3"])]


def test_nodeport_addresses_limit_where_nodeports_answer(lab, tmp_path, mode):
    src = str(tmp_path / "s")
    write_state(src, docs())
    reconciler(lab, "apply", *common_flags(src, mode, extra=["--nodeport-addresses", "172.30.0.0/24"]))
    ok = lab.tcp("ext1", ADDR["node"][4], 31080, count=10)
    assert outcomes(ok) == {"ok": 10} and set(servers(ok)) == {"pod1", "pod3"}
    lab.add_node_address("172.30.9.9", "lo")
    try:
        # a local address outside --nodeport-addresses: no NodePort there (nothing listens: refused)
        outside = lab.tcp("node", "172.30.9.9", 31080, count=3)
        assert not any(r.ok for r in outside)
        reconciler(lab, "apply", *common_flags(src, mode, extra=["--nodeport-addresses", "172.30.9.0/24"]))
        inside = lab.tcp("node", "172.30.9.9", 31080, count=5)
        assert outcomes(inside) == {"ok": 5}
        lan = lab.tcp("ext1", ADDR["node"][4], 31080, count=3)
        assert not any(r.ok for r in lan)
    finally:
        lab.del_node_address("172.30.9.9", "lo")


def test_nodeport_addresses_primary_is_the_nodes_ip(lab, tmp_path, mode):
    """primary: NodePorts answer on the Node's InternalIP only (kube-proxy's server.go), not on the
    node's other local addresses."""
    src = str(tmp_path / "s")
    write_state(src, [*docs(), node_object(addresses=[ADDR["node"][4]])])
    flags = common_flags(src, mode, extra=["--nodeport-addresses", "primary"])
    reconciler(lab, "apply", *flags)
    assert reconciler(lab, "plan", *flags, check=False).returncode == 0  # read back as written
    assert outcomes(lab.tcp("ext1", ADDR["node"][4], 31080, count=5)) == {"ok": 5}
    lab.add_node_address("172.30.9.9", "lo")
    try:
        other = lab.tcp("node", "172.30.9.9", 31080, count=3)
    finally:
        lab.del_node_address("172.30.9.9", "lo")
    assert not any(r.ok for r in other)


def test_nodeport_addresses_as_the_kernel_holds_them_and_never_loopback(lab, tmp_path, mode):
    """CIDRs that overlap or touch (the kernel merges an inline set's intervals: nft lists them
    merged) leave nothing to do after apply; a CIDR that holds loopback (0.0.0.0/1) serves its
    other local addresses, never 127.0.0.1 (kube-proxy's nftables mode skips loopback)."""
    src = str(tmp_path / "s")
    write_state(src, docs())
    for cidrs in ("172.30.0.0/25,172.30.0.128/25,10.9.0.0/24,10.9.1.0/24,10.9.2.0/24", "0.0.0.0/1,172.30.0.0/24"):
        flags = common_flags(src, mode, extra=["--nodeport-addresses", cidrs, "--service-cidr", "10.96.0.0/13,10.104.0.0/13"])
        reconciler(lab, "apply", *flags)
        assert reconciler(lab, "plan", *flags, check=False).returncode == 0, cidrs  # read back as written
        ok = lab.tcp("ext1", ADDR["node"][4], 31080, count=5)
        assert outcomes(ok) == {"ok": 5}, cidrs
    lab.add_node_address("10.9.9.9", "lo")  # inside 0.0.0.0/1
    try:
        inside = lab.tcp("node", "10.9.9.9", 31080, count=5)
        loopback = lab.tcp("node", "127.0.0.1", 31080, count=3)  # nothing listens there: refused
    finally:
        lab.del_node_address("10.9.9.9", "lo")
    assert outcomes(inside) == {"ok": 5}
    assert outcomes(loopback) == {"refused": 3}


def test_a_cluster_ip_that_is_a_local_address_keeps_its_host_sockets(lab, tmp_path, mode):
    """The REJECT of a ClusterIP's unused ports and the service CIDR's DROP run for forwarded and
    locally sent packets only, as kube-proxy's nftables mode hooks them: a ClusterIP that is also
    a local address (a kube-ipvs0 left over) still reaches what listens on it (iptables rejected it)."""
    src = str(tmp_path / "s")
    write_state(src, docs())
    reconciler(lab, "apply", *common_flags(src, mode, extra=["--service-cidr", "10.96.0.0/16"]))
    host = lab.start_server("node", "host", [9191], udp=False)
    lab.add_node_address("10.96.2.10", "lo")
    try:
        local = lab.tcp("pod1", "10.96.2.10", 9191, count=3)
        service = lab.tcp("pod1", "10.96.2.10", 80, count=3)  # its service port: DNATed as ever
    finally:
        lab.del_node_address("10.96.2.10", "lo")
        host.stop()
    assert outcomes(local) == {"ok": 3} and set(servers(local)) == {"host"}
    assert outcomes(service) == {"ok": 3} and set(servers(service)) <= {"pod1", "pod3"}
    unused = lab.tcp("pod1", "10.96.2.10", 9191, count=2)  # not a local address now: forwarded, refused
    assert outcomes(unused) == {"refused": 2}


def test_masquerade_all_hides_pod_sources(lab, tmp_path, mode):
    src = str(tmp_path / "s")
    write_state(src, docs())
    reconciler(lab, "apply", *common_flags(src, mode))
    kept = lab.tcp("pod2", "10.96.2.10", 80, count=10)
    assert {r.seen_ip for r in kept} == {ADDR["pod2"][4]}
    reconciler(lab, "apply", *common_flags(src, mode, extra=["--masquerade-all"]))
    hidden = lab.tcp("pod2", "10.96.2.10", 80, count=10)
    assert outcomes(hidden) == {"ok": 10}
    assert ADDR["pod2"][4] not in {r.seen_ip for r in hidden}


def test_unused_port_of_a_cluster_ip_is_refused_without_service_cidrs(lab, tmp_path, mode):
    """kube-proxy's nftables mode rejects a port no service port of a ClusterIP uses whatever its
    flags (its iptables mode does not, nor does ours without --service-cidr: one rule per IP)."""
    src = str(tmp_path / "s")
    write_state(src, docs())
    reconciler(lab, "apply", *common_flags(src, mode))
    assert outcomes(lab.tcp("pod1", "10.96.2.10", 80, count=3)) == {"ok": 3}
    unused = lab.tcp("pod1", "10.96.2.10", 81, count=2, timeout=1.0)
    if mode == "nftables":
        assert outcomes(unused) == {"refused": 2} and max(r.elapsed for r in unused) < 0.5
    else:
        assert "refused" not in outcomes(unused)


def test_no_endpoint_checks_see_the_packets_kube_proxy_s_mode_checks(lab, tmp_path, mode):
    """The REJECT/DROP of a service port without (usable) endpoints sees what kube-proxy's mode
    sees: nftables checks ClusterIPs, external addresses and (on --nodeport-addresses) nodePorts
    from input, forward and output; iptables checks ClusterIPs from FORWARD and OUTPUT
    (KUBE-SERVICES), external addresses and nodePorts on any local address from INPUT and FORWARD
    (KUBE-EXTERNAL-SERVICES)."""
    src = str(tmp_path / "s")
    ext = ADDR["ext1"][4]
    write_state(src, [
        svc("gone", ["10.96.2.20"], [{"name": "http", "port": 8088, "protocol": "TCP"}], externalIPs=[ext]),
        svc("itp", ["10.96.2.21"], [{"name": "http", "port": 8089, "protocol": "TCP"}], internalTrafficPolicy="Local"),
        eps("itp", ["pod3"]),
        svc("np", ["10.96.2.22"], [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 31090}],
            type="NodePort"),
    ])
    reconciler(lab, "apply", *common_flags(src, mode, extra=["--nodeport-addresses", "172.30.0.0/24"]))
    remote = lab.start_server("ext1", "ext1", [8088], udp=False)
    host = lab.start_server("node", "host", [8089, 31090], udp=False)
    lab.add_node_address("10.96.2.21", "lo")
    lab.add_node_address("172.30.9.9", "lo")
    try:
        own_to_ext = lab.tcp("node", ext, 8088, count=2)  # the node to a remote host's address, an externalIP
        pod_to_ext = lab.tcp("pod1", ext, 8088, count=2)  # forwarded
        to_local_cluster_ip = lab.tcp("pod1", "10.96.2.21", 8089, count=2)  # ITP Local, only remote endpoints
        nodeport_elsewhere = lab.tcp("pod1", "172.30.9.9", 31090, count=2)  # outside --nodeport-addresses
        nodeport = lab.tcp("ext1", ADDR["node"][4], 31090, count=2)
    finally:
        lab.del_node_address("10.96.2.21", "lo")
        lab.del_node_address("172.30.9.9", "lo")
        remote.stop()
        host.stop()
    assert outcomes(pod_to_ext) == {"refused": 2} and outcomes(nodeport) == {"refused": 2}
    if mode == "nftables":
        assert outcomes(own_to_ext) == {"refused": 2}
        assert outcomes(to_local_cluster_ip) == {"timeout": 2}
        assert outcomes(nodeport_elsewhere) == {"ok": 2} and set(servers(nodeport_elsewhere)) == {"host"}
    else:
        assert outcomes(own_to_ext) == {"ok": 2} and set(servers(own_to_ext)) == {"ext1"}
        assert outcomes(to_local_cluster_ip) == {"ok": 2} and set(servers(to_local_cluster_ip)) == {"host"}
        assert outcomes(nodeport_elsewhere) == {"refused": 2}

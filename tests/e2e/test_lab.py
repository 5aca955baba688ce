"""Self-tests of the e2e namespace lab with no proxy rules installed."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from lab import EXTERNAL_CIDR, FAMILIES, SERVICE_CIDR, Lab, list_netns, skip_reason
from traffic import Result, concurrently, outcomes, servers

pytestmark = pytest.mark.e2e

FAST = 0.3  # probe timeout for negative cases


def both(*calls: Callable[[], list[Result]]) -> list[Result]:
    """Concatenated results of probe calls run concurrently."""
    return [r for res in concurrently(calls) for r in res]


@contextmanager
def nft_table(lab: Lab, host: str, name: str, chain_body: str) -> Iterator[None]:
    """Temporary ``inet`` table with one filter chain in ``host``; always deleted."""
    lab.nft(host, f"table inet {name} {{\n chain c {{\n {chain_body}\n }}\n}}\n")
    try:
        yield
    finally:
        lab.nft(host, f"delete table inet {name}")


def test_setup_starts_every_pod_server(lab: Lab) -> None:
    assert all(s.alive for s in lab.servers)
    assert {s.name for s in lab.servers} == {"pod1", "pod2", "pod3"}


@pytest.mark.parametrize("fam", FAMILIES)
def test_pod_to_pod_across_nodes(lab: Lab, fam: int) -> None:
    for port in (8080, 9090):
        for res in lab.tcp("pod1", lab.addr("pod3", fam), port, count=3) + \
                lab.udp("pod1", lab.addr("pod3", fam), port, count=3):
            assert res.outcome == "ok", res
            assert res.server == "pod3"
            assert res.seen_ip == lab.addr("pod1", fam)
            assert res.seen_port == res.local_port


@pytest.mark.parametrize("fam", FAMILIES)
def test_pod_to_pod_same_node(lab: Lab, fam: int) -> None:
    res = lab.tcp("pod1", lab.addr("pod2", fam), 8080) + lab.udp("pod2", lab.addr("pod1", fam), 9090)
    assert [(r.outcome, r.server) for r in res] == [("ok", "pod2"), ("ok", "pod1")]
    assert [r.seen_ip for r in res] == [lab.addr("pod1", fam), lab.addr("pod2", fam)]


@pytest.mark.parametrize("fam", FAMILIES)
def test_external_client_routed_to_pod(lab: Lab, fam: int) -> None:
    for ext in ("ext1", "ext2"):
        res = lab.tcp(ext, lab.addr("pod1", fam), 8080) + lab.udp(ext, lab.addr("pod1", fam), 8080)
        assert [(r.outcome, r.server, r.seen_ip) for r in res] == [("ok", "pod1", lab.addr(ext, fam))] * 2


@pytest.mark.parametrize("fam", FAMILIES)
def test_node_to_pod(lab: Lab, fam: int) -> None:
    res = lab.tcp("node", lab.addr("pod1", fam), 9090) + lab.udp("node", lab.addr("pod1", fam), 9090)
    assert [(r.outcome, r.server, r.seen_ip) for r in res] == [("ok", "pod1", lab.node_lan_ip[fam])] * 2


@pytest.mark.parametrize("fam", FAMILIES)
def test_closed_port_is_refused_quickly(lab: Lab, fam: int) -> None:
    res = lab.tcp("pod1", lab.addr("pod3", fam), 7777, count=3, timeout=FAST) + \
        lab.udp("pod1", lab.addr("pod3", fam), 7777, count=3, timeout=FAST)
    assert outcomes(res) == {"refused": 6}, res
    assert max(r.elapsed for r in res) < 0.2


@pytest.mark.parametrize("fam", FAMILIES)
def test_blackholed_address_times_out(lab: Lab, fam: int) -> None:
    dst = lab.addr("pod3", fam)
    ipkw = "ip" if fam == 4 else "ip6"
    with nft_table(lab, "node", "blackhole", f"type filter hook forward priority 0; {ipkw} daddr {dst} drop"):
        res = both(lambda: lab.tcp("pod1", dst, 8080, timeout=FAST),
                   lambda: lab.udp("pod1", dst, 8080, timeout=FAST))
        assert outcomes(res) == {"timeout": 2}, res
        assert all(r.elapsed >= FAST * 0.9 for r in res)
    res = lab.tcp("pod1", dst, 8080) + lab.udp("pod1", dst, 8080)
    assert outcomes(res) == {"ok": 2}, res


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize(("verdict", "tcp_expect", "udp_expect"), [
    ("reject", "refused", "refused"),
    ("reject with icmpx type admin-prohibited", "unreachable", "unreachable"),
    ("reject with icmpx type host-unreachable", "unreachable", "unreachable"),
    ("meta l4proto tcp reject with tcp reset", "refused", "ok"),
])
def test_reject_flavours_are_classified(lab: Lab, fam: int, verdict: str, tcp_expect: str,
                                        udp_expect: str) -> None:
    dst = lab.addr("pod3", fam)
    ipkw = "ip" if fam == 4 else "ip6"
    # Both forwarded (pod1) and locally originated (node) traffic.
    body = (f"type filter hook forward priority 0; {ipkw} daddr {dst} {verdict}\n }}\n"
            f" chain o {{\n type filter hook output priority 0; {ipkw} daddr {dst} {verdict}")
    with nft_table(lab, "node", "rej", body):
        for src in ("pod1", "node"):
            t = lab.tcp(src, dst, 8080, timeout=FAST)[0]
            u = lab.udp(src, dst, 8080, timeout=FAST)[0]
            assert (t.outcome, u.outcome) == (tcp_expect, udp_expect), (src, t, u)
            assert t.elapsed < 0.2 and u.elapsed < 0.2


@pytest.mark.parametrize("fam", FAMILIES)
def test_unmatched_service_and_external_ips_time_out(lab: Lab, fam: int) -> None:
    """Without rules, ClusterIP/LB traffic is routable (no ENETUNREACH) and silently lost."""
    svc = {4: "10.96.0.10", 6: "fd00:96::10"}[fam]
    ext = {4: "172.30.1.5", 6: "fd00:31::5"}[fam]
    assert ipaddress.ip_address(svc) in ipaddress.ip_network(SERVICE_CIDR[fam])
    assert ipaddress.ip_address(ext) in ipaddress.ip_network(EXTERNAL_CIDR[fam])
    pairs = [("node", svc), ("pod1", svc), ("node2", svc), ("ext1", svc), ("ext1", ext)]
    calls = [(lambda s=src, i=ip: lab.tcp(s, i, 80, timeout=FAST)) for src, ip in pairs] + \
        [(lambda s=src, i=ip: lab.udp(s, i, 53, timeout=FAST)) for src, ip in pairs]
    for (src, ip), res in zip(pairs * 2, concurrently(calls), strict=True):
        assert outcomes(res) == {"timeout": 1}, (src, ip, res)


@pytest.mark.parametrize("fam", FAMILIES)
def test_add_node_address(lab: Lab, fam: int) -> None:
    ip = "172.30.1.5" if fam == 4 else "fd00:31::5"
    assert ip not in lab.exec("node", ["ip", "addr"]).stdout
    lab.add_node_address(ip, "lo")
    try:
        # Local now, nothing listens: the node's kernel answers RST/port-unreachable.
        res = lab.tcp("ext1", ip, 7777, timeout=FAST) + lab.udp("ext1", ip, 7777, timeout=FAST)
        assert outcomes(res) == {"refused": 2}, res
    finally:
        lab.del_node_address(ip, "lo")
    assert ip not in lab.exec("node", ["ip", "addr"]).stdout


def test_udp_source_port_is_reused(lab: Lab) -> None:
    for fam, port in ((4, 40001), (6, 40002)):
        res = lab.udp("pod2", lab.addr("pod3", fam), 8080, count=4, source_port=port)
        assert outcomes(res) == {"ok": 4}, res
        assert {r.local_port for r in res} == {r.seen_port for r in res} == {port}


def test_many_probes_in_one_call(lab: Lab) -> None:
    res = lab.tcp("ext2", lab.addr("pod2", 6), 8080, count=50)
    res += lab.udp("ext2", lab.addr("pod2", 4), 9090, count=50)
    assert outcomes(res) == {"ok": 100}
    assert servers(res) == {"pod2": 100}
    assert len({r.local_port for r in res[:50]}) == 50  # a fresh socket per TCP probe


def test_lab_exit_removes_namespaces_and_servers() -> None:
    if skip_reason():
        pytest.skip(skip_reason())
    lab = Lab()
    with pytest.raises(RuntimeError, match="boom"):
        with lab:
            srv = lab.start_server("node", "hostnet", [8081])
            assert set(lab.ns.values()) <= set(list_netns())
            assert lab.tcp("ext1", lab.node_lan_ip[4], 8081)[0].server == "hostnet"
            raise RuntimeError("boom")
    assert not set(lab.ns.values()) & set(list_netns())
    assert not srv.alive

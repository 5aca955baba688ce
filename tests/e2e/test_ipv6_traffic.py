"""IPv6 with real packets, both backends: what a client sees for each kind of refusal and drop
(kube-proxy nftables mode's verdicts: reject sends ICMPv6 port-unreachable, ECONNREFUSED; drop
times out), the ETP Local short-circuit, NodePorts (not on ::1) and LB source ranges."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from lab import ADDR, Lab
from manifests import Applied, common_flags, eps, node_object, reconciler, svc, write_state
from traffic import outcomes, servers

pytestmark = pytest.mark.e2e

HTTP = [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]
DNS = [{"name": "dns", "port": 53, "targetPort": 8080, "protocol": "UDP"}]
NODE6 = ADDR["node"][6]
V6 = {"ipFamilies": ["IPv6"]}


def node_port(port: int, base: list[dict[str, Any]] = HTTP) -> list[dict[str, Any]]:
    return [{**base[0], "nodePort": port}]


def docs() -> list[dict]:
    return [
        node_object("zone-a", addresses=(ADDR["node"][4], NODE6)),
        svc("none", ["fd00:96::2:1"], node_port(31101), type="NodePort", **V6),
        svc("none-udp", ["fd00:96::2:2"], node_port(31102, DNS), type="NodePort", **V6),
        svc("etp-remote", ["fd00:96::2:3"], node_port(31103), type="LoadBalancer", externalTrafficPolicy="Local",
            externalIPs=["fd00:31::53"], status={"loadBalancer": {"ingress": [{"ip": "fd00:31::13"}]}}, **V6),
        eps("etp-remote", ["pod3"], 6),
        svc("itp-remote", ["fd00:96::2:4"], HTTP, internalTrafficPolicy="Local", **V6),
        eps("itp-remote", ["pod3"], 6),
        svc("served", ["fd00:96::2:5"], node_port(31105), type="NodePort", **V6),
        eps("served", ["pod1", "pod3"], 6),
        svc("ranges", ["fd00:96::2:6"], HTTP, type="LoadBalancer", loadBalancerSourceRanges=["fd00:30::100/128"],
            status={"loadBalancer": {"ingress": [{"ip": "fd00:31::16"}]}}, **V6),
    ]


@pytest.fixture(scope="module", params=["nftables", "iptables"])
def applied(lab: Lab, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Applied]:
    src = str(tmp_path_factory.mktemp("v6"))
    write_state(src, docs())
    reconciler(lab, "apply", *common_flags(src, request.param, extra=["--service-cidr", "10.96.0.0/16,fd00:96::/64"]))
    yield Applied(src, request.param)
    reconciler(lab, "cleanup", "--mode", request.param, check=False)


REFUSED, TIMEOUT = {"refused": 2}, {"timeout": 2}
CASES = [  # (what, client, address, port, protocol, outcomes, servers)
    ("no endpoints: NodePort", "ext1", NODE6, 31101, "tcp", REFUSED, set()),
    ("no endpoints: NodePort, UDP", "ext1", NODE6, 31102, "udp", REFUSED, set()),
    ("no endpoints: NodePort from the node", "node", NODE6, 31101, "tcp", REFUSED, set()),
    ("no endpoints: ClusterIP from a pod", "pod1", "fd00:96::2:1", 80, "tcp", REFUSED, set()),
    ("no endpoints: ClusterIP from the node", "node", "fd00:96::2:1", 80, "tcp", REFUSED, set()),
    ("unused port of a ClusterIP", "pod1", "fd00:96::2:5", 81, "tcp", REFUSED, set()),
    ("unallocated service IP", "pod1", "fd00:96::99", 80, "tcp", TIMEOUT, set()),
    ("ETP Local, no local endpoint: NodePort", "ext1", NODE6, 31103, "tcp", TIMEOUT, set()),
    ("ETP Local, no local endpoint: externalIP", "ext1", "fd00:31::53", 80, "tcp", TIMEOUT, set()),
    ("ETP Local, no local endpoint: LB IP", "ext1", "fd00:31::13", 80, "tcp", TIMEOUT, set()),
    ("ETP Local short-circuit: a pod to the LB IP", "pod1", "fd00:31::13", 80, "tcp", {"ok": 2}, {"pod3"}),
    ("ETP Local short-circuit: the node to its NodePort", "node", NODE6, 31103, "tcp", {"ok": 2}, {"pod3"}),
    ("ITP Local, no local endpoint", "pod1", "fd00:96::2:4", 80, "tcp", TIMEOUT, set()),
    ("NodePort", "ext1", NODE6, 31105, "tcp", {"ok": 2}, None),
    ("no NodePort on ::1", "node", "::1", 31105, "tcp", REFUSED, set()),
    ("LB source ranges: outside", "ext2", "fd00:31::16", 80, "tcp", TIMEOUT, set()),
    ("LB source ranges: inside, no endpoints", "ext1", "fd00:31::16", 80, "tcp", REFUSED, set()),
]


@pytest.mark.parametrize("what,client,address,port,proto,expected,served", CASES, ids=[c[0] for c in CASES])
def test_what_an_ipv6_client_sees(lab: Lab, applied: Applied, what: str, client: str, address: str, port: int,
                                  proto: str, expected: dict[str, int], served: set[str] | None) -> None:
    probe = lab.udp if proto == "udp" else lab.tcp
    results = probe(client, address, port, count=2, timeout=1)
    assert dict(outcomes(results)) == expected, what
    if served is not None:
        assert set(servers(results)) == served, what
    else:
        assert set(servers(results)) <= {"pod1", "pod3"}, what

"""Endpoint selection: a table of cases against kube-proxy's CategorizeEndpoints rules."""

from __future__ import annotations

import pytest

from reconciler.topology import EndpointInfo, categorize_endpoints


def ep(ip: str, ready: bool = True, serving: bool | None = None, terminating: bool = False, node: str = "node-a",
       zones: tuple[str, ...] = (), nodes: tuple[str, ...] = ()) -> EndpointInfo:
    return EndpointInfo(ip, 80, ready, ready if serving is None else serving, terminating, node,
                        zoneHints=frozenset(zones), nodeHints=frozenset(nodes))


A = ep("10.0.0.1")                                   # local, ready
B = ep("10.0.0.2", node="node-b")                    # remote, ready
T_LOCAL = ep("10.0.0.3", ready=False, serving=True, terminating=True)
T_REMOTE = ep("10.0.0.4", ready=False, serving=True, terminating=True, node="node-b")
DEAD = ep("10.0.0.5", ready=False, serving=False, terminating=True)
NOT_READY = ep("10.0.0.6", ready=False, serving=False)
ZA = ep("10.0.1.1", zones=("zone-a",))
ZB = ep("10.0.1.2", node="node-b", zones=("zone-b",))
NO_HINT = ep("10.0.1.3", node="node-b")
NA = ep("10.0.2.1", zones=("zone-a",), nodes=("node-a",))
NB = ep("10.0.2.2", node="node-b", zones=("zone-a",), nodes=("node-b",))


def ips(eps) -> list[str]:
    return [e.ip for e in eps]


CASES = [
    # name, endpoints, uses_cluster, uses_local, zone, cluster, local, has_any
    ("ready only", [A, B, NOT_READY], True, False, "zone-a", [A, B], [], True),
    ("fallback to serving+terminating", [T_LOCAL, T_REMOTE, DEAD], True, False, None, [T_LOCAL, T_REMOTE], [], True),
    ("terminating unused while any ready", [A, T_REMOTE], True, False, None, [A], [], True),
    ("nothing usable", [DEAD, NOT_READY], True, True, None, [], [], False),
    ("local list: local ready", [A, B, T_LOCAL], True, True, None, [A, B], [A], True),
    ("local falls back separately", [B, T_LOCAL], True, True, None, [B], [T_LOCAL], True),
    ("no local endpoints but remote ready", [B], False, True, None, [], [], True),
    ("zone hints used", [ZA, ZB], True, False, "zone-a", [ZA], [], True),
    ("zone hints ignored when one lacks hints", [ZA, ZB, NO_HINT], True, False, "zone-a", [ZA, ZB, NO_HINT], [], True),
    ("zone hints ignored when none match", [ZB], True, False, "zone-a", [ZB], [], True),
    ("zone hints ignored without node zone", [ZA, ZB], True, False, None, [ZA, ZB], [], True),
    # kube-proxy reads a missing (or empty) zone label as zone "", which a hint may name
    ("a node without zone is in zone \"\"", [ep("10.0.1.5", zones=("",)), ZB], True, False, None,
     [ep("10.0.1.5", zones=("",))], [], True),
    ("an empty zone label is zone \"\"", [ep("10.0.1.5", zones=("",)), ZB], True, False, "",
     [ep("10.0.1.5", zones=("",))], [], True),
    ("hints not applied to local list", [ZB, ep("10.0.1.9", zones=("zone-b",))], True, True, "zone-a",
     [ZB, ep("10.0.1.9", zones=("zone-b",))], [ep("10.0.1.9", zones=("zone-b",))], True),
    ("node hints win over zone hints", [NA, NB], True, False, "zone-a", [NA], [], True),
    ("hints ignore unready endpoints", [ZA, ZB, NOT_READY], True, False, "zone-a", [ZA], [], True),
]


@pytest.mark.parametrize("name,eps,uses_cluster,uses_local,zone,cluster,local,has_any", CASES,
                         ids=[c[0] for c in CASES])
def test_categorize(name, eps, uses_cluster, uses_local, zone, cluster, local, has_any):
    got = categorize_endpoints(eps, "node-a", zone, uses_cluster, uses_local)
    assert ips(got.cluster) == ips(cluster)
    assert ips(got.local) == ips(local)
    assert got.has_any is has_any

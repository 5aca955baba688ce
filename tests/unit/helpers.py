"""Small builders for unit tests: manifests in a temp directory, objects in memory."""

from __future__ import annotations

import os
from typing import Any

from reconciler.desired import BuildOptions, build_desired_state
from reconciler.sources.objects import Location, SourceObject
from reconciler.state import DesiredState

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STATE_DIR = os.path.join(REPO, "state")


def service(name: str, ip: str, ports: list[dict[str, Any]], ns: str = "default", **spec: Any) -> SourceObject:
    body = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
            "spec": {"clusterIP": ip, "ports": ports, **spec}}
    return SourceObject("Service", ns, name, body, Location(f"mem:{ns}/{name}"))


def endpoint(ip: str, node: str | None = "node-a", ready: bool | None = True, serving: bool | None = None,
             terminating: bool | None = None, zone: str | None = None, hints: list[str] | None = None) -> dict[str, Any]:
    cond: dict[str, Any] = {}
    for k, v in (("ready", ready), ("serving", serving), ("terminating", terminating)):
        if v is not None:
            cond[k] = v
    ep: dict[str, Any] = {"addresses": [ip], "conditions": cond}
    if node:
        ep["nodeName"] = node
    if zone:
        ep["zone"] = zone
    if hints is not None:
        ep["hints"] = {"forZones": [{"name": z} for z in hints]}
    return ep


def endpoint_slice(svc: str, endpoints: list[dict[str, Any]], port: int = 8080, port_name: str = "http",
                   ns: str = "default", name: str | None = None, family: str = "IPv4",
                   protocol: str = "TCP") -> SourceObject:
    name = name or f"{svc}-{family.lower()}-{port_name}"
    body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": ns, "labels": {"kubernetes.io/service-name": svc}},
            "addressType": family, "ports": [{"name": port_name, "port": port, "protocol": protocol}],
            "endpoints": endpoints}
    return SourceObject("EndpointSlice", ns, name, body, Location(f"mem:{ns}/{name}"))


def node(name: str = "node-a", zone: str | None = "zone-a") -> SourceObject:
    labels = {"topology.kubernetes.io/zone": zone} if zone else {}
    body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}
    return SourceObject("Node", "", name, body, Location(f"mem:node/{name}"))


def build(objects: list[SourceObject], **opts: Any) -> DesiredState:
    defaults: dict[str, Any] = {"node_name": "node-a", "cluster_cidrs": ("10.244.0.0/16",)}
    defaults.update(opts)
    return build_desired_state(objects, BuildOptions(**defaults))


HTTP = [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]

"""Build Service/EndpointSlice manifests for the lab's pods and run the reconciler in its node."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from ruamel.yaml import YAML

from lab import ADDR, Lab

NODE_OF = {"pod1": "node-a", "pod2": "node-a", "pod3": "node-b"}
RECONCILER = [sys.executable, "-m", "reconciler"]


@dataclass(frozen=True)
class Applied:
    """A state directory applied in the lab's node with one mode (the e2e suites run per mode)."""

    source: str
    mode: str


def svc(name: str, ips: Sequence[str], ports: list[dict[str, Any]], ns: str = "default", **spec: Any) -> dict:
    body = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
            "spec": {"clusterIP": ips[0], "clusterIPs": list(ips), "ports": ports, **spec}}
    if "status" in spec:
        body["status"] = body["spec"].pop("status")
    return body


def eps(name: str, pods: Sequence[str], family: int = 4, ports: Sequence[tuple[str, int, str]] = (("http", 8080, "TCP"),),
        ns: str = "default", conditions: dict[str, dict[str, bool]] | None = None, suffix: str = "",
        hints: dict[str, list[str]] | None = None) -> dict:
    endpoints = []
    for p in pods:
        ep: dict[str, Any] = {"addresses": [ADDR[p][family]], "nodeName": NODE_OF[p],
                              "conditions": (conditions or {}).get(p, {"ready": True})}
        if hints and p in hints:
            ep["hints"] = {"forZones": [{"name": z} for z in hints[p]]}
        endpoints.append(ep)
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"{name}-v{family}{suffix}", "namespace": ns,
                         "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4" if family == 4 else "IPv6",
            "ports": [{"name": n, "port": p, "protocol": pr} for n, p, pr in ports], "endpoints": endpoints}


def node_object(zone: str = "zone-a", addresses: Sequence[str] = ()) -> dict:
    node = {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/zone": zone}}}
    if addresses:
        node["status"] = {"addresses": [{"type": "InternalIP", "address": a} for a in addresses]}
    return node


def write_state(directory: str, docs: list[dict]) -> None:
    """One file per object (the loader reads nested dirs; flat is enough here)."""
    os.makedirs(directory, exist_ok=True)
    for f in os.listdir(directory):
        os.unlink(os.path.join(directory, f))
    y = YAML(typ="safe", pure=True)
    for i, d in enumerate(docs):
        with open(os.path.join(directory, f"{i:03d}-{d['kind'].lower()}-{d['metadata']['name']}.yaml"), "w") as fh:
            y.dump(d, fh)


def reconciler(lab: Lab, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `reconciler ARGS` inside the lab's node namespace."""
    return lab.exec("node", [*RECONCILER, *args], check=check, timeout=60)


def common_flags(source: str, mode: str = "nftables", extra: Sequence[str] = ()) -> list[str]:
    return ["--source", source, "--mode", mode, "--node-name", "node-a",
            "--cluster-cidr", "10.244.0.0/16,fd00:244::/32", *extra]

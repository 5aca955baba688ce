"""Small builders for unit tests: manifests in a temp directory, objects in memory."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from typing import Any

from reconciler.conntrack import Entry, Frontend
from reconciler.desired import BuildOptions, build_desired_state
from reconciler.sources.objects import Location, SourceObject
from reconciler.state import DesiredState, Family

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


class FakeConntrack:
    """A conntrack table in memory (conntrack.Kernel): entries per family; `failures` makes the
    next that many dumps raise; `dumps` counts the dumps."""

    def __init__(self, entries: list[Entry] | None = None, failures: int = 0) -> None:
        self.entries: list[Entry] = list(entries or [])
        self.failures = failures
        self.dumps = 0

    def udp_entries(self, family: Family, to: Frontend | None = None) -> list[Entry]:
        self.dumps += 1
        if self.failures:
            self.failures -= 1
            raise OSError("conntrack netlink unavailable")
        return [e for e in self.entries if (":" in e.dst) == (family == "ipv6")
                and (to is None or (to[0] in (None, e.dst) and to[1] == e.dport))]

    def delete(self, family: Family, entries: Sequence[Entry]) -> int:
        gone = [e for e in entries if e in self.entries]
        self.entries = [e for e in self.entries if e not in gone]
        return len(gone)


def notify_socket(path: str) -> socket.socket:
    """A service manager's notification socket (sd_notify's $NOTIFY_SOCKET), bound at path."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    return sock


def heard(sock: socket.socket, quiet: float = 0.2, most: float = 5.0) -> list[str]:
    """The notifications a manager's socket got until none came for `quiet` seconds (at most
    `most` seconds)."""
    out: list[str] = []
    deadline = time.monotonic() + most
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(min(quiet, left))
        try:
            out.append(sock.recv(4096).decode())
        except (socket.timeout, BlockingIOError):
            break
    return out

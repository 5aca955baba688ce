"""The canonical desired-state document: backend-neutral, versioned, deterministic.

Every Kubernetes decision (which endpoints serve which traffic, REJECT vs DROP, masquerade, affinity)
is made once, when this document is built (see desired.py); backends only render it.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import operator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

API_VERSION = "reconciler.service-reconciler.io/v1alpha1"
KIND = "DesiredState"

Family = Literal["ipv4", "ipv6"]


def family_name(family: Family) -> str:
    """'IPv4' / 'IPv6', as the API writes a family."""
    return "IPv4" if family == "ipv4" else "IPv6"


FAMILIES: tuple[Family, ...] = ("ipv4", "ipv6")
Protocol = Literal["TCP", "UDP", "SCTP"]
Verdict = Literal["forward", "reject", "drop"]


@dataclass(frozen=True, order=True, slots=True)
class Endpoint:
    """One backend address the data path may DNAT to."""

    ip: str
    port: int

    def __str__(self) -> str:
        return f"[{self.ip}]:{self.port}" if ":" in self.ip else f"{self.ip}:{self.port}"

    def to_dict(self) -> dict[str, Any]:
        return {"ip": self.ip, "port": self.port}


@dataclass(frozen=True, slots=True)
class TrafficPath:
    """How one kind of traffic (internal = ClusterIP, external = NodePort/externalIP/LB) is handled.

    verdict 'forward' DNATs to `endpoints` (never empty then); 'reject' refuses at once; 'drop' times
    out. `shortCircuit` (external, policy Local only) is the endpoint list used for traffic that
    comes from a local pod or from the node itself, which upstream sends to all cluster endpoints.
    """

    verdict: Verdict
    endpoints: tuple[Endpoint, ...] = ()
    policy: Literal["Cluster", "Local"] = "Cluster"
    shortCircuit: tuple[Endpoint, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "verdict": self.verdict,
            "policy": self.policy,
            "endpoints": [e.to_dict() for e in self.endpoints],
        }
        if self.policy == "Local":
            d["shortCircuit"] = [e.to_dict() for e in self.shortCircuit]
        return d


@dataclass(frozen=True, slots=True)
class ServicePortFamily:
    """One service port in one IP family: its addresses and resolved traffic paths."""

    family: Family
    clusterIP: str
    internal: TrafficPath
    external: TrafficPath | None = None
    externalIPs: tuple[str, ...] = ()
    loadBalancerIPs: tuple[str, ...] = ()
    loadBalancerSourceRanges: tuple[str, ...] = ()
    hairpinEndpoints: tuple[Endpoint, ...] = ()
    # UDP: every serving endpoint (ready, or terminating and serving), whatever the traffic
    # policies and topology chose: the flows the conntrack cleanup keeps (see conntrack.py)
    servingEndpoints: tuple[Endpoint, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"clusterIP": self.clusterIP, "internal": self.internal.to_dict()}
        if self.external is not None:
            d["external"] = self.external.to_dict()
        if self.externalIPs:
            d["externalIPs"] = list(self.externalIPs)
        if self.loadBalancerIPs:
            d["loadBalancerIPs"] = list(self.loadBalancerIPs)
        if self.loadBalancerSourceRanges:
            d["loadBalancerSourceRanges"] = list(self.loadBalancerSourceRanges)
        if self.hairpinEndpoints:
            d["hairpinEndpoints"] = [e.to_dict() for e in self.hairpinEndpoints]
        if self.servingEndpoints:
            d["servingEndpoints"] = [e.to_dict() for e in self.servingEndpoints]
        return d


@dataclass(frozen=True)
class ServicePort:
    """One port of one Service: `namespace/name:port/PROTOCOL` (port = the port's name, or its
    number when unnamed), with a block per IP family it is reachable in."""

    namespace: str
    name: str
    portName: str
    protocol: Protocol
    port: int
    nodePort: int | None
    families: tuple[ServicePortFamily, ...]
    affinityTimeoutSeconds: int | None = None
    healthCheckNodePort: int | None = None

    @cached_property
    def id(self) -> str:
        return service_port_id(self.namespace, self.name, self.portName, self.port, self.protocol)

    def family(self, fam: Family) -> ServicePortFamily | None:
        for f in self.families:
            if f.family == fam:
                return f
        return None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": self.id,
            "namespace": self.namespace,
            "name": self.name,
            "portName": self.portName,
            "protocol": self.protocol,
            "port": self.port,
        }
        if self.nodePort is not None:
            d["nodePort"] = self.nodePort
        if self.affinityTimeoutSeconds is not None:
            d["sessionAffinity"] = {"clientIP": {"timeoutSeconds": self.affinityTimeoutSeconds}}
        if self.healthCheckNodePort is not None:
            d["healthCheckNodePort"] = self.healthCheckNodePort
        for f in self.families:
            d[f.family] = f.to_dict()
        return d

    def digest(self) -> str:
        """Content hash: equal digests mean identical rendering for this service port."""
        return hashlib.blake2b(json.dumps(self.to_dict(), sort_keys=True).encode(), digest_size=12).hexdigest()


class PortChanges:
    """Which service ports changed between one DesiredState and the next, by identity.

    desired.BuildCache hands unchanged service ports back as the very same objects, so a port
    that is not the same object is new or changed. When the document carries the builder's own
    delta from the document this tracker saw last (`DesiredState.changes`), that is the answer:
    O(changes). Otherwise (the first document, or one built apart) every port is compared by
    identity, at C speed.
    """

    def __init__(self) -> None:
        self._by_id: dict[int, ServicePort] = {}
        self._serial: int | None = None

    def update(self, desired: DesiredState) -> tuple[list[ServicePort], list[ServicePort]]:
        """(ports gone or replaced, ports new or replacing) since the last update, sorted by id."""
        by_port_id = operator.attrgetter("id")
        last, self._serial = self._serial, None  # set again once the update is complete
        if last is not None and desired.serial == last:
            self._serial = last
            return [], []
        delta, old_by_id = desired.changes, self._by_id
        if delta is not None and last is not None and delta.since == last and all(i in old_by_id for i in delta.gone):
            gone = [old_by_id.pop(i) for i in delta.gone]
            old_by_id.update((id(sp), sp) for sp in delta.new)
            self._serial = desired.serial
            return sorted(gone, key=by_port_id), sorted(delta.new, key=by_port_id)
        services = desired.services
        new_by_id = dict(zip(map(id, services), services))
        gone_ids = old_by_id.keys() - new_by_id.keys()
        added = new_by_id.keys() - old_by_id.keys()
        self._by_id, self._serial = new_by_id, desired.serial
        return (sorted((old_by_id[i] for i in gone_ids), key=by_port_id),
                list(services) if len(added) == len(services) else
                sorted((new_by_id[i] for i in added), key=by_port_id))


@dataclass(frozen=True)
class PortDelta:
    """What a build changed, relative to the document with serial `since` (None: to nothing):
    the ports it made, and the identities (id()) of those it dropped or replaced (not the ports:
    a document must not keep its predecessor's ports alive)."""

    since: int | None
    gone: tuple[int, ...]
    new: tuple[ServicePort, ...]


def service_port_id(namespace: str, name: str, port_name: str, port: int, protocol: str) -> str:
    return f"{namespace}/{name}:{port_name or port}/{protocol}"


@dataclass(frozen=True)
class HealthCheck:
    """A healthCheckNodePort server: answers 200 while this node has local endpoints.

    Counted per IP family of the Service (`byFamily`), as kube-proxy's two proxiers of a
    dual-stack node each serve their own family's count: a request is answered with the count
    of the family of the address it reached. `localEndpoints` is the largest of them; without
    `byFamily` it is every family's."""

    service: str  # namespace/name
    nodePort: int
    localEndpoints: int
    byFamily: tuple[tuple[Family, int], ...] = ()

    def count(self, family: Family) -> int:
        """The local endpoints a request reaching an address of `family` is answered with (0 for
        a family the Service does not have)."""
        if not self.byFamily:
            return self.localEndpoints
        return dict(self.byFamily).get(family, 0)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"service": self.service, "nodePort": self.nodePort,
                               "localEndpoints": self.localEndpoints}
        if len(self.byFamily) > 1:  # (a dual-stack Service)
            out["localEndpointsByFamily"] = dict(self.byFamily)
        return out


@dataclass(frozen=True)
class NodeInfo:
    name: str
    zone: str | None = None
    # this node's IP per family, as kube-proxy finds it on the Node: the first InternalIP, else
    # ExternalIP; a bindAddress (KubeProxyConfiguration) is the one of its family
    addresses: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name}
        if self.zone:
            d["zone"] = self.zone
        if self.addresses:
            d["addresses"] = list(self.addresses)
        return d


LOOPBACK = {4: ipaddress.ip_network("127.0.0.0/8"), 6: ipaddress.ip_network("::1/128")}  # by IP version
EVERY_ADDRESS: dict[Family, str] = {"ipv4": "0.0.0.0/0", "ipv6": "::/0"}  # each family's CIDR of all


def holds_loopback(cidr: str) -> bool:
    """Whether a CIDR holds its family's loopback addresses (0.0.0.0/1 holds 127.0.0.0/8)."""
    net = ipaddress.ip_network(cidr, strict=False)
    return net.supernet_of(LOOPBACK[net.version])  # type: ignore[arg-type]


@dataclass(frozen=True)
class FamilyOptions:
    """Per-family node options that every backend applies the same way."""

    clusterCIDRs: tuple[str, ...] = ()
    serviceCIDRs: tuple[str, ...] = ()
    # None: NodePorts answer on every local address; otherwise only local addresses in these CIDRs.
    nodePortCIDRs: tuple[str, ...] | None = None

    @property
    def nodePortsHoldLoopback(self) -> bool:
        """Whether a nodePort CIDR holds this family's loopback addresses (0.0.0.0/1 holds
        127.0.0.0/8), which the backends leave out as they do with every local address."""
        return any(holds_loopback(c) for c in self.nodePortCIDRs or ())

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"clusterCIDRs": list(self.clusterCIDRs), "serviceCIDRs": list(self.serviceCIDRs)}
        d["nodePortAddresses"] = None if self.nodePortCIDRs is None else list(self.nodePortCIDRs)
        return d


@dataclass(frozen=True)
class DesiredState:
    node: NodeInfo
    masqueradeAll: bool
    families: dict[Family, FamilyOptions]
    services: tuple[ServicePort, ...]
    healthChecks: tuple[HealthCheck, ...] = ()
    warnings: tuple[str, ...] = field(default=(), compare=False)
    serial: int | None = field(default=None, compare=False)  # set by desired.BuildCache
    changes: PortDelta | None = field(default=None, compare=False, repr=False)

    def by_id(self) -> dict[str, ServicePort]:
        return {s.id: s for s in self.services}

    def to_dict(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "node": self.node.to_dict(),
            "masqueradeAll": self.masqueradeAll,
            "families": {f: self.families[f].to_dict() for f in FAMILIES if f in self.families},
            "services": [s.to_dict() for s in self.services],
            "healthChecks": [h.to_dict() for h in self.healthChecks],
        }

"""Kubernetes objects -> the canonical DesiredState. Validation and every Service semantic live here."""

from __future__ import annotations

import bisect
import ipaddress
import itertools
import logging
import operator
import re
import socket
from collections import defaultdict
from dataclasses import dataclass, field
from sys import intern
from typing import Any, Callable, Iterable, TypeVar

from . import fields
from .sources.objects import (
    InputConflict, InputError, InputErrors, InputWarning, Location, Path, SourceObject, in_place_order,
    name_some, type_name,
)
from .state import (
    LOOPBACK, DesiredState, Endpoint, Family, FamilyOptions, HealthCheck, NodeInfo, PortDelta, ServicePort,
    ServicePortFamily, TrafficPath, family_name,
)
from .topology import EndpointInfo, categorize_endpoints

log = logging.getLogger(__name__)
_T = TypeVar("_T")

SERVICE_PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
HEADLESS_LABEL = "service.kubernetes.io/headless"
# objects carrying either label (whatever its value) are not ours: kube-proxy's informers select
# `!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless`
SKIP_LABELS = (SERVICE_PROXY_NAME_LABEL, HEADLESS_LABEL)
# names as the API server validates them: they become parts of chain names and comments in the
# kernel's rules, so anything else (a blank, a quote, a newline) is refused, never written there
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # DNS-1123 label: namespaces, port names
_DNS_1035 = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")  # Service names
_DNS_LABEL_RULE = "a DNS-1123 label (lower-case letters, digits and '-', at most 63) is required"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
ZONE_LABEL = "topology.kubernetes.io/zone"
DEFAULT_AFFINITY_TIMEOUT = 10800
PROTOCOLS = ("TCP", "UDP", "SCTP")
_ADDRESS_TYPES = {"IPv4": "ipv4", "IPv6": "ipv6"}
_NO_HINTS: frozenset[str] = frozenset()  # shared: every frozenset() call is a new 216-byte object
_NO_CONDITIONS: dict[str, Any] = {}
_SERIALS = itertools.count(1)  # DesiredState.serial: which document a PortDelta is relative to
NODEPORT_PRIMARY = "primary"  # nodePortAddresses: [primary]: this node's IPs, from its Node


@dataclass(frozen=True)
class BuildOptions:
    """Node-level inputs to the document (flags or KubeProxyConfiguration)."""

    node_name: str
    cluster_cidrs: tuple[str, ...] = ()
    service_cidrs: tuple[str, ...] = ()
    nodeport_cidrs: tuple[str, ...] | None = None  # None: every local address; (NODEPORT_PRIMARY,): node IPs
    masquerade_all: bool = False
    node_labels: dict[str, str] = field(default_factory=dict)  # used when no Node object is given
    # this node's IP of its family whatever the Node says (KubeProxyConfiguration bindAddress)
    node_ip_override: str | None = None


# Addresses are read as kube-proxy reads them (netutils.ParseIPSloppy / ParseCIDRSloppy,
# k8s.io/utils/net): Go's strict parser first; failing that, leading zeros are dropped from the
# octets of a dotted quad (the whole address, or an IPv6 address's IPv4 tail) and from a prefix
# length after it, and the result is parsed again. So 010.0.0.5 is 10.0.0.5 (decimal, never
# octal; 0x0a is no number). An IPv4-mapped IPv6 address (::ffff:a.b.c.d) is the IPv4 address.
_LEADING_ZEROS = re.compile(r"(^|:)0*(0|[1-9][0-9]*)\.0*(0|[1-9][0-9]*)\.0*(0|[1-9][0-9]*)\.0*(0|[1-9][0-9]*)"
                            r"((/)0*(0|[1-9][0-9]*))?\Z")
_STRIP_ZEROS = r"\1\2.\3.\4.\5\7\8"
_V4_MAPPED = bytes(10) + b"\xff\xff"  # the first 12 bytes of ::ffff:a.b.c.d
_ZEROS_NOTE = "leading zeros are decimal to kube-proxy, octal to some other tools"
_MAPPED_NOTE = "an IPv4-mapped IPv6 address is IPv4 to kube-proxy"


def _pton(text: str) -> bytes | None:
    """The 4 or 16 bytes of an address written as Go's net.ParseIP requires, or None."""
    try:
        return socket.inet_pton(socket.AF_INET6 if ":" in text else socket.AF_INET, text)
    except (OSError, ValueError):
        return None


def _sloppily(parse: Callable[[str], Any], text: str) -> tuple[Any, str] | None:
    """parse(text), else parse() of the text with leading zeros dropped (ParseIPSloppy's rule):
    the result and why it was read loosely ('' if it was not); None if neither parses."""
    got = parse(text)
    if got is not None:
        return got, ""
    got = parse(_LEADING_ZEROS.sub(_STRIP_ZEROS, text))
    return None if got is None else (got, _ZEROS_NOTE)


def _mapped(note: str) -> str:
    return f"{note}; {_MAPPED_NOTE}" if note else _MAPPED_NOTE


def _read_ip(text: str) -> tuple[str, str] | None:
    """An IP address as kube-proxy reads it: its canonical text (what nft and iptables print) and
    why it was read loosely ('' if it was not); None if invalid."""
    read = _sloppily(_pton, text)
    if read is None:
        return None
    packed, note = read
    if packed[:12] == _V4_MAPPED:
        return socket.inet_ntop(socket.AF_INET, packed[12:]), _mapped(note)
    return socket.inet_ntop(socket.AF_INET6 if len(packed) == 16 else socket.AF_INET, packed), note


def _network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    """Go's net.ParseCIDR: a strict address, '/' and a decimal prefix length (leading zeros allowed)."""
    addr, slash, bits = text.partition("/")
    packed = _pton(addr) if slash and bits.isascii() and bits.isdigit() else None
    if packed is None:
        return None
    try:
        return (ipaddress.IPv4Network if len(packed) == 4 else ipaddress.IPv6Network)((packed, int(bits)), strict=False)
    except ValueError:
        return None


def _read_cidr(text: str) -> tuple[str, str] | None:
    """A CIDR as kube-proxy reads it (an IPv4-mapped IPv6 network of /96 or longer is IPv4, as Go
    prints it): its canonical text and why it was read loosely, as _read_ip; None if invalid."""
    read = _sloppily(_network, text)
    if read is None:
        return None
    net, note = read
    if isinstance(net, ipaddress.IPv6Network) and (v4 := net.network_address.ipv4_mapped) is not None:
        return str(ipaddress.IPv4Network((v4, net.prefixlen - 96))), _mapped(note)
    return str(net), note


def normalize_ip(text: Any) -> str | None:
    """The canonical text of an IP address as kube-proxy reads it, or None if invalid."""
    read = _read_ip(text) if isinstance(text, str) else None
    return read[0] if read else None


def ip_family(addr: str) -> Family:
    return "ipv6" if ":" in addr else "ipv4"


def _split_cidrs(cidrs: Iterable[str], merged: bool = False) -> dict[Family, tuple[str, ...]]:
    """CIDRs per family; `merged`: overlapping and adjacent ones made one (as a set of addresses:
    the cluster CIDRs, where one inside another, 10.0.0.0/8 and 10.244.0.0/16, made an nftables
    interval set refuse the whole transaction)."""
    out: dict[Family, list[Any]] = {"ipv4": [], "ipv6": []}
    for c in cidrs:
        net = ipaddress.ip_network(c, strict=False)
        out["ipv4" if net.version == 4 else "ipv6"].append(net)
    return {k: tuple(str(n) for n in (ipaddress.collapse_addresses(v) if merged else v)) for k, v in out.items()}


# ---------------------------------------------------------------------------------------------
# Field access with precise errors


class _Reader:
    """Typed access to one object's fields; every failure becomes an InputError at file:line, and
    every warning goes to `warnings` as 'file:line:column: field: message'."""

    def __init__(self, obj: SourceObject, warnings: list[str] | None = None):
        self.obj = obj
        self.warnings = [] if warnings is None else warnings

    @property
    def from_api(self) -> bool:
        """The object was served by the API server, which never holds what it refuses (the
        manifest-only checks and warnings are not made for it)."""
        return self.obj.location.origin.startswith(_API_ORIGIN)

    def error(self, path: Path, msg: str) -> InputError:
        return InputError(self.obj.where(path), msg, path)

    def warn(self, path: Path, msg: str) -> None:
        self.warnings.append(InputWarning(self.obj.where(path), msg, path))

    def get(self, path: Path, default: Any = None) -> Any:
        node: Any = self.obj.body
        for part in path:
            if isinstance(part, int):
                if not isinstance(node, list) or part >= len(node):
                    return default
            elif not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return default if node is None else node

    def typed(self, path: Path, kind: type | tuple[type, ...], default: Any = None) -> Any:
        v = self.get(path, default)
        if v is default:
            return v
        if isinstance(v, bool) and kind is not bool and (kind is int or (isinstance(kind, tuple) and int in kind)):
            raise self.error(path, f"expected {_tname(kind)}, got boolean")
        if not isinstance(v, kind):
            raise self.error(path, f"expected {_tname(kind)}, got {_tname(type(v))}")
        return v

    def port(self, path: Path, required: bool = True, zero_unset: bool = False) -> int | None:
        """An integer 1-65535 at path; with `zero_unset`, 0 reads as not set (as the API server
        and kube-proxy read a nodePort or healthCheckNodePort of 0)."""
        v = self.typed(path, int)
        if zero_unset and v == 0:
            v = None
        if v is None:
            if required:
                raise self.error(path, "is required")
            return None
        if not 1 <= v <= 65535:
            raise self.error(path, f"port {v} out of range 1-65535")
        return v

    def ip(self, path: Path, value: Any = None) -> str:
        """The IP address at path (or `value`, read from there) as kube-proxy reads it; a loose
        spelling (010.0.0.5, ::ffff:10.0.0.5) gets a warning."""
        v = self.typed(path, str) if value is None else value
        read = _read_ip(v) if isinstance(v, str) else None
        if read is None:
            raise self.error(path, f"invalid IP address {v!r}")
        return self.read_as(path, v, read)

    def read_as(self, path: Path, given: str, read: tuple[str, str | None]) -> str:
        """An address or CIDR as _read_ip/_read_cidr read it (its text, a note on a loose
        spelling): the text, the note a warning at path."""
        if read[1]:
            self.warn(path, f"{given!r} is read as {read[0]} ({read[1]})")
        return read[0]

    def cidr(self, path: Path) -> str | None:
        """The CIDR at path as kube-proxy reads it (blanks around it allowed; a loose spelling
        warned about, as in ip()); None, with a warning, if it is none: kube-proxy ignores it."""
        v = self.typed(path, str, "")
        read = _read_cidr(v.strip())
        if read is None:
            self.warn(path, f"invalid CIDR {v!r}; ignored, as kube-proxy ignores it")
            return None
        return self.read_as(path, v, read)

    def enum(self, path: Path, allowed: tuple[str, ...], default: str) -> str:
        v = self.typed(path, str, default)
        if v not in allowed:
            raise self.error(path, f"must be one of {', '.join(allowed)}, got {v!r}")
        return v


# what the API server serves holds only fields of its Kubernetes version (it drops any other as it
# decodes an object): one unknown here is of a newer version, no misspelling, and is not checked
_API_ORIGIN = "kubernetes:"  # (sources/kubernetes.py's locations)


def _warn_unknown(r: _Reader, value: Any, type_: fields.Type, base: Path = ()) -> None:
    """A warning at each field of `value` (an object of `type_` at `base`: a mapping, else its
    reader's error) and of its nested objects that their types do not have (fields.unknown_fields);
    none for an object read from the API server."""
    if type(value) is dict and (unknown := fields.unknown_fields(value, type_)):
        if not r.from_api:
            for p in unknown:
                r.warn(base + p, fields.unknown_field_message(fields.field_type(type_, p), p[-1]))


def _tname(kind: Any) -> str:
    if isinstance(kind, tuple):
        return " or ".join(type_name(k) for k in kind)
    return type_name(kind) if isinstance(kind, type) else str(kind)


# ---------------------------------------------------------------------------------------------
# Services


@dataclass(frozen=True)
class _Port:
    name: str
    protocol: str
    port: int
    node_port: int | None


@dataclass(frozen=True)
class _Service:
    namespace: str
    name: str
    cluster_ips: dict[Family, str]
    ports: tuple[_Port, ...]
    external_ips: dict[Family, tuple[str, ...]]
    lb_ips: dict[Family, tuple[str, ...]]
    source_ranges: dict[Family, tuple[str, ...]]
    affinity_timeout: int | None
    etp_local: bool
    itp_local: bool
    health_check_node_port: int | None


def _raise_all(errors: list[InputError]) -> None:
    """Raise the errors found in one object: the one, or all of them (in the order of their
    lines). Its readers go on after an error in one part (a port, an address, a field: `try`,
    errors.append) to the others, so that all of an object's errors are reported at once."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise InputErrors(in_place_order(errors))


def _check_names(r: _Reader, service_name: bool) -> None:
    """metadata.namespace a DNS label and (a Service's) metadata.name a DNS-1035 label."""
    if not _DNS_LABEL.fullmatch(r.obj.namespace):
        raise r.error(("metadata", "namespace"), f"invalid namespace {r.obj.namespace!r}: {_DNS_LABEL_RULE}")
    if service_name and not _DNS_1035.fullmatch(r.obj.name):
        raise r.error(("metadata", "name"), f"invalid Service name {r.obj.name!r}: a DNS-1035 label "
                      "(a lower-case letter, then letters, digits and '-', at most 63) is required")


def _port_name(r: _Reader, path: Path) -> str:
    name = r.typed(path, str, "")
    if name and not _DNS_LABEL.fullmatch(name):
        raise r.error(path, f"invalid port name {name!r}: {_DNS_LABEL_RULE}")
    return name


def _read_whole(read: Callable[[SourceObject, list[str], list[InputError]], _T | None], obj: SourceObject,
                warnings: list[str]) -> _T | None:
    """read(obj) as the build needs it (None: skipped), or all its errors (InputError(s)): read
    goes on after an error in one part to the others, collecting them."""
    errors: list[InputError] = []
    result: _T | None = None
    try:
        result = read(obj, warnings, errors)
    except InputError as exc:  # (in a part the others depend on: what was found so far, and this)
        errors.append(exc)
    _raise_all(errors)
    return result


def _parse_service(obj: SourceObject, warnings: list[str]) -> _Service | None:
    return _read_whole(_read_service, obj, warnings)


def _labels(r: _Reader) -> dict[str, str]:
    """metadata.labels: a mapping of strings to strings, as the API server takes them."""
    labels = r.typed(("metadata", "labels"), dict, {})
    for key, value in labels.items():
        if not isinstance(value, str) and value is not None:
            raise r.error(("metadata", "labels", key), f"expected string, got {_tname(type(value))}")
    return labels


def _read_service(obj: SourceObject, warnings: list[str], errors: list[InputError]) -> _Service | None:
    r = _Reader(obj, warnings)
    _warn_unknown(r, obj.body, fields.SERVICE)
    labels = _labels(r)
    if any(k in labels for k in SKIP_LABELS):
        return None  # owned by another proxy (or headless), as kube-proxy skips it
    _attempt(errors, _check_names, r, service_name=True)
    r.typed(("spec",), dict)
    svc_type = r.enum(("spec", "type"), ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName"), "ClusterIP")
    if svc_type == "ExternalName":
        return None
    # (read by the API server, not by a proxy; a wrong type here is a manifest the API server refuses)
    _attempt(errors, r.typed, ("spec", "allocateLoadBalancerNodePorts"), bool)
    _attempt(errors, r.typed, ("spec", "trafficDistribution"), str)
    ips = r.typed(("spec", "clusterIPs"), list)
    paths: list[Path]
    if ips:
        paths = [("spec", "clusterIPs", i) for i in range(len(ips))]
        single = r.get(("spec", "clusterIP"))
        if single is not None and single != ips[0]:  # the API server keeps the two in step
            invalid = single not in ("", "None") and (not isinstance(single, str) or normalize_ip(single) is None)
            errors.append(r.error(("spec", "clusterIP"), f"invalid IP address {single!r}" if invalid
                                  else f"{single!r} is not clusterIPs[0] ({ips[0]!r})"))
    elif r.get(("spec", "clusterIP")) is not None:
        paths = [("spec", "clusterIP")]
    else:
        paths = []
    if any(r.get(p) == "None" for p in paths):
        return None  # headless
    # no clusterIP yet (the API server allocates one; a manifest written by hand may lack it): the
    # Service is skipped, with a warning, once the rest of it is checked (its errors are errors all the same)
    unallocated = not paths or r.get(paths[0]) == ""
    cluster_ips: dict[Family, str] = {}
    for p in paths if not unallocated else ():
        try:
            ip = r.ip(p)
            _check_cluster_ip(r, p, ip)
            fam = ip_family(ip)
            if fam in cluster_ips:
                raise r.error(p, f"two clusterIPs of family {fam}")
            cluster_ips[fam] = ip
        except InputError as exc:
            errors.append(exc)
    _attempt(errors, _check_ip_families, r, [r.get(p) for p in paths] if not unallocated else [])

    raw_ports = r.typed(("spec", "ports"), list, [])
    if not raw_ports:
        errors.append(r.error(("spec", "ports"), "a Service needs at least one port"))
    ports: list[_Port] = []
    names: dict[tuple[str, str], int] = {}
    for i in range(len(raw_ports)):
        try:
            _read_port(r, ("spec", "ports", i), svc_type, len(raw_ports), ports, names, errors)
        except InputError as exc:
            errors.append(exc)

    external_ips: dict[Family, list[str]] = defaultdict(list)
    placed: list[tuple[Path, str]] = []  # (where, address) of each externalIP and LB IP programmed
    for i, _ in enumerate(r.typed(("spec", "externalIPs"), list, [])):
        try:
            ip = r.ip(("spec", "externalIPs", i))
            _not_special(r, ("spec", "externalIPs", i), ip)
            external_ips[ip_family(ip)].append(ip)
            placed.append((("spec", "externalIPs", i), ip))
        except InputError as exc:
            errors.append(exc)
    lb_ips: dict[Family, list[str]] = defaultdict(list)
    if svc_type == "LoadBalancer":
        try:  # (a status of another shape would be read as no ingress at all: its IPs dropped)
            r.typed(("status",), dict)
            r.typed(("status", "loadBalancer"), dict)
        except InputError as exc:
            errors.append(exc)
        for i, _ in enumerate(r.typed(("status", "loadBalancer", "ingress"), list, [])):
            try:
                base = ("status", "loadBalancer", "ingress", i)
                if (ip := _read_ingress(r, base, lb_ips)) is not None:
                    placed.append(((*base, "ip"), ip))
            except InputError as exc:
                errors.append(exc)
    elif not r.from_api and isinstance(  # (a manifest's leftover)
            ingress := r.get(("status", "loadBalancer", "ingress")), list) and any(
            isinstance(i, dict) and i.get("ip") for i in ingress):
        r.warn(("status", "loadBalancer", "ingress"), f"ignored: a {svc_type} Service's load balancer IPs are not "
               "programmed (the API server clears this status on any type but LoadBalancer since v1.29; "
               "kube-proxy would program them)")
    if cluster_ips:  # (a family the Service has no clusterIP of is not proxied: nor are these, as upstream)
        for where, ip in placed:
            if ip_family(ip) not in cluster_ips:
                r.warn(where, f"{ip} is of a family this Service has no clusterIP of "
                              f"({', '.join(family_name(f) for f in cluster_ips)} only): not programmed, as "
                              "kube-proxy does not")

    ranges: dict[Family, list[str]] = defaultdict(list)
    try:
        raw_ranges = r.typed(("spec", "loadBalancerSourceRanges"), list, [])
        for i in range(len(raw_ranges)):
            c = r.cidr(("spec", "loadBalancerSourceRanges", i))
            if c is not None:
                ranges[ip_family(c)].append(c)
        if raw_ranges and not ranges:
            r.warn(("spec", "loadBalancerSourceRanges"), "no valid range: every source may reach the load "
                   "balancer IPs, as with kube-proxy")
    except InputError as exc:
        errors.append(exc)

    timeout = None
    from_api = r.from_api
    try:
        if r.enum(("spec", "sessionAffinity"), ("None", "ClientIP"), "None") == "ClientIP":
            tpath: Path = ("spec", "sessionAffinityConfig", "clientIP", "timeoutSeconds")
            timeout = r.typed(tpath, int, DEFAULT_AFFINITY_TIMEOUT)
            if not 0 < timeout <= 86400:
                raise r.error(tpath, f"must be 1-86400, got {timeout}")
        elif r.get(("spec", "sessionAffinityConfig")) is not None and not from_api:
            r.warn(("spec", "sessionAffinityConfig"), "set while sessionAffinity is None: ignored (the API server "
                   "refuses it)")
    except InputError as exc:
        errors.append(exc)
    given_etp = r.get(("spec", "externalTrafficPolicy"))
    etp = "Cluster" if given_etp in (None, "Global") else given_etp
    if etp not in ("Cluster", "Local"):
        errors.append(r.error(("spec", "externalTrafficPolicy"), f"must be Cluster or Local, got {etp!r}"))
    if given_etp is not None and svc_type == "ClusterIP" and not r.get(("spec", "externalIPs")) and not from_api:
        r.warn(("spec", "externalTrafficPolicy"), "set on a Service with no external address (no NodePort, load "
               "balancer or externalIP): nothing it applies to (the API server refuses it)")
    itp = _attempt(errors, r.enum, ("spec", "internalTrafficPolicy"), ("Cluster", "Local"), "Cluster")
    _attempt(errors, _check_ip_family_policy, r, len(cluster_ips))
    hcnp = None
    try:
        hcnp = r.port(("spec", "healthCheckNodePort"), required=False, zero_unset=True)
        if hcnp is not None and not (svc_type == "LoadBalancer" and etp == "Local") and not from_api:
            r.warn(("spec", "healthCheckNodePort"), "set but not served: only a LoadBalancer with "
                   "externalTrafficPolicy Local has one (the API server refuses it otherwise)")
    except InputError as exc:
        errors.append(exc)

    if errors:
        return None  # (raised by _parse_service)
    if unallocated:
        warnings.append(InputWarning(obj.where(("spec",)), f"Service {obj.namespace}/{obj.name} has no clusterIP; skipped"))
        return None

    def frozen(d: dict[Family, list[str]]) -> dict[Family, tuple[str, ...]]:
        return {k: tuple(sorted(set(v), key=_ip_key)) for k, v in d.items()}

    return _Service(
        namespace=obj.namespace, name=obj.name, cluster_ips=cluster_ips, ports=tuple(ports),
        external_ips=frozen(external_ips), lb_ips=frozen(lb_ips), source_ranges=frozen(ranges),
        affinity_timeout=timeout, etp_local=etp == "Local", itp_local=itp == "Local",
        health_check_node_port=hcnp if (svc_type == "LoadBalancer" and etp == "Local") else None,
    )


def _check_ip_families(r: _Reader, ips: list[Any]) -> None:
    """spec.ipFamilies, when given, names the family of each clusterIP in order (the API server
    refuses a Service where it does not, and kube-proxy reads a family's clusterIP by its index
    there); a family beyond the clusterIPs given is one not allocated yet (nothing to program)."""
    families = r.typed(("spec", "ipFamilies"), list, [])
    if len(families) > 2:
        raise r.error(("spec", "ipFamilies"), f"at most two families (IPv4, IPv6), got {len(families)}")
    for i, family in enumerate(families):
        path: Path = ("spec", "ipFamilies", i)
        name = r.enum(path, tuple(_ADDRESS_TYPES), "")
        if families.index(family) != i:
            raise r.error(path, f"{name} is listed twice")
        if i < len(ips) and isinstance(ips[i], str):
            ip = normalize_ip(ips[i])
            if ip is not None and ip_family(ip) != _ADDRESS_TYPES[name]:
                raise r.error(path, f"{name} is not the family of clusterIPs[{i}] ({ips[i]})")
        elif ips and i >= len(ips) and not r.from_api:
            r.warn(path, f"{name} has no clusterIP (clusterIPs[{i}]): nothing is programmed for it (the API server "
                   "allocates one)")


def _attempt(errors: list[InputError], read: Callable[..., Any], *args: Any, default: Any = None, **kw: Any) -> Any:
    """read(*args, **kw), or (its InputError, or each of its InputErrors, added to errors)
    default: one field's error does not stop the reading of the next."""
    try:
        return read(*args, **kw)
    except InputError as exc:
        errors.append(exc)
    except InputErrors as exc:  # (several fields of one part)
        errors += exc.errors
    return default


def _read_port(r: _Reader, base: Path, svc_type: str, count: int, ports: list[_Port],
               names: dict[tuple[str, str], int], errors: list[InputError]) -> None:
    """One of spec.ports, added to ports (and its name to names) when it is valid; the errors of
    its fields, each of them, added to errors when not (or one raised)."""
    r.typed(base, dict)
    reads = (lambda: _port_name(r, base + ("name",)), lambda: r.enum(base + ("protocol",), PROTOCOLS, "TCP"),
             lambda: r.port(base + ("port",)), lambda: r.port(base + ("nodePort",), required=False, zero_unset=True),
             lambda: _target_port(r, base + ("targetPort",)))
    try:
        name, protocol, port, node_port, _ = [read() for read in reads]
    except InputError:  # read again, field by field: each wrong one is reported
        for read in reads:
            _attempt(errors, read)
        return
    if svc_type == "ClusterIP" and node_port is not None:
        raise r.error(base + ("nodePort",), "a ClusterIP Service has no nodePort (type NodePort or LoadBalancer has)")
    if node_port is not None and not 30000 <= node_port <= 32767:
        r.warn(base + ("nodePort",), f"{node_port} is outside the API server's default range 30000-32767: "
               "it takes that port on every node address it answers on")
    if node_port is None and svc_type != "ClusterIP" and not (
            svc_type == "LoadBalancer" and r.get(("spec", "allocateLoadBalancerNodePorts")) is False):
        r.warn(base + ("nodePort",), f"not set: a {svc_type} Service's port gets one from the API server; "
               "this one has no NodePort here")
    if count > 1 and not name:
        raise r.error(base + ("name",), "is required when a Service has more than one port")
    if (name, protocol) in names or (name and any(n == name for n, _ in names)):
        raise r.error(base + ("name",), f"duplicate port name {name!r}")
    names[(name, protocol)] = int(base[-1])
    assert port is not None
    if any(p.port == port and p.protocol == protocol for p in ports):
        raise r.error(base + ("port",), f"duplicate port {port}/{protocol}")
    ports.append(_Port(name, protocol, port, node_port))


_IP_FAMILY_POLICIES = ("SingleStack", "PreferDualStack", "RequireDualStack")


def _check_ip_family_policy(r: _Reader, cluster_ips: int) -> None:
    """spec.ipFamilyPolicy: one of the three, and not SingleStack with a clusterIP of each family
    (the API server refuses both); RequireDualStack with one clusterIP is warned about."""
    policy = r.typed(("spec", "ipFamilyPolicy"), str)
    if policy is not None and policy not in _IP_FAMILY_POLICIES:
        raise r.error(("spec", "ipFamilyPolicy"), f"must be one of {', '.join(_IP_FAMILY_POLICIES)}, got {policy!r}")
    if policy == "SingleStack" and cluster_ips > 1:
        raise r.error(("spec", "ipFamilyPolicy"), "SingleStack, with a clusterIP of each family")
    if policy == "RequireDualStack" and cluster_ips == 1 and not r.from_api:
        r.warn(("spec", "ipFamilyPolicy"), "RequireDualStack with one clusterIP: only its family is served")


_PORT_NAME = re.compile(r"(?!.*--)[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?")


def _target_port(r: _Reader, path: Path) -> None:
    """spec.ports[].targetPort: a number 1-65535 or a port name (IANA_SVC_NAME), as the API
    server takes it (the EndpointSlices carry the port it resolves to, which is what is used)."""
    v = r.typed(path, (int, str))
    if v == 0 or v == "":  # (the API server's defaulting reads either as the port itself)
        return
    if isinstance(v, int) and not 1 <= v <= 65535:
        raise r.error(path, f"port {v} out of range 1-65535")
    if isinstance(v, str) and not (_PORT_NAME.fullmatch(v) and any(c.isalpha() for c in v)):
        raise r.error(path, f"invalid port name {v!r}: at most 15 lower-case letters, digits and '-', with a "
                            "letter, '-' neither first, last nor twice in a row")


def _read_ingress(r: _Reader, base: Path, lb_ips: dict[Family, list[str]]) -> str | None:
    """One of status.loadBalancer.ingress: its IP added to lb_ips (and returned) when kube-proxy
    programs it."""
    if not isinstance(r.get(base), dict):
        raise r.error(base, "expected a mapping (ip, hostname, ipMode, ports)")
    mode = r.get(base + ("ipMode",))
    if mode not in (None, "VIP", "Proxy"):  # (the API server allows only these; kube-proxy skips it)
        r.warn(base + ("ipMode",), f"{mode!r} is neither VIP nor Proxy; this ingress IP is skipped, "
                                   "as kube-proxy skips it")
    if r.get(base + ("ip",)) in (None, "") or mode not in (None, "VIP"):
        return None  # hostname-only ingress ("" is no ip to kube-proxy), or the LB proxies itself
    ip = r.ip(base + ("ip",))
    lb_ips[ip_family(ip)].append(ip)
    return ip


def _nodeport_cidrs(split: dict[Family, tuple[str, ...]] | None, family: Family) -> tuple[str, ...] | None:
    """A family's nodePort addresses (None: every local address but loopback), as kube-proxy's
    NodePortAddresses reads the flag: a family it names no CIDR of, or CIDRs that cover every
    address (0.0.0.0/0; 0.0.0.0/1 with 128.0.0.0/1), match all. Kept collapsed (overlapping and
    adjacent CIDRs merged, as the kernel holds them). Loopback addresses are left out (nftables
    mode never serves NodePorts there): loopback CIDRs are dropped (only loopback: none), and the
    renderers keep loopback out of a wider CIDR that holds it (FamilyOptions.nodePortsHoldLoopback)."""
    if split is None or not split[family]:
        return None
    nets = list(ipaddress.collapse_addresses(ipaddress.ip_network(c) for c in split[family]))  # type: ignore[misc]
    if any(n.prefixlen == 0 for n in nets):
        return None
    loopback = LOOPBACK[nets[0].version]
    return tuple(str(n) for n in nets if not n.subnet_of(loopback))  # type: ignore[arg-type]


def _primary_cidrs(node: NodeInfo, warnings: list[str]) -> tuple[str, ...]:
    """nodePortAddresses [primary] as kube-proxy resolves it (server.go): this node's IP of each
    family as a /32 or /128, loopback left out. A family without one names no CIDR, so every local
    address of it serves; without any, all do (as kube-proxy's, which then assumes loopback)."""
    cidrs = tuple(f"{a}/{32 if ip_family(a) == 'ipv4' else 128}" for a in node.addresses
                  if not ipaddress.ip_address(a).is_loopback)
    if not cidrs:
        warnings.append(InputWarning(None, f"nodePortAddresses primary: no IP of Node {node.name!r} is known (no "
                                           "Node object with an InternalIP or ExternalIP, no bindAddress): NodePorts "
                                           "answer on every local address"))
    return cidrs


def _ip_key(s: str) -> tuple[int, bytes, int]:
    """Sort key for addresses and CIDRs: family, then numeric order."""
    addr, _, plen = s.partition("/")
    fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
    return (fam, socket.inet_pton(fam, addr), int(plen or 0))


# ---------------------------------------------------------------------------------------------
# EndpointSlices


@dataclass(frozen=True)
class _Slice:
    namespace: str
    service: str
    family: Family
    ports: tuple[tuple[str, str, int], ...]  # (name, protocol, port)
    endpoints: tuple[EndpointInfo, ...]  # with the slice's port if it has one port, else 0 (see `ports`)


_SLICE = fields.ENDPOINT_SLICE.without("endpoints")  # (each endpoint is checked as _parse_slice reads it)
_ENDPOINT_FIELDS = fields.ENDPOINT.fields.issuperset
_CONDITION_FIELDS = fields.ENDPOINT_CONDITIONS.fields.issuperset
_REFERENCE_FIELDS = fields.OBJECT_REFERENCE.fields.issuperset
_UNKNOWN = object()  # (a condition's value when one is unknown: no boolean, so _endpoint reads it)


def _known_fields(raw: dict[str, Any]) -> bool:
    """Whether every field of an endpoint of no usual shape (see _parse_slice), and of its
    targetRef, is known (its conditions: _parse_slice; its hints: _endpoint)."""
    ref = raw.get("targetRef")
    return _ENDPOINT_FIELDS(raw) and (type(ref) is not dict or _REFERENCE_FIELDS(ref))


def _parse_slice(obj: SourceObject, warnings: list[str]) -> _Slice | None:
    return _read_whole(_read_slice, obj, warnings)


_PARSERS: dict[str, Callable[[SourceObject, list[str]], Any]] = {"Service": _parse_service,
                                                                 "EndpointSlice": _parse_slice}


def _read_slice(obj: SourceObject, warnings: list[str], errors: list[InputError]) -> _Slice | None:
    r = _Reader(obj, warnings)
    _warn_unknown(r, obj.body, _SLICE)
    labels = _labels(r)
    if any(k in labels for k in SKIP_LABELS):
        return None
    if r.get(("addressType",)) is None:
        raise r.error(("addressType",), "is required (IPv4, IPv6 or FQDN)")
    addr_type = r.enum(("addressType",), ("IPv4", "IPv6", "FQDN"), "")
    if addr_type == "FQDN":
        return None
    _check_names(r, service_name=False)
    service = labels.get(SERVICE_NAME_LABEL)
    if service is not None and not isinstance(service, str):
        raise r.error(("metadata", "labels", SERVICE_NAME_LABEL), f"expected string, got {_tname(type(service))}")
    if not service:
        warnings.append(InputWarning(obj.where(("metadata",)), f"EndpointSlice {obj.namespace}/{obj.name} has no "
                                     f"{SERVICE_NAME_LABEL} label; skipped"))
        return None
    family: Family = _ADDRESS_TYPES[addr_type]  # type: ignore[assignment]
    ports = []
    for i, _ in enumerate(r.typed(("ports",), list, [])):
        try:
            base: Path = ("ports", i)
            name = _port_name(r, base + ("name",))
            protocol = r.enum(base + ("protocol",), PROTOCOLS, "TCP")
            port = r.port(base + ("port",), required=False, zero_unset=True)
            if port is None:
                r.warn(base + ("port",), f"{'port 0' if r.get(base + ('port',)) == 0 else 'no port number'}; "
                       "ignored, as kube-proxy ignores it")
            else:
                ports.append((name, protocol, port))
        except InputError as exc:
            errors.append(exc)
    endpoints = []
    # the usual slice has one port: its endpoints carry it and need no copy per port later
    port_number = ports[0][2] if len(ports) == 1 else 0
    v6 = family == "ipv6"
    af = socket.AF_INET6 if v6 else socket.AF_INET
    for i, raw in enumerate(r.typed(("endpoints",), list, [])):
        # the usual endpoint (one address, boolean conditions, names, no hints, no unknown field)
        # decided here; any other shape, or anything wrong, by _endpoint, which names the place of
        # what is wrong
        ep = None
        if type(raw) is dict and "hints" not in raw:
            addrs, cond = raw.get("addresses"), raw.get("conditions")
            if cond is None or cond == {}:  # (not `or`: `conditions: 0` is no mapping, not "none")
                cond = _NO_CONDITIONS
            node_name, zone = raw.get("nodeName"), raw.get("zone")
            if (type(addrs) is list and len(addrs) == 1 and type(addrs[0]) is str and type(cond) is dict
                    and (node_name is None or type(node_name) is str) and (zone is None or type(zone) is str)
                    # no unknown field: only those read here (counted), else compared as sets
                    and ((len(raw) == (3 if zone is None else 4) and node_name is not None
                          and cond is not _NO_CONDITIONS) or _known_fields(raw))):
                ready = cond.get("ready")
                if len(cond) == 1 and ready is not None:  # the usual conditions: ready alone
                    serving = terminating = None
                elif _CONDITION_FIELDS(cond):
                    serving, terminating = cond.get("serving"), cond.get("terminating")
                else:  # an unknown field: _endpoint names it
                    ready = serving = terminating = _UNKNOWN
                if ((ready is None or type(ready) is bool) and (serving is None or type(serving) is bool)
                        and (terminating is None or type(terminating) is bool)):
                    try:
                        packed = socket.inet_pton(af, addrs[0])  # (an IPv4-mapped one, or one that may
                        # be special: _endpoint)
                        ip = (None if (v6 and packed[:12] == _V4_MAPPED) or packed[0] in _MAYBE_SPECIAL
                              else socket.inet_ntop(af, packed))
                    except (OSError, ValueError):
                        ip = None
                    if ip is not None:
                        ep = EndpointInfo(ip, port_number, ready is not False, serving is not False,
                                          terminating is True, intern(node_name) if node_name else node_name,
                                          intern(zone) if zone else zone, _NO_HINTS, _NO_HINTS)
        if ep is None:
            ep = _attempt(errors, _endpoint, r, raw, i, family, addr_type, port_number)
            if ep is None:
                continue
        endpoints.append(ep)
    if errors:
        return None  # (raised by _parse_slice)
    return _Slice(obj.namespace, service, family, tuple(ports), tuple(endpoints))


def _endpoint(r: _Reader, raw: Any, i: int, family: Family, addr_type: str, port_number: int
              ) -> EndpointInfo | None:
    """endpoints[i] of a slice, read with every check (raises InputError naming the field); None,
    with a warning, for one without addresses (kube-proxy ignores it)."""
    base = ("endpoints", i)
    if not isinstance(raw, dict):
        raise r.error(base, "expected a mapping")
    _warn_unknown(r, raw, fields.ENDPOINT, base)
    addrs = raw.get("addresses")
    if not isinstance(addrs, list) and addrs is not None:
        raise r.error(base + ("addresses",), f"expected a list of addresses, got {_tname(type(addrs))}")
    if not addrs:
        r.warn(base + ("addresses",), "no address; ignored, as kube-proxy ignores it")
        return None
    errors: list[InputError] = []  # (each field's: one does not hide the next)
    ip = _attempt(errors, _address, r, base + ("addresses", 0), addrs[0], family, addr_type)  # (the first only
    for j in range(1, len(addrs)):  # is used; the others must still be of the slice's type)
        _attempt(errors, _address, r, base + ("addresses", j), addrs[j], family, addr_type)
    cond = raw.get("conditions")
    cond = {} if cond is None else cond
    if not isinstance(cond, dict):
        errors.append(r.error(base + ("conditions",), "expected a mapping"))
        cond = {}
    ready = _attempt(errors, _flag, r, cond, "ready", True, base)
    serving = _attempt(errors, _flag, r, cond, "serving", True, base)  # unset: serving, as kube-proxy reads it
    terminating = _attempt(errors, _flag, r, cond, "terminating", False, base)
    hints = raw.get("hints")
    hints = {} if hints is None else hints
    if not isinstance(hints, dict):
        errors.append(r.error(base + ("hints",), "expected a mapping"))
        hints = {}
    zone_hints = _attempt(errors, _hint_names, r, hints, "forZones", base, default=_NO_HINTS)
    node_hints = _attempt(errors, _hint_names, r, hints, "forNodes", base, default=_NO_HINTS)
    node_name = raw.get("nodeName")
    zone = raw.get("zone")
    for key, value in (("nodeName", node_name), ("zone", zone)):
        if value is not None and not isinstance(value, str):
            errors.append(r.error(base + (key,), f"expected string, got {_tname(type(value))}"))
    _raise_all(errors)
    # a few names repeat across 100k endpoints: share one string each
    node_name = intern(node_name) if node_name else node_name
    zone = intern(zone) if zone else zone
    return EndpointInfo(
        ip=ip, port=port_number, ready=ready, serving=serving, terminating=terminating, node=node_name, zone=zone,
        zoneHints=zone_hints, nodeHints=node_hints,
    )


def _address(r: _Reader, path: Path, text: Any, family: Family, addr_type: str) -> str:
    """An endpoint address, which must be of the slice's family (as kube-proxy reads it) and no
    special one (as the API server requires)."""
    ip = r.ip(path, text)
    if ip_family(ip) != family:
        raise r.error(path, f"{ip if ip == text else f'{text!r}, read as {ip},'} is not an {addr_type} address")
    _not_special(r, path, ip)
    return ip


# first bytes of the addresses _not_special() may refuse (0/8, 127/8, 169.254/16, 224.0.0/24; ::,
# ::1, fe80::/10, ff02::/16): the usual endpoint's address is decided without a look at it
_MAYBE_SPECIAL = frozenset((0, 127, 169, 224, 0xfe, 0xff))
_LINK_LOCAL_MULTICAST_V4 = ipaddress.ip_network("224.0.0.0/24")


def _link_local_multicast(a: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Go's IsLinkLocalMulticast: 224.0.0.0/24, or an IPv6 multicast address of link-local scope
    (ff02::, ff12::, ...: whatever its flags)."""
    if a.version == 4:
        return a in _LINK_LOCAL_MULTICAST_V4
    return a.packed[0] == 0xFF and a.packed[1] & 0x0F == 0x02


def _special(a: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why an address is one the API server refuses as an endpoint or externalIP
    (ValidateNonSpecialIP), or None: unspecified, loopback, link-local, link-local multicast."""
    return ("unspecified (0.0.0.0, ::)" if a.is_unspecified
            else "in the loopback range (127.0.0.0/8, ::1/128)" if a.is_loopback
            else "in the link-local range (169.254.0.0/16, fe80::/10)" if a.is_link_local
            else "in the link-local multicast range (224.0.0.0/24, ff02::/16, ff12::/16, ...)"
            if _link_local_multicast(a) else None)


def _not_special(r: _Reader, path: Path, ip: str) -> None:
    """An endpoint address or externalIP is none of those the API server refuses there."""
    reason = _special(ipaddress.ip_address(ip))
    if reason is not None:
        raise r.error(path, f"{ip} may not be {reason}, as the API server requires")


def _check_cluster_ip(r: _Reader, path: Path, ip: str) -> None:
    """A clusterIP is no special address, nor multicast: every packet to it is DNATed, the node's
    own too (a clusterIP 127.0.0.53 would take over the node's local DNS resolver). No service
    CIDR of a cluster holds one."""
    a = ipaddress.ip_address(ip)
    reason = _special(a) or ("multicast (224.0.0.0/4, ff00::/8)" if a.is_multicast else None)
    if reason is not None:
        raise r.error(path, f"{ip} may not be {reason}: the node's own traffic to it would be taken over")


def _flag(r: _Reader, cond: dict[str, Any], key: str, default: bool, base: Path) -> bool:
    v = cond.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise r.error(base + ("conditions", key), f"expected boolean, got {_tname(type(v))}")
    return v


def _hint_names(r: _Reader, hints: dict[str, Any], key: str, base: Path) -> frozenset[str]:
    """hints.forZones / hints.forNodes: a list of {name: string} (the API server takes nothing
    else; one dropped would change which endpoints are used)."""
    items = hints.get(key)
    if items is None:
        return _NO_HINTS
    path = (*base, "hints", key)
    if not isinstance(items, list):
        raise r.error(path, f"expected a list of {{name: ...}}, got {_tname(type(items))}")
    for i, h in enumerate(items):
        if not isinstance(h, dict) or not isinstance(h.get("name", ""), str):
            raise r.error((*path, i), "expected {name: <a string>}")
    return frozenset(h.get("name", "") for h in items) or _NO_HINTS


# ---------------------------------------------------------------------------------------------
# Join and decide


def _endpoints_for(slices: list[_Slice], port: _Port, family: Family) -> list[EndpointInfo]:
    """Endpoints of one service port in one family, merged across slices (matched by port name and protocol)."""
    merged: dict[tuple[str, int], EndpointInfo] = {}
    for sl in slices:
        if sl.family != family:
            continue
        for name, protocol, number in sl.ports:
            if name != port.name or protocol != port.protocol:
                continue
            for ep in sl.endpoints:
                key = (ep.ip, number)
                if key not in merged or not ep.terminating:  # a non-terminating copy wins, as upstream
                    merged[key] = ep if ep.port == number else _with_port(ep, number)
    af = socket.AF_INET6 if family == "ipv6" else socket.AF_INET  # (a slice's addresses are of its family)
    return sorted(merged.values(), key=lambda e: (socket.inet_pton(af, e.ip), e.port))


def _with_port(ep: EndpointInfo, port: int) -> EndpointInfo:
    return EndpointInfo(ep.ip, port, ep.ready, ep.serving, ep.terminating, ep.node, ep.zone,
                        ep.zoneHints, ep.nodeHints)


def _endpoints_of(infos: Iterable[EndpointInfo]) -> tuple[Endpoint, ...]:
    return tuple([Endpoint(e.ip, e.port) for e in infos])


def _family_block(svc: _Service, port: _Port, family: Family, eps: list[EndpointInfo], node: NodeInfo
                  ) -> tuple[ServicePortFamily, set[str]]:
    ext_ips = svc.external_ips.get(family, ())
    lb_ips = svc.lb_ips.get(family, ())
    externally_accessible = port.node_port is not None or bool(ext_ips) or bool(lb_ips)
    etp_local = svc.etp_local and externally_accessible
    uses_cluster = not svc.itp_local or externally_accessible
    uses_local = svc.itp_local or etp_local
    cat = categorize_endpoints(eps, node.name, node.zone, uses_cluster, uses_local)
    made: dict[int, tuple[Endpoint, ...]] = {}  # (the paths often share a list: one tuple each)

    def endpoints(infos: tuple[EndpointInfo, ...]) -> tuple[Endpoint, ...]:
        out = made.get(id(infos))
        if out is None:
            out = made[id(infos)] = _endpoints_of(infos)
        return out

    if not cat.has_any:
        internal = TrafficPath("reject", policy="Local" if svc.itp_local else "Cluster")
    elif svc.itp_local:
        internal = TrafficPath("forward", endpoints(cat.local), "Local") if cat.local else TrafficPath("drop", policy="Local")
    else:
        internal = TrafficPath("forward", endpoints(cat.cluster)) if cat.cluster else TrafficPath("reject")

    external = None
    if externally_accessible:
        policy = "Local" if etp_local else "Cluster"
        chosen = cat.local if etp_local else cat.cluster
        short = endpoints(cat.cluster) if etp_local else ()
        if not cat.has_any:
            external = TrafficPath("reject", policy=policy, shortCircuit=())
        elif chosen:
            external = TrafficPath("forward", endpoints(chosen), policy, short)
        else:
            external = TrafficPath("drop", (), policy, short)

    # Hairpin (a pod reaching itself through its service, masqueraded so that the answer does
    # not come from itself), for this node's own pods on any path. (A pod of another node can
    # be sent back to itself only by the ETP Local pod short-circuit: the renderers cover that
    # from external.shortCircuit.)
    local = [e for e in eps if e.node is None or e.node == node.name]
    hairpin: tuple[Endpoint, ...] = ()
    if local:
        paths = [internal] + ([external] if external else [])
        used = {(x.ip, x.port) for p in paths for x in (*p.endpoints, *p.shortCircuit)}
        hairpin = tuple(Endpoint(e.ip, e.port) for e in local if (e.ip, e.port) in used)
    serving: tuple[Endpoint, ...] = ()
    if port.protocol == "UDP":  # (what the conntrack cleanup keeps; it cleans UDP only)
        serving = _endpoints_of(e for e in eps if e.serving)
        if serving == internal.endpoints:  # the usual case: one tuple for both
            serving = internal.endpoints
    block = ServicePortFamily(
        family=family, clusterIP=svc.cluster_ips[family], internal=internal, external=external,
        externalIPs=ext_ips, loadBalancerIPs=lb_ips,
        loadBalancerSourceRanges=_source_ranges(svc.source_ranges.get(family, ()), lb_ips, node, family),
        hairpinEndpoints=tuple(sorted(hairpin, key=lambda e: (_ip_key(e.ip), e.port))),
        servingEndpoints=serving,
    )
    return block, {e.ip for e in eps if e.ready and e.node == node.name}  # (its ready local endpoints)


def _source_ranges(ranges: tuple[str, ...], lb_ips: tuple[str, ...], node: NodeInfo, family: Family
                   ) -> tuple[str, ...]:
    """The sources allowed to reach the LB IPs, merged (nft refuses overlapping intervals).

    As kube-proxy does: when this node's IP is inside a range, the LB IPs themselves are allowed
    too. A VIP-like load balancer often has its IP routed to the nodes as a local address, so a
    request from the node to it never leaves and arrives with the LB IP as its source.
    """
    if not ranges or not lb_ips:
        return ()
    nets = [ipaddress.ip_network(r) for r in ranges]
    node_ip = next((a for a in node.addresses if ip_family(a) == family), None)
    if node_ip is not None and any(ipaddress.ip_address(node_ip) in n for n in nets):
        nets += [ipaddress.ip_network(ip) for ip in lb_ips]
    return tuple(str(n) for n in ipaddress.collapse_addresses(nets))  # type: ignore[arg-type]


def _warn_loose_node_ips(r: _Reader) -> None:
    """A warning for each of this node's status.addresses in a loose spelling (010.0.0.5,
    ::ffff:10.0.0.5), read as kube-proxy reads it (its IPs decide nodePortAddresses [primary] and
    the load balancer source ranges' exception), as for every other address."""
    addresses = r.get(("status", "addresses"))
    for i, a in enumerate(addresses if isinstance(addresses, list) else ()):  # (other shapes: no IP, as before)
        value = a.get("address") if isinstance(a, dict) and a.get("type") in ("InternalIP", "ExternalIP") else None
        read = _read_ip(value) if isinstance(value, str) else None
        if read is not None:
            r.read_as(("status", "addresses", i, "address"), value, read)


def _node_ips(body: dict[str, Any], override: str | None = None) -> tuple[str, ...]:
    """This node's IP per family (IPv4 first), as kube-proxy picks it from a Node's
    status.addresses: the first InternalIP of the family, else its first ExternalIP. Entries that
    are not addresses are skipped. An `override` (bindAddress) is the IP of its family, as
    kube-proxy's detectNodeIPs has it."""
    status = body.get("status")
    addresses = status.get("addresses") if isinstance(status, dict) else None
    found: dict[Family, str] = {}
    if override is not None:
        found[ip_family(override)] = override
    for kind in ("InternalIP", "ExternalIP"):
        for a in addresses if isinstance(addresses, list) else ():
            ip = normalize_ip(a.get("address")) if isinstance(a, dict) and a.get("type") == kind else None
            if ip is not None:
                found.setdefault(ip_family(ip), ip)
    return tuple(found[f] for f in ("ipv4", "ipv6") if f in found)


_port_id = operator.attrgetter("id")


class BuildCache:
    """A builder with memory (the run loop). Each build diffs the object list against the previous
    one by identity (sources hand back the same objects for unchanged input), parses only new
    objects and rebuilds only the Services they touch: a build costs O(changes), and unchanged
    ServicePorts keep their identity, which the render caches rely on. A build that raises leaves
    the memory as it was."""

    def __init__(self) -> None:
        self.options: BuildOptions | None = None
        self.objects: dict[int, SourceObject] = {}
        self.parsed: dict[int, tuple[Any, tuple[str, ...]]] = {}  # id -> (result, warnings)
        self.warned: dict[int, tuple[str, ...]] = {}  # objects with warnings
        self.services: dict[tuple[str, str], tuple[SourceObject, _Service]] = {}
        self.slices: dict[tuple[str, str], dict[int, tuple[SourceObject, _Slice]]] = defaultdict(dict)
        self.node_obj: SourceObject | None = None
        self.node_names: dict[int, str] = {}  # of every Node object (see _node_missing)
        self.node = NodeInfo("")
        self.results: dict[tuple[str, str], tuple[list[ServicePort], HealthCheck | None]] = {}
        self.ports: dict[str, ServicePort] = {}
        self.sorted_ports: list[ServicePort] = []  # self.ports' values, by id
        self.health: dict[tuple[str, str], HealthCheck] = {}
        self.nodeports: dict[tuple[Any, ...], str] = {}  # see _check_nodeports
        self.families: dict[Family, FamilyOptions] = {}
        self.serial: int | None = None  # of the last document built (see state.PortChanges)
        self.last_added: list[SourceObject] = []  # what the last successful build saw change
        self.last_removed: list[SourceObject] = []

    def build(self, objects: Iterable[SourceObject], opts: BuildOptions) -> DesiredState:
        """The DesiredState of exactly `objects` (diffed by identity against the last build)."""
        new = {id(o): o for o in objects}
        if opts != self.options:
            self.__init__()  # type: ignore[misc]
        added = [new[i] for i in new.keys() - self.objects.keys()]
        removed = [self.objects[i] for i in self.objects.keys() - new.keys()]
        return self._build(added, removed, opts, new)

    def update(self, added: Iterable[SourceObject], removed: Iterable[SourceObject],
               opts: BuildOptions) -> DesiredState:
        """Like build(), from what was added and removed since the last successful build (a
        source that knows its changes): no pass over the unchanged objects at all."""
        added = [o for o in added if id(o) not in self.objects]
        removed = [o for o in removed if id(o) in self.objects]
        if opts != self.options and self.options is not None:
            gone = {id(o) for o in removed}
            return self.build([o for i, o in self.objects.items() if i not in gone] + added, opts)
        return self._build(added, removed, opts, None)

    def _build(self, added: list[SourceObject], removed: list[SourceObject], opts: BuildOptions,
               objects: dict[int, SourceObject] | None) -> DesiredState:
        """Parse `added`, drop `removed`, rebuild the Services they touch, then commit (objects:
        the new id -> object map, or None to apply the delta to the current one)."""
        added.sort(key=lambda o: (o.kind, o.namespace, o.name))

        # 1. parse what is new (nothing is changed yet: errors leave the memory intact)
        warnings: list[str] = []
        errors: list[InputError] = []
        failed_warnings: list[str] = []  # (those of the objects with errors)
        parsed: dict[int, tuple[Any, tuple[str, ...]]] = {}
        node_obj = self.node_obj
        if node_obj is not None and (id(node_obj) not in objects if objects is not None else
                                     any(o is node_obj for o in removed)):
            node_obj = None
        node_names = self.node_names
        if any(o.kind == "Node" for o in itertools.chain(added, removed)):
            removed_ids = {id(o) for o in removed}
            node_names = {i: n for i, n in node_names.items() if i not in removed_ids}
            node_names.update((id(o), o.name) for o in added if o.kind == "Node")
        for obj in added:
            try:
                mine: list[str] = []
                if (parse := _PARSERS.get(obj.kind)) is not None:
                    parsed[id(obj)] = (parse(obj, mine), tuple(mine))
                elif obj.kind == "Node":
                    r = _Reader(obj, mine)
                    _warn_unknown(r, obj.body, fields.NODE)
                    if obj.name == opts.node_name:
                        _labels(r)  # (its zone label decides topology)
                        _warn_loose_node_ips(r)
                        node_obj = obj
                    parsed[id(obj)] = (None, tuple(mine))
            except InputError as exc:
                errors.append(exc)
                failed_warnings += mine
            except InputErrors as exc:
                errors += exc.errors
                failed_warnings += mine
            except (TypeError, AttributeError, ValueError, KeyError) as exc:  # a shape no check above foresaw
                log.debug("reading %s %s/%s", obj.kind, obj.namespace, obj.name, exc_info=True)
                errors.append(InputError(obj.where(()), f"{obj.kind} {obj.namespace}/{obj.name}: unexpected "
                                         f"value ({type(exc).__name__}: {exc})"))
        if errors:  # (with what was found beside them: the warnings of every object read)
            raise InputErrors(errors, in_place_order([w for _, ws in parsed.values() for w in ws] + failed_warnings))

        # 2. what the changes touch
        labels = dict(opts.node_labels)
        if node_obj is not None:
            labels.update({str(k): str(v) for k, v in (node_obj.body.get("metadata", {}).get("labels") or {}).items()})
        node = NodeInfo(opts.node_name, labels.get(ZONE_LABEL) or None,
                        _node_ips(node_obj.body if node_obj is not None else {}, opts.node_ip_override))
        services = dict(self.services)
        slices: dict[tuple[str, str], dict[int, tuple[SourceObject, _Slice]]] = {}  # copies of changed entries

        def slices_of(key: tuple[str, str]) -> dict[int, tuple[SourceObject, _Slice]]:
            if key not in slices:
                slices[key] = dict(self.slices.get(key, {}))
            return slices[key]

        touched: set[tuple[str, str]] = set()
        for obj in removed:
            result = self.parsed.get(id(obj), (None, ()))[0]
            if isinstance(result, _Service):
                if services.get((result.namespace, result.name), (None,))[0] is obj:
                    del services[(result.namespace, result.name)]
                touched.add((result.namespace, result.name))
            elif isinstance(result, _Slice):
                slices_of((result.namespace, result.service)).pop(id(obj), None)
                touched.add((result.namespace, result.service))
        for obj in added:
            result = parsed.get(id(obj), (None, ()))[0]
            if isinstance(result, _Service):
                services[(result.namespace, result.name)] = (obj, result)
                touched.add((result.namespace, result.name))
            elif isinstance(result, _Slice):
                slices_of((result.namespace, result.service))[id(obj)] = (obj, result)
                touched.add((result.namespace, result.service))
        if node != self.node:
            touched = set(services) | set(self.results)

        # 3. rebuild the touched Services, check nodePorts, then commit
        results = {}
        for key in touched:
            if key in services:
                svc = services[key][1]
                current = slices[key] if key in slices else self.slices.get(key, {})
                svc_slices = sorted(current.values(), key=lambda pair: pair[0].name)
                results[key] = _service_ports(svc, [sl for _, sl in svc_slices], node)
            else:
                results[key] = None
        try:
            nodeports = self._check_nodeports(results, services)
        except InputErrors as exc:
            exc.warnings = in_place_order(w for _, ws in parsed.values() for w in ws)
            raise

        lost_node = self.node_obj is not None and node_obj is None and opts == self.options
        self.options, self.node_obj, self.node, self.node_names = opts, node_obj, node, node_names
        if objects is not None:
            self.objects = objects
        else:
            for obj in removed:
                del self.objects[id(obj)]
            self.objects.update((id(o), o) for o in added)
        self.last_added, self.last_removed = added, removed
        for obj in removed:
            self.parsed.pop(id(obj), None)
        self.parsed.update(parsed)
        self.services, self.nodeports = services, nodeports
        for key, entries in slices.items():
            if entries:
                self.slices[key] = entries
            else:
                self.slices.pop(key, None)
        for obj in removed:
            self.warned.pop(id(obj), None)
        self.warned.update({i: p[1] for i, p in parsed.items() if p[1]})
        gone: list[int] = []
        made: list[ServicePort] = []
        for key, result in results.items():
            for sp in self.results.pop(key, ([], None))[0]:
                gone.append(id(sp))
                del self.ports[sp.id]
                del self.sorted_ports[bisect.bisect_left(self.sorted_ports, sp.id, key=_port_id)]
            self.health.pop(key, None)
            if result is not None:
                self.results[key] = result
                made += result[0]
                for sp in result[0]:
                    self.ports[sp.id] = sp
                    bisect.insort(self.sorted_ports, sp, key=_port_id)
                if result[1] is not None:
                    self.health[key] = result[1]
        cluster = _split_cidrs(opts.cluster_cidrs, merged=True)
        service_cidrs = _split_cidrs(opts.service_cidrs)
        nodeport_cidrs = opts.nodeport_cidrs
        if node_obj is None and node_names:
            warnings.append(_node_missing(opts.node_name, node_names.values()))
        elif lost_node:  # (said once, when it goes: a directory need not hold it)
            warnings.append(InputWarning(None, f'Node "{opts.node_name}" is no longer in the input: this node\'s '
                                               'zone, labels and IPs are unknown from now on (topology, '
                                               'nodePortAddresses [primary])'))
        if nodeport_cidrs == (NODEPORT_PRIMARY,):
            nodeport_cidrs = _primary_cidrs(node, warnings)
        nodeport = _split_cidrs(nodeport_cidrs) if nodeport_cidrs is not None else None
        families: dict[Family, FamilyOptions] = {
            f: FamilyOptions(cluster[f], service_cidrs[f], _nodeport_cidrs(nodeport, f)) for f in ("ipv4", "ipv6")
        }
        for w in self.warned.values():
            warnings.extend(w)
        health = sorted(self.health.values(), key=lambda h: h.service)
        serial, since = next(_SERIALS), self.serial
        self.serial = serial
        return DesiredState(node, opts.masquerade_all, families, tuple(self.sorted_ports),
                            tuple(health), tuple(in_place_order(warnings)), serial=serial,
                            changes=PortDelta(since, tuple(gone), tuple(made)))

    def _check_nodeports(self, results: dict[tuple[str, str], Any], services: dict[tuple[str, str], Any]
                         ) -> dict[tuple[Any, ...], str]:
        """Two services on one nodePort, or on one ClusterIP and port, would make the kernel
        state ambiguous (the API server never allows either): refuse, naming both. A claim built
        before stays its Service's while that still makes it, whatever the port is called now (a
        Service rebuilt for its endpoints or the Node, or with a port renamed, is never the one
        refused); between new claims the first by name wins. Kept as owners: (protocol, nodePort)
        and (clusterIP, protocol, port) -> service port id."""
        owners = dict(self.nodeports)
        for key, result in results.items():
            now: dict[tuple[Any, ...], str] = {}
            for sp in result[0] if result else []:
                for k in _claims(sp):
                    now.setdefault(k, sp.id)
            for sp in self.results.get(key, ([], None))[0]:
                for k in _claims(sp):
                    if owners.get(k) == sp.id:
                        if k in now:
                            owners[k] = now[k]
                        else:
                            del owners[k]
        errors = []
        for key, result in sorted(results.items()):
            for i, sp in enumerate(result[0] if result else []):
                for k in _claims(sp):
                    if k in owners and owners[k] != sp.id:
                        what = (f"nodePort {k[1]}/{k[0]}" if len(k) == 2 else
                                f"{f'[{k[0]}]' if ':' in k[0] else k[0]}:{k[2]}/{k[1]}")
                        field = "nodePort" if len(k) == 2 else "port"
                        there = self._port_location(owners[k], field, results, services)
                        errors.append(InputConflict(services[key][0].where(("spec", "ports", i, field)),
                                                    f"{what} already used by {owners[k]}"
                                                    + (f" ({there})" if there else ""), ("spec", "ports", i, field)))
                    owners.setdefault(k, sp.id)
        if errors:
            raise InputErrors(errors)
        return owners


    def _port_location(self, sid: str, field: str, results: dict[tuple[str, str], Any],
                       services: dict[tuple[str, str], Any]) -> Location | str | None:
        """Where a service port (by id, 'ns/name:port/PROTO') has this field of it, for naming the
        other side of a conflict."""
        namespace, _, name = sid.split(":", 1)[0].partition("/")
        key = (namespace, name)
        if key not in services:
            return None
        result = results[key] if key in results else self.results.get(key)
        for i, sp in enumerate(result[0] if result else []):
            if sp.id == sid:
                return services[key][0].where(("spec", "ports", i, field))
        return services[key][0].where()


def _node_missing(name: str, names: Iterable[str], shown: int = 3) -> InputWarning:
    """The warning of an input with Node objects but none of this node's name: the node name is
    most likely wrong (the hostname, when no --node-name was given), and with it every decision
    that depends on this node (its zone, its IPs, which endpoints are local)."""
    listing = name_some(sorted(set(names)), shown)
    return InputWarning(None, f'no Node "{name}" in the input (it has: {listing}): this node\'s zone and IPs are '
                              f'unknown, and only endpoints with nodeName "{name}" are local; is --node-name (or '
                              'hostnameOverride) right?')


def _claims(sp: ServicePort) -> list[tuple[Any, ...]]:
    """What a service port holds alone: its nodePort, and each ClusterIP with its port."""
    out: list[tuple[Any, ...]] = [(blk.clusterIP, sp.protocol, sp.port) for blk in sp.families]
    if sp.nodePort is not None:
        out.append((sp.protocol, sp.nodePort))
    return out


def build_desired_state(objects: Iterable[SourceObject], opts: BuildOptions,
                        cache: BuildCache | None = None) -> DesiredState:
    """Validate and join Services, EndpointSlices and this node's Node into a DesiredState.

    Raises InputErrors listing every invalid object (file:line:column: field: problem). With a
    cache (the run loop), only what changed since the cache's last build is parsed and rebuilt.
    """
    return (cache or BuildCache()).build(objects, opts)


def object_errors(objects: Iterable[SourceObject]) -> list[InputError]:
    """The errors each Service and EndpointSlice has on its own (what the build's first step
    finds; not the conflicts between objects): for reporting them beside errors that stop a build
    from being tried (a directory's files that do not parse)."""
    errors: list[InputError] = []
    for obj in objects:
        if (parse := _PARSERS.get(obj.kind)) is None:
            continue
        try:
            _attempt(errors, parse, obj, [])
        except (TypeError, AttributeError, ValueError, KeyError):  # (the build reports those shapes)
            pass
    return errors


def _service_ports(svc: _Service, svc_slices: list[_Slice], node: NodeInfo
                   ) -> tuple[list[ServicePort], HealthCheck | None]:
    """The ServicePorts of one Service (and its health check), from its EndpointSlices."""
    ports: list[ServicePort] = []
    local_ips: dict[str, set[str]] = {}  # per family, over all its ports, as kube-proxy counts them
    for port in svc.ports:
        blocks = []
        for family in ("ipv4", "ipv6"):
            if family not in svc.cluster_ips:
                continue
            eps = _endpoints_for(svc_slices, port, family)  # type: ignore[arg-type]
            block, ready_local = _family_block(svc, port, family, eps, node)  # type: ignore[arg-type]
            blocks.append(block)
            local_ips.setdefault(family, set()).update(ready_local)
        ports.append(ServicePort(
            namespace=svc.namespace, name=svc.name, portName=port.name, protocol=port.protocol,  # type: ignore[arg-type]
            port=port.port, nodePort=port.node_port, families=tuple(blocks),
            affinityTimeoutSeconds=svc.affinity_timeout, healthCheckNodePort=svc.health_check_node_port,
        ))
    check = None
    if svc.health_check_node_port is not None:
        counts = tuple((family, len(ips)) for family, ips in local_ips.items())
        check = HealthCheck(f"{svc.namespace}/{svc.name}", svc.health_check_node_port,
                            max((n for _, n in counts), default=0), counts)  # type: ignore[arg-type]
    return ports, check

"""Options from flags and from kube-proxy's own KubeProxyConfiguration file (flags win)."""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
from dataclasses import dataclass, field, replace
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError

from .desired import BuildOptions
from .sources.objects import InputError, Location

log = logging.getLogger(__name__)

MODES = ("nftables", "iptables")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Go duration syntax as kube-proxy writes it ('30s', '200ms', '1m30s') -> seconds."""
    s = text.strip()
    if s == "0":
        return 0.0
    pos, total = 0, 0.0
    for m in _DURATION.finditer(s):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos != len(s) or not s:
        raise ValueError(f"invalid duration {text!r} (examples: 30s, 200ms, 1m)")
    return total


def conntrack_seconds(text: str, where: str) -> float:
    """A conntrack timeout in seconds; kube-proxy writes it truncated to whole seconds (warned)."""
    seconds = parse_duration(text)
    if seconds != int(seconds):
        log.warning("%s: %s is not a whole number of seconds: %d is written (kube-proxy truncates)",
                    where, text, int(seconds))
    return seconds


def parse_cidrs(text: str | list[str], what: str) -> tuple[str, ...]:
    items = text if isinstance(text, list) else [p for p in text.split(",")]
    out = []
    for item in items:
        item = item.strip()
        if not item:
            continue
        try:
            out.append(str(ipaddress.ip_network(item, strict=False)))
        except ValueError:
            raise ValueError(f"{what}: invalid CIDR {item!r}") from None
    return tuple(out)


@dataclass
class Options:
    mode: str = "nftables"
    node_name: str = field(default_factory=lambda: socket.gethostname().lower())
    cluster_cidrs: tuple[str, ...] = ()
    service_cidrs: tuple[str, ...] = ()
    nodeport_cidrs: tuple[str, ...] | None = None
    masquerade_all: bool = False
    sync_period: float = 30.0
    min_sync_period: float = 1.0
    healthz_bind_address: str = "0.0.0.0:10256"
    metrics_bind_address: str = "127.0.0.1:10249"
    bind_address_hard_fail: bool = False  # exit if healthz/metrics cannot listen (else: retried)
    # the conntrack sysctls `run` sets at start (kube-proxy's `conntrack:`; 0 leaves a value alone)
    conntrack_max_per_core: int = 32768
    conntrack_min: int = 131072
    conntrack_tcp_timeout_established: float = 86400.0
    conntrack_tcp_timeout_close_wait: float = 3600.0
    conntrack_tcp_be_liberal: bool = False
    conntrack_udp_timeout: float = 0.0
    conntrack_udp_timeout_stream: float = 0.0
    conntrack_sysctl_dir: str | None = None  # where net.netfilter is (None: /proc/sys/net/netfilter)

    def build_options(self) -> BuildOptions:
        return BuildOptions(self.node_name, self.cluster_cidrs, self.service_cidrs, self.nodeport_cidrs,
                            self.masquerade_all)


def load_kube_proxy_config(path: str) -> dict[str, Any]:
    """The fields of a KubeProxyConfiguration that apply here, as Options keyword arguments."""
    try:
        with open(path, encoding="utf-8") as fh:
            doc = YAML(typ="rt").load(fh)
    except OSError as exc:
        raise InputError(Location(path), f"cannot read: {exc}") from exc
    except MarkedYAMLError as exc:
        mark = exc.problem_mark
        raise InputError(Location(path, mark.line + 1, mark.column + 1) if mark else Location(path),
                         f"invalid YAML: {exc.problem}") from exc

    def where(*keys: str) -> Location:
        node, line, col = doc, 0, 0
        for k in keys:
            if hasattr(node, "lc") and isinstance(node, dict) and k in node:
                line, col = node.lc.key(k)
                node = node[k]
        return Location(path, line + 1, col + 1)

    if not isinstance(doc, dict):
        raise InputError(Location(path, 1, 1), "expected a KubeProxyConfiguration mapping")
    if doc.get("kind") != "KubeProxyConfiguration" or not str(doc.get("apiVersion", "")).startswith(
            "kubeproxy.config.k8s.io/"):
        raise InputError(where("kind"), "expected apiVersion kubeproxy.config.k8s.io/v1alpha1, "
                                        "kind KubeProxyConfiguration", ("kind",))
    out: dict[str, Any] = {}
    mode = doc.get("mode") or ""
    if mode:
        if mode not in MODES:
            raise InputError(where("mode"), f"mode {mode!r} is not supported (use {' or '.join(MODES)})", ("mode",))
        out["mode"] = mode
    try:
        if doc.get("clusterCIDR"):
            out["cluster_cidrs"] = parse_cidrs(str(doc["clusterCIDR"]), "clusterCIDR")
    except ValueError as exc:
        raise InputError(where("clusterCIDR"), str(exc), ("clusterCIDR",)) from None
    try:
        npa = doc.get("nodePortAddresses")
        if npa:
            cidrs = [c for c in npa if c != "primary"]
            if len(cidrs) < len(npa):
                log.warning("%s: nodePortAddresses 'primary' is read as every local address", where("nodePortAddresses"))
            out["nodeport_cidrs"] = parse_cidrs(cidrs, "nodePortAddresses") if cidrs else None
    except ValueError as exc:
        raise InputError(where("nodePortAddresses"), str(exc), ("nodePortAddresses",)) from None
    if doc.get("hostnameOverride"):
        out["node_name"] = str(doc["hostnameOverride"]).strip().lower()
    mode_section = doc.get(out.get("mode", "nftables")) or {}
    for key, attr in (("masqueradeAll", "masquerade_all"),):
        value = doc.get(key, mode_section.get(key) if isinstance(mode_section, dict) else None)
        if value is not None:
            out[attr] = bool(value)
    if doc.get("bindAddressHardFail") is not None:
        out["bind_address_hard_fail"] = bool(doc["bindAddressHardFail"])
    for key, attr in (("syncPeriod", "sync_period"), ("minSyncPeriod", "min_sync_period")):
        value = doc.get(key) or (mode_section.get(key) if isinstance(mode_section, dict) else None)
        if value:
            try:
                out[attr] = parse_duration(str(value))
            except ValueError as exc:
                raise InputError(where(key), str(exc), (key,)) from None
    for key, attr in (("healthzBindAddress", "healthz_bind_address"), ("metricsBindAddress", "metrics_bind_address")):
        if doc.get(key):
            out[attr] = str(doc[key])
    out.update(_conntrack(doc, where))
    _warn_unsupported(doc, where)
    return out


# KubeProxyConfiguration `conntrack:` keys -> Options attributes
CONNTRACK_KEYS = {
    "maxPerCore": "conntrack_max_per_core",
    "min": "conntrack_min",
    "tcpEstablishedTimeout": "conntrack_tcp_timeout_established",
    "tcpCloseWaitTimeout": "conntrack_tcp_timeout_close_wait",
    "tcpBeLiberal": "conntrack_tcp_be_liberal",
    "udpTimeout": "conntrack_udp_timeout",
    "udpStreamTimeout": "conntrack_udp_timeout_stream",
}
INT32_MAX = 2**31 - 1


def _conntrack(doc: dict[str, Any], where: Any) -> dict[str, Any]:
    """The `conntrack:` section: null is kube-proxy's default; what kube-proxy rejects is an error,
    an unknown key (kube-proxy's lenient decoding drops it) a warning."""
    section = doc.get("conntrack")
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise InputError(where("conntrack"), "expected a mapping", ("conntrack",))
    out: dict[str, Any] = {}
    for key, value in section.items():
        loc, path = where("conntrack", key), ("conntrack", key)
        if key not in CONNTRACK_KEYS:
            log.warning("%s: conntrack.%s is not a KubeProxyConfiguration field; ignored", loc, key)
            continue
        if value is None:
            continue
        if key == "tcpBeLiberal":
            if not isinstance(value, bool):
                raise InputError(loc, f"expected true or false, got {value!r}", path)
        elif key in ("maxPerCore", "min"):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT32_MAX:
                raise InputError(loc, f"expected an integer from 0 to {INT32_MAX}, got {value!r}", path)
        else:
            try:
                value = conntrack_seconds(str(value), f"{loc}: conntrack.{key}")
            except ValueError as exc:
                raise InputError(loc, str(exc), path) from None
        out[CONNTRACK_KEYS[key]] = value
    return out


def _warn_unsupported(doc: dict[str, Any], where: Any) -> None:
    """Warn about settings that would change what kube-proxy programs and that are not honoured
    here (silently ignoring them would program something else than the file asks for)."""
    detect = doc.get("detectLocalMode")
    if detect and detect != "ClusterCIDR":
        log.warning("%s: detectLocalMode %s is not supported: pod traffic is told by clusterCIDR "
                    "(--cluster-cidr) only; without it nothing is treated as local pod traffic",
                    where("detectLocalMode"), detect)
    for mode in MODES:  # (both: --mode may pick the other one)
        section = doc.get(mode)
        bit = section.get("masqueradeBit") if isinstance(section, dict) else None
        if bit is not None and bit != 14:
            log.warning("%s: masqueradeBit %s is not supported: the masquerade mark is bit 14 (0x4000)",
                        where(mode, "masqueradeBit"), bit)


def merge(base: Options, overrides: dict[str, Any]) -> Options:
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})

"""Options from flags and from kube-proxy's own KubeProxyConfiguration file (flags win)."""

from __future__ import annotations

import logging
import re
import socket
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError

from .desired import NODEPORT_PRIMARY, BuildOptions, _read_cidr, _read_ip, ip_family
from .fields import did_you_mean
from .sources.objects import InputError, InputWarning, Location, type_name, undecodable_at

log = logging.getLogger(__name__)

MODES = ("nftables", "iptables")
API_VERSION, KIND = "kubeproxy.config.k8s.io/v1alpha1", "KubeProxyConfiguration"
SYNC_PERIOD, MIN_SYNC_PERIOD = 30.0, 1.0  # kube-proxy's defaults
HEALTHZ_PORT, METRICS_PORT = 10256, 10249
PRIMARY_WITH_CIDRS = "can't use both 'primary' and CIDRs"
_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ns|us|µs|ms|s|m|h)")  # (ASCII digits, as Go's)
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


@dataclass(frozen=True)
class ConfigPlace:
    """Where a --config file's value is: a warning about its spelling is an InputWarning there
    (its file, line, column and field in `validate -o json`), as the file's other warnings are."""

    location: Location
    keys: tuple[str | int, ...]


What = str | ConfigPlace  # what a value is: a flag's name, or its place in the --config file


def _warn(what: What, message: str) -> None:
    if isinstance(what, ConfigPlace):
        log.warning("%s", InputWarning(what.location, message, what.keys))
    else:
        log.warning("%s: %s", what, message)


def conntrack_seconds(text: str, where: What) -> float:
    """A conntrack timeout in seconds; kube-proxy writes it truncated to whole seconds (warned)."""
    seconds = parse_duration(text)
    if seconds != int(seconds):
        _warn(where, f"{text} is not a whole number of seconds: {int(seconds)} is written (kube-proxy truncates)")
    return seconds


def read_cidr(text: Any, what: What) -> str:
    """A CIDR as kube-proxy reads it (netutils.ParseCIDRSloppy, as the manifest reader does); a
    loose spelling is warned about under `what`. ValueError if it is none."""
    read = _read_cidr(text.strip()) if isinstance(text, str) else None
    if read is None:
        raise ValueError(f"invalid CIDR {text!r}")
    if read[1]:
        _warn(what, f"{text!r} is read as {read[0]} ({read[1]})")
    return read[0]


def parse_cidrs(text: str, what: What) -> tuple[str, ...]:
    """Comma-separated CIDRs (blank entries skipped)."""
    return tuple(read_cidr(p, what) for p in text.split(",") if p.strip())


def parse_service_cidrs(text: str, what: What) -> tuple[str, ...]:
    """parse_cidrs, but no CIDR of every address (/0): new traffic to any address of it that is
    no ClusterIP is dropped, which would cut the node off."""
    cidrs = parse_cidrs(text, what)
    for c in cidrs:
        if c.endswith("/0"):
            raise ValueError(f"{c} is every address: traffic to any address that is not a ClusterIP would be "
                             "dropped (name the cluster's service CIDR, e.g. 10.96.0.0/12)")
    return cidrs


def parse_nodeport_addresses(text: str, what: What) -> tuple[str, ...]:
    """CIDRs, or 'primary' alone: this node's IPs (resolved when the document is built)."""
    items = [p.strip() for p in text.split(",") if p.strip()]
    if NODEPORT_PRIMARY in items:
        if len(items) > 1:
            raise ValueError(PRIMARY_WITH_CIDRS)
        return (NODEPORT_PRIMARY,)
    return tuple(read_cidr(p, what) for p in items)


def bind_address(value: Any, default_port: int, what: What | None = None) -> str:
    """healthzBindAddress / metricsBindAddress as kube-proxy reads them: a bare IP gets the default
    port (AppendPortIfNeeded), then IP:port with a port 1-65535 (validateHostPort); an IP in a
    loose spelling is warned about under `what`."""
    text = value.strip() if isinstance(value, str) else ""
    read, port = _read_ip(text), str(default_port)
    if read is None:  # IP:port or [IPv6]:port, as net.SplitHostPort
        host_text, _, port = text.rpartition(":")
        if host_text.startswith("[") and host_text.endswith("]"):
            host_text = host_text[1:-1]
        elif ":" in host_text:
            host_text = ""  # (an IPv6 address needs brackets)
        read = _read_ip(host_text)
        if read is None:
            raise ValueError(f"expected IP:port or an IP (port {default_port}), got {value!r}")
        if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(f"port must be 1-65535, got {value!r}")
    host = read[0]
    address = f"[{host}]:{int(port)}" if ":" in host else f"{host}:{int(port)}"
    if read[1] and what is not None:
        _warn(what, f"{value!r} is read as {address} ({read[1]})")
    return address


@dataclass
class Options:
    mode: str = "nftables"
    node_name: str = field(default_factory=lambda: socket.gethostname().lower())
    cluster_cidrs: tuple[str, ...] = ()
    service_cidrs: tuple[str, ...] = ()
    nodeport_cidrs: tuple[str, ...] | None = None  # None: every local address; (NODEPORT_PRIMARY,): node IPs
    masquerade_all: bool = False
    sync_period: float = SYNC_PERIOD
    min_sync_period: float = MIN_SYNC_PERIOD
    healthz_bind_address: str = f"0.0.0.0:{HEALTHZ_PORT}"
    metrics_bind_address: str = f"127.0.0.1:{METRICS_PORT}"
    bind_address_hard_fail: bool = False  # exit if healthz/metrics cannot listen (else: retried)
    node_ip_override: str | None = None  # bindAddress, when not 0.0.0.0 or ::: this node's IP of its family
    bind_address: str = "0.0.0.0"  # bindAddress as given (for /configz)
    kubeconfig: str | None = None  # for the API source (None: in-cluster)
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
                            self.masquerade_all, node_ip_override=self.node_ip_override)


def go_duration(seconds: float) -> str:
    """Seconds as Go's time.Duration prints them (what kube-proxy's /configz shows): 30s, 1m0s,
    24h0m0s, 200ms, 0s."""
    ns = round(seconds * 1e9)
    if ns == 0:
        return "0s"
    sign, ns = ("-" if ns < 0 else ""), abs(ns)

    def fraction(value: int, unit: int) -> str:
        whole, rest = divmod(value, unit)
        return f"{whole}.{str(rest).rjust(len(str(unit)) - 1, '0').rstrip('0')}" if rest else str(whole)

    if ns < 1_000_000_000:
        for unit, name in ((1_000_000, "ms"), (1_000, "µs"), (1, "ns")):
            if ns >= unit:
                return f"{sign}{fraction(ns, unit)}{name}"
    hours, ns = divmod(ns, 3600 * 10**9)
    minutes, ns = divmod(ns, 60 * 10**9)
    text = f"{fraction(ns, 10**9)}s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    if hours:
        text = f"{hours}h{text}"
    return sign + text


def configz(opts: Options) -> dict[str, Any]:
    """/configz, as kube-proxy serves it: the configuration in effect (file, then flags), under its
    group name, in the field names of kube-proxy's internal KubeProxyConfiguration; only the
    fields this tool honours."""
    return {"kubeproxy.config.k8s.io": {
        "Linux": {
            "Conntrack": {
                "MaxPerCore": opts.conntrack_max_per_core, "Min": opts.conntrack_min,
                "TCPEstablishedTimeout": go_duration(opts.conntrack_tcp_timeout_established),
                "TCPCloseWaitTimeout": go_duration(opts.conntrack_tcp_timeout_close_wait),
                "TCPBeLiberal": opts.conntrack_tcp_be_liberal,
                "UDPTimeout": go_duration(opts.conntrack_udp_timeout),
                "UDPStreamTimeout": go_duration(opts.conntrack_udp_timeout_stream),
            },
            "MasqueradeAll": opts.masquerade_all,
        },
        "ClientConnection": {"Kubeconfig": opts.kubeconfig or ""},
        "HostnameOverride": opts.node_name,
        "BindAddress": opts.bind_address,
        "HealthzBindAddress": opts.healthz_bind_address,
        "MetricsBindAddress": opts.metrics_bind_address,
        "BindAddressHardFail": opts.bind_address_hard_fail,
        "Mode": opts.mode,
        "DetectLocalMode": "ClusterCIDR",
        "DetectLocal": {"ClusterCIDRs": list(opts.cluster_cidrs)},
        "NodePortAddresses": list(opts.nodeport_cidrs) if opts.nodeport_cidrs is not None else None,
        "SyncPeriod": go_duration(opts.sync_period),
        "MinSyncPeriod": go_duration(opts.min_sync_period),
    }}


def load_kube_proxy_config(path: str, mode: str | None = None) -> dict[str, Any]:
    """The fields of a KubeProxyConfiguration that apply here, as Options keyword arguments,
    defaulted and validated as kube-proxy does (errors name file:line). `mode` (--mode) wins over
    the file's in choosing the section read, `nftables:` or `iptables:`."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        text = raw.decode("utf-8")
        yaml = YAML(typ="rt")
        yaml.preserve_quotes = True  # (a quoted 'yes' stays a string: see _bool)
        doc = yaml.load(text)
    except OSError as exc:
        raise InputError(Location(path), f"cannot read: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise InputError(undecodable_at(path, raw, exc), f"not UTF-8 text (byte 0x{raw[exc.start]:02x})") from exc
    except MarkedYAMLError as exc:
        mark = exc.problem_mark
        raise InputError(Location(path, mark.line + 1, mark.column + 1) if mark else Location(path),
                         f"invalid YAML: {exc.problem}") from exc

    def where(*keys: str | int) -> Location:
        node, line, col = doc, 0, 0
        for k in keys:
            if isinstance(node, dict) and k in node:
                line, col = node.lc.key(k)
            elif isinstance(node, list) and isinstance(k, int) and k < len(node):
                line, col = node.lc.item(k)
            else:
                break
            node = node[k]
        return Location(path, line + 1, col + 1)

    if not isinstance(doc, dict):
        raise InputError(Location(path, 1, 1), f"expected a {KIND} mapping")
    for key, want in (("apiVersion", API_VERSION), ("kind", KIND)):
        if doc.get(key) != want:
            raise InputError(where(key), f"is required ({want})" if doc.get(key) is None
                             else f"expected {want}, got {doc.get(key)!r}", (key,))
    out: dict[str, Any] = {}
    file_mode = doc.get("mode")
    if file_mode not in (None, "", *MODES):
        raise InputError(where("mode"), f"mode {file_mode!r} is not supported (use {' or '.join(MODES)})", ("mode",))
    if file_mode:
        out["mode"] = file_mode
    elif not mode:
        log.warning("%s", InputWarning(where("mode"), "not set: kube-proxy runs iptables then, "
                                       "service-reconciler nftables (and reads nftables:); set mode: iptables to "
                                       "keep iptables", ("mode",)))
    section = mode or file_mode or "nftables"
    cluster_cidr = _string(doc, where, "clusterCIDR")  # (a number, a list: refused, as kube-proxy's decoder does)
    if cluster_cidr:
        out["cluster_cidrs"] = _checked(where, ("clusterCIDR",), parse_cidrs, cluster_cidr)
    nodeport_cidrs = _nodeport_addresses(doc, where)
    if nodeport_cidrs is not None:
        out["nodeport_cidrs"] = nodeport_cidrs
    name = _string(doc, where, "hostnameOverride")
    if name:  # kube-proxy's node name, as --node-name (GetHostname: trimmed, lower-cased, never blank)
        if not name.strip():
            raise InputError(where("hostnameOverride"), "blank: give this node's name, as its Node object has it "
                             "(kube-proxy refuses an empty hostname too)", ("hostnameOverride",))
        out["node_name"] = name.strip().lower()
    kubeconfig = _string(doc, where, "clientConnection", "kubeconfig")
    if kubeconfig:
        out["kubeconfig"] = kubeconfig
    hard_fail = _bool(doc, where, "bindAddressHardFail")
    if hard_fail is not None:
        out["bind_address_hard_fail"] = hard_fail
    out.update(_mode_section(doc, where, section))
    out.update(_bind_addresses(doc, where))
    out.update(_conntrack(doc, where))
    _check_unread(doc, where, section)
    _warn_unsupported(doc, where, section)
    _warn_unknown_keys(doc, where)
    return out


Where = Callable[..., Location]


def _checked(where: Where, keys: tuple[str | int, ...], parse: Callable[[Any, What], Any], value: Any) -> Any:
    """parse(value, its place), its ValueError an InputError at `keys`."""
    loc = where(*keys)
    try:
        return parse(value, ConfigPlace(loc, keys))
    except ValueError as exc:
        raise InputError(loc, str(exc), keys) from None


_YAML11_BOOLS = {**dict.fromkeys("y Y yes Yes YES on On ON".split(), True),
                 **dict.fromkeys("n N no No NO off Off OFF".split(), False)}


def _bool(doc: dict[str, Any], where: Where, *keys: str) -> bool | None:
    """A true/false at `keys` (None if unset), unquoted yes/no/on/off/y/n too: kube-proxy's YAML
    reader is YAML 1.1's; anything else (the string 'false') is an error."""
    value: Any = doc
    for k in keys:
        value = value.get(k) if isinstance(value, dict) else None
    if type(value) is str and value in _YAML11_BOOLS:  # (a plain scalar; a quoted one is a str subclass)
        return _YAML11_BOOLS[value]
    if value is not None and not isinstance(value, bool):
        raise InputError(where(*keys), f"expected true or false, got {value!r}", keys)
    return value


def _string(doc: dict[str, Any], where: Where, *keys: str) -> str | None:
    """A string at `keys` (None if unset); anything else is an error, as kube-proxy's decoder
    refuses it (a number for hostnameOverride was ignored: another node's name in effect)."""
    value: Any = doc
    for depth, k in enumerate(keys):
        if value is not None and not isinstance(value, dict):  # (clientConnection: /etc/kc)
            raise InputError(where(*keys[:depth]), f"expected a mapping, got {type_name(type(value))}", keys[:depth])
        value = value.get(k) if isinstance(value, dict) else None
    if value is not None and not isinstance(value, str):
        raise InputError(where(*keys), f"expected string, got {type_name(type(value))}", keys)
    return value


def _nodeport_addresses(doc: dict[str, Any], where: Where) -> tuple[str, ...] | None:
    """nodePortAddresses: CIDRs, or [primary] (this node's IPs); null or []: every local address."""
    items = doc.get("nodePortAddresses")
    if items is None or items == []:
        return None
    if not isinstance(items, list):  # ("", 0, a mapping: refused, as kube-proxy's decoder does)
        raise InputError(where("nodePortAddresses"), "expected a list of CIDRs, or [primary]", ("nodePortAddresses",))
    if items == [NODEPORT_PRIMARY]:
        return (NODEPORT_PRIMARY,)
    if NODEPORT_PRIMARY in items:
        keys = ("nodePortAddresses", items.index(NODEPORT_PRIMARY))
        raise InputError(where(*keys), PRIMARY_WITH_CIDRS, keys)
    return tuple(_checked(where, ("nodePortAddresses", i), read_cidr, c) for i, c in enumerate(items))


def _mode_section(doc: dict[str, Any], where: Where, section: str) -> dict[str, Any]:
    """masqueradeAll, syncPeriod and minSyncPeriod of the mode run (kube-proxy's conversion.go:
    nftables: in nftables mode, else iptables:). A zero period is unset, as kube-proxy defaults it;
    the periods are validated as kube-proxy does."""
    body = doc.get(section)
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise InputError(where(section), "expected a mapping", (section,))
    out: dict[str, Any] = {}
    masquerade_all = _bool(doc, where, section, "masqueradeAll")
    if masquerade_all is not None:
        out["masquerade_all"] = masquerade_all
    for key, attr, rule in (("syncPeriod", "sync_period", "must be greater than 0"),
                            ("minSyncPeriod", "min_sync_period", "must not be negative")):
        if body.get(key) is None:
            continue
        keys, text = (section, key), str(body[key]).strip()
        try:
            seconds = parse_duration(text.removeprefix("-"))
        except ValueError:
            raise InputError(where(*keys), f"invalid duration {text!r} (examples: 30s, 200ms, 1m)", keys) from None
        if seconds and text.startswith("-"):
            raise InputError(where(*keys), f"{rule}, got {text}", keys)
        if seconds:  # (0: unset)
            out[attr] = seconds
    sync, least = out.get("sync_period", SYNC_PERIOD), out.get("min_sync_period", MIN_SYNC_PERIOD)
    if least > sync:
        keys = (section, "minSyncPeriod" if "min_sync_period" in out else "syncPeriod")
        raise InputError(where(*keys), f"minSyncPeriod ({least:g}s) must not exceed syncPeriod ({sync:g}s)", keys)
    return out


def _bind_addresses(doc: dict[str, Any], where: Where) -> dict[str, Any]:
    """healthzBindAddress and metricsBindAddress as kube-proxy defaults them; bindAddress picks the
    family of their defaults (an IPv6 one: [::]:10256, [::1]:10249) and, when it is no unspecified
    address, is this node's IP of its family, as kube-proxy takes it (over the Node's)."""
    bind = doc.get("bindAddress")
    read = ("0.0.0.0", "") if bind in (None, "") else _read_ip(bind) if isinstance(bind, str) else None
    if read is None:
        raise InputError(where("bindAddress"), f"invalid IP address {bind!r}", ("bindAddress",))
    ip = read[0]
    if read[1]:  # (a loose spelling, read as kube-proxy reads it)
        _warn(ConfigPlace(where("bindAddress"), ("bindAddress",)), f"{bind!r} is read as {ip} ({read[1]})")
    out: dict[str, Any] = {"bind_address": ip}
    if ip not in ("0.0.0.0", "::"):
        out["node_ip_override"] = ip
    defaults = ("[::]", "[::1]") if ":" in ip else ("0.0.0.0", "127.0.0.1")
    for key, attr, host, port in (("healthzBindAddress", "healthz_bind_address", defaults[0], HEALTHZ_PORT),
                                  ("metricsBindAddress", "metrics_bind_address", defaults[1], METRICS_PORT)):
        value = doc.get(key)
        if value not in (None, ""):
            try:
                out[attr] = bind_address(value, port, ConfigPlace(where(key), (key,)))
            except ValueError as exc:
                raise InputError(where(key), str(exc), (key,)) from None
        elif ":" in ip:
            out[attr] = f"{host}:{port}"
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
            log.warning("%s", InputWarning(loc, f"not a field of KubeProxyConfiguration"
                                                f"{did_you_mean(str(key), frozenset(CONNTRACK_KEYS))}; ignored, as "
                                                "kube-proxy's lenient decoding ignores it", path))
            continue
        if value is None:
            continue
        if key == "tcpBeLiberal":
            value = _bool(doc, where, *path)
        elif key in ("maxPerCore", "min"):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT32_MAX:
                raise InputError(loc, f"expected an integer from 0 to {INT32_MAX}, got {value!r}", path)
        else:
            try:
                value = conntrack_seconds(str(value), ConfigPlace(loc, path))
            except ValueError as exc:
                raise InputError(loc, str(exc), path) from None
        out[CONNTRACK_KEYS[key]] = value
    return out


# fields of the mode sections that are no fields at the top level (_warn_unsupported says so)
MODE_SECTION_ONLY = ("masqueradeAll", "syncPeriod", "minSyncPeriod")

IGNORED = {
    "oomScoreAdj": "the process's OOM score is left as it is",
    "configSyncPeriod": "the API caches are not resynced periodically",
    "featureGates": "there are no feature gates",
    "logging": "use -v and --log-format",
}


# KubeProxyConfiguration v1alpha1's fields (k8s.io/kube-proxy/config/v1alpha1, v1.36), for the
# unknown-key warnings (kube-proxy's strict decoding names them, then it decodes leniently)
TOP_FIELDS = frozenset((
    "apiVersion", "kind", "featureGates", "clientConnection", "hostnameOverride", "bindAddress",
    "healthzBindAddress", "metricsBindAddress", "bindAddressHardFail", "enableProfiling",
    "showHiddenMetricsForVersion", "mode", "iptables", "ipvs", "nftables", "winkernel", "detectLocalMode",
    "detectLocal", "clusterCIDR", "nodePortAddresses", "oomScoreAdj", "conntrack", "configSyncPeriod",
    "portRange", "windowsRunAsService", "logging"))
SECTION_FIELDS = {
    "clientConnection": frozenset(("kubeconfig", "acceptContentTypes", "contentType", "qps", "burst")),
    "iptables": frozenset(("masqueradeBit", "masqueradeAll", "localhostNodePorts", "syncPeriod", "minSyncPeriod")),
    "ipvs": frozenset(("syncPeriod", "minSyncPeriod", "scheduler", "excludeCIDRs", "strictARP", "tcpTimeout",
                       "tcpFinTimeout", "udpTimeout")),
    "nftables": frozenset(("masqueradeBit", "masqueradeAll", "syncPeriod", "minSyncPeriod")),
    "winkernel": frozenset(("networkName", "sourceVip", "enableDSR", "rootHnsEndpointName", "forwardHealthCheckVip")),
    "detectLocal": frozenset(("bridgeInterface", "interfaceNamePrefix")),
}


def _warn_unknown_keys(doc: dict[str, Any], where: Where) -> None:
    """A warning at file:line for each key that is no field of its place (a misspelt one would
    silently leave its setting at the default), with the field it probably means."""
    def check(mapping: dict[str, Any], known: frozenset[str], *at: str) -> None:
        for key in mapping:
            if key in known or (not at and key in MODE_SECTION_ONLY):  # (see _warn_unsupported)
                continue
            hint = did_you_mean(str(key), known)
            log.warning("%s", InputWarning(where(*at, key), f"not a field of KubeProxyConfiguration{hint}; ignored, "
                                           "as kube-proxy's lenient decoding ignores it", (*at, key)))
    check(doc, TOP_FIELDS)
    for name, known in SECTION_FIELDS.items():
        if isinstance(doc.get(name), dict):
            check(doc[name], known, name)


# What kube-proxy's decoder takes in the fields not read here (and in the mode section not run):
# a value of another type stops kube-proxy before it starts, so it is refused here too.
_UNREAD_TYPES: dict[tuple[str, ...], str] = {
    ("enableProfiling",): "boolean", ("windowsRunAsService",): "boolean", ("showHiddenMetricsForVersion",): "string",
    ("portRange",): "string", ("detectLocalMode",): "string", ("configSyncPeriod",): "duration",
    ("oomScoreAdj",): "integer", ("featureGates",): "mapping", ("logging",): "mapping", ("ipvs",): "mapping",
    ("winkernel",): "mapping", ("detectLocal",): "mapping", ("clientConnection", "qps"): "number",
    ("clientConnection", "burst"): "integer", ("clientConnection", "contentType"): "string",
    ("clientConnection", "acceptContentTypes"): "string", ("iptables", "localhostNodePorts"): "boolean",
    **{(mode, key): kind for mode in MODES for key, kind in (
        ("masqueradeAll", "boolean"), ("masqueradeBit", "integer"), ("syncPeriod", "duration"),
        ("minSyncPeriod", "duration"))},
}


_PYTHON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str, "mapping": dict, "integer": int, "number": (int, float), "duration": str}


def _check_unread(doc: dict[str, Any], where: Where, section: str) -> None:
    """The types of the values the loader does not otherwise read (the fields not used here, the
    mode section not run), as kube-proxy's decoder checks them; null is unset."""
    for mode in MODES:
        if mode != section and doc.get(mode) is not None and not isinstance(doc[mode], dict):
            raise InputError(where(mode), "expected a mapping", (mode,))
    for keys, kind in _UNREAD_TYPES.items():
        if keys[0] == section and keys[-1] in MODE_SECTION_ONLY:
            continue  # (read by _mode_section)
        value: Any = doc
        for k in keys:
            value = value.get(k) if isinstance(value, dict) else None
        if value is None or (kind == "duration" and type(value) is int and value == 0):
            continue  # (unset; a zero duration reads as unset, not false)
        if kind == "boolean":
            _bool(doc, where, *keys)
        elif isinstance(value, bool) or not isinstance(value, _PYTHON_TYPES[kind]):
            raise InputError(where(*keys), f"expected {'a duration' if kind == 'duration' else kind}, got "
                             f"{type_name(type(value))}", keys)
        elif kind == "duration":
            try:
                parse_duration(value.strip().removeprefix("-"))
            except ValueError:
                raise InputError(where(*keys), f"invalid duration {value!r} (examples: 30s, 200ms, 1m)", keys) from None


def _set(value: Any) -> bool:
    """Whether a value is other than zero (kubeadm writes zeros for what it leaves at the default)."""
    if isinstance(value, (dict, list)):
        return any(_set(v) for v in (value.values() if isinstance(value, dict) else value))
    return value not in (None, False, 0, "", "0", "0s")


def _warn_unsupported(doc: dict[str, Any], where: Where, section: str) -> None:
    """Warn about settings that would change what kube-proxy programs and that are not honoured
    here (silently ignoring them would program something else than the file asks for)."""
    for key in MODE_SECTION_ONLY:
        if key in doc:
            log.warning("%s", InputWarning(where(key), "not a KubeProxyConfiguration field at the top "
                                           "level: kube-proxy ignores it, and so does service-reconciler (set it "
                                           f"under {section}:)", (key,)))
    for key, why in IGNORED.items():
        if _set(doc.get(key)):
            log.warning("%s", InputWarning(where(key), f"not used: {why}", (key,)))
    detect = doc.get("detectLocalMode")
    if detect and detect != "ClusterCIDR":
        log.warning("%s", InputWarning(where("detectLocalMode"), f"{detect} is not supported: pod "
                                       "traffic is told by clusterCIDR (--cluster-cidr) only; without it nothing is "
                                       "treated as local pod traffic", ("detectLocalMode",)))
    for mode in MODES:  # (both: --mode may pick the other one)
        section = doc.get(mode)
        bit = section.get("masqueradeBit") if isinstance(section, dict) else None
        if bit is not None and bit != 14:
            log.warning("%s", InputWarning(where(mode, "masqueradeBit"), f"{bit} is not supported: "
                                           "the masquerade mark is bit 14 (0x4000)", (mode, "masqueradeBit")))


def merge(base: Options, overrides: dict[str, Any]) -> Options:
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})

"""The conntrack sysctls kube-proxy sets at start (pkg/proxy/conntrack/sysctls.go, setSysctls):
nf_conntrack_max sized by the node's CPUs and the hash table with it, the TCP and UDP timeouts,
TCP be_liberal. `run` sets them once, before its first sync; a value that cannot be written is a
warning, and proxying goes on (kube-proxy exits instead)."""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass

from .config import Options

log = logging.getLogger(__name__)

SYSCTL_DIR = "/proc/sys/net/netfilter"
MAX_CAP = 1048576  # kube-proxy caps maxPerCore x CPUs there (kubernetes#137002)


@dataclass(frozen=True)
class Sysctl:
    name: str  # under net.netfilter
    value: int
    key: str  # the KubeProxyConfiguration `conntrack:` key that asks for it
    raise_only: bool = False  # the table size: never lowered (kubernetes#142035)

    def needs_write(self, current: int | None) -> bool:
        """kube-proxy's rule: write a value that differs (an unreadable one does); the table size
        only when it is smaller."""
        if current is None:
            return True
        return current < self.value if self.raise_only else current != self.value


def conntrack_max(max_per_core: int, minimum: int, cpus: int) -> int:
    """getConntrackMax: maxPerCore x CPUs, capped at MAX_CAP, else at least `minimum`; 0 (maxPerCore
    0): leave nf_conntrack_max alone."""
    if max_per_core <= 0:
        return 0
    scaled = max_per_core * cpus
    return MAX_CAP if scaled > MAX_CAP else max(scaled, minimum)


def wanted(opts: Options, cpus: int) -> list[Sysctl]:
    """What kube-proxy's setSysctls would set, in its order. The hash table is sized by
    nf_conntrack_buckets, the same kernel value as kube-proxy's
    /sys/module/nf_conntrack/parameters/hashsize, so that every value lives in one directory."""
    out: list[Sysctl] = []
    limit = conntrack_max(opts.conntrack_max_per_core, opts.conntrack_min, cpus)
    if limit > 0:
        out += [Sysctl("nf_conntrack_max", limit, "maxPerCore", raise_only=True),
                Sysctl("nf_conntrack_buckets", limit // 4, "maxPerCore", raise_only=True)]
    for name, key, value in (
            ("nf_conntrack_tcp_timeout_established", "tcpEstablishedTimeout", opts.conntrack_tcp_timeout_established),
            ("nf_conntrack_tcp_timeout_close_wait", "tcpCloseWaitTimeout", opts.conntrack_tcp_timeout_close_wait),
            ("nf_conntrack_tcp_be_liberal", "tcpBeLiberal", int(opts.conntrack_tcp_be_liberal)),
            ("nf_conntrack_udp_timeout", "udpTimeout", opts.conntrack_udp_timeout),
            ("nf_conntrack_udp_timeout_stream", "udpStreamTimeout", opts.conntrack_udp_timeout_stream)):
        if value > 0:  # (whole seconds, truncated, as kube-proxy's int(d / time.Second))
            out.append(Sysctl(name, int(value), key))
    return out


def node_cpus() -> int:
    """The node's online CPUs, not this process's CPU affinity (as kube-proxy's DetectNumCPU)."""
    return os.cpu_count() or 1


def _read(directory: str, name: str) -> int | None:
    try:
        with open(os.path.join(directory, name), encoding="ascii") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _write(directory: str, name: str, value: int) -> None:
    with open(os.path.join(directory, name), "w", encoding="ascii") as fh:
        fh.write(str(value))


def tune(opts: Options, *, retry_later: bool = False) -> bool:
    """Set the conntrack sysctls `opts` ask for that differ, logging what was set (one line) and, as
    warnings, what could not be. When nf_conntrack is not loaded yet and `retry_later`: nothing done,
    False (our rules load it: the caller calls again after its first sync)."""
    settings = wanted(opts, node_cpus())
    directory = opts.conntrack_sysctl_dir or SYSCTL_DIR
    if settings and not os.path.exists(os.path.join(directory, "nf_conntrack_max")):
        if retry_later:
            log.info("conntrack sysctls: %s; they are set after the first sync",
                     "nf_conntrack is not loaded yet" if os.path.isdir(directory)
                     else f"no directory {directory} yet (nf_conntrack not loaded, or the directory not mounted)")
            return False
        if not os.path.isdir(directory):  # (where --conntrack-sysctl-dir names a mount that is not there)
            log.warning("conntrack sysctls not set: no directory %s (netfilter's sysctls not loaded, or the "
                        "directory not mounted)", directory)
        else:
            log.warning("conntrack sysctls not set: nf_conntrack is not loaded (no %s/nf_conntrack_max)", directory)
        return True
    changed: dict[str, int] = {}
    for s in settings:
        current = _read(directory, s.name)
        if not s.needs_write(current):
            continue
        try:
            _write(directory, s.name, s.value)
        except OSError as exc:
            hint = f"conntrack.{s.key}: {'false' if s.key == 'tcpBeLiberal' else '0'} leaves it alone"
            if exc.errno == errno.EROFS:
                hint += "; a read-only /proc/sys: see --conntrack-sysctl-dir"
            log.warning("cannot set net.netfilter.%s to %d (it is %s): %s; proxying goes on without it (%s)",
                        s.name, s.value, "unreadable" if current is None else current, exc, hint)
            continue
        changed[s.name] = s.value
    if changed:
        log.info("conntrack sysctls set: %s", ", ".join(f"net.netfilter.{k}={v}" for k, v in changed.items()),
                 extra={"fields": {"sysctls": changed}})
    return True

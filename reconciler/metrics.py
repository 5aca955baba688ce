"""Prometheus metrics for `reconciler run` (own CollectorRegistry, never the global one).

Names follow kube-proxy (pkg/proxy/metrics) where they mean the same thing; ours start with
`reconciler_`. One sync programs both IP families, so the sync metrics carry no ip_family label.
The process's own metrics (process_*, python_*) come with it, as kube-proxy's process_* and go_*.
"""

from __future__ import annotations

import datetime as _dt
import gzip
import logging
import math
import re
import threading
from decimal import Decimal
from typing import Any, Callable, Iterable, Mapping

from prometheus_client import (
    CollectorRegistry, Counter, Gauge, GCCollector, Histogram, PlatformCollector,
    ProcessCollector, disable_created_metrics, generate_latest,
)

from .sources.objects import SourceObject
from .state import DesiredState, PortChanges, family_name

log = logging.getLogger(__name__)

disable_created_metrics()  # no *_created series: kube-proxy exports none

# kube-proxy: metrics.ExponentialBuckets(0.001, 2, 15)
SYNC_BUCKETS = tuple(0.001 * 2**i for i in range(15))
# kube-proxy: merge(LinearBuckets(0.25, 0.25, 2), LinearBuckets(1, 1, 59), LinearBuckets(60, 5, 12),
# LinearBuckets(120, 30, 7)); its merge() starts from a 0 element.
NETWORK_PROGRAMMING_BUCKETS = tuple(
    [0.0, 0.25, 0.5] + [float(i) for i in range(1, 60)] + [60.0 + 5 * i for i in range(12)]
    + [120.0 + 30 * i for i in range(7)]
)
TRIGGER_TIME_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"


class Metrics:
    """Every metric the daemon exports, registered in `self.registry`."""

    def __init__(self, mode: str | None = None, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._nle_changes = PortChanges()
        self._nle_totals = [0, 0]
        self._changes_lock = threading.Lock()
        self._changes_seen = (0, 0)  # a source's event counts when last observed
        r = self.registry
        if registry is None:  # (a registry given may have them already)
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
            GCCollector(registry=r)
        # kube-proxy's per-mode count of failed kernel transactions (every attempt, as its alerts expect)
        self.kernel_tool_failures: Counter | None = None
        self.partial_failures: Counter | None = None  # iptables: failed incremental restores
        self.iptables_rules: Gauge | None = None
        self.iptables_rules_last: Gauge | None = None
        if mode == "nftables":
            self.kernel_tool_failures = Counter(
                "kubeproxy_sync_proxy_rules_nftables_sync_failures_total",
                "Cumulative proxy nftables sync failures", registry=r)
            # kube-proxy deletes stale chains in a second transaction that can fail on its own;
            # ours are deleted in the sync's one transaction, so this stays 0 (for the alerts)
            Counter("kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total",
                    "Cumulative proxy nftables cleanup failures", registry=r)
        elif mode == "iptables":
            self.kernel_tool_failures = Counter(
                "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
                "Cumulative proxy iptables restore failures", registry=r)
            self.partial_failures = Counter(
                "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total",
                "Cumulative proxy iptables partial restore failures", registry=r)
            self.iptables_rules = Gauge(
                "kubeproxy_sync_proxy_rules_iptables_total", "Total number of iptables rules owned by kube-proxy",
                ["table"], registry=r)
            self.iptables_rules_last = Gauge(
                "kubeproxy_sync_proxy_rules_iptables_last", "Number of iptables rules written by kube-proxy in last sync",
                ["table"], registry=r)
        self.sync_duration = Histogram(
            "kubeproxy_sync_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds",
            buckets=SYNC_BUCKETS, registry=r)
        self.full_sync_duration = Histogram(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs", buckets=SYNC_BUCKETS, registry=r)
        self.partial_sync_duration = Histogram(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs", buckets=SYNC_BUCKETS, registry=r)
        self.last_sync = Gauge(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced", registry=r)
        self.last_queued = Gauge(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued", registry=r)
        self.network_programming = Histogram(
            "kubeproxy_network_programming_duration_seconds", "In Cluster Network Programming Latency in seconds",
            buckets=NETWORK_PROGRAMMING_BUCKETS, registry=r)
        self.endpoint_changes = Counter(
            "kubeproxy_sync_proxy_rules_endpoint_changes_total", "Cumulative proxy rules Endpoint changes",
            registry=r)
        self.service_changes = Counter(
            "kubeproxy_sync_proxy_rules_service_changes_total", "Cumulative proxy rules Service changes",
            registry=r)
        self.endpoint_changes_pending = Gauge(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending", "Pending proxy rules Endpoint changes",
            registry=r)
        self.service_changes_pending = Gauge(
            "kubeproxy_sync_proxy_rules_service_changes_pending", "Pending proxy rules Service changes",
            registry=r)
        self.no_local_endpoints = Gauge(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints", ["traffic_policy"], registry=r)
        for policy in ("internal", "external"):
            self.no_local_endpoints.labels(policy).set(0)
        self.conntrack_duration = Histogram(
            "kubeproxy_conntrack_reconciler_sync_duration_seconds", "ReconcileConntrackFlowsLatency latency in seconds",
            ["ip_family"], buckets=SYNC_BUCKETS, registry=r)
        self.conntrack_deleted = Counter(
            "kubeproxy_conntrack_reconciler_deleted_entries_total",
            "Cumulative conntrack flows deleted by conntrack reconciler", ["ip_family"], registry=r)
        self.healthz = Counter("kubeproxy_proxy_healthz_total", "Cumulative proxy healthz HTTP status",
                               ["code"], registry=r)
        self.livez = Counter("kubeproxy_proxy_livez_total", "Cumulative proxy livez HTTP status",
                             ["code"], registry=r)
        # ours
        self.drift_repairs = Counter(
            "reconciler_drift_repairs_total",
            "Full resyncs that found the kernel changed behind our back (and repaired it)", registry=r)
        self.drift_operations = Counter(
            "reconciler_drift_operations_total", "Kernel operations needed to repair drift", registry=r)
        self.kernel_reads = Counter(
            "reconciler_kernel_reads_total",
            "Syncs that read our kernel objects back (the first, and full resyncs the ruleset "
            "generation could not vouch for)", registry=r)
        self.kernel_reads_skipped = Counter(
            "reconciler_kernel_reads_skipped_total",
            "Full resyncs that did not read the kernel back: the ruleset generation had not moved "
            "since the kernel was known to hold what we applied", registry=r)
        self.rest_requests = Counter(  # (client-go's, as kube-proxy's clients export it; the API source only)
            "rest_client_requests_total", "Number of HTTP requests, partitioned by status code, method, and host.",
            ["code", "host", "method"], registry=r)
        self.source_errors = Counter(
            "reconciler_source_errors_total",
            "Input errors: invalid manifests/objects (reason=invalid) or source failures (reason=source: "
            "the API out of reach, a directory that cannot be read or holds no object)",
            ["reason"], registry=r)
        self.kernel_errors = Counter(
            "reconciler_kernel_errors_total", "Failed syncs: a kernel tool failed or did not converge", registry=r)
        self.kernel_operations = Counter(
            "reconciler_kernel_operations_total", "Kernel operations applied", ["action"], registry=r)
        self.syncs = Counter("reconciler_syncs_total", "Syncs by type (full, incremental) and result",
                             ["type", "result"], registry=r)
        self.degraded = Gauge("reconciler_input_degraded",
                              "1 while the input is degraded: the source cannot be read (the API out of reach "
                              "for 10 s or more), or what it holds is invalid and the last good state is kept",
                              registry=r)
        self.services = Gauge("reconciler_service_ports", "Service ports in the applied desired state", registry=r)
        for reason in ("invalid", "source"):
            self.source_errors.labels(reason)
        for action in ("add", "delete", "replace"):
            self.kernel_operations.labels(action)
        for kind in ("full", "incremental"):
            for result in ("success", "error"):
                self.syncs.labels(kind, result)

    def observe_operations(self, by_action: Mapping[str, int]) -> None:
        """Count kernel operations applied, given as {action ("+", "-", "~"): how many}."""
        names = {"+": "add", "-": "delete", "~": "replace"}
        for action, n in by_action.items():
            if n:
                self.kernel_operations.labels(names.get(action, str(action))).inc(n)

    def observe_changes(self, read: Callable[[], tuple[int, int, int, int]]) -> None:
        """A source's change figures, as read() gives them (see sources.kubernetes.ChangeLog): its
        event counts since it started, and what no sync has taken yet. Read and set under one
        lock: an informer thread's older figures never overwrite a sync's newer ones."""
        with self._changes_lock:
            services, endpoint_slices, pending_services, pending_slices = read()
            seen = self._changes_seen
            self.service_changes.inc(max(0, services - seen[0]))
            self.endpoint_changes.inc(max(0, endpoint_slices - seen[1]))
            self._changes_seen = (max(services, seen[0]), max(endpoint_slices, seen[1]))
            self.service_changes_pending.set(pending_services)
            self.endpoint_changes_pending.set(pending_slices)

    def observe_conntrack(self, result: Any) -> None:
        """A stale-UDP conntrack cleanup (conntrack.Result): each family's pass, per family."""
        for run in result.runs:
            family = family_name(run.family)
            self.conntrack_duration.labels(family).observe(run.seconds)
            self.conntrack_deleted.labels(family).inc(run.deleted)

    def set_iptables_rules(self, total: Mapping[str, int], written: Mapping[str, int]) -> None:
        """iptables mode: our rules per table now, and those the last transaction wrote."""
        if self.iptables_rules is None or self.iptables_rules_last is None:
            return
        for table in ("filter", "nat"):
            self.iptables_rules.labels(table).set(total.get(table, 0))
            self.iptables_rules_last.labels(table).set(written.get(table, 0))

    def set_no_local_endpoints(self, desired: DesiredState) -> None:
        """Gauges per traffic policy, updated from the service ports that changed since the last
        call (by identity, see state.PortChanges): the cost follows the changes."""
        gone, new = self._nle_changes.update(desired)
        totals = self._nle_totals
        for sign, ports in ((-1, gone), (1, new)):
            for sp in ports:
                totals[0] += sign * _no_local(sp, "internal")
                totals[1] += sign * _no_local(sp, "external")
        self.no_local_endpoints.labels("internal").set(totals[0])
        self.no_local_endpoints.labels("external").set(totals[1])


def exposition(registry: CollectorRegistry, accept_encoding: str = "") -> tuple[bytes, dict[str, str]]:
    """/metrics as kube-proxy serves it (client_golang's promhttp with no options): the text
    format 0.0.4 whatever the scraper accepts (never OpenMetrics, whose metadata drops `_total`),
    gzipped when the scraper takes it, bucket bounds written as Go writes floats (`le="1"`, not
    `le="1.0"`: on Prometheus 2 another spelling is another series, beside kube-proxy's)."""
    body = _LE.sub(lambda m: f'le="{go_float(m.group(1))}"', generate_latest(registry).decode()).encode()
    headers = {"Content-Type": TEXT_FORMAT}
    if "gzip" in accept_encoding.lower():
        body = gzip.compress(body)
        headers["Content-Encoding"] = "gzip"
    return body, headers


_LE = re.compile(r'(?<=[{,])le="([^"]+)"')  # (the label le, not the end of table="filter")
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"  # (prometheus_client's newest says 1.0.0: the same text)


def go_float(text: str) -> str:
    """A float as Go's strconv.FormatFloat(f, 'g', -1, 64) writes it (expfmt's bounds): the
    shortest digits, an exponent below 1e-4 and from 1e6 on."""
    f = float(text)
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    if f == 0:
        return "0"
    d = Decimal(repr(f)).normalize()
    exp = d.adjusted()
    if -4 <= exp < 6:
        return format(d, "f")
    sign, digits, _ = d.as_tuple()
    mantissa = str(digits[0]) + ("." + "".join(map(str, digits[1:])) if len(digits) > 1 else "")
    return f"{'-' if sign else ''}{mantissa}e{'+' if exp >= 0 else '-'}{abs(exp):02d}"


def no_local_endpoints(desired: DesiredState, policy: str) -> int:
    """Service ports (per IP family, like kube-proxy's per-family proxiers summed) whose traffic
    policy is Local and that have no local endpoint to send that traffic to, though they have
    endpoints elsewhere (traffic dropped; with none at all it is rejected, and not counted)."""
    return sum(_no_local(sp, policy) for sp in desired.services)


def _no_local(sp: Any, policy: str) -> int:
    n = 0
    for fam in sp.families:
        path = fam.internal if policy == "internal" else fam.external
        if path is not None and path.policy == "Local" and path.verdict == "drop":
            n += 1
    return n


def trigger_time(body: Any) -> str | None:
    """An EndpointSlice's last-change-trigger-time annotation, if it has one."""
    meta = body.get("metadata") if isinstance(body, dict) else None
    ann = meta.get("annotations") if isinstance(meta, dict) else None
    value = ann.get(TRIGGER_TIME_ANNOTATION) if isinstance(ann, dict) else None
    return value if isinstance(value, str) and value else None


def trigger_times(objects: Iterable[SourceObject]) -> dict[tuple[str, str, str], list[str]]:
    """EndpointSlice key -> its last-change-trigger-time annotation (when present), in a list."""
    out = {}
    for obj in objects:
        if obj.kind == "EndpointSlice" and (value := trigger_time(obj.body)) is not None:
            out[obj.key] = [value]
    return out


def parse_time(text: str) -> float | None:
    """RFC 3339 (nanoseconds allowed) -> epoch seconds, None when unparsable."""
    try:
        t = _dt.datetime.fromisoformat(text.strip())
    except ValueError:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.timezone.utc)
    return t.timestamp()


def network_programming_latencies(times: Iterable[str], now: float, since: float) -> list[float]:
    """Latencies of these trigger times, each not older than `since` (kube-proxy ignores changes
    older than its own start)."""
    out = []
    for value in times:
        t = parse_time(value)
        if t is None or t < since:
            continue
        out.append(max(0.0, now - t))
    return out

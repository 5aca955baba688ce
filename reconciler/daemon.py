"""`reconciler run`: reconcile continuously from a watched directory or the Kubernetes API.

The loop (kube-proxy's BoundedFrequencyRunner, simplified):

* source events only mark the state dirty; syncs are coalesced: a sync starts no sooner than
  min-sync-period after the previous one ended (kube-proxy v1.34+'s runner: no bursts), and a
  full resync runs at least once per sync-period;
* a normal sync is incremental: the plan is made against the model left by the last
  successful apply (no kernel read), then applied atomically, without reading the kernel back;
* the first sync (and a resync that reads) plans against the kernel as read, and the
  generation verifies its apply when our commits alone moved it since (reconcile.apply);
* the periodic full resync re-reads the kernel, unless the nf_tables ruleset generation shows
  that nothing was committed since our own last commit (drift.py; at least hourly all the same);
  operations found although the kernel should still be as we left it are drift: logged
  ("repaired drift: N operations"), counted, repaired;
* invalid input never removes what is programmed: from a directory the last good DesiredState
  is kept whole (before there is one, see Daemon._may_start_without_bad_files), from the API
  invalid objects are skipped one by one (as kube-proxy does); the errors are logged with their
  place and counted, /healthz says degraded;
* kernel errors are logged and counted; the next sync (at the latest one sync-period later) is
  a full one;
* at start, before the first sync, the conntrack sysctls are set as kube-proxy sets them
  (conntrack_sysctls.py; if nf_conntrack is not loaded yet, after the first sync, which loads it);
* SIGTERM/SIGINT: the current transaction finishes, the kernel state stays, exit 0;
* the --config file's content changed: the same, but exit 1, to be started again with it
  (kube-proxy's way: its settings are read once).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import heapq
import json
import logging
import math
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Container, Iterable, Protocol

from . import __version__, conntrack, conntrack_sysctls, gcpolicy, instance_lock, quiet_library_loggers
from .backends.base import KernelError
from .config import Options, configz
from .config_watch import ConfigFileWatch
from .desired import BuildCache, BuildOptions, build_desired_state, object_errors
from .drift import DriftCheck
from .events import EventRecorder, Sender, api_sender, node_ref, service_ref
from .health import (
    SYSTEM_CLOCK, Clock, ProxyHealth, RetryingListener, ServiceHealthServers, default_hosts, local_addresses,
    node_eligible, start_metrics_server, start_proxy_health_server,
)
from .metrics import Metrics, network_programming_latencies, trigger_times
from .reconcile import Planned, apply, clean_conntrack, make_plan, other_mode_leftovers
from .sdnotify import Notifier
from .sources.manifests import may_hold_a_node
from .sources.objects import (
    SERVICE_KINDS, InputConflict, InputError, InputErrors, Location, SourceObject, SourceUnavailable, in_place_order,
    name_some,
)
from .sources.watch import LOGGED_PATHS, DirectorySource, Snapshot
from .state import EVERY_ADDRESS, DesiredState

log = logging.getLogger("reconciler.daemon")

BIND_RETRY_SECONDS = 5.0  # a healthz or metrics address in use is retried this often (kube-proxy's)

Key = tuple[str, str, str]


# ----------------------------------------------------------------------------------------------
# Logging


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = _dt.datetime.fromtimestamp(record.created, tz=_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3]
        line = f"{ts}Z {record.levelname} {record.getMessage()}"  # fields: JSON format only
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = _dt.datetime.fromtimestamp(record.created, tz=_dt.timezone.utc).isoformat(timespec="milliseconds")
        out: dict[str, Any] = {"ts": ts.replace("+00:00", "Z"), "level": record.levelname.lower(),
                               "msg": record.getMessage(), "logger": record.name}
        fields = getattr(record, "fields", None)
        if fields:
            for k, v in fields.items():
                out.setdefault(k, v)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(fmt: str = "text", verbose: bool = False, stream: Any = None) -> None:
    """Root logging for the daemon: one line per record, text or JSON (ts, level, msg, fields)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    quiet_library_loggers()


def _fields(**kw: Any) -> dict[str, Any]:
    return {"fields": kw}


# ----------------------------------------------------------------------------------------------
# Sources


class Source(Protocol):
    kind: str
    # True: snapshot(objects=False) fills added_objects/removed_objects (what changed since the
    # previous snapshot) and may leave `objects` empty; the build then costs O(changes)
    deltas: bool

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def ready(self) -> bool: ...

    def snapshot(self) -> Snapshot: ...


class KubeSource:
    """KubernetesSource behind the daemon's Source interface."""

    kind = "kubernetes"
    deltas = False  # the informers' caches are diffed by the build cache (identity of bodies)

    def __init__(self, kubeconfig: str | None, node_name: str, on_change: Callable[[], None]) -> None:
        from .sources.kubernetes import KubernetesSource, load_api_client

        try:
            client = load_api_client(kubeconfig)
        except Exception as exc:  # noqa: BLE001 - kubernetes.config raises several types
            where = kubeconfig or "in-cluster service account"
            raise ValueError(f"--source kubernetes: cannot load API client configuration ({where}): {exc}") from exc
        self.client = client
        self.source = KubernetesSource(client, node_name, on_change=on_change)

    def start(self) -> None:
        self.source.start()

    def stop(self) -> None:
        self.source.stop()

    def ready(self) -> bool:
        return self.source.wait_synced(0)

    def snapshot(self) -> Snapshot:
        return Snapshot(objects=self.source.snapshot(), changed=True)

    def changes(self) -> tuple[int, int, int, int]:
        return self.source.changes()

    def take_changes(self) -> tuple[dict[tuple[str, str], list[str]], set[tuple[str, str]]]:
        return self.source.take_changes()

    def release_bodies(self, keep: Container[int] = (), built: Container[int] = ()) -> None:
        """See KubernetesSource.release_bodies: `built`, the ids the build cache holds (an object
        refused by the build is not there: it is read again when it changes)."""
        self.source.release_bodies(built)

    @property
    def failures(self) -> int:
        """API errors so far (list/watch failures, each retried by the informer)."""
        return self.source.counters.get("errors", 0)

    @property
    def failing(self) -> str | None:
        """Why the API cannot be read now (None: every informer reaches it)."""
        return self.source.failing

    @property
    def requests(self) -> tuple[str, dict[str, int]]:
        """(API server host, requests so far by status code): see KubernetesSource.requests."""
        return self.source.host, self.source.requests


# ----------------------------------------------------------------------------------------------
# The loop


@dataclass
class SyncReport:
    kind: str  # full | incremental
    ok: bool
    operations: int = 0
    drift: int = 0
    added: int = 0
    changed: int = 0
    removed: int = 0
    seconds: float = 0.0
    error: str | None = None
    kernel_read: bool = False  # read to plan (the first sync; a resync the generation could not vouch for)
    services: tuple[str, ...] = ()  # the first few service ports its operations touched, for the log
    services_total: int = 0  # ... and how many in all
    no_input: bool = False  # (no valid input yet: nothing done)


class _PendingChanges:
    """What a change-reporting source added and removed since the last successful build."""

    def __init__(self) -> None:
        self.added: dict[int, SourceObject] = {}
        self.removed: dict[int, SourceObject] = {}

    def add(self, added: Iterable[SourceObject], removed: Iterable[SourceObject]) -> None:
        for obj in removed:
            if self.added.pop(id(obj), None) is None:  # added and gone again: never built
                self.removed[id(obj)] = obj
        for obj in added:
            self.added[id(obj)] = obj


@dataclass
class _InputState:
    errors: tuple[str, ...] = ()
    warnings: set[str] = field(default_factory=set)
    held: bool = False  # the errors hold back every change (a directory's), not just their objects
    shown: tuple[str, str] | None = None  # what /healthz says of the errors: (summary, the first)
    source_failing: str | None = None  # the source cannot be read now (the API out of reach): why


class Daemon:
    """The sync loop. Thread-safe `notify()`; `step()` runs at most one due sync (tests drive it
    with a FakeClock); `run_forever(stop)` is the real loop."""

    def __init__(self, opts: Options, backend: Any, source: Source | None = None, *,
                 clock: Clock = SYSTEM_CLOCK, metrics: Metrics | None = None,
                 health: ProxyHealth | None = None, service_health: ServiceHealthServers | None = None,
                 notifier: Notifier | None = None) -> None:
        if opts.sync_period <= 0:
            raise ValueError("--sync-period must be greater than 0")
        if opts.min_sync_period < 0:
            raise ValueError("--min-sync-period must not be negative")
        self.opts = opts
        self.backend = backend
        self.source: Source | None = source
        self.clock = clock
        self.metrics = metrics or Metrics(getattr(backend, "mode", None))
        self.health = health or ProxyHealth(2 * opts.sync_period, clock, node_eligible=self.node_eligible)
        conntrack.RECONCILER.listeners.append(lambda result: self.metrics.observe_conntrack(result))
        self.service_health = service_health
        self.notifier = notifier or Notifier({})  # (systemd's: run() passes the one of its environment)
        self.start_wall = clock.time()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._dirty = True  # the first sync reads the source
        self._need_full = True
        self._hup = False  # SIGHUP: see resync_now()
        self._eligible: bool | None = None  # this node's Node's eligibility, as last logged
        # syncs are paced as kube-proxy's BoundedFrequencyRunner paces them: the next starts no
        # sooner than min_sync_period after the last one ended
        self._last_end = -math.inf
        self._last_full = -math.inf
        self.desired: DesiredState | None = None  # last good desired state
        self.applied_desired: DesiredState | None = None
        self.applied_model: Any = None  # the kernel model after the last successful apply
        self.drift_check = DriftCheck(backend, clock)  # whether a resync must read the kernel
        self._build_cache = BuildCache()  # unchanged Services are not rebuilt
        self._pending = _PendingChanges()  # source changes no build has taken in yet
        # trigger times of the changes since the last applied sync, by Service (from the API) or by
        # EndpointSlice (from a build)
        self._triggers: dict[Key, list[str]] = {}
        self._seen_triggers: dict[Key, str] = {}  # a directory's slices' trigger times, as last read
        self._gone_triggers: dict[Key, str] = {}  # (those of the slices the last build removed)
        self._failed_in_a_row = 0  # syncs that failed since the last one that succeeded
        # a transaction of ours failed since the last sync that succeeded: it may have committed
        # part of itself (iptables commits table by table), which the next read finds
        self._own_partial = False
        self._stop: threading.Event | None = None  # (run_forever's: no retry once it is set)
        self._input = _InputState()
        self._node: dict[str, Any] | None = None
        self._source_errors_seen = 0
        self._requests_seen: dict[str, int] = {}  # (see _poll_source_errors)
        self._kernel_holds_ours: bool | None = None  # (unknown until needed, see _may_start_...)
        self.after_first_sync: Callable[[], Any] | None = None  # called once, after the first applied sync
        self.syncs: list[SyncReport] = []  # recent reports (tests, debugging)

    # -- events ----------------------------------------------------------------------------

    def notify(self) -> None:
        """The source changed (any thread): queue a sync."""
        with self._lock:
            self._dirty = True
        self.health.queued_update()
        self.metrics.last_queued.set(self.clock.time())
        self._observe_source_changes()
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def resync_now(self) -> None:
        """A full resync as soon as min-sync-period allows (SIGHUP): the whole source read again,
        the kernel checked as at the periodic resync. Only sets flags (it runs in a signal
        handler, which may interrupt this very thread while it holds self._lock)."""
        self._hup = True
        self._wake.set()

    def node_eligible(self) -> bool:
        node = self._node
        if node is None:
            # a manifest directory need not describe the node; from the API it is missing only once
            # a build from the synced caches (which sets self._node and self.desired) found no Node:
            # before, eligible while starting up, as kube-proxy's ProxyHealthServer is
            return self.source is None or self.source.kind != "kubernetes" or self.desired is None
        return node_eligible(node)

    # -- scheduling --------------------------------------------------------------------------

    def due(self) -> tuple[str | None, float]:
        """(kind of sync due now or None, seconds until the next one may be due)."""
        now = self.clock.monotonic()
        if self.source is not None and not self.source.ready():
            return None, 1.0  # no sync with a half-listed cache; notify() wakes us when synced
        with self._lock:
            dirty = self._dirty or self._hup
        earliest = max(now, self._last_end + self.opts.min_sync_period)
        full_at = max(self._last_full + self.opts.sync_period, earliest)
        full = self._need_full or self._hup or self.applied_model is None or now >= full_at
        if dirty:
            if now >= earliest:
                return ("full" if full else "incremental"), 0.0
            return None, earliest - now
        if now >= full_at:
            return "full", 0.0
        return None, full_at - now

    def step(self) -> SyncReport | None:
        kind, _ = self.due()
        return self.sync(kind) if kind else None

    def run_forever(self, stop: threading.Event) -> None:
        self._stop = stop
        self.health.updated()  # like kube-proxy's SyncLoop start
        self.metrics.last_queued.set(self.clock.time())
        while not stop.is_set():
            self._wake.clear()
            self.notifier.alive()
            self._poll_source_errors()
            kind, wait = self.due()
            if kind is not None:
                self.sync(kind)
                continue
            self._wake.wait(min(max(wait, 0.0), 5.0, self.notifier.due_in()))

    def _poll_source_errors(self) -> None:
        n = getattr(self.source, "failures", 0)
        if isinstance(n, int) and n > self._source_errors_seen:
            self.metrics.source_errors.labels("source").inc(n - self._source_errors_seen)
            self._source_errors_seen = n
        failing = getattr(self.source, "failing", None)
        if not isinstance(failing, str):
            failing = None
        if failing != self._input.source_failing:  # (the API out of reach: degraded until it answers)
            self._input.source_failing = failing
            self._show_input_state()
        requests = getattr(self.source, "requests", None)
        if requests is not None:  # (the API's: client-go's rest_client_requests_total)
            host, counts = requests
            for code, total in counts.items():
                seen = self._requests_seen.get(code, 0)
                if total > seen:
                    self.metrics.rest_requests.labels(code, host, "GET").inc(total - seen)
                    self._requests_seen[code] = total

    # -- input -------------------------------------------------------------------------------

    def _observe_source_changes(self) -> None:
        """kube-proxy's change metrics, from a source that logs its changes (the API)."""
        changes = getattr(self.source, "changes", None)
        if changes is not None:
            self.metrics.observe_changes(changes)

    def _take_source_changes(self) -> None:
        """Before a snapshot: what a change-logging source collected since the last one (trigger
        times; the Services whose slices were deleted drop theirs, as kube-proxy's do)."""
        take = getattr(self.source, "take_changes", None)
        if take is None:
            return
        times, dropped = take()
        for ns, name in dropped:
            self._triggers.pop(("Service", ns, name), None)
        for (ns, name), values in times.items():
            self._triggers.setdefault(("Service", ns, name), []).extend(values)
        self._observe_source_changes()  # (pending: 0 again)

    def _refresh_desired(self) -> None:
        assert self.source is not None
        try:
            self._take_source_changes()
            snap = self._snapshot()
        except Exception as exc:  # noqa: BLE001 - a source failure is an input problem, never a wipe
            log.exception("reading the source failed")
            self._input_failed([f"source: {exc}"], source_failures={f"source: {exc}"})
            return
        if getattr(snap, "stopped", False) or (not snap.changed and self.desired is not None
                                               and not self._input.errors):
            return
        if snap.reread or snap.removed:
            log.debug("re-read %s; dropped %s",
                      name_some(snap.reread, LOGGED_PATHS), name_some(snap.removed, LOGGED_PATHS),
                      extra=_fields(reread=snap.reread[:LOGGED_PATHS], reread_count=len(snap.reread),
                                    removed=snap.removed[:LOGGED_PATHS], removed_count=len(snap.removed)))
        errors: list[InputError] = list(snap.errors)
        desired = None
        excluded: list[str] = []
        skipped: list[InputError] = []

        def first_start() -> bool:
            return self._may_start_without_bad_files(snap)

        if errors and first_start():
            skipped, errors = errors, []
        if not errors:
            desired, errors, excluded = self._build(snap, first_start)
        elif self._source_has_deltas:  # (files that do not parse stop the build: the others' own errors too)
            errors += object_errors(self._pending.added.values())
        errors = in_place_order([*skipped, *errors])
        if errors and desired is None:
            self._input_failed([str(e) for e in errors],
                               source_failures={str(e) for e in errors if isinstance(e, SourceUnavailable)})
            if self.desired is None and snap.changed:
                self._health_checks_before_first_sync(errors)
            return
        if self._source_has_deltas and errors:
            bad = sorted({e.location.origin if isinstance(e.location, Location) else str(e.location) for e in errors})
            log.warning("nothing of ours is programmed yet: starting without the objects of %d manifest file(s) "
                        "with errors (%s); further changes wait until the directory is valid as a whole",
                        len(bad), ", ".join(bad))
            excluded = bad
        for w in [*snap.warnings, *desired.warnings]:  # type: ignore[union-attr]
            if w not in self._input.warnings:
                log.warning("%s", w)
        self._input.warnings = {*snap.warnings, *desired.warnings}  # type: ignore[union-attr]
        if excluded:
            # objects we cannot use are skipped: from the API one by one (like kube-proxy does),
            # from a directory on a first start by file
            self._input_failed([str(e) for e in errors], kept=False)
        else:
            self._input_ok()
        # What changed, from the build's own delta: O(changes), not O(objects)
        cache = self._build_cache
        if not hasattr(self.source, "changes"):  # (the API's are counted per event)
            self._count_changes(cache.last_added, cache.last_removed)
            self._take_trigger_times(cache.last_added, cache.last_removed)
        self._node = dict(cache.node_obj.body) if cache.node_obj is not None else None
        self._log_eligibility()
        self.desired = desired
        release = getattr(self.source, "release_bodies", None)
        if release is not None:  # the build cache has all it needs from them, but those held back
            release(keep=self._pending.added, built=cache.objects)  # (see _build_pending)

    def _log_eligibility(self) -> None:
        """Said when this node's Node turns ineligible for load balancer traffic (/healthz 503:
        being deleted, or tainted for removal by the cluster autoscaler) and when it is eligible
        again: /healthz's answer changes for a reason the log should give."""
        if self._node is None:
            return
        eligible = node_eligible(self._node)
        if eligible == self._eligible:
            return
        if not eligible:
            meta = self._node.get("metadata") or {}
            why = ("it is being deleted (deletionTimestamp)" if meta.get("deletionTimestamp") else
                   "the cluster autoscaler is about to remove it (ToBeDeletedByClusterAutoscaler taint)")
            log.warning("Node %s is not eligible for load balancer traffic: %s; /healthz answers 503",
                        self.opts.node_name, why)
        elif self._eligible is not None:
            log.info("Node %s is eligible for load balancer traffic again; /healthz answers 200", self.opts.node_name)
        self._eligible = eligible

    def _health_checks_before_first_sync(self, errors: list[InputError]) -> None:
        """A process restarted on a programmed kernel with errors in its directory leaves the
        kernel as it is, proxying what the last process programmed: meanwhile the
        healthCheckNodePorts are served for the Services of the files without errors (refused,
        a load balancer would take this node out for the services it does serve)."""
        if self.service_health is None or not self._source_has_deltas:
            return
        bad = {e.location.origin for e in errors if isinstance(e.location, Location)}
        objects = [o for o in self._pending.added.values() if o.location.origin not in bad]
        try:
            partial = build_desired_state(objects, self.opts.build_options())
        except (InputErrors, InputError) as exc:
            log.debug("no healthCheckNodePorts before the first sync: %s", exc)
            return
        self.service_health.sync(partial.healthChecks)

    def _build_pending(self, opts: BuildOptions, first_start: Callable[[], bool]
                       ) -> tuple[DesiredState | None, list[InputError]]:
        """Build what a directory changed. Any error rejects it all, but on a first start (see
        _may_start_without_bad_files) the objects of the files named by errors are held back:
        they stay pending, not built, for the next build to try again."""
        held: dict[int, SourceObject] = {}
        all_errors: list[InputError] = []
        for _ in range(5):
            added = [o for i, o in self._pending.added.items() if i not in held]
            try:
                desired = self._build_cache.update(added, self._pending.removed.values(), opts)
            except (InputErrors, InputError) as exc:
                errors = exc.errors if isinstance(exc, InputErrors) else [exc]
                all_errors.extend(errors)
                if any(isinstance(e, InputConflict) for e in errors):
                    return None, all_errors  # (which side is meant cannot be told)
                files = {e.location.origin for e in errors if isinstance(e.location, Location)}
                bad = {i: o for i, o in self._pending.added.items() if i not in held and o.location.origin in files}
                if any(o.kind == "Node" and o.name == self.opts.node_name for o in bad.values()):
                    return None, all_errors  # (without this node's Node: NodePorts on every address)
                if not bad or not first_start():
                    return None, all_errors
                held.update(bad)
                continue
            self._pending = _PendingChanges()
            self._pending.added = held
            self._set_pending_changes()
            if not held and not any(o.kind in SERVICE_KINDS for o in self._build_cache.objects.values()):
                return None, [*all_errors, self._empty_source()]
            return desired, all_errors
        return None, all_errors

    def _empty_source(self) -> InputError:
        """A directory with no Service or EndpointSlice (a wrong --source, a folder cloned again
        and not checked out yet, an emptied branch, a copy that has written the Node's file
        first) is taken for a mistake: applied, it would remove every service port of ours."""
        root = getattr(self.source, "root", "source")
        return SourceUnavailable(Location(root), "no Service or EndpointSlice in it: taken for a mistake "
                          "(a wrong --source, a checkout not done yet), not applied; `reconciler cleanup` "
                          "removes every service port of ours")

    def _may_start_without_bad_files(self, snap: Snapshot) -> bool:
        """A directory with errors keeps the last good state whole; before there is one (a
        node's first start, a reboot: the kernel holds nothing of ours, in any mode), its files
        without errors are applied rather than nothing. A process restarted on a programmed
        kernel leaves that as it is. The kernel is looked at once per process."""
        if self.desired is not None or not self._source_has_deltas:
            return False
        if snap.errors and not getattr(snap, "skippable", False):
            return False  # (duplicates: which one is meant cannot be told)
        if any(may_hold_a_node(e.location.origin) for e in snap.errors if isinstance(e.location, Location)):
            return False  # (this node's Node, perhaps: see _build)
        if self._kernel_holds_ours is None:
            try:
                ours = self.backend.cleanup(look_first=True)
                self._kernel_holds_ours = bool(ours) or bool(other_mode_leftovers(self.backend.mode, look_first=True))
            except Exception as exc:  # noqa: BLE001 - unknown: keep the kernel as it is
                log.warning("could not tell whether the kernel holds our objects (%s): taking it that it does", exc)
                self._kernel_holds_ours = True
        return not self._kernel_holds_ours

    @property
    def _source_has_deltas(self) -> bool:
        return bool(getattr(self.source, "deltas", False))  # test fakes may not say

    def _snapshot(self) -> Snapshot:
        """The source's content. A source that reports its changes (a directory) is asked for just
        those; they wait in self._pending until a build takes them in."""
        assert self.source is not None
        if self._source_has_deltas:
            snap = self.source.snapshot(objects=False)  # type: ignore[call-arg]
            self._pending.add(snap.added_objects or (), snap.removed_objects or ())
            self._set_pending_changes()
            return snap
        return self.source.snapshot()

    def _build(self, snap: Snapshot, first_start: Callable[[], bool] = lambda: False
               ) -> tuple[DesiredState | None, list[InputError], list[str]]:
        """Build the desired state; from the API, objects named by errors are dropped and the
        build retried, from a directory any error rejects the whole input (but see
        _build_pending)."""
        opts = self.opts.build_options()
        if self._source_has_deltas:
            desired, errors = self._build_pending(opts, first_start)
            return desired, errors, []
        objects = snap.objects
        excluded: list[str] = []
        all_errors: list[InputError] = []
        current = list(objects)
        for _ in range(5):
            try:
                return build_desired_state(current, opts, self._build_cache), all_errors, excluded
            except (InputErrors, InputError) as exc:
                errors = exc.errors if isinstance(exc, InputErrors) else [exc]
                all_errors.extend(errors)
                if self.source is None or self.source.kind != "kubernetes":
                    return None, all_errors, excluded
                names = {str(e.location) for e in errors}
                bad = [o for o in current
                       if str(o.location) in names or f"{o.kind} {o.namespace}/{o.name}" in names]
                if not bad:
                    return None, all_errors, excluded
                bad_ids = {id(o) for o in bad}
                excluded += [f"{o.kind} {o.namespace}/{o.name}" for o in bad]
                current = [o for o in current if id(o) not in bad_ids]
        return None, all_errors, excluded

    def _input_failed(self, messages: list[str], kept: bool = True, source_failures: Container[str] = ()) -> None:
        """Input that cannot be programmed: `messages`, those in `source_failures` the source's
        own (it could not be read, its directory is gone or holds no object: reason=source), the
        rest invalid objects (reason=invalid)."""
        key = tuple(messages)
        if key != self._input.errors:
            new = [m for m in messages if m not in self._input.errors]
            what = ("skipping the objects" if not kept else "keeping the last good state" if self.desired is not None
                    else "nothing applied yet: the kernel is left as it is")
            for m in messages:
                log.error("invalid input (%s): %s", what, m, extra=_fields(error=m))
            failed = sum(m in source_failures for m in new)
            self.metrics.source_errors.labels("source").inc(failed)
            self.metrics.source_errors.labels("invalid").inc(len(new) - failed)
            self._input.errors = key
        self._input.held = kept
        summary = messages[0] + (f" (and {len(messages) - 1} more)" if len(messages) > 1 else "")
        self._input.shown = (summary, messages[0])
        self._show_input_state()

    def _input_ok(self) -> None:
        if self._input.errors:
            log.info("input is valid again")
        self._input.errors, self._input.held, self._input.shown = (), False, None
        self._show_input_state()

    def _show_input_state(self) -> None:
        """/healthz's `degraded` (and reconciler_input_degraded): the source failing (the API out
        of reach, its objects as last seen still programmed) first, else the input's errors."""
        if self._input.source_failing is not None:  # (its time: since the source failed, whatever it says)
            self.health.set_input_error(self._input.source_failing, first="source")
        elif self._input.shown is not None:
            self.health.set_input_error(*self._input.shown)
        else:
            self.health.set_input_error(None)
        self.metrics.degraded.set(int(self._input.source_failing is not None or self._input.shown is not None))

    def _set_pending_changes(self) -> None:
        """A directory's changes read but not built yet (an invalid input holds them) as kube-proxy's
        pending change gauges: Services and EndpointSlices."""
        objs = [*self._pending.added.values(), *self._pending.removed.values()]
        self.metrics.service_changes_pending.set(len({o.key for o in objs if o.kind == "Service"}))
        self.metrics.endpoint_changes_pending.set(len({o.key for o in objs if o.kind == "EndpointSlice"}))

    def _take_trigger_times(self, added: list[SourceObject], removed: list[SourceObject]) -> None:
        """A directory's EndpointSlices' trigger times, each once: a file read again for another
        object in it (or a touch) brings its slices back unchanged, and the time their last change
        was triggered at marks no new change."""
        seen = self._seen_triggers
        # (a slice gone in one build and back in the next, a file caught while rewritten: the
        # same change still)
        gone = {o.key: seen.pop(o.key) for o in removed if o.kind == "EndpointSlice" and o.key in seen}
        before = {**self._gone_triggers, **gone}
        for key, values in trigger_times(added).items():
            if before.get(key) != values[0]:
                self._triggers[key] = values
            seen[key] = values[0]
        self._gone_triggers = {k: v for k, v in gone.items() if k not in seen}

    def _count_changes(self, added: list[SourceObject], removed: list[SourceObject]) -> None:
        """Count changed Services and EndpointSlices (an update is one removal plus one addition)."""
        keys = {(o.kind, o.namespace, o.name) for o in (*added, *removed) if o.kind in ("Service", "EndpointSlice")}
        for kind, _, _ in keys:
            (self.metrics.service_changes if kind == "Service" else self.metrics.endpoint_changes).inc()

    # -- syncing -----------------------------------------------------------------------------

    def sync(self, kind: str) -> SyncReport:
        with gcpolicy.paused():
            report = self._sync(kind)
        gcpolicy.after_sync(report.kernel_read or not report.ok)
        self._last_end = self.clock.monotonic()
        return report

    def _sync(self, kind: str) -> SyncReport:
        start = self.clock.monotonic()
        hup, self._hup = self._hup, False  # (SIGHUP; one that comes during this sync counts for the next)
        if hup:
            self.notifier.reloading()  # (READY=1 again once this sync has ended: _remember)
            if (rescan := getattr(self.source, "rescan", None)) is not None:
                rescan()  # (the whole source read again, not just the files it saw change)
        with self._lock:
            was_dirty, self._dirty = self._dirty or hup, False
        full = kind == "full"
        if full:
            self._last_full = start
        if self.source is not None and (was_dirty or full or self.desired is None):
            self._refresh_desired()
            # a wait for git to finish writing the tree is not the sync's work (its duration metric)
            start += getattr(self.source, "waited_for_git", 0.0)
        if self.desired is None:  # never had valid input: leave the kernel alone
            self.health.updated()
            report = SyncReport(kind, ok=True)
            again = bool(self.syncs) and self.syncs[-1].ok and self.syncs[-1].no_input  # (said once)
            report.no_input = True
            log.log(logging.DEBUG if again else logging.INFO, "sync %s: no valid input yet, kernel left as it is",
                    kind, extra=_fields(sync=kind))
            return self._remember(report)
        report = self._sync_kernel(full, start)
        if not report.ok and not full and not (self._stop is not None and self._stop.is_set()):
            # (not once asked to stop: no new transaction then, the failed one is left to the next start)
            log.warning("incremental sync failed (%s); retrying with a full resync", report.error,
                        extra=_fields(sync=kind, error=report.error))
            self._last_full = start
            # (timed on its own, as kube-proxy's next sync)
            report = self._sync_kernel(True, self.clock.monotonic())
        return self._remember(report)

    def _remember(self, report: SyncReport) -> SyncReport:
        self.syncs.append(report)
        del self.syncs[:-50]
        self._failed_in_a_row = 0 if report.ok else self._failed_in_a_row + 1
        self.notifier.synced(self._status_line(report))
        return report

    def _status_line(self, report: SyncReport) -> str:
        """What a sync leaves the service in, in a line (systemd's STATUS=, see sdnotify)."""
        shown = self._input.shown[1] if self._input.shown is not None else None
        if report.no_input:
            return "no valid input yet, kernel left as it is" + (f": {shown}" if shown else "")
        if not report.ok:
            return f"sync failed ({self._failed_in_a_row} in a row): {report.error}"
        ports = len(self.desired.services) if self.desired is not None else 0
        line = f"in sync: {ports} service port{'' if ports == 1 else 's'} ({self.opts.mode})"
        if self._input.source_failing is not None:
            return f"{line}; source failing, its last state kept: {self._input.source_failing}"
        return f"{line}; input error, last good state kept: {shown}" if shown else line

    def _sync_kernel(self, full: bool, start: float) -> SyncReport:
        kind = "full" if full else "incremental"
        desired = self.desired
        assert desired is not None
        check = self.drift_check
        if self.applied_model is None:  # nothing applied yet: all of it is a change to make
            self.health.queued_update()
        # a full resync reads the kernel back, unless its generation says that nobody has
        # committed anything since our own last commit (see drift.py)
        read = self.applied_model is None or (full and check.needs_read())
        try:
            if read:
                read_at = check.reading()
                planned = make_plan(self.backend, desired, describe=False)
            else:
                leftovers = []
                if full:
                    log.debug("full resync without reading the kernel back: the ruleset generation "
                              "is still %s, where the kernel held what we applied", check.known)
                    leftovers = other_mode_leftovers(self.backend.mode, unseen_only=True)
                planned = make_plan(self.backend, desired, observed_model=self.applied_model,
                                    other_mode=bool(leftovers), leftovers=leftovers, describe=False)
            drift = self._drift(read, desired, planned)
            # (what a failed transaction of ours committed is no one else's doing: not reported)
            ours = self._own_partial
            if drift:  # the kernel is not as we left it: a change to make, like a queued one
                self.health.queued_update()
                conntrack.RECONCILER.recheck()  # (UDP flows made meanwhile may bypass our rules)
            operations = len(planned.plan.operations)
            by_action = Counter(op.action for op in planned.plan.operations)
            rules_written = getattr(self.backend, "rules_written", None)
            written = rules_written(planned.own_operations) if rules_written is not None else {}
            counts = planned.count_services(self.backend)  # the numbers, not the description
            touched = planned.touched(self.backend) if operations else set()
            named = tuple(heapq.nsmallest(LOGGED_SERVICES, touched))
            # nothing to do: the kernel equals the desired model; keep that one (the renderer's
            # objects, which the next diff recognises by identity), not a second, observed copy.
            # apply() lets the plan go before it reads the kernel back (a cold start's peak RSS).
            if operations:
                after = apply(self.backend, planned, verify=read, release=True)
                if read:  # verified at verified_at: by the generation, or by reading it back
                    check.found_in_sync(planned.verified_at)
                else:
                    check.committed(planned.generations)
            else:
                after = planned.desired_model
                if read:
                    check.found_in_sync(read_at)
                clean_conntrack(planned)  # (apply() does it otherwise)
        except Exception as exc:  # noqa: BLE001 - kernel tools, rendering: never kill the loop
            # (a transaction that may have committed part of itself: the next read finds that part)
            self._own_partial = self._own_partial or getattr(exc, "partial", False)
            check.forget()
            return self._failed(kind, start, exc, quiet=not full, whole=read)
        seconds = self.clock.monotonic() - start
        self.applied_model = after
        self.applied_desired = desired
        self._need_full = False
        self._own_partial = False
        if ours:
            drift = 0
        report = SyncReport(kind, True, operations, drift, counts["+"], counts["~"], counts["-"], seconds,
                            kernel_read=read, services=named, services_total=len(touched))
        if read:
            self.metrics.kernel_reads.inc()
        elif full:
            self.metrics.kernel_reads_skipped.inc()
        if drift:
            log.warning("repaired drift: %d operations%s", drift, _of(named, len(touched)),
                        extra=_fields(drift_operations=drift))
            self.metrics.drift_repairs.inc()
            self.metrics.drift_operations.inc(drift)
        rule_counts = getattr(self.backend, "rule_counts", None)
        if rule_counts is not None:
            self.metrics.set_iptables_rules(rule_counts(after), written)
        self._after_success(report, desired, by_action)
        return report

    def _drift(self, read: bool, desired: DesiredState, planned: Planned) -> int:
        """Operations a resync that read the kernel needs although it should be as we left it."""
        if not read or self.applied_model is None or not planned.plan.operations:
            return 0
        if desired == self.applied_desired:
            return len(planned.plan.operations)
        # input changed too: drift is what separates the kernel from what we last applied
        return len(self.backend.diff(self.applied_model, planned.observed_model))

    def _failed(self, kind: str, start: float, exc: Exception, quiet: bool, whole: bool = False) -> SyncReport:
        seconds = self.clock.monotonic() - start
        msg = str(exc).strip() or type(exc).__name__
        self._need_full = True
        # the changes' trigger times are let go, as kube-proxy lets a failed sync's go: kept, they
        # would pile up for as long as syncs fail (every retry takes the source's new ones)
        self._triggers = {}
        m = self.metrics
        m.syncs.labels(kind, "error").inc()
        m.sync_duration.observe(seconds)  # every attempt, as kube-proxy: a slow failure shows too
        (m.full_sync_duration if whole else m.partial_sync_duration).observe(seconds)
        if m.kernel_tool_failures is not None and isinstance(exc, (KernelError, OSError)):
            m.kernel_tool_failures.inc()  # (incremental attempts too: kube-proxy counts each failure)
            if m.partial_failures is not None and kind == "incremental":
                m.partial_failures.inc()
        if not quiet:
            m.kernel_errors.inc()
            if isinstance(exc, (KernelError, OSError)):
                log.error("sync %s failed: %s", kind, msg, extra=_fields(sync=kind, error=msg))
            else:
                log.exception("sync %s failed: %s", kind, msg, extra=_fields(sync=kind, error=msg))
        # (health: a change queued before, or drift found, stays pending and ages toward unhealthy;
        # a resync that failed with nothing to do leaves it healthy, as kube-proxy does)
        return SyncReport(kind, False, seconds=seconds, error=msg)

    def _after_success(self, report: SyncReport, desired: DesiredState, by_action: Counter[str]) -> None:
        m = self.metrics
        m.sync_duration.observe(report.seconds)
        # kube-proxy's "full" syncs are those that rewrite everything (the first, after a failure, and
        # hourly), its periodic ones "partial": ours are those that read the kernel back to plan
        (m.full_sync_duration if report.kernel_read else m.partial_sync_duration).observe(report.seconds)
        m.last_sync.set(self.clock.time())
        m.syncs.labels(report.kind, "success").inc()
        m.observe_operations(by_action)
        m.set_no_local_endpoints(desired)
        m.services.set(len(desired.services))
        # trigger times of the changes since the last applied sync
        times = (t for values in self._triggers.values() for t in values)
        for latency in network_programming_latencies(times, self.clock.time(), self.start_wall):
            m.network_programming.observe(latency)
        self._triggers = {}
        self.health.programmed()
        if self.service_health is not None:
            self.service_health.sync(desired.healthChecks)
        suffix = (f"; the input has errors ({_first_error(self._input.errors)}): changes since the last valid "
                  "input are held back") if self._input.held else ""
        failed = self._failed_in_a_row  # (before this sync: it is remembered after)
        if failed:
            suffix += f"; syncs succeed again, after {failed} failed"
        # a resync that found nothing to do (nor read the kernel) after one that succeeded: every
        # sync period, so at debug level (kube-proxy says nothing of it either)
        quiet = (bool(self.syncs) and not failed and report.operations == 0 and not report.kernel_read
                 and not self._input.held)
        log.log(logging.DEBUG if quiet else logging.INFO,
                "sync %s: service ports +%d ~%d -%d%s, %d operations, %.1fms%s", report.kind, report.added,
                report.changed, report.removed, _of(report.services, report.services_total),
                report.operations, report.seconds * 1000, suffix,
                extra=_fields(sync=report.kind, added=report.added, changed=report.changed,
                              removed=report.removed, operations=report.operations,
                              duration_ms=round(report.seconds * 1000, 1), services=len(desired.services),
                              kernel_read=report.kernel_read, held_back=self._input.held))
        if self.after_first_sync is not None:
            hook, self.after_first_sync = self.after_first_sync, None
            hook()


# ----------------------------------------------------------------------------------------------
# Entry point


LOGGED_SERVICES = 3  # service ports a sync's log line names


def _first_error(errors: tuple[str, ...]) -> str:
    """The first of the input's errors, for each sync's log line while they hold changes back
    (the full list is logged once, when it changes)."""
    first = errors[0] if errors else "logged before"
    first = first if len(first) <= 200 else first[:197] + "..."
    return first + (f"; and {len(errors) - 1} more" if len(errors) > 1 else "")


def _of(services: tuple[str, ...], total: int) -> str:
    """' (a, b, c and 3 more)': the service ports a sync touched, the first few named, for its log
    line."""
    return f" ({name_some(list(services), LOGGED_SERVICES, total=total)})" if services else ""


def nodeport_hosts(desired: DesiredState | None) -> list[str]:
    """The local addresses NodePorts answer on, per the document's nodePort CIDRs ('primary'
    resolved there; a family without: all of its addresses): where healthCheckNodePorts listen."""
    return local_addresses(list(_nodeport_cidrs(desired)))


def _nodeport_cidrs(desired: DesiredState | None) -> tuple[str, ...]:
    if desired is None:
        return tuple(EVERY_ADDRESS.values())
    cidrs: list[str] = []
    for family, f in desired.families.items():
        cidrs += [EVERY_ADDRESS[family]] if f.nodePortCIDRs is None else f.nodePortCIDRs
    return tuple(cidrs)


class NodePortHosts:
    """nodeport_hosts() of the run loop's current document, asked at every sync that has health
    checks (see ServiceHealthServers): the local addresses are listed again when the CIDRs change
    (the Node's IP, with nodePortAddresses `primary`) and at most every `ttl` seconds otherwise (an
    address made or renumbered inside them, or a listing that failed), not at every sync."""

    def __init__(self, desired: Callable[[], DesiredState | None], ttl: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._desired = desired
        self._ttl, self._clock = ttl, clock
        self._last: tuple[tuple[str, ...], float, list[str]] | None = None

    def __call__(self) -> list[str]:
        cidrs, now = _nodeport_cidrs(self._desired()), self._clock()
        if self._last is None or self._last[0] != cidrs or now - self._last[1] >= self._ttl:
            self._last = (cidrs, now, local_addresses(list(cidrs)))
        return self._last[2]


def run(args: argparse.Namespace, opts: Options) -> int:
    """`reconciler run`: returns the exit code (0 after SIGTERM/SIGINT, 1 when the --config file
    changed). (It never describes a plan in service terms, see Planned.count_services: deepdiff
    is not loaded, ~10 MiB.)"""
    from .backends import get_backend

    setup_logging(getattr(args, "log_format", "text") or "text", bool(getattr(args, "verbose", False)))
    if not opts.cluster_cidrs and not opts.masquerade_all:  # (as kube-proxy says at start)
        log.warning("no --cluster-cidr (clusterCIDR): traffic to ClusterIPs from outside the pod network cannot "
                    "be told from pods' and is not masqueraded (replies may not find their way back)")
    backend = get_backend(opts.mode)
    metrics = Metrics(opts.mode)
    daemon = Daemon(opts, backend, None, metrics=metrics, notifier=Notifier())
    hosts: Any = default_hosts() if opts.nodeport_cidrs is None else NodePortHosts(lambda: daemon.desired)
    daemon.service_health = ServiceHealthServers(lambda: daemon.health.healthy, hosts, node=opts.node_name or "")

    # an address in use is retried in the background while we proxy, unless bindAddressHardFail
    listeners = [
        RetryingListener(lambda: start_proxy_health_server(opts.healthz_bind_address, daemon.health, metrics),
                         BIND_RETRY_SECONDS),
        RetryingListener(lambda: start_metrics_server(opts.metrics_bind_address, metrics.registry, opts.mode,
                                                     configz(opts)),
                         BIND_RETRY_SECONDS),
    ]
    source: Source | None = None
    recorder: EventRecorder | None = None
    stop = threading.Event()
    config_changed = threading.Event()
    # first: SIGTERM while starting (the instance lock, the listeners, the source) stops it with
    # its log line, SIGHUP asks for the first sync's full read (which it is anyway)
    saved_handlers = _install_signal_handlers(stop, daemon)

    def exit_for_new_config() -> None:
        config_changed.set()
        stop.set()
        daemon.wake()

    # (made now, holding the file's content as read moments ago: an edit from here on counts)
    config_watch = ConfigFileWatch(args.config, exit_for_new_config) if getattr(args, "config", None) else None
    instance = None
    try:
        instance = instance_lock.acquire()  # (before anything listens or programs)
        if args.source == "kubernetes":  # (its API client first: the Events of the listeners below)
            source = KubeSource(opts.kubeconfig, opts.node_name, daemon.notify)
            recorder = start_events(api_sender(source.client), opts.node_name, daemon.service_health, listeners[0])
        else:
            source = DirectorySource(args.source, daemon.notify, stop_event=stop)
        hard_fail = opts.bind_address_hard_fail
        started = [listener.start(retry=not hard_fail) for listener in listeners]
        if hard_fail and not all(started):
            return 1
        daemon.source = source
        if config_watch is not None:
            config_watch.start()
        source.start()
        log.info("service-reconciler %s running: mode %s, node %s, source %s, sync period %gs, min sync period "
                 "%gs, cluster CIDRs %s, service CIDRs %s, nodePort addresses %s%s", __version__, opts.mode,
                 opts.node_name, args.source, opts.sync_period, opts.min_sync_period,
                 ",".join(opts.cluster_cidrs) or "none", ",".join(opts.service_cidrs) or "none",
                 ",".join(opts.nodeport_cidrs) if opts.nodeport_cidrs is not None else "all",
                 ", masquerade all" if opts.masquerade_all else "",
                 extra=_fields(version=__version__, mode=opts.mode, node=opts.node_name, source=args.source))
        if source.kind == "kubernetes":
            log.info("waiting for the Service, EndpointSlice and Node caches to sync")
        if not conntrack_sysctls.tune(opts, retry_later=True):  # (nf_conntrack not loaded: our rules load it)
            daemon.after_first_sync = lambda: conntrack_sysctls.tune(opts)
        daemon.run_forever(stop)
        daemon.notifier.stopping()
        log.info("stopping; kernel state left in place")
        return 1 if config_changed.is_set() else 0
    except (InputError, ValueError, instance_lock.AlreadyRunning) as exc:
        log.error("%s", exc)
        return 1
    finally:
        instance_lock.release(instance)
        if config_watch is not None:
            config_watch.stop()
        if source is not None:
            source.stop()
        if daemon.service_health is not None:
            daemon.service_health.close()
        if recorder is not None:
            recorder.stop()
        for listener in listeners:
            listener.close()
        for signum, previous in saved_handlers.items():
            signal.signal(signum, previous)


def start_events(send: Sender, node: str, service_health: ServiceHealthServers | None,
                 healthz: RetryingListener | None = None) -> EventRecorder:
    """Kube-proxy's Events, from the API source's `run`: Starting on the Node now,
    FailedToStartProxierHealthcheck on it when /healthz cannot listen, and
    FailedToStartServiceHealthcheck on a Service whose health check port cannot be opened."""
    recorder = EventRecorder(send, node)
    recorder.start()
    recorder.record(node_ref(node), "Normal", "Starting", "StartKubeProxy", "")  # (kube-proxy's birth cry)
    if healthz is not None:
        healthz.on_error = lambda exc: recorder.record(node_ref(node), "Warning", "FailedToStartProxierHealthcheck",
                                                       "StartKubeProxy", f"failed to start proxier healthz: {exc}")
    if service_health is not None:
        def failed(service: str, message: str) -> None:
            namespace, _, name = service.partition("/")
            recorder.record(service_ref(namespace, name), "Warning", "FailedToStartServiceHealthcheck", "Listen",
                            message)
        service_health.on_failure = failed
    return recorder


def _install_signal_handlers(stop: threading.Event, daemon: Daemon) -> dict[int, Any]:
    """SIGTERM/SIGINT only set the stop flag: the sync in progress completes (its transaction is
    atomic anyway), then the loop exits. SIGHUP asks for a full resync now (as a reload does
    elsewhere). Returns the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum: int, _frame: Any) -> None:
        if not stop.is_set():
            log.info("received %s: finishing the current sync, then exiting", signal.Signals(signum).name)
        stop.set()
        daemon.wake()

    def hangup(_signum: int, _frame: Any) -> None:
        log.info("received SIGHUP: a full resync now (the source read again, the kernel checked)")
        daemon.resync_now()

    previous = {}
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous[signum] = signal.signal(signum, handler)
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, hangup)
    return previous

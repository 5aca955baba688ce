"""`reconciler run`: the sync loop's logic (injected clock + a fake backend: unit tests only, the
kernel is never faked in e2e tests), the watched directory's per-file cache, logging, metrics, and
the Kubernetes path for real: the daemon as a subprocess in a network namespace against
tests/fakeapi.py with the real nftables backend."""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from prometheus_client import generate_latest

from helpers import build, endpoint, endpoint_slice, heard, node, notify_socket, service
from reconciler.backends.base import KernelError, Operation
from reconciler.config import Options
from reconciler.daemon import Daemon, setup_logging
from reconciler.backends.generation import next_generation
from reconciler.health import FakeClock, rfc3339
from reconciler.sources import watch as watch_mod
from reconciler.sources.kubernetes import ChangeLog
from reconciler.sources.objects import InputError, Location, SourceObject, SourceUnavailable
from reconciler.sources.watch import DirectorySource, Snapshot

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests import netns as throwaway_netns
from tests.fakeapi import FakeAPIServer, endpoint_slice as api_slice, node as api_node, service as api_service  # noqa: E402,I001

SYNC, MIN_SYNC = 30.0, 1.0
HTTP = [{"name": "http", "port": 80, "protocol": "TCP"}]


def wait_until(pred: Callable[[], Any], timeout: float = 5.0, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    return pred()


# --------------------------------------------------------------------------------------- fakes


class FakeBackend:
    """A kernel model {service port id: digest}; counts kernel reads and transactions. Like
    nf_tables, it counts commits in a generation (None: a kernel that keeps none, legacy
    iptables), and apply() names the generations its commits produced (names_commits=False: it
    cannot tell, as for a transaction that might commit nothing); tamper() is somebody else's
    commit."""

    mode = "fake"

    def __init__(self, generation: int | None = 1) -> None:
        self.kernel: dict[str, str] = {}
        self.observes = 0
        self.applies: list[list[Operation]] = []
        self.fail: Exception | None = None
        self.gen = generation
        self.names_commits = True
        self.cleanup_calls = 0

    def generation(self) -> int | None:
        return self.gen

    def tamper(self, change: Callable[[dict[str, str]], Any]) -> None:
        change(self.kernel)
        if self.gen is not None:
            self.gen += 1

    def render(self, desired: Any) -> dict[str, str]:
        return {s.id: s.digest() for s in desired.services}

    def observe(self) -> dict[str, str]:
        self.observes += 1
        return dict(self.kernel)

    def diff(self, want: dict[str, str], have: dict[str, str]) -> list[Operation]:
        ops = []
        for sid in sorted(set(want) | set(have)):
            if sid not in have:
                ops.append(Operation("+", "service", sid, f"add {sid} {want[sid]}", sid))
            elif sid not in want:
                ops.append(Operation("-", "service", sid, f"delete {sid}", sid))
            elif want[sid] != have[sid]:
                ops.append(Operation("~", "service", sid, f"replace {sid} {want[sid]}", sid))
        return ops

    def unconverged(self, want: dict[str, str]) -> list[Operation]:
        return self.diff(want, self.observe())

    def prepare(self, ops: list[Operation]) -> Callable[[], list[int] | None]:
        return lambda: self.apply(ops)

    def apply(self, ops: list[Operation]) -> list[int] | None:
        if self.fail is not None:
            raise self.fail
        before = dict(self.kernel)
        for op in ops:
            if op.action == "-":
                del self.kernel[op.name]
            else:
                self.kernel[op.name] = op.text.split()[-1]
        self.applies.append(ops)
        if self.gen is None:
            return []
        if self.kernel != before:  # a transaction that changes nothing commits nothing
            self.gen += 1
        produced = [self.gen] if self.kernel != before else []
        return produced if self.names_commits else None

    def service_view(self, model: dict[str, str], only: set[str] | None = None) -> dict[str, dict[str, Any]]:
        return {sid: {"addresses": [d], "endpoints": []} for sid, d in model.items()}

    def removed_unnamed(self, observed, operations) -> set:  # (every operation names its service port)
        return set()

    def cleanup(self, look_first: bool = False) -> list[Operation]:
        self.cleanup_calls += 1
        return [Operation("-", "service", sid, f"delete {sid}", sid) for sid in sorted(self.kernel)]


class FakeSource:
    kind = "directory"

    def __init__(self, objects: list[SourceObject]) -> None:
        self.objects = list(objects)
        self.errors: list[InputError] = []
        self.is_ready = True
        self.snapshots = 0

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def ready(self) -> bool:
        return self.is_ready

    def snapshot(self) -> Snapshot:
        self.snapshots += 1
        return Snapshot(objects=list(self.objects), errors=list(self.errors), changed=True)


def web(ip: str = "10.96.0.10", eps: tuple[str, ...] = ("10.244.1.10",), name: str = "web") -> list[SourceObject]:
    return [service(name, ip, HTTP), endpoint_slice(name, [endpoint(e) for e in eps], port=8080)]


def make(objects: list[SourceObject] | None = None, generation: int | None = 1,
         **opts: Any) -> tuple[Daemon, FakeBackend, FakeSource, FakeClock]:
    clock = FakeClock()
    backend = FakeBackend(generation)
    source = FakeSource(web() if objects is None else objects)
    o = Options(node_name="node-a", sync_period=opts.pop("sync_period", SYNC),
                min_sync_period=opts.pop("min_sync_period", MIN_SYNC), **opts)
    return Daemon(o, backend, source, clock=clock), backend, source, clock


def value(d: Daemon, name: str, labels: dict[str, str] | None = None) -> float:
    v = d.metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if v is None else v


# ------------------------------------------------------------------------------------ the loop


def test_first_sync_is_full_then_nothing_until_something_happens() -> None:
    d, backend, source, clock = make()
    assert d.due() == ("full", 0.0)
    report = d.step()
    assert report is not None and report.kind == "full" and report.ok and report.added == 1
    assert backend.kernel == {"default/web:http/TCP": d.desired.services[0].digest()}  # type: ignore[union-attr]
    kind, wait = d.due()
    assert kind is None and wait == pytest.approx(SYNC, abs=1e-3)
    clock.advance(SYNC - 0.01)
    assert d.step() is None


@pytest.mark.parametrize("generation", [1, None], ids=["generation", "no generation"])
def test_the_first_sync_reads_back_only_when_the_generation_cannot_vouch(generation: int | None) -> None:
    d, backend, source, clock = make(generation=generation)
    assert d.step().kernel_read  # type: ignore[union-attr]
    # read before planning; the commit that followed it alone: no read-back (else one)
    assert backend.observes == (1 if generation else 2)
    assert d.drift_check.known == (2 if generation else None)
    assert not resync(d, clock).kernel_read if generation else resync(d, clock).kernel_read


def test_events_within_min_sync_period_after_a_sync_coalesce_into_one() -> None:
    """Paced as kube-proxy's BoundedFrequencyRunner (v1.34+): a sync starts no sooner than
    min-sync-period after the previous one ended (no bursts); the events in between coalesce."""
    d, backend, source, clock = make()
    d.step()
    clock.advance(5)
    source.objects = web(eps=("10.244.1.10", "10.244.1.11"))
    d.notify()
    first = d.step()  # the last sync ended long ago: runs at once
    assert first is not None and first.kind == "incremental" and first.changed == 1
    syncs = len(d.syncs)
    for i in range(5):  # more events inside one min-sync-period after it
        clock.advance(0.15)
        source.objects = web(eps=("10.244.1.10", "10.244.1.11", f"10.244.2.{10 + i}"))
        d.notify()
        assert d.step() is None
    kind, wait = d.due()
    assert kind is None and wait == pytest.approx(MIN_SYNC - 0.75, abs=1e-3)
    clock.advance(wait + 1e-3)
    report = d.step()
    assert report is not None and report.kind == "incremental"
    assert len(d.syncs) == syncs + 1  # five events, one sync
    assert d.step() is None
    assert len(backend.applies) == 3  # initial, the first change, the coalesced rest
    assert "10.244.2.14" in str(d.desired)
    clock.advance(0.5)  # half a min-sync-period since it ended: the next event waits the rest
    source.objects = web()
    d.notify()
    assert d.step() is None and d.due()[1] == pytest.approx(MIN_SYNC - 0.5, abs=1e-3)


def test_incremental_sync_plans_without_reading_the_kernel() -> None:
    d, backend, source, clock = make()
    d.step()
    reads = backend.observes
    clock.advance(2)
    source.objects = web() + web("10.96.0.11", name="api")
    d.notify()
    report = d.step()
    assert report is not None and report.kind == "incremental" and report.added == 1
    # no read at all: neither the plan nor the (atomic) apply reads the kernel back; the
    # periodic full resync does
    assert backend.observes == reads
    clock.advance(2)
    d.notify()  # an event that changes nothing: no transaction, no read at all
    report = d.step()
    assert report is not None and report.operations == 0
    assert backend.observes == reads


@pytest.mark.parametrize("generation", [1, None], ids=["generation", "no generation"])
def test_full_resync_every_sync_period_repairs_drift(generation: int | None) -> None:
    d, backend, source, clock = make(generation=generation)
    d.step()
    reads = backend.observes
    clock.advance(SYNC)
    report = d.step()
    assert report is not None and report.kind == "full" and report.operations == 0 and report.drift == 0
    # the full resync re-reads the kernel, unless its generation vouches for it
    assert backend.observes == reads + (generation is None)
    assert value(d, "reconciler_drift_repairs_total") == 0
    backend.tamper(dict.clear)  # someone flushed our table
    clock.advance(SYNC)
    report = d.step()
    assert report is not None and report.kind == "full" and report.drift == 1 and report.kernel_read
    assert backend.kernel  # repaired
    assert value(d, "reconciler_drift_repairs_total") == 1
    assert value(d, "reconciler_drift_operations_total") == 1


def resync(d: Daemon, clock: FakeClock) -> Any:
    clock.advance(SYNC)
    report = d.step()
    assert report is not None and report.kind == "full" and report.ok
    return report


def test_resync_reads_the_kernel_only_when_its_generation_moved() -> None:
    d, backend, source, clock = make()
    assert d.step().kernel_read  # type: ignore[union-attr]  # the first sync always reads
    reads = backend.observes
    report = resync(d, clock)
    assert not report.kernel_read and backend.observes == reads and report.operations == 0
    assert value(d, "reconciler_kernel_reads_skipped_total") == 1
    # our own commits keep the generation known: an incremental sync, then a resync
    source.objects = web(eps=("10.244.1.10", "10.244.1.11"))
    d.notify()
    clock.advance(2)
    assert d.step().operations == 1  # type: ignore[union-attr]
    assert not resync(d, clock).kernel_read and backend.observes == reads
    # somebody else commits anything at all (no change to ours): the next resync reads, once
    backend.tamper(lambda kernel: None)
    report = resync(d, clock)
    assert report.kernel_read and report.drift == 0 and backend.observes == reads + 1
    assert not resync(d, clock).kernel_read and backend.observes == reads + 1
    assert value(d, "reconciler_kernel_reads_total") == 2
    assert value(d, "reconciler_kernel_reads_skipped_total") == 3


def test_a_commit_beside_ours_makes_the_next_resync_read() -> None:
    d, backend, source, clock = make()
    d.step()
    real_apply = backend.apply

    def with_a_foreign_commit(ops: list[Operation]) -> list[int] | None:
        backend.tamper(lambda kernel: kernel.clear())  # lands in the same instant
        return real_apply(ops)

    backend.apply = with_a_foreign_commit  # type: ignore[method-assign]
    source.objects = web() + web("10.96.0.11", name="api")
    d.notify()
    clock.advance(2)
    assert d.step().operations == 1  # type: ignore[union-attr]
    backend.apply = real_apply  # type: ignore[method-assign]
    report = resync(d, clock)
    assert report.kernel_read and report.drift == 1 and len(backend.kernel) == 2


def test_a_transaction_that_changed_nothing_beside_a_foreign_commit_is_not_taken_for_ours() -> None:
    d, backend, source, clock = make()
    d.step()
    real_apply = backend.apply

    def somebody_was_quicker(ops: list[Operation]) -> list[int] | None:
        def their_commit(kernel: dict[str, str]) -> None:
            kernel.update({op.name: op.text.split()[-1] for op in ops})  # our very change
            kernel["other"] = "y"  # and more

        backend.tamper(their_commit)
        return real_apply(ops)  # ours then changes nothing: the generation moved once, not by us

    backend.apply = somebody_was_quicker  # type: ignore[method-assign]
    source.objects = web(eps=("10.244.1.77",))
    d.notify()
    clock.advance(2)
    assert d.step().operations == 1  # type: ignore[union-attr]
    backend.apply = real_apply  # type: ignore[method-assign]
    report = resync(d, clock)
    assert report.kernel_read and report.drift == 1 and "other" not in backend.kernel


def test_a_backend_that_cannot_name_its_commits_is_read_after_them() -> None:
    d, backend, source, clock = make()
    backend.names_commits = False  # (a transaction that might have committed nothing)
    d.step()
    assert not resync(d, clock).kernel_read  # nobody committed: still vouched for
    source.objects = web(eps=("10.244.1.78",))
    d.notify()
    clock.advance(2)
    assert d.step().operations == 1  # type: ignore[union-attr]
    assert resync(d, clock).kernel_read
    assert not resync(d, clock).kernel_read


def test_generations_wrap_around_skipping_zero() -> None:
    assert next_generation(1) == 2 and next_generation(0xFFFFFFFE) == 0xFFFFFFFF
    assert next_generation(0xFFFFFFFF) == 1
    d, backend, source, clock = make(generation=0xFFFFFFFE)
    d.step()  # the first sync's commit: 0xFFFFFFFF, then the kernel's next is 1
    real_apply = backend.apply

    def wrapping(ops: list[Operation]) -> list[int] | None:
        produced = real_apply(ops)
        backend.gen = 1
        return [1] if produced else produced

    backend.apply = wrapping  # type: ignore[method-assign]
    source.objects = web(eps=("10.244.1.79",))
    d.notify()
    clock.advance(2)
    assert d.step().operations == 1  # type: ignore[union-attr]
    assert d.drift_check.known == 1 and not resync(d, clock).kernel_read


def test_an_incremental_commit_after_a_foreign_one_does_not_vouch_for_the_kernel() -> None:
    d, backend, source, clock = make(web() + web("10.96.0.11", name="api"))
    d.step()
    backend.tamper(lambda kernel: kernel.pop("default/api:http/TCP"))  # drift, then our commit
    source.objects = web(eps=("10.244.1.99",)) + web("10.96.0.11", name="api")
    d.notify()
    clock.advance(2)
    assert d.step().kind == "incremental"  # type: ignore[union-attr]
    report = resync(d, clock)
    assert report.kernel_read and report.drift == 1 and "default/api:http/TCP" in backend.kernel


@pytest.mark.parametrize("in_sync", [True, False], ids=["read finds it in sync", "read repairs"])
def test_a_commit_during_the_read_makes_the_next_resync_read_again(in_sync: bool) -> None:
    d, backend, source, clock = make()
    d.step()
    backend.tamper(lambda kernel: None if in_sync else kernel.clear())
    real_observe = backend.observe

    def observe_while_somebody_commits() -> dict[str, str]:
        seen = real_observe()
        backend.tamper(lambda kernel: None)
        return seen

    backend.observe = observe_while_somebody_commits  # type: ignore[method-assign]
    report = resync(d, clock)
    assert report.kernel_read and report.drift == (0 if in_sync else 1)
    backend.observe = real_observe  # type: ignore[method-assign]
    assert resync(d, clock).kernel_read  # what came after the read is not known
    assert not resync(d, clock).kernel_read


def test_a_resync_that_trusts_the_generation_still_asks_for_unseen_leftovers(monkeypatch: pytest.MonkeyPatch) -> None:
    import reconciler.daemon as daemon_mod

    asked: list[tuple[str, bool]] = []
    monkeypatch.setattr(daemon_mod, "other_mode_leftovers",
                        lambda mode, look_first=False, unseen_only=False: asked.append((mode, unseen_only)) or [])
    d, backend, source, clock = make()
    d.step()
    assert not resync(d, clock).kernel_read
    assert asked == [("fake", True)]


def test_the_kernel_is_read_at_least_hourly_and_after_a_failure() -> None:
    d, backend, source, clock = make()
    d.step()
    kinds = [resync(d, clock).kernel_read for _ in range(int(3600 / SYNC))]
    assert kinds == [False] * (int(3600 / SYNC) - 1) + [True]  # the 120th resync is an hour after the read
    backend.fail = KernelError("nft: Error")
    source.objects = web(eps=("10.244.1.12",))
    d.notify()
    clock.advance(2)
    assert d.step().ok is False  # type: ignore[union-attr]
    backend.fail = None
    assert resync(d, clock).kernel_read


def test_sync_lines_say_what_matters_at_info(caplog: pytest.LogCaptureFixture) -> None:
    """A resync with nothing to do, every period, is a debug line; the first sync, changes,
    recovery after failures and held-back input are info lines."""
    def lines() -> list[tuple[str, str]]:
        out = [(r.levelname, r.getMessage()) for r in caplog.records if r.getMessage().startswith("sync ")]
        caplog.clear()
        return out

    d, backend, source, clock = make()
    with caplog.at_level(logging.DEBUG, logger="reconciler.daemon"):
        d.step()
        assert [level for level, _ in lines()] == ["INFO"]
        resync(d, clock)
        assert [level for level, _ in lines()] == ["DEBUG"]
        backend.fail = KernelError("nft: Error")
        source.objects = web(eps=("10.244.1.12",))
        for _ in range(2):
            d.notify()
            clock.advance(SYNC)
            assert d.step().ok is False  # type: ignore[union-attr]
        backend.fail = None
        resync(d, clock)
        (level, msg), = [line for line in lines() if not line[1].startswith("sync full failed")]
        assert level == "INFO" and msg.endswith("; syncs succeed again, after 2 failed"), msg
        resync(d, clock)
        assert [level for level, _ in lines()] == ["DEBUG"]


def test_api_requests_are_exported_as_client_go_does() -> None:
    """rest_client_requests_total{code, host, method}: what dashboards built for kube-proxy chart."""
    d, _, source, _ = make()
    source.requests = ("10.0.0.1:6443", {"200": 3, "<error>": 1})  # type: ignore[attr-defined]
    d._poll_source_errors()
    source.requests = ("10.0.0.1:6443", {"200": 5, "<error>": 1, "503": 2})  # type: ignore[attr-defined]
    d._poll_source_errors()
    got = {code: value(d, "rest_client_requests_total", {"code": code, "host": "10.0.0.1:6443", "method": "GET"})
           for code in ("200", "<error>", "503")}
    assert got == {"200": 5, "<error>": 1, "503": 2}


def test_api_bodies_are_let_go_once_built(tmp_path: Path) -> None:
    """As a directory's: once built, a Service's or EndpointSlice's body is cut down, to a
    fingerprint and a slice's Service (10k Services: the bodies were ~1/3 of the process). An
    object the build refused keeps its body (read again when it changes); a relist of the same
    state changes nothing; a real change is built from the new body."""
    with FakeAPIServer(bookmark_interval=None) as api:
        api.create(api_service("web", cluster_ip="10.96.0.10"))
        api.create(api_slice("web-1", "web", ["10.244.1.5"]))
        api.create(api_service("bad", cluster_ip="10.96.0.300"))
        api.create(api_node("node-a"))
        with api_daemon(api, tmp_path) as (d, backend, clock, source):
            assert d.step().ok  # type: ignore[union-attr]
            assert list(backend.kernel) == ["default/web:http/TCP"]
            informers = {inf.kind: inf.cache for inf in source.source._informers}
            web_svc, web_slice = informers["Service"][("default", "web")], informers["EndpointSlice"][("default", "web-1")]
            assert list(web_svc) == ["fingerprint"] and sorted(web_slice) == ["fingerprint", "service"]
            assert web_slice["service"] == "web"  # (a deleted slice's Service: see ChangeLog)
            assert "spec" in informers["Service"][("default", "bad")]  # (refused: kept whole)
            assert "status" in informers["Node"][("", "node-a")]
            before = {o.key: o for o in source.snapshot().objects}
            api.expire_watches = True
            api.close_watches()  # (every watch 410: a relist of the same state)
            assert wait_until(lambda: source.source.counters["relists"] >= 3, timeout=5)
            api.expire_watches = False
            after = {o.key: o for o in source.snapshot().objects}
            assert all(after[k] is before[k] for k in before), "a relist of the same state made new objects"
            api.update(api_slice("web-1", "web", ["10.244.1.6"]))
            api.update(api_service("bad", cluster_ip="10.96.0.31"))
            bodies = lambda: str([o.body for o in source.snapshot().objects])  # noqa: E731
            assert wait_until(lambda: "'10.96.0.31'" in bodies() and "10.244.1.6" in bodies(), timeout=15)
            clock.advance(SYNC)
            report = d.step()
            assert report is not None and report.ok
            assert sorted(backend.kernel) == ["default/bad:http/TCP", "default/web:http/TCP"]
            assert "10.244.1.6" in str(d.desired.services)  # type: ignore[union-attr]
            slices = next(inf.cache for inf in source.source._informers if inf.kind == "EndpointSlice")
            assert "endpoints" not in slices[("default", "web-1")]  # (released)
            api.delete("EndpointSlice", "default", "web-1")
            assert wait_until(lambda: source.changes()[3] == 1, timeout=15)
            assert source.take_changes()[1] == {("default", "web")}  # (its Service's trigger times dropped)


def test_an_api_service_built_before_keeps_its_ports_against_a_newcomer(tmp_path: Path) -> None:
    """A Service that arrives on the ClusterIP and port of one built before is the one refused,
    even when the older one is rebuilt in the same batch (its endpoints changed) and its name
    sorts later: the older one's body was let go once built, so refusing it would lose it until
    the server changed it."""
    with FakeAPIServer(bookmark_interval=None) as api:
        api.create(api_service("zzz", cluster_ip="10.96.0.10"))
        api.create(api_slice("zzz-1", "zzz", ["10.244.1.5"]))
        api.create(api_node("node-a"))
        with api_daemon(api, tmp_path) as (d, backend, clock, source):
            assert d.step().ok  # type: ignore[union-attr]
            api.create(api_service("aaa", cluster_ip="10.96.0.10"))
            api.update(api_slice("zzz-1", "zzz", ["10.244.1.6"]))
            bodies = lambda: str([o.body for o in source.snapshot().objects])  # noqa: E731
            assert wait_until(lambda: "10.244.1.6" in bodies() and "'aaa'" in bodies(), timeout=15)
            clock.advance(SYNC)
            assert d.step().ok  # type: ignore[union-attr]
            assert list(backend.kernel) == ["default/zzz:http/TCP"]
            assert "10.244.1.6" in str(d.desired.services)  # type: ignore[union-attr]
            assert d.health.body(True)[1]["lastError"].startswith("kubernetes:Service/default/aaa:")
            api.update(api_service("aaa", cluster_ip="10.96.0.11"))
            assert wait_until(lambda: "'10.96.0.11'" in bodies(), timeout=15)
            clock.advance(SYNC)
            assert d.step().ok  # type: ignore[union-attr]
            assert sorted(backend.kernel) == ["default/aaa:http/TCP", "default/zzz:http/TCP"]


@contextlib.contextmanager
def api_daemon(api: FakeAPIServer, tmp_path: Path) -> Iterator[tuple[Daemon, FakeBackend, FakeClock, Any]]:
    """A Daemon on a started KubeSource reading `api` (synced), stopped afterwards."""
    from reconciler.daemon import KubeSource

    cfg = tmp_path / "kubeconfig"
    cfg.write_text(f"apiVersion: v1\nkind: Config\nclusters: [{{name: f, cluster: {{server: '{api.url}'}}}}]\n"
                   "users: [{name: u, user: {token: t}}]\ncontexts: [{name: f, context: {cluster: f, user: u}}]\n"
                   "current-context: f\n")
    clock, backend = FakeClock(), FakeBackend()
    d = Daemon(Options(node_name="node-a", sync_period=SYNC, min_sync_period=MIN_SYNC), backend, None, clock=clock)
    source = KubeSource(str(cfg), "node-a", d.notify)
    d.source = source
    source.start()
    try:
        assert wait_until(source.ready, timeout=5)
        yield d, backend, clock, source
    finally:
        source.stop()


def test_an_api_out_of_reach_reports_degraded_until_it_answers_again() -> None:
    """While the source cannot be read (an informer's requests fail: the API server out of reach,
    or refusing us), /healthz says `degraded` with the reason, and reconciler_input_degraded is 1,
    as the README says; a sync meanwhile (its objects as last seen) does not clear it. Once it
    answers, the input's own errors, if any, are what is shown; else nothing."""
    d, _, source, clock = make()
    d.step()
    reason = "source: the API server cannot be read (Service informer: connection refused); retrying"
    source.failing = reason  # type: ignore[attr-defined]
    d._poll_source_errors()
    code, body = d.health.body(with_node=True)
    assert code == 200 and body["degraded"] is True and body["lastError"] == reason
    assert value(d, "reconciler_input_degraded") == 1
    clock.advance(SYNC)
    d.step()  # a periodic resync, with what the source last had
    assert d.health.body(with_node=True)[1]["lastError"] == reason
    source.errors = [InputError(Location("api: Service default/web", 0, 0), "must be 1-65535", ("spec",))]
    d.notify()
    clock.advance(SYNC)
    d.step()  # an invalid object while the API is out of reach: the source's state first
    assert d.health.body(with_node=True)[1]["lastError"] == reason
    source.failing = None  # type: ignore[attr-defined]
    d._poll_source_errors()
    body = d.health.body(with_node=True)[1]
    assert body["degraded"] is True and "must be 1-65535" in body["lastError"]
    source.errors = []
    d.notify()
    clock.advance(SYNC)
    d.step()
    assert d.health.body(with_node=True)[1]["degraded"] is False and value(d, "reconciler_input_degraded") == 0


def test_drift_logged(caplog: pytest.LogCaptureFixture) -> None:
    d, backend, source, clock = make(web() + web("10.96.0.11", name="api"))
    d.step()
    backend.tamper(dict.clear)
    clock.advance(SYNC)
    with caplog.at_level(logging.INFO, logger="reconciler.daemon"):
        d.step()
    assert "repaired drift: 2 operations" in caplog.text
    assert "sync full: service ports +2 ~0 -0 (default/api:http/TCP, default/web:http/TCP), 2 operations" in caplog.text


def test_drift_counted_when_input_changed_in_the_same_resync() -> None:
    d, backend, source, clock = make(web() + web("10.96.0.11", name="api"))
    d.step()
    backend.tamper(lambda k: k.pop("default/api:http/TCP"))  # drift
    source.objects = web(eps=("10.244.1.99",)) + web("10.96.0.11", name="api")  # and a real change
    clock.advance(SYNC)
    d.notify()
    report = d.step()
    assert report is not None and report.kind == "full" and report.operations == 2 and report.drift == 1


def test_invalid_input_keeps_last_good_state() -> None:
    d, backend, source, clock = make()
    d.step()
    kernel = dict(backend.kernel)
    clock.advance(2)
    source.objects = []
    source.errors = [InputError(Location("state/web.yaml", 12, 7), "must be 1-65535", ("spec", "ports", 0, "port"))]
    d.notify()
    report = d.step()
    assert report is not None and report.ok
    assert backend.kernel == kernel  # nothing removed
    assert value(d, "reconciler_source_errors_total", {"reason": "invalid"}) == 1
    code, body = d.health.body(with_node=True)
    assert code == 200 and body["degraded"] is True
    assert body["lastError"] == "state/web.yaml:12:7: spec.ports[0].port: must be 1-65535"
    # the same error again (periodic resync) is not counted twice
    clock.advance(SYNC)
    d.step()
    assert value(d, "reconciler_source_errors_total", {"reason": "invalid"}) == 1
    assert backend.kernel == kernel
    # fixed: applied, no longer degraded
    source.errors = []
    source.objects = web(eps=("10.244.1.12",))
    d.notify()
    clock.advance(2)
    report = d.step()
    assert report is not None and report.changed == 1
    assert d.health.body(with_node=True)[1]["degraded"] is False


def test_semantic_errors_from_the_builder_keep_last_good_state(caplog: pytest.LogCaptureFixture) -> None:
    d, backend, source, clock = make()
    d.step()
    kernel = dict(backend.kernel)
    bad = service("bad", "10.96.0.99", [{"name": "http", "port": 70000, "protocol": "TCP"}])
    source.objects = web() + [bad]
    d.notify()
    clock.advance(2)
    with caplog.at_level(logging.ERROR, logger="reconciler.daemon"):
        d.step()
    assert backend.kernel == kernel
    assert "mem:default/bad" in caplog.text and "keeping the last good state" in caplog.text


def test_no_valid_input_at_start_leaves_the_kernel_alone() -> None:
    d, backend, source, clock = make()
    backend.kernel = {"default/old:http/TCP": "x"}  # programmed by a previous run
    source.errors = [InputError(Location("state/a.yaml", 1, 1), "invalid YAML")]
    d.step()
    assert backend.kernel == {"default/old:http/TCP": "x"}
    assert backend.applies == []


def test_kernel_error_is_counted_retried_next_period_and_ages_health() -> None:
    d, backend, source, clock = make()
    d.health.updated()  # as run_forever does at start
    backend.fail = KernelError("nft: Error: Could not process rule")
    report = d.step()
    assert report is not None and not report.ok
    assert value(d, "reconciler_kernel_errors_total") == 1
    assert value(d, "reconciler_syncs_total", {"type": "full", "result": "error"}) == 1
    kind, wait = d.due()
    assert kind is None and wait == pytest.approx(SYNC, abs=1e-3)  # retried on the next period
    clock.advance(SYNC)
    assert d.step().ok is False  # type: ignore[union-attr]
    assert d.health.body(with_node=True)[0] == 200
    clock.advance(SYNC)  # a change has been pending for 2 x syncPeriod
    assert d.health.body(with_node=True)[0] == 503
    backend.fail = None
    report = d.step()
    assert report is not None and report.ok and report.kind == "full"
    assert d.health.body(with_node=True)[0] == 200


def test_failed_resyncs_with_nothing_to_do_leave_health_alone_but_unrepaired_drift_ages_it() -> None:
    """As kube-proxy: /healthz turns 503 when a change waits 2 x syncPeriod, not when periodic
    resyncs with nothing to do fail. Drift a resync found and could not repair is such a change."""
    d, backend, source, clock = make(generation=None)  # (no generation: every resync reads)
    d.health.updated()
    assert d.step().ok  # type: ignore[union-attr]

    def unreadable() -> dict[str, str]:
        raise KernelError("nft: netlink: Error: Operation not permitted")

    backend.observe = unreadable  # type: ignore[method-assign]
    for _ in range(3):
        clock.advance(SYNC)
        assert d.step().ok is False  # type: ignore[union-attr]
        assert d.health.body(with_node=True)[0] == 200
    del backend.observe
    backend.tamper(lambda k: k.clear())  # somebody removed our rules...
    backend.fail = KernelError("nft: Error: Could not process rule")  # ...and we cannot put them back
    for status in (200, 200, 503):
        clock.advance(SYNC)
        assert d.step().ok is False  # type: ignore[union-attr]
        assert d.health.body(with_node=True)[0] == status


def change_with_the_next_apply_failing(d: Daemon, backend: FakeBackend, source: FakeSource, clock: FakeClock,
                                       error: str = "nft: No such file or directory", takes: float = 0.0) -> None:
    """An endpoint changes (an incremental sync is due) and the backend's next apply fails once
    with `error`; each apply takes `takes` seconds of the clock."""
    real_apply = backend.apply
    calls = []

    def apply_once_failing(ops: list[Operation]) -> list[int] | None:
        calls.append(ops)
        clock.advance(takes)
        if len(calls) == 1:
            raise KernelError(error)
        return real_apply(ops)

    backend.apply = apply_once_failing  # type: ignore[method-assign]
    source.objects = web(eps=("10.244.1.77",))
    d.notify()
    clock.advance(2)


def test_failed_incremental_sync_falls_back_to_a_full_one() -> None:
    d, backend, source, clock = make()
    d.step()
    change_with_the_next_apply_failing(d, backend, source, clock)
    report = d.step()
    assert report is not None and report.ok and report.kind == "full"
    assert value(d, "reconciler_kernel_errors_total") == 0  # recovered at once
    assert value(d, "reconciler_syncs_total", {"type": "incremental", "result": "error"}) == 1


def test_no_retry_once_asked_to_stop() -> None:
    """SIGTERM during an incremental sync that then fails: no new transaction (the full retry) on
    the way out; the next start reads the kernel anyway."""
    d, backend, source, clock = make()
    d.step()
    stop = threading.Event()
    d._stop = stop  # (as run_forever sets it)
    real_apply = backend.apply
    calls: list[Any] = []

    def stopped_then_failing(ops: list[Operation]) -> list[int] | None:
        calls.append(ops)
        stop.set()  # (SIGTERM arrives while the tool runs; the tool then fails)
        raise KernelError("nft: interrupted")

    backend.apply = stopped_then_failing  # type: ignore[method-assign]
    source.objects = web(eps=("10.244.1.77",))
    d.notify()
    clock.advance(2)
    report = d.step()
    assert report is not None and not report.ok and report.kind == "incremental" and len(calls) == 1
    backend.apply = real_apply  # type: ignore[method-assign]


def test_what_our_own_failed_sync_committed_is_no_drift(caplog: pytest.LogCaptureFixture) -> None:
    """iptables commits table by table: a restore that failed after its first table left the
    kernel half-way. The retry completes it; that is not somebody else's drift (the drift alerts
    would fire for it)."""
    d, backend, source, clock = make(objects=web() + web("10.96.0.11", name="api"))
    d.step()
    real_apply = backend.apply
    calls: list[Any] = []

    def half_then_failing(ops: list[Operation]) -> list[int] | None:
        calls.append(ops)
        if len(calls) == 1:
            real_apply(ops[:1])
            error = KernelError("iptables-restore: line 9 failed; committed before it failed: table filter")
            error.partial = True  # (as the iptables backend marks it)
            raise error
        return real_apply(ops)

    backend.apply = half_then_failing  # type: ignore[method-assign]
    source.objects = web(eps=("10.244.1.77",)) + web("10.96.0.11", ("10.244.1.78",), name="api")
    d.notify()
    clock.advance(2)
    report = d.step()
    assert report is not None and report.ok and report.kind == "full" and report.kernel_read
    assert report.drift == 0 and value(d, "reconciler_drift_repairs_total") == 0
    assert "repaired drift" not in caplog.text
    assert backend.kernel == backend.render(d.desired)


def test_a_failed_transaction_that_committed_nothing_hides_no_drift(caplog: pytest.LogCaptureFixture) -> None:
    """An nft transaction is all or nothing, and the usual reason one fails is that somebody else
    removed our table: what the retry then repairs is drift, and said so."""
    d, backend, source, clock = make()
    d.step()
    backend.tamper(lambda k: k.clear())
    real_apply = backend.apply
    calls: list[Any] = []

    def failing_once(ops: list[Operation]) -> list[int] | None:
        calls.append(ops)
        if len(calls) == 1:
            raise KernelError("nft: Error: No such file or directory; did you mean table 'reconciler'?")
        return real_apply(ops)

    backend.apply = failing_once  # type: ignore[method-assign]
    source.objects = web(eps=("10.244.1.77",))
    d.notify()
    clock.advance(2)
    report = d.step()
    assert report is not None and report.ok and report.kernel_read and report.drift > 0
    assert value(d, "reconciler_drift_repairs_total") == 1 and "repaired drift" in caplog.text


def test_no_sync_before_the_source_is_synced() -> None:
    d, backend, source, clock = make()
    source.is_ready = False
    assert d.due()[0] is None
    clock.advance(100)
    assert d.step() is None and source.snapshots == 0
    assert d.health.ready_body()[0] == 503  # (the API's lists not done: not ready, /readyz)
    source.is_ready = True
    d.notify()
    assert d.step() is not None and source.snapshots == 1
    assert d.health.ready_body()[0] == 200


def test_metrics_after_syncs() -> None:
    clock_start = 1_700_000_000.0
    objs = web()
    trigger = "2023-11-14T22:13:22.5Z"  # clock start + 2.5 s
    objs[1].body["metadata"]["annotations"] = {  # type: ignore[index]
        "endpoints.kubernetes.io/last-change-trigger-time": trigger}
    local_svc = service("loc", "10.96.0.12", HTTP, internalTrafficPolicy="Local")
    local_eps = endpoint_slice("loc", [endpoint("10.244.2.10", node="node-b")], port=8080)
    d, backend, source, clock = make(objs + [local_svc, local_eps])
    clock.advance(4)
    d.notify()
    d.step()
    reg = d.metrics.registry
    assert reg.get_sample_value("kubeproxy_network_programming_duration_seconds_count") == 1
    assert reg.get_sample_value("kubeproxy_network_programming_duration_seconds_sum") == pytest.approx(1.5)
    assert reg.get_sample_value("kubeproxy_sync_proxy_rules_last_timestamp_seconds") == clock_start + 4
    assert reg.get_sample_value("kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds") == clock_start + 4
    assert reg.get_sample_value("kubeproxy_sync_proxy_rules_service_changes_total") == 2
    assert reg.get_sample_value("kubeproxy_sync_proxy_rules_endpoint_changes_total") == 2
    assert reg.get_sample_value("kubeproxy_sync_proxy_rules_no_local_endpoints_total",
                                {"traffic_policy": "internal"}) == 1
    assert reg.get_sample_value("kubeproxy_sync_proxy_rules_no_local_endpoints_total",
                                {"traffic_policy": "external"}) == 0
    assert reg.get_sample_value("reconciler_kernel_operations_total", {"action": "add"}) == 2
    assert reg.get_sample_value("kubeproxy_sync_proxy_rules_duration_seconds_count") == 1
    # the same trigger time is not observed again; an unchanged resync changes no counter
    clock.advance(SYNC)
    d.step()
    assert reg.get_sample_value("kubeproxy_network_programming_duration_seconds_count") == 1
    assert reg.get_sample_value("kubeproxy_sync_proxy_rules_service_changes_total") == 2
    text = generate_latest(reg).decode()
    for name in ("kubeproxy_sync_proxy_rules_duration_seconds", "reconciler_drift_repairs_total",
                 "reconciler_source_errors_total", "reconciler_kernel_errors_total"):
        assert f"# TYPE {name} " in text


class RecordingServers:
    """Stands in for ServiceHealthServers: the health checks each sync handed it."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def sync(self, checks: Any) -> list[str]:
        self.calls.append(tuple(checks))
        return []


def test_health_check_servers_follow_the_desired_state() -> None:
    lb = service("lb", "10.96.0.20", [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30080}],
                 type="LoadBalancer", externalTrafficPolicy="Local", healthCheckNodePort=32000)
    eps = endpoint_slice("lb", [endpoint("10.244.1.10"), endpoint("10.244.1.11"),
                                endpoint("10.244.2.10", node="node-b")], port=8080)
    d, backend, source, clock = make([lb, eps, node()])
    servers = RecordingServers()
    d.service_health = servers  # type: ignore[assignment]
    d.step()
    assert [(h.service, h.nodePort, h.localEndpoints) for h in servers.calls[-1]] == [("default/lb", 32000, 2)]


LB_YAML = """apiVersion: v1
kind: Service
metadata: {name: lb, namespace: default}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.20
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
  ports: [{name: http, port: 80, protocol: TCP, nodePort: 30080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: lb-1, namespace: default, labels: {kubernetes.io/service-name: lb}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints: [{addresses: [10.244.1.10], nodeName: node-a}]
"""


def test_a_restart_with_errors_on_a_programmed_kernel_serves_the_health_checks_meanwhile(tmp_path: Path) -> None:
    """The kernel is left as the last process programmed it (its services proxied): their
    healthCheckNodePorts are served from the files without errors, or a load balancer would
    take this node out for the services it does serve."""
    (tmp_path / "lb.yaml").write_text(LB_YAML)
    (tmp_path / "bad.yaml").write_text(SVC_YAML.format(name="b", ip="10.96.0.11", port=70000))
    backend = FakeBackend()
    backend.kernel = {"default/lb:http/TCP": "before"}  # (the last process's)
    d, backend, clock = directory_daemon(tmp_path, backend)
    servers = RecordingServers()
    d.service_health = servers  # type: ignore[assignment]
    d.step()
    assert backend.kernel == {"default/lb:http/TCP": "before"} and backend.applies == []
    assert [(h.service, h.nodePort, h.localEndpoints) for h in servers.calls[-1]] == [("default/lb", 32000, 1)]


def test_node_eligibility_from_the_source(caplog: pytest.LogCaptureFixture) -> None:
    d, backend, source, clock = make(web())
    d.step()
    assert d.node_eligible() is True  # a directory without a Node object
    gone = node()
    gone.body["metadata"]["deletionTimestamp"] = "2024-01-01T00:00:00Z"  # type: ignore[index]
    source.objects = web() + [gone]
    d.notify()
    clock.advance(2)
    with caplog.at_level(logging.INFO, logger="reconciler.daemon"):
        d.step()
        assert d.node_eligible() is False
        assert d.health.body(with_node=True)[0] == 503
        # (why /healthz answers 503 now, and when it no longer does, is in the log)
        source.objects = web() + [node()]
        d.notify()
        clock.advance(2)
        d.step()
    said = [r.getMessage() for r in caplog.records if "eligible" in r.getMessage()]
    assert said == ["Node node-a is not eligible for load balancer traffic: it is being deleted (deletionTimestamp); "
                    "/healthz answers 503",
                    "Node node-a is eligible for load balancer traffic again; /healthz answers 200"]


def test_the_node_is_eligible_until_the_api_caches_have_synced() -> None:
    """kube-proxy knows its Node before it serves: /healthz is not 503 merely because we just
    started; once built from synced caches, a missing Node is ineligible as before."""
    d, backend, source, clock = make(web())
    source.kind = "kubernetes"
    source.is_ready = False
    d.health.updated()
    assert d.step() is None
    code, body = d.health.body(with_node=True)
    assert code == 200 and body["nodeEligible"] is True
    source.is_ready = True
    d.step()
    assert d.node_eligible() is False  # synced, and no Node of ours
    source.objects = web() + [node()]
    d.notify()
    clock.advance(2)
    d.step()
    assert d.node_eligible() is True
    tainted = node()
    tainted.body["spec"] = {"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]}
    source.objects = web() + [tainted]
    d.notify()
    clock.advance(2)
    d.step()
    assert d.node_eligible() is False


def test_run_forever_coalesces_real_events_and_stops() -> None:
    d, backend, source, clock = make(min_sync_period=0.4)
    d.clock = __import__("reconciler.health", fromlist=["SYSTEM_CLOCK"]).SYSTEM_CLOCK
    d._last_full = float("-inf")
    stop = threading.Event()
    t = threading.Thread(target=d.run_forever, args=(stop,), daemon=True)
    t.start()
    try:
        assert wait_until(lambda: len(d.syncs) == 1)
        time.sleep(0.5)
        for i in range(8):  # 8 events within ~0.16 s: one sync at once, at most one more
            source.objects = web(eps=(f"10.244.1.{20 + i}",))  # min-sync-period after it ended
            d.notify()
            time.sleep(0.02)
        assert wait_until(lambda: "10.244.1.27" in str(d.desired), timeout=3)
        time.sleep(0.6)
        assert 2 <= len(d.syncs) <= 3, d.syncs
    finally:
        stop.set()
        d.wake()
        t.join(5)
    assert not t.is_alive()


# ------------------------------------------------------------------------- watched directory


SVC_YAML = """apiVersion: v1
kind: Service
metadata:
  name: {name}
  namespace: default
spec:
  clusterIP: {ip}
  ports:
  - name: http
    port: {port}
    protocol: TCP
"""


@pytest.fixture
def count_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = watch_mod.load_file

    def counting(path: str, **kwargs: Any) -> Any:
        calls.append(os.path.basename(path))
        return real(path, **kwargs)

    monkeypatch.setattr(watch_mod, "load_file", counting)
    return calls


def write(path: Path, text: str) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_directory_cache_rereads_only_changed_files(tmp_path: Path, count_loads: list[str]) -> None:
    for i in range(4):
        (tmp_path / f"s{i}.yaml").write_text(SVC_YAML.format(name=f"s{i}", ip=f"10.96.0.{10 + i}", port=80))
    src = DirectorySource(str(tmp_path))
    snap = src.snapshot()
    assert sorted(count_loads) == ["s0.yaml", "s1.yaml", "s2.yaml", "s3.yaml"] and snap.changed
    assert len(snap.objects) == 4 and not snap.errors
    count_loads.clear()
    assert src.snapshot().changed is False and count_loads == []
    write(tmp_path / "s1.yaml", SVC_YAML.format(name="s1", ip="10.96.0.11", port=81))  # modified
    snap = src.snapshot()
    assert count_loads == ["s1.yaml"] and snap.changed
    assert {o.name: o.body["spec"]["ports"][0]["port"] for o in snap.objects}["s1"] == 81
    count_loads.clear()
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "s9.yaml").write_text(SVC_YAML.format(name="s9", ip="10.96.0.19", port=80))  # added
    (tmp_path / "s2.yaml").unlink()  # deleted
    snap = src.snapshot()
    assert count_loads == ["s9.yaml"]
    assert sorted(o.name for o in snap.objects) == ["s0", "s1", "s3", "s9"]
    assert [os.path.basename(p) for p in snap.removed] == ["s2.yaml"]


def test_named_files_are_checked_without_walking_the_tree(tmp_path: Path, count_loads: list[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """What the watcher names (a manifest, an editor's temporary file) is all a snapshot looks at."""
    for i in range(4):
        (tmp_path / f"s{i}.yaml").write_text(SVC_YAML.format(name=f"s{i}", ip=f"10.96.0.{10 + i}", port=80))
    src = DirectorySource(str(tmp_path))
    src.snapshot()
    walks: list[str] = []
    real_walk = watch_mod.manifest_files
    monkeypatch.setattr(watch_mod, "manifest_files", lambda root, linked=None: walks.append(root) or real_walk(root, linked))
    count_loads.clear()
    write(tmp_path / "s1.yaml", SVC_YAML.format(name="s1", ip="10.96.0.11", port=81))
    src._dirty |= {str(tmp_path / "s1.yaml"), str(tmp_path / ".s1.yaml.tmp"), str(tmp_path / "notes.txt")}
    snap = src.snapshot()
    assert walks == [] and count_loads == ["s1.yaml"] and snap.changed
    assert {o.name: o.body["spec"]["ports"][0]["port"] for o in snap.objects}["s1"] == 81
    (tmp_path / "s3.yaml").unlink()
    (tmp_path / "s4.yaml").write_text(SVC_YAML.format(name="s4", ip="10.96.0.14", port=80))
    src._dirty |= {str(tmp_path / "s3.yaml"), str(tmp_path / "s4.yaml")}
    snap = src.snapshot()
    assert walks == [] and sorted(o.name for o in snap.objects) == ["s0", "s1", "s2", "s4"]
    src._dirty |= {str(tmp_path)}  # a directory event: walk the tree
    src.snapshot()
    assert walks == [str(tmp_path)]


def test_directory_events_trigger_on_change_and_partial_reload(tmp_path: Path, count_loads: list[str]) -> None:
    for i in range(3):
        (tmp_path / f"s{i}.yaml").write_text(SVC_YAML.format(name=f"s{i}", ip=f"10.96.0.{10 + i}", port=80))
    events = threading.Event()
    src = DirectorySource(str(tmp_path), events.set)
    src.snapshot()
    src.start()
    try:
        time.sleep(0.2)  # let the watcher settle
        count_loads.clear()
        events.clear()
        # same size, within one mtime tick on coarse filesystems: the event path forces the re-read
        write(tmp_path / "s0.yaml", SVC_YAML.format(name="s0", ip="10.96.0.10", port=90))
        assert events.wait(5), "no watch event"
        snap = src.snapshot()
        assert count_loads == ["s0.yaml"]
        assert {o.name: o.body["spec"]["ports"][0]["port"] for o in snap.objects}["s0"] == 90
    finally:
        src.stop()
    assert src._thread is not None and not src._thread.is_alive()


def test_directory_errors_and_duplicates(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=80))
    (tmp_path / "b.yaml").write_text("apiVersion: v1\nkind: Service\nmetadata: {name: b\n")
    src = DirectorySource(str(tmp_path))
    snap = src.snapshot()
    assert [o.name for o in snap.objects] == ["a"]
    assert len(snap.errors) == 1 and str(snap.errors[0]).startswith(f"{tmp_path}/b.yaml:")
    (tmp_path / "b.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=80))
    snap = src.snapshot()
    assert len(snap.errors) == 1 and "duplicate Service default/a" in str(snap.errors[0])
    shutil.rmtree(tmp_path)
    snap = src.snapshot()
    assert snap.errors and "no such directory" in str(snap.errors[0])
    assert isinstance(snap.errors[0], SourceUnavailable)  # (counted as reason=source, not invalid)


def directory_daemon(tmp_path: Path, backend: FakeBackend | None = None) -> tuple[Daemon, FakeBackend, FakeClock]:
    """A Daemon on a FakeBackend reading tmp_path as `run --source DIR` does."""
    clock = FakeClock()
    backend = backend or FakeBackend()
    d = Daemon(Options(node_name="node-a"), backend, None, clock=clock)
    d.source = DirectorySource(str(tmp_path), d.notify)
    return d, backend, clock


def next_sync(d: Daemon, clock: FakeClock) -> None:
    """The directory changed: the next sync, min-sync-period later."""
    d.notify()
    clock.advance(2)
    d.step()


def test_daemon_with_directory_source(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=80))
    d, backend, clock = directory_daemon(tmp_path)
    d.step()
    assert list(backend.kernel) == ["default/a:http/TCP"]
    (tmp_path / "b.yaml").write_text("kind: [")
    next_sync(d, clock)
    assert list(backend.kernel) == ["default/a:http/TCP"]
    assert d.health.body(True)[1]["lastError"].startswith(f"{tmp_path}/b.yaml:1")
    caplog.clear()
    (tmp_path / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=81))  # (held back)
    with caplog.at_level(logging.INFO, logger="reconciler.daemon"):
        next_sync(d, clock)
    assert list(backend.kernel) == ["default/a:http/TCP"] and len(backend.applies) == 1
    assert "+0 ~0 -0, 0 operations" in caplog.text and "changes since the last valid input are held back" in caplog.text
    (tmp_path / "b.yaml").unlink()
    (tmp_path / "c.yaml").write_text(SVC_YAML.format(name="c", ip="10.96.0.12", port=80))
    next_sync(d, clock)
    assert list(backend.kernel) == ["default/a:http/TCP", "default/c:http/TCP"]
    assert "lastError" not in d.health.body(True)[1]


def test_sighup_asks_for_a_full_resync_now(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """SIGHUP (a reload, elsewhere) reads the whole source again and syncs, rather than ending
    the process as the default action would; SIGTERM/SIGINT still stop it."""
    import os
    import signal

    from reconciler.daemon import _install_signal_handlers

    (tmp_path / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=80))
    d, backend, clock = directory_daemon(tmp_path)
    d.step()
    (tmp_path / "b.yaml").write_text(SVC_YAML.format(name="b", ip="10.96.0.11", port=80))  # (no watcher here)
    clock.advance(2)
    assert d.step() is None  # nothing told it
    stop = threading.Event()
    previous = _install_signal_handlers(stop, d)
    try:
        with caplog.at_level(logging.INFO, logger="reconciler.daemon"):
            os.kill(os.getpid(), signal.SIGHUP)
        report = d.step()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    assert report is not None and report.kind == "full" and not stop.is_set()
    assert list(backend.kernel) == ["default/a:http/TCP", "default/b:http/TCP"]
    assert "received SIGHUP: a full resync now" in caplog.text
    # the handler may interrupt the loop's own thread while it holds the daemon's lock: it takes none
    done = threading.Event()

    def interrupted() -> None:
        with d._lock:
            d.resync_now()
        done.set()

    threading.Thread(target=interrupted, daemon=True).start()
    assert done.wait(5), "resync_now() blocked on a lock its caller held"
    clock.advance(2)
    assert d.step() is not None  # (and the request stands)


def test_run_logs_the_input_errors_in_file_and_line_order(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """As validate lists them (the build reads EndpointSlices before Services)."""
    (tmp_path / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=70000) + "---\n"
                                     "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n"
                                     "metadata: {name: a-1, labels: {kubernetes.io/service-name: a}}\n"
                                     "addressType: IPv4\nendpoints: [{addresses: [10.244.1.300]}]\n")
    d, backend, _ = directory_daemon(tmp_path)
    d.step()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("invalid input")]
    assert [m.split(f"{tmp_path}/a.yaml:")[1].split(":")[0] for m in lines] == ["10", "17"], lines
    assert d.health.body(True)[1]["lastError"].startswith(f"{tmp_path}/a.yaml:10:")


def test_run_reports_the_objects_errors_beside_a_file_that_does_not_parse(tmp_path: Path) -> None:
    """As validate does: fixing the syntax error should not be the first of two rounds."""
    (tmp_path / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=80))
    d, backend, clock = directory_daemon(tmp_path)
    d.step()
    (tmp_path / "b.yaml").write_text("kind: [")
    (tmp_path / "c.yaml").write_text(SVC_YAML.format(name="c", ip="10.96.0.12", port=70000))
    next_sync(d, clock)
    assert list(backend.kernel) == ["default/a:http/TCP"]
    assert d.health.body(True)[1]["lastError"].startswith(f"{tmp_path}/b.yaml:1")
    assert f"{tmp_path}/c.yaml:10:5: spec.ports[0].port: port 70000 out of range" in " ".join(d._input.errors)


def test_a_trigger_time_read_again_from_a_directory_is_not_a_new_sample(tmp_path: Path) -> None:
    """A file holding a Service and its slice (as kubectl exports them, with the slice's
    last-change-trigger-time) changed in the Service alone: the slice is read again, but its
    trigger time marks no new change; a new trigger time does."""
    start = FakeClock().time()

    def text(label: str, trigger: float, ip: str = "10.244.1.5") -> str:
        return SVC_YAML.format(name="a", ip="10.96.0.10", port=80).replace(
            "  namespace: default\n", f"  namespace: default\n  labels: {{tier: {label}}}\n", 1) + f"""---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: a-1
  namespace: default
  labels: {{kubernetes.io/service-name: a}}
  annotations: {{endpoints.kubernetes.io/last-change-trigger-time: "{rfc3339(trigger)}"}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints: [{{addresses: [{ip}]}}]
"""
    (tmp_path / "a.yaml").write_text(text("web", start + 0.5))
    d, backend, clock = directory_daemon(tmp_path)
    clock.advance(1)
    d.step()
    assert value(d, "kubeproxy_network_programming_duration_seconds_count") == 1
    (tmp_path / "a.yaml").write_text(text("frontend", start + 0.5))  # the Service's label only
    next_sync(d, clock)
    assert value(d, "kubeproxy_network_programming_duration_seconds_count") == 1
    (tmp_path / "a.yaml").write_text(text("frontend", clock.time(), ip="10.244.1.6"))
    next_sync(d, clock)
    assert value(d, "kubeproxy_network_programming_duration_seconds_count") == 2
    assert value(d, "kubeproxy_network_programming_duration_seconds_sum") == pytest.approx(0.5 + 2)


def test_ready_once_a_sync_programmed_the_kernel(tmp_path: Path) -> None:
    """/readyz: a first start on input with nothing valid in it leaves the kernel alone (live,
    not ready)."""
    (tmp_path / "a.yaml").write_text("kind: [")
    d, backend, clock = directory_daemon(tmp_path)
    d.step()
    assert backend.kernel == {} and d.health.body(False)[0] == 200 and d.health.ready_body()[0] == 503
    (tmp_path / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=80))
    next_sync(d, clock)
    assert list(backend.kernel) == ["default/a:http/TCP"] and d.health.ready_body()[0] == 200


def test_no_valid_input_yet_is_said_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "a.yaml").write_text("kind: [")
    d, backend, clock = directory_daemon(tmp_path)
    with caplog.at_level(logging.DEBUG, logger="reconciler.daemon"):
        for _ in range(3):
            d.sync("full")
            clock.advance(SYNC)
    said = [r.levelno for r in caplog.records if "no valid input yet" in r.getMessage()]
    assert said == [logging.INFO, logging.DEBUG, logging.DEBUG] and backend.kernel == {}


def test_a_directory_with_nothing_in_it_is_held_as_an_error(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    """An emptied directory (a wrong --source, a folder cloned again before its checkout, an
    emptied branch) is taken for a mistake: applied, it would remove every service port."""
    (tmp_path / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=80))
    d, backend, clock = directory_daemon(tmp_path)
    d.step()
    assert list(backend.kernel) == ["default/a:http/TCP"]
    (tmp_path / "a.yaml").unlink()
    (tmp_path / "notes.txt").write_text("not a manifest")
    next_sync(d, clock)
    assert list(backend.kernel) == ["default/a:http/TCP"]
    error = d.health.body(True)[1]["lastError"]
    assert error.startswith(f"{tmp_path}: no Service or EndpointSlice in it: taken for a mistake"), error
    assert "invalid input (keeping the last good state)" in caplog.text
    # a failure of the source (a wrong or emptied directory), not an invalid object
    assert value(d, "reconciler_source_errors_total", {"reason": "source"}) == 1
    assert value(d, "reconciler_source_errors_total", {"reason": "invalid"}) == 0
    (tmp_path / "node.yaml").write_text("apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\n")
    next_sync(d, clock)  # (a copy that has written the Node first: still no service of it)
    assert list(backend.kernel) == ["default/a:http/TCP"]
    assert d.health.body(True)[1]["lastError"].startswith(f"{tmp_path}: no Service or EndpointSlice in it")
    (tmp_path / "c.yaml").write_text("kind: [")  # an invalid file beside it: counted as such
    next_sync(d, clock)
    assert value(d, "reconciler_source_errors_total", {"reason": "source"}) == 1
    assert value(d, "reconciler_source_errors_total", {"reason": "invalid"}) == 1
    (tmp_path / "c.yaml").unlink()
    (tmp_path / "b.yaml").write_text(SVC_YAML.format(name="b", ip="10.96.0.11", port=80))  # (the checkout done)
    next_sync(d, clock)
    assert list(backend.kernel) == ["default/b:http/TCP"] and "lastError" not in d.health.body(True)[1]
    (tmp_path / "b.yaml").unlink()  # a process started on it (a wrong --source): the kernel as it is
    caplog.clear()
    again, _, _ = directory_daemon(tmp_path, backend)
    again.step()
    assert list(backend.kernel) == ["default/b:http/TCP"]
    assert "invalid input (nothing applied yet: the kernel is left as it is)" in caplog.text


def test_a_warning_is_logged_once_while_it_holds_and_again_when_it_changes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Every build says that no Node has this node's name, or that a field is unknown; the log
    says it once (and again only when its text changes)."""
    (tmp_path / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=80))
    (tmp_path / "node.yaml").write_text("apiVersion: v1\nkind: Node\nmetadata: {name: node-b}\n")
    d, backend, clock = directory_daemon(tmp_path)
    with caplog.at_level(logging.WARNING, logger="reconciler"):
        d.step()
        (tmp_path / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=81) + "  sessionAfinity: x\n")
        next_sync(d, clock)
        clock.advance(SYNC)
        d.step()  # (a full resync)
        (tmp_path / "node.yaml").write_text("apiVersion: v1\nkind: Node\nmetadata: {name: node-c}\n")
        next_sync(d, clock)
    said = [r.getMessage() for r in caplog.records if "no Node" in r.getMessage() or "unknown field" in r.getMessage()]
    assert [m.replace(f"{tmp_path}/", "") for m in said] == [
        'no Node "node-a" in the input (it has: node-b): this node\'s zone and IPs are unknown, and only endpoints '
        'with nodeName "node-a" are local; is --node-name (or hostnameOverride) right?',
        "a.yaml:12:3: spec.sessionAfinity: unknown field of ServiceSpec, ignored (did you mean sessionAffinity?); "
        "kubectl's strict field validation would refuse it",
        'no Node "node-a" in the input (it has: node-c): this node\'s zone and IPs are unknown, and only endpoints '
        'with nodeName "node-a" are local; is --node-name (or hostnameOverride) right?',
    ]


def test_this_nodes_node_going_from_the_input_is_said_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A directory need not hold the Node; one that did and no longer does changes this node's
    zone and IPs (topology, nodePortAddresses [primary]) without any other sign."""
    (tmp_path / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=80))
    (tmp_path / "node.yaml").write_text(NODE_A)
    d, backend, clock = directory_daemon(tmp_path)
    d.step()
    with caplog.at_level(logging.WARNING, logger="reconciler"):
        (tmp_path / "node.yaml").unlink()
        next_sync(d, clock)
        clock.advance(SYNC)
        d.step()  # (a full resync: not said again)
    said = [r.getMessage() for r in caplog.records if "Node" in r.getMessage()]
    assert said == ['Node "node-a" is no longer in the input: this node\'s zone, labels and IPs are unknown from now on '
                    '(topology, nodePortAddresses [primary])']


def test_first_start_on_a_kernel_without_our_objects_programs_the_readable_files(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=80))
    (tmp_path / "b.yaml").write_text(SVC_YAML.format(name="b", ip="10.96.0.11", port=70000))
    d, backend, clock = directory_daemon(tmp_path)
    d.step()
    assert list(backend.kernel) == ["default/a:http/TCP"]  # rather than nothing
    assert d.health.body(True)[1]["lastError"].startswith(f"{tmp_path}/b.yaml:10:5: spec.ports[0].port")
    first = dict(backend.kernel)
    (tmp_path / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=81))
    next_sync(d, clock)  # once there is a last good state, it stays whole while a file has errors
    assert backend.kernel == first
    assert d.health.body(True)[1]["lastError"].startswith(f"{tmp_path}/b.yaml:10:5: spec.ports[0].port")
    (tmp_path / "b.yaml").write_text(SVC_YAML.format(name="b", ip="10.96.0.11", port=80))
    next_sync(d, clock)
    assert sorted(backend.kernel) == ["default/a:http/TCP", "default/b:http/TCP"]
    assert d.desired is not None and sorted(s.port for s in d.desired.services) == [80, 81]
    assert d.health.body(True)[1].get("lastError") in (None, "")
    assert backend.cleanup_calls == 1


def test_first_start_leaves_out_a_file_that_does_not_parse(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=80))
    (tmp_path / "b.yaml").write_text("kind: [")
    d, backend, clock = directory_daemon(tmp_path)
    d.step()
    assert list(backend.kernel) == ["default/a:http/TCP"]
    assert d.health.body(True)[1]["lastError"].startswith(f"{tmp_path}/b.yaml:1")
    (tmp_path / "b.yaml").write_text(SVC_YAML.format(name="b", ip="10.96.0.11", port=80))
    next_sync(d, clock)
    assert sorted(backend.kernel) == ["default/a:http/TCP", "default/b:http/TCP"]


def test_a_restart_on_a_programmed_kernel_leaves_it_whole_while_a_file_is_unreadable(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=80))
    (tmp_path / "b.yaml").write_text(SVC_YAML.format(name="b", ip="10.96.0.11", port=70000))
    backend = FakeBackend()
    backend.kernel = {"default/a:http/TCP": "before", "default/b:http/TCP": "before"}  # the last process's
    d, backend, clock = directory_daemon(tmp_path, backend)
    d.step()
    next_sync(d, clock)
    assert backend.kernel == {"default/a:http/TCP": "before", "default/b:http/TCP": "before"}
    assert backend.applies == [] and backend.cleanup_calls == 1  # looked at once


NODE_A = "apiVersion: v1\nkind: Node\nmetadata:\n  name: node-a\n"


@pytest.mark.parametrize("files, error", [  # (error: a pattern matched at the start)
    # which of two Services is meant cannot be told: the error names the one whose name sorts
    # later, which may well be the old, working one
    ({"old.yaml": SVC_YAML.format(name="zzz", ip="10.96.0.10", port=80),
      "new.yaml": SVC_YAML.format(name="aaa", ip="10.96.0.10", port=80)}, r".*already used by default/aaa:http"),
    ({"b.yaml": SVC_YAML.format(name="a", ip="10.96.0.11", port=80)}, r".*duplicate Service default/a"),
    # without this node's Node `nodePortAddresses: [primary]` would open NodePorts on every
    # address, and topology hints go astray without its zone label
    ({"node.yaml": NODE_A + "  labels: [1]\n"}, r"{root}/node\.yaml:"),  # read, but invalid
    ({"node.yaml": NODE_A + "status: [\n"}, r"{root}/node\.yaml:"),  # does not parse
], ids=["one-cluster-ip-and-port", "duplicates", "invalid-node", "node-that-does-not-parse"])
def test_a_first_start_programs_nothing_when_what_is_meant_cannot_be_told(
        tmp_path: Path, files: dict[str, str], error: str) -> None:
    (tmp_path / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.20", port=80))
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    d, backend, _ = directory_daemon(tmp_path)
    d.step()
    assert backend.kernel == {} and backend.applies == []
    assert re.match(error.format(root=re.escape(str(tmp_path))), d.health.body(True)[1]["lastError"])


def test_first_start_when_the_kernel_cannot_be_looked_at_programs_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=80))
    (tmp_path / "b.yaml").write_text("kind: [")
    backend = FakeBackend()

    def broken(look_first: bool = False) -> list[Operation]:
        backend.cleanup_calls += 1
        raise KernelError("nft: no such file")

    backend.cleanup = broken  # type: ignore[method-assign]
    d, backend, clock = directory_daemon(tmp_path, backend)
    with caplog.at_level(logging.WARNING, logger="reconciler.daemon"):
        d.step()
        next_sync(d, clock)
    assert backend.kernel == {} and backend.applies == [] and backend.cleanup_calls == 1
    assert len([r for r in caplog.records if "could not tell whether the kernel" in r.getMessage()]) == 1


# ------------------------------------------------------------------------------------ logging


@contextlib.contextmanager
def daemon_logging(fmt: str) -> Iterator[io.StringIO]:
    """setup_logging(fmt) into a string for the block; the root logger is restored afterwards."""
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        setup_logging(fmt, stream=stream)
        yield stream
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_json_log_lines() -> None:
    with daemon_logging("json") as stream:
        d, backend, source, clock = make()
        d.step()
        logging.getLogger("reconciler.daemon").error("plain %s", "message")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    sync = next(rec for rec in lines if rec["msg"].startswith("sync full"))
    assert {"ts", "level", "msg"} <= set(sync)
    assert sync["level"] == "info" and sync["sync"] == "full" and sync["added"] == 1 and sync["operations"] == 1
    assert "duration_ms" in sync
    assert lines[-1]["msg"] == "plain message" and lines[-1]["level"] == "error"


def test_text_log_lines() -> None:
    with daemon_logging("text") as stream:
        d, backend, source, clock = make()
        d.step()
    line = next(ln for ln in stream.getvalue().splitlines() if "sync full" in ln)
    assert " INFO sync full: service ports +1 ~0 -0 (default/web:http/TCP), 1 operations, " in line


def test_the_files_read_are_logged_by_a_few_names_and_a_count(tmp_path: Path) -> None:
    """A first start re-reads every file: the debug line names ten and counts the rest (at 10k
    files it named them all: one ~1 MB line, twice in JSON)."""
    for i in range(25):
        (tmp_path / f"s{i:02}.yaml").write_text(SVC_YAML.format(name=f"s{i}", ip=f"10.96.0.{10 + i}", port=80))
    with daemon_logging("json") as stream:
        logging.getLogger().setLevel(logging.DEBUG)
        d, backend, clock = directory_daemon(tmp_path)
        d.step()
    line = next(json.loads(ln) for ln in stream.getvalue().splitlines() if '"re-read ' in ln)
    assert line["msg"].endswith("s09.yaml and 15 more; dropped nothing") and "s10.yaml" not in line["msg"]
    assert line["reread_count"] == 25 and len(line["reread"]) == 10 and line["removed_count"] == 0


# ---------------------------------------------------------- Kubernetes source, real kernel


CLONE_NEWNET = 0x40000000


@pytest.fixture
def netns() -> Iterator[str]:
    reason = throwaway_netns.skip_reason("nft")
    if reason:
        pytest.skip(reason)
    with throwaway_netns.throwaway(f"srdaemon{os.getpid()}") as name:
        yield name


def start_in_netns(ns: str, start: Callable[[], Any]) -> Any:
    """Call `start` on a thread that joined network namespace `ns` (sockets it opens live there)."""
    libc = ctypes.CDLL(None, use_errno=True)
    out: dict[str, Any] = {}

    def body() -> None:
        fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                out["error"] = OSError(ctypes.get_errno(), "setns failed")
                return
            out["value"] = start()
        except BaseException as exc:  # noqa: BLE001
            out["error"] = exc
        finally:
            os.close(fd)

    t = threading.Thread(target=body)
    t.start()
    t.join(10)
    if "error" in out:
        raise out["error"]
    return out["value"]


def nft_table(ns: str) -> str:
    cp = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "ruleset"],
                        capture_output=True, text=True, timeout=10)
    return cp.stdout if cp.returncode == 0 else ""


def test_kubernetes_source_end_to_end_in_a_netns(netns: str, tmp_path: Path) -> None:
    api = FakeAPIServer(bookmark_interval=0.2)
    start_in_netns(netns, api.start)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
        "users": [{"name": "fake", "user": {"token": "fake-token"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
    }))
    api.create(api_node("node-a"))
    api.hold_lists("EndpointSlice")  # the cache stays half-listed until released
    log_path = tmp_path / "daemon.log"
    proc = None
    try:
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", netns, sys.executable, "-m", "reconciler", "run",
                 "--source", "kubernetes", "--kubeconfig", str(kubeconfig), "--node-name", "node-a",
                 "--sync-period", "2s", "--min-sync-period", "100ms",
                 "--healthz-bind-address", "127.0.0.1:10256", "--metrics-bind-address", "127.0.0.1:10249",
                 "--log-format", "json"],
                stdout=log_file, stderr=subprocess.STDOUT, cwd=str(ROOT))
        api.create(api_service("web", cluster_ip="10.96.0.10"))
        api.create(api_slice("web-1", "web", ["10.244.1.10", "10.244.1.11"]))
        assert wait_until(lambda: api.list_requests("EndpointSlice"), timeout=15), log_path.read_text()
        time.sleep(1.0)
        assert "10.96.0.10" not in nft_table(netns), "synced with a half-listed cache"
        assert '"msg": "sync ' not in log_path.read_text()
        api.release_lists("EndpointSlice")
        table = wait_until(lambda: "10.96.0.10" in nft_table(netns) and nft_table(netns), timeout=15)
        assert table, log_path.read_text()
        assert "10.244.1.11" in table
        # an update, then the delete, follow
        api.update(api_slice("web-1", "web", ["10.244.1.10"]))
        assert wait_until(lambda: "10.244.1.11" not in nft_table(netns), timeout=10), log_path.read_text()
        api.create(api_service("api", cluster_ip="10.96.0.11"))
        assert wait_until(lambda: "10.96.0.11" in nft_table(netns), timeout=10), log_path.read_text()
        api.delete("Service", "default", "web")
        api.delete("EndpointSlice", "default", "web-1")
        assert wait_until(lambda: "10.96.0.10" not in nft_table(netns), timeout=10), log_path.read_text()
        assert "10.96.0.11" in nft_table(netns)
        # kube-proxy's Events: Starting on the Node; a healthCheckNodePort already in use:
        # FailedToStartServiceHealthcheck on its Service, once however many syncs retry it
        blocker = start_in_netns(netns, lambda: socket.create_server(("0.0.0.0", 32100)))
        try:
            lb = api_service("lb", cluster_ip="10.96.0.12")
            lb["spec"].update(type="LoadBalancer", externalTrafficPolicy="Local", healthCheckNodePort=32100)
            lb["spec"]["ports"][0]["nodePort"] = 31000
            local = api_slice("lb-1", "lb", ["10.244.1.20"])
            local["endpoints"][0]["nodeName"] = "node-a"
            api.create(lb)
            api.create(local)

            def failed() -> list[dict[str, Any]]:
                return [e for e in api.recorded_events if e["reason"] == "FailedToStartServiceHealthcheck"]
            assert wait_until(failed, timeout=15), log_path.read_text()
            api.update(api_service("api", cluster_ip="10.96.0.11", port=81))  # another sync: retried, not re-sent
            assert wait_until(lambda: "tcp . 81 " in nft_table(netns), timeout=10), log_path.read_text()
        finally:
            blocker.close()
        [event] = failed()
        assert event["regarding"] == {"apiVersion": "v1", "kind": "Service", "namespace": "default", "name": "lb"}
        assert (event["type"], event["action"], event["metadata"]["namespace"]) == ("Warning", "Listen", "default")
        assert event["note"].startswith('node node-a failed to start healthcheck "default/lb" on port 32100: ')
        [start] = [e for e in api.recorded_events if e["reason"] == "Starting"]
        assert start["regarding"] == {"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": "node-a"}
        assert (start["type"], start["action"], start["metadata"]["namespace"]) == (
            "Normal", "StartKubeProxy", "default")
        # /healthz from inside the namespace: the node exists, so eligible
        probe = subprocess.run(
            ["ip", "netns", "exec", netns, sys.executable, "-c",
             "import urllib.request,sys;r=urllib.request.urlopen('http://127.0.0.1:10256/healthz',timeout=5);"
             "sys.stdout.write(str(r.status)+' '+r.read().decode())"],
            capture_output=True, text=True, timeout=20)
        status, _, body = probe.stdout.partition(" ")
        assert status == "200", probe.stderr
        assert json.loads(body)["nodeEligible"] is True
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, log_path.read_text()
        assert "10.96.0.11" in nft_table(netns)  # kernel state left in place
        lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
        assert any(rec["msg"].startswith("sync full") for rec in lines)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        api.stop()


# ------------------------------------------------------------------------------ run() errors


def _run_in_process(argv: list[str]) -> tuple[int, str]:
    from reconciler.cli import build_parser, options_from
    from reconciler.daemon import run

    args = build_parser().parse_args(argv)
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stream = io.StringIO()
    try:
        import reconciler.daemon as daemon_mod

        real_setup = daemon_mod.setup_logging
        daemon_mod.setup_logging = lambda fmt="text", verbose=False, stream_=None: real_setup(fmt, verbose, stream)
        try:
            code = run(args, options_from(args))
        finally:
            daemon_mod.setup_logging = real_setup
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # handlers restored
    return code, stream.getvalue()


def test_signals_are_handled_from_the_start_of_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM or SIGHUP while run starts (its instance lock, listeners, source: ~0.4 s) is
    handled as later, not the default action's silent death (a reload during a start)."""
    import reconciler.daemon as daemon_mod

    seen: dict[int, Any] = {}

    def acquire(*_a: Any) -> None:
        seen.update({s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)})
        raise daemon_mod.instance_lock.AlreadyRunning("/run/x.lock", "1")  # (ends run at once)

    monkeypatch.setattr(daemon_mod.instance_lock, "acquire", acquire)
    code, out = _run_in_process(["run", "--source", str(tmp_path), "--node-name", "node-a",
                                 "--healthz-bind-address", "", "--metrics-bind-address", ""])
    assert code == 1 and "already programs this network namespace" in out
    assert all(callable(h) and h not in (signal.default_int_handler,) for h in seen.values()), seen
    assert {getattr(h, "__module__", None) for h in seen.values()} == {"reconciler.daemon"}


def test_run_proxies_while_the_healthz_port_is_taken_and_binds_it_later(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As kube-proxy's serveHealthz (wait.Until every 5 s): an address in use is no reason to stop
    proxying; it is retried in the background, its error logged once."""
    import socket
    import urllib.request

    import reconciler.backends as backends_mod
    import reconciler.daemon as daemon_mod

    (tmp_path / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=80))
    backend = FakeBackend()
    monkeypatch.setattr(backends_mod, "get_backend", lambda mode: backend)
    monkeypatch.setattr(daemon_mod, "BIND_RETRY_SECONDS", 0.05)
    running: dict[str, Any] = {}
    real_install = daemon_mod._install_signal_handlers

    def install(stop: threading.Event, daemon: Daemon) -> dict[int, Any]:
        running.update(stop=stop, daemon=daemon)
        return real_install(stop, daemon)

    monkeypatch.setattr(daemon_mod, "_install_signal_handlers", install)

    def healthz(port: int) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
                return resp.status
        except OSError:
            return 0

    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    port = blocker.getsockname()[1]
    result: dict[str, tuple[int, str]] = {}
    t = threading.Thread(target=lambda: result.update(run=_run_in_process(
        ["run", "--source", str(tmp_path), "--node-name", "node-a",
         "--healthz-bind-address", f"127.0.0.1:{port}", "--metrics-bind-address", "127.0.0.1:0"])), daemon=True)
    t.start()
    try:
        assert wait_until(lambda: backend.applies, timeout=10), "no sync while the healthz port was taken"
        assert list(backend.kernel) == ["default/a:http/TCP"]
        time.sleep(0.3)  # several retries fail meanwhile
        blocker.close()
        assert wait_until(lambda: healthz(port) == 200, timeout=5)
    finally:
        blocker.close()
        if "stop" in running:
            running["stop"].set()
            running["daemon"].wake()
        t.join(10)
    assert not t.is_alive()
    code, out = result["run"]
    assert code == 0, out
    assert out.count(f"healthz: cannot listen on 127.0.0.1:{port}: Address already in use; retrying every 0.05s") == 1
    assert f"serving healthz on 127.0.0.1:{port}" in out


def test_run_with_bind_address_hard_fail_exits_1(tmp_path: Path) -> None:
    import socket

    config = tmp_path / "config.yaml"
    config.write_text("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
                      "bindAddressHardFail: true\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, out = _run_in_process(["run", "--source", str(tmp_path / "state"), "--node-name", "node-a", "--config",
                                     str(config), "--healthz-bind-address", f"127.0.0.1:{port}",
                                     "--metrics-bind-address", "127.0.0.1:0"])
    assert code == 1
    assert f"healthz: cannot listen on 127.0.0.1:{port}: Address already in use\n" in out


def test_run_exits_1_when_its_config_file_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As kube-proxy: its settings are read once, so a new --config content ends the process (after
    the sync in progress), for the kubelet or systemd to start it again with them."""
    import reconciler.backends as backends_mod
    import reconciler.config_watch as config_watch_mod

    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=80))
    config = tmp_path / "config.conf"
    config.write_text("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n")
    backend = FakeBackend()
    monkeypatch.setattr(backends_mod, "get_backend", lambda mode: backend)
    monkeypatch.setattr(config_watch_mod, "CHECK_SECONDS", 0.05)
    result: dict[str, tuple[int, str]] = {}
    t = threading.Thread(target=lambda: result.update(run=_run_in_process(
        ["run", "--source", str(tmp_path / "state"), "--node-name", "node-a", "--config", str(config),
         "--healthz-bind-address", "", "--metrics-bind-address", ""])), daemon=True)
    t.start()
    try:
        assert wait_until(lambda: backend.applies, timeout=10)
        time.sleep(0.2)
        assert t.is_alive()  # (the file as it was: running on)
        config.write_text("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
                          "mode: iptables\n")
        t.join(10)
    finally:
        config.write_text("unreadable: [")  # (had it not exited: ends it all the same)
        t.join(10)
    assert not t.is_alive()
    code, out = result["run"]
    assert code == 1, out
    assert f"the configuration file {config} changed: exiting, to be started again with it" in out
    assert list(backend.kernel) == ["default/a:http/TCP"]  # the kernel state stays


NF_HOST = {"nf_conntrack_max": 262144, "nf_conntrack_buckets": 65536, "nf_conntrack_tcp_timeout_established": 432000,
           "nf_conntrack_tcp_timeout_close_wait": 60}


def _netfilter(d: Path) -> dict[str, int]:
    return {p.name: int(p.read_text()) for p in d.iterdir()}


@pytest.mark.parametrize("loaded", [True, False])
def test_run_sets_the_conntrack_sysctls_once_before_the_first_sync(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loaded: bool) -> None:
    """As kube-proxy's platformSetup: once, before the proxier's first sync; nf_conntrack not loaded
    yet: once, right after the first sync (whose rules load it)."""
    import reconciler.backends as backends_mod
    import reconciler.daemon as daemon_mod
    from reconciler import conntrack_sysctls

    nf, state = tmp_path / "netfilter", tmp_path / "state"
    nf.mkdir()
    state.mkdir()
    (state / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=80))
    backend = FakeBackend()
    monkeypatch.setattr(backends_mod, "get_backend", lambda mode: backend)
    monkeypatch.setattr(conntrack_sysctls, "node_cpus", lambda: 4)
    wanted = {"nf_conntrack_max": 300000, "nf_conntrack_buckets": 75000, "nf_conntrack_tcp_timeout_established": 86400,
              "nf_conntrack_tcp_timeout_close_wait": 3600}
    if loaded:
        for name, v in NF_HOST.items():
            (nf / name).write_text(f"{v}\n")

    def run_forever(self: Daemon, stop: threading.Event) -> None:
        assert _netfilter(nf) == (wanted if loaded else {})
        for name, v in NF_HOST.items():  # (not loaded: the first sync loads it; loaded: reset, to see no second write)
            (nf / name).write_text(f"{v}\n")
        self.sync("full")
        assert _netfilter(nf) == (NF_HOST if loaded else wanted)  # (loaded: set once, not again)
        self.sync("full")

    monkeypatch.setattr(daemon_mod.Daemon, "run_forever", run_forever)
    code, out = _run_in_process(["run", "--source", str(state), "--node-name", "node-a", "--conntrack-min", "300000",
                                 "--conntrack-sysctl-dir", str(nf), "--healthz-bind-address", "127.0.0.1:0",
                                 "--metrics-bind-address", "127.0.0.1:0"])
    assert code == 0, out
    assert backend.applies
    assert out.count("conntrack sysctls set: net.netfilter.nf_conntrack_max=300000, ") == 1
    first_sync, tuned = out.index("sync full"), out.index("conntrack sysctls set")
    assert (tuned < first_sync) if loaded else (first_sync < tuned)
    assert ("nf_conntrack is not loaded yet" in out) is not loaded


def test_after_first_sync_runs_once_after_the_first_applied_sync() -> None:
    d, backend, source, clock = make(objects=[service("web", "10.96.0.10", HTTP)])
    source.errors = [InputError(Location("a.yaml", 1, 1), "broken")]
    calls: list[int] = []
    d.after_first_sync = lambda: calls.append(len(backend.applies))
    d.sync("full")  # no valid input yet: the kernel is left alone
    assert calls == []
    source.errors = []
    d.notify()
    d.sync("full")
    d.sync("full")
    assert calls == [1] and d.after_first_sync is None


def test_run_missing_directory_exits_1(tmp_path: Path) -> None:
    code, out = _run_in_process(["run", "--source", str(tmp_path / "nope"), "--node-name", "node-a",
                                 "--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0"])
    assert code == 1
    assert f"{tmp_path}/nope: no such directory" in out
    # (started without --cluster-cidr: said, as kube-proxy says it)
    assert "WARNING no --cluster-cidr (clusterCIDR): traffic to ClusterIPs from outside the pod network" in out
    code, out = _run_in_process(["run", "--source", str(tmp_path / "nope"), "--node-name", "node-a",
                                 "--cluster-cidr", "10.244.0.0/16",
                                 "--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0"])
    assert code == 1 and "--cluster-cidr" not in out


def test_run_invalid_bind_address_exits_1(tmp_path: Path) -> None:
    code, out = _run_in_process(["run", "--source", str(tmp_path), "--node-name", "node-a",
                                 "--metrics-bind-address", "localhost:10249", "--healthz-bind-address", ""])
    assert code == 1
    assert "--metrics-bind-address: bind address 'localhost:10249' must be an IP address" in out


def test_kernel_tool_failures_are_counted_under_kube_proxys_names_and_timed() -> None:
    """kube-proxy's alerts watch kubeproxy_sync_proxy_rules_{nftables_sync,iptables_restore}_failures_total,
    which count every failed attempt; its sync duration histograms take failed attempts too."""
    from reconciler.metrics import Metrics

    assert Metrics("iptables").registry.get_sample_value(
        "kubeproxy_sync_proxy_rules_iptables_restore_failures_total") == 0
    assert Metrics("nftables").registry.get_sample_value("process_cpu_seconds_total") is not None
    d, backend, source, clock = make()
    d.metrics = Metrics("nftables")
    d.step()
    change_with_the_next_apply_failing(d, backend, source, clock)
    assert d.step().ok  # type: ignore[union-attr]  # (the full retry)
    failures = "kubeproxy_sync_proxy_rules_nftables_sync_failures_total"
    assert value(d, failures) == 1  # the incremental attempt, though the sync recovered at once
    assert value(d, "kubeproxy_sync_proxy_rules_duration_seconds_count") == 3  # first, failed, retry
    assert value(d, "kubeproxy_sync_partial_proxy_rules_duration_seconds_count") == 1
    backend.fail = KernelError("nft: Error: Could not process rule")
    source.objects = web(eps=("10.244.1.78",))
    d.notify()
    clock.advance(2)
    assert d.step().ok is False  # type: ignore[union-attr]
    assert value(d, failures) == 3  # the incremental attempt and its full retry
    assert value(d, "kubeproxy_sync_full_proxy_rules_duration_seconds_count") == 3  # first, retry, retry


def test_only_syncs_that_read_the_kernel_are_timed_as_full() -> None:
    """kube-proxy times as "full" the syncs that rewrite everything (the first, after a failure,
    hourly) and its periodic ones as "partial": a resync every sync period that the ruleset
    generation lets skip the kernel read is a partial one; one after a foreign commit is full."""
    from reconciler.metrics import Metrics

    d, backend, source, clock = make()
    d.metrics = Metrics("nftables")
    full, partial = ("kubeproxy_sync_full_proxy_rules_duration_seconds_count",
                     "kubeproxy_sync_partial_proxy_rules_duration_seconds_count")
    assert d.step().kernel_read  # type: ignore[union-attr]
    for _ in range(3):
        clock.advance(SYNC)
        report = d.step()
        assert report is not None and report.kind == "full" and not report.kernel_read
    assert (value(d, full), value(d, partial)) == (1, 3)
    backend.gen += 1  # (somebody else committed)
    clock.advance(SYNC)
    assert d.step().kernel_read  # type: ignore[union-attr]
    assert (value(d, full), value(d, partial)) == (2, 3)


def test_no_local_endpoints_counts_only_dropped_traffic() -> None:
    """kube-proxy counts a Local policy with no local endpoint only when the service has endpoints
    elsewhere (its traffic is dropped); with none at all it is rejected and not counted."""
    none_anywhere = [
        service("itp", "10.96.0.21", HTTP, internalTrafficPolicy="Local"),
        service("etp", "10.96.0.22", [dict(HTTP[0], nodePort=30022)], type="NodePort",
                externalTrafficPolicy="Local"),
    ]
    elsewhere = [
        service("itp2", "10.96.0.23", HTTP, internalTrafficPolicy="Local"),
        endpoint_slice("itp2", [endpoint("10.244.2.10", node="node-b")], port=8080),
        service("etp2", "10.96.0.24", [dict(HTTP[0], nodePort=30024)], type="NodePort",
                externalTrafficPolicy="Local"),
        endpoint_slice("etp2", [endpoint("10.244.2.11", node="node-b")], port=8080),
    ]
    d, backend, source, clock = make(none_anywhere)
    d.step()
    assert value(d, "kubeproxy_sync_proxy_rules_no_local_endpoints_total", {"traffic_policy": "internal"}) == 0
    assert value(d, "kubeproxy_sync_proxy_rules_no_local_endpoints_total", {"traffic_policy": "external"}) == 0
    source.objects = none_anywhere + elsewhere
    d.notify()
    clock.advance(2)
    d.step()
    assert value(d, "kubeproxy_sync_proxy_rules_no_local_endpoints_total", {"traffic_policy": "internal"}) == 1
    assert value(d, "kubeproxy_sync_proxy_rules_no_local_endpoints_total", {"traffic_policy": "external"}) == 1


class ChangeLoggingSource(FakeSource):
    """A source that logs its changes as the API source does (sources.kubernetes.ChangeLog)."""

    kind = "kubernetes"

    def __init__(self, objects: list[SourceObject]) -> None:
        super().__init__(objects)
        self.log = ChangeLog()

    def changes(self) -> tuple[int, int, int, int]:
        c = self.log
        return c.services, c.endpoint_slices, len(c.pending_services), c.pending_slices

    def take_changes(self) -> tuple[dict[tuple[str, str], list[str]], set[tuple[str, str]]]:
        return self.log.take()


def test_change_metrics_follow_the_api_events() -> None:
    """*_changes_total count every event (three updates of one slice: three), *_changes_pending
    what the next sync has not taken yet; the network programming latency is observed per event."""
    clock = FakeClock()
    objs = web()
    source = ChangeLoggingSource(objs)
    for o in objs:
        source.log.record(o.kind, (o.namespace, o.name), None, o.body)
    d = Daemon(Options(node_name="node-a", sync_period=SYNC, min_sync_period=MIN_SYNC), FakeBackend(), source,
               clock=clock)
    d.notify()
    assert value(d, "kubeproxy_sync_proxy_rules_service_changes_pending") == 1
    assert value(d, "kubeproxy_sync_proxy_rules_endpoint_changes_pending") == 1
    d.step()
    assert value(d, "kubeproxy_sync_proxy_rules_service_changes_pending") == 0
    assert value(d, "kubeproxy_sync_proxy_rules_endpoint_changes_pending") == 0
    old = objs[1].body
    for i, ip in enumerate(("10.244.1.20", "10.244.1.21", "10.244.1.22")):
        new = endpoint_slice("web", [endpoint(ip)], port=8080).body
        new["metadata"]["annotations"] = {  # type: ignore[index]
            "endpoints.kubernetes.io/last-change-trigger-time": rfc3339(clock.time() + i)}
        source.log.record("EndpointSlice", ("default", "web"), old, new)
        old = new
        d.notify()
    source.objects = [objs[0], SourceObject("EndpointSlice", "default", "web", old, objs[1].location)]
    assert value(d, "kubeproxy_sync_proxy_rules_endpoint_changes_total") == 4
    assert value(d, "kubeproxy_sync_proxy_rules_endpoint_changes_pending") == 3
    assert value(d, "kubeproxy_sync_proxy_rules_service_changes_total") == 1
    clock.advance(4)
    assert d.step().ok  # type: ignore[union-attr]
    assert value(d, "kubeproxy_sync_proxy_rules_endpoint_changes_pending") == 0
    assert value(d, "kubeproxy_network_programming_duration_seconds_count") == 3
    assert value(d, "kubeproxy_network_programming_duration_seconds_sum") == pytest.approx(4 + 3 + 2)
    # a failed sync lets its changes' trigger times go, as kube-proxy does (kept, they would pile
    # up while syncs keep failing): the sync that then succeeds observes none of them
    backend = d.backend
    for attempt in range(3):
        new = endpoint_slice("web", [endpoint(f"10.244.1.{30 + attempt}")], port=8080).body
        new["metadata"]["annotations"] = {  # type: ignore[index]
            "endpoints.kubernetes.io/last-change-trigger-time": rfc3339(clock.time())}
        source.log.record("EndpointSlice", ("default", "web"), old, new)
        old = new
        source.objects = [objs[0], SourceObject("EndpointSlice", "default", "web", old, objs[1].location)]
        backend.fail = KernelError("nft: refused")  # type: ignore[attr-defined]
        clock.advance(SYNC)
        d.notify()
        assert d.step().ok is False  # type: ignore[union-attr]
    assert d._triggers == {}
    backend.fail = None  # type: ignore[attr-defined]
    clock.advance(SYNC)
    d.notify()
    assert d.step().ok  # type: ignore[union-attr]
    assert value(d, "kubeproxy_network_programming_duration_seconds_count") == 3


def test_directory_changes_held_by_invalid_input_are_pending(tmp_path: Path) -> None:
    """From a directory the pending gauges are the changes read but not built yet."""
    (tmp_path / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=80))
    clock = FakeClock()
    d = Daemon(Options(node_name="node-a"), FakeBackend(), None, clock=clock)
    d.source = DirectorySource(str(tmp_path), d.notify)
    d.step()
    assert value(d, "kubeproxy_sync_proxy_rules_service_changes_pending") == 0
    (tmp_path / "b.yaml").write_text(SVC_YAML.format(name="b", ip="10.96.0.11", port=80))
    (tmp_path / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=81))
    (tmp_path / "c.yaml").write_text("kind: [")
    d.notify()
    clock.advance(2)
    d.step()
    assert value(d, "reconciler_input_degraded") == 1
    assert value(d, "kubeproxy_sync_proxy_rules_service_changes_pending") == 2  # a (changed) and b
    (tmp_path / "c.yaml").unlink()
    d.notify()
    clock.advance(2)
    d.step()
    assert value(d, "reconciler_input_degraded") == 0
    assert value(d, "kubeproxy_sync_proxy_rules_service_changes_pending") == 0
    assert value(d, "kubeproxy_sync_proxy_rules_service_changes_total") == 3  # a; then a and b


def test_a_full_retry_is_timed_on_its_own_and_iptables_counts_partial_failures() -> None:
    """The full resync after a failed incremental one is timed from its own start (kube-proxy's
    next sync is a call of its own); iptables mode counts the failed incremental restore as a
    partial restore failure too."""
    from reconciler.metrics import Metrics

    d, backend, source, clock = make()
    d.metrics = Metrics("iptables")
    d.step()
    change_with_the_next_apply_failing(d, backend, source, clock, "iptables-restore: line 3 failed", takes=1.0)
    assert d.step().ok  # type: ignore[union-attr]
    assert value(d, "kubeproxy_sync_full_proxy_rules_duration_seconds_sum") == pytest.approx(1.0)
    assert value(d, "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total") == 1
    assert value(d, "kubeproxy_sync_proxy_rules_iptables_restore_failures_total") == 1


def test_exposition_has_no_created_series_and_nftables_cleanup_failures_at_zero() -> None:
    from reconciler.metrics import Metrics

    m = Metrics("nftables")
    text = generate_latest(m.registry).decode()
    assert "_created" not in text
    assert m.registry.get_sample_value("kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total") == 0


def test_conntrack_cleanups_are_measured_per_family(conntrack_in_memory: Any) -> None:
    """kubeproxy_conntrack_reconciler_{sync_duration_seconds,deleted_entries_total}{ip_family}."""
    from reconciler.conntrack import Entry

    dns = [{"name": "dns", "port": 53, "protocol": "UDP"}]
    objs = [service("dns", "10.96.0.10", dns),
            endpoint_slice("dns", [endpoint("10.244.1.10")], port=53, port_name="dns", protocol="UDP")]
    conntrack_in_memory.entries = [Entry("10.244.9.9", 40000, "10.96.0.10", 53, "10.96.0.10", 53),
                                   Entry("10.244.9.9", 40001, "10.96.0.10", 53, "10.244.1.10", 53)]
    d, backend, source, clock = make(objs)
    d.step()
    ipv4 = {"ip_family": "IPv4"}
    assert value(d, "kubeproxy_conntrack_reconciler_sync_duration_seconds_count", ipv4) == 1
    assert value(d, "kubeproxy_conntrack_reconciler_deleted_entries_total", ipv4) == 1
    assert len(conntrack_in_memory.entries) == 1


def test_health_check_ports_listen_where_nodeports_answer_primary_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    """With nodePortAddresses [primary] the healthCheckNodePort servers take the node's IP, as the
    document resolved it (a family without a node IP: all of its addresses)."""
    import reconciler.daemon as daemon_mod

    asked: list[list[str]] = []
    monkeypatch.setattr(daemon_mod, "local_addresses", lambda cidrs: asked.append(list(cidrs)) or [])
    n = node()
    n.body["status"] = {"addresses": [{"type": "InternalIP", "address": "10.0.0.7"}]}  # type: ignore[index]
    desired = build([n, *web()], nodeport_cidrs=("primary",))
    daemon_mod.nodeport_hosts(desired)
    assert asked == [["10.0.0.7/32", "::/0"]]


def test_health_check_addresses_are_listed_again_when_the_nodeport_cidrs_change_or_after_a_while(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The run loop's health check servers ask for their addresses at every sync with health
    checks: the local addresses are listed (`ip -j addr`) again when the document's nodePort CIDRs
    change (the Node's IP moved), and otherwise at most every 30 s (an address made inside them
    later, a listing that failed), not at every sync."""
    import reconciler.daemon as daemon_mod

    asked: list[list[str]] = []
    monkeypatch.setattr(daemon_mod, "local_addresses", lambda cidrs: asked.append(list(cidrs)) or [cidrs[0]])
    current: list[Any] = [None]
    now = [0.0]
    hosts = daemon_mod.NodePortHosts(lambda: current[0], clock=lambda: now[0])
    for ip, t in (("10.0.0.7", 0.0), ("10.0.0.7", 10.0), ("10.0.0.8", 11.0), ("10.0.0.8", 40.0), ("10.0.0.8", 42.0)):
        now[0] = t
        n = node()
        n.body["status"] = {"addresses": [{"type": "InternalIP", "address": ip}]}  # type: ignore[index]
        current[0] = build([n, *web()], nodeport_cidrs=("primary",))
        assert hosts() == [f"{ip}/32"]
    assert asked == [["10.0.0.7/32", "::/0"], ["10.0.0.8/32", "::/0"], ["10.0.0.8/32", "::/0"]]


def test_urllib3_retry_warnings_are_not_logged_but_its_errors_are() -> None:
    """An unreachable API server: urllib3 warns of each retry (~50 lines in 15 s); the informers
    say it once per attempt themselves."""
    with daemon_logging("text") as stream:
        logging.getLogger("urllib3.connectionpool").warning("Retrying (Retry(total=2)) after connection broken")
        logging.getLogger("urllib3.connectionpool").error("something worse")
    assert "Retrying" not in stream.getvalue() and "something worse" in stream.getvalue()


def test_a_sync_log_line_names_the_first_service_ports_it_touched() -> None:
    from reconciler.daemon import _of

    assert _of(("a/x:http/TCP", "b/y:dns/UDP", "c/z:https/TCP"), 5) == " (a/x:http/TCP, b/y:dns/UDP, c/z:https/TCP and 2 more)"
    assert _of(("a/x:http/TCP",), 1) == " (a/x:http/TCP)" and _of((), 0) == ""


def test_a_wait_for_git_is_not_counted_as_sync_time(tmp_path: Path) -> None:
    """kubeproxy_sync_proxy_rules_duration_seconds times the sync's own work: a slow git command
    holding the index lock would set off latency alerts."""
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "index.lock").write_text("")  # (held the whole time: read after lock_wait)
    (tmp_path / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=80))
    d = Daemon(Options(node_name="node-a"), FakeBackend(), None)  # (the real clock)
    d.source = DirectorySource(str(tmp_path), d.notify, lock_wait=0.5)
    report = d.step()
    assert report is not None and report.ok and report.operations == 1
    assert d.source.waited_for_git >= 0.5 and report.seconds < 0.4


def test_a_second_run_in_the_same_network_namespace_exits_naming_the_first(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Two would undo each other's syncs at every resync; apply and cleanup are told that a run
    will put its own state back."""
    import subprocess
    import sys

    import reconciler.backends as backends_mod
    from reconciler import instance_lock

    monkeypatch.setattr(backends_mod, "get_backend", lambda mode: FakeBackend())  # (never this host's kernel)
    monkeypatch.setattr(instance_lock, "LOCK_DIR", str(tmp_path))
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=80))
    assert instance_lock.holder(str(tmp_path)) is None
    # the first: another process holding the lock (as a running `reconciler run` does)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[2]); "
                               "from reconciler import instance_lock; f = instance_lock.acquire(sys.argv[1]); "
                               "print('held', flush=True); time.sleep(30)", str(tmp_path), str(Path(__file__).parents[2])],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert instance_lock.holder(str(tmp_path)) == str(holder.pid)
        code, out = _run_in_process(["run", "--source", str(tmp_path / "state"), "--node-name", "node-a",
                                     "--cluster-cidr", "10.244.0.0/16",
                                     "--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0"])
        assert code == 1
        assert f"another `reconciler run` (pid {holder.pid}) already programs this network namespace" in out
    finally:
        holder.kill()
        holder.wait(10)
    assert instance_lock.holder(str(tmp_path)) is None  # (its lock went with it)
    lock = instance_lock.acquire(str(tmp_path))  # (free again)
    assert lock is not None and instance_lock.holder(str(tmp_path)) == str(os.getpid())
    instance_lock.release(lock)
    assert list(tmp_path.glob("*.lock")) == []  # (no file left per namespace)


def test_a_stop_while_git_writes_the_tree_builds_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """SIGTERM during a checkout on the first sync: nothing read, so nothing built (not an
    'empty directory' error, nor a half-checked-out tree)."""
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "index.lock").write_text("")
    (tmp_path / "a.yaml").write_text(SVC_YAML.format(name="a", ip="10.96.0.10", port=80))
    stop = threading.Event()
    stop.set()
    backend = FakeBackend()
    d = Daemon(Options(node_name="node-a"), backend, None, clock=FakeClock())
    d.source = DirectorySource(str(tmp_path), d.notify, stop_event=stop, lock_wait=10.0)
    d.step()
    assert backend.kernel == {} and "lastError" not in d.health.body(True)[1]
    assert "no Service or EndpointSlice" not in caplog.text


# --------------------------------------------------------------------------- systemd notifications


def test_systemd_hears_ready_after_the_first_sync_then_what_each_sync_leaves(tmp_path: Path) -> None:
    from reconciler.sdnotify import Notifier
    path = str(tmp_path / "notify")
    with notify_socket(path) as sock:
        d, backend, source, clock = make(objects=[])
        d.notifier = Notifier({"NOTIFY_SOCKET": path})
        source.errors = [InputError(Location("state/web.yaml", 12, 7), "must be 1-65535", ("spec", "ports", 0, "port"))]
        d.step()  # (no valid input yet: started all the same, saying why nothing is programmed)
        assert heard(sock) == ["READY=1\nSTATUS=no valid input yet, kernel left as it is: "
                                "state/web.yaml:12:7: spec.ports[0].port: must be 1-65535"]
        source.errors, source.objects = [], web()
        d.notify()
        clock.advance(2)
        d.step()
        assert heard(sock) == ["STATUS=in sync: 1 service port (nftables)"]
        source.objects = []
        source.errors = [InputError(Location("state/web.yaml", 3, 1), "is required", ("metadata", "name"))]
        d.notify()
        clock.advance(2)
        d.step()
        assert heard(sock) == ["STATUS=in sync: 1 service port (nftables); input error, last good state kept: "
                                "state/web.yaml:3:1: metadata.name: is required"]
        clock.advance(SYNC)
        d.step()  # (a resync that changes nothing of it: nothing said)
        assert heard(sock) == []


def test_a_sighup_resync_is_a_reload_to_systemd(tmp_path: Path) -> None:
    """`systemctl reload` (SIGHUP): RELOADING=1 when its full resync starts, READY=1 once it has
    ended, even when it changed nothing; a periodic resync says nothing."""
    from reconciler.sdnotify import Notifier
    path = str(tmp_path / "notify")
    with notify_socket(path) as sock:
        d, backend, source, clock = make(objects=web())
        d.notifier = Notifier({"NOTIFY_SOCKET": path}, clock.monotonic)
        d.step()
        assert heard(sock) == ["READY=1\nSTATUS=in sync: 1 service port (nftables)"]
        clock.advance(2)
        d.resync_now()
        d.step()
        got = heard(sock)
        assert [g.split("\n")[0] for g in got] == ["RELOADING=1", "READY=1"], got
        assert got[0] == f"RELOADING=1\nMONOTONIC_USEC={int(clock.monotonic() * 1e6)}"
        assert got[1] == "READY=1\nSTATUS=in sync: 1 service port (nftables)"
        clock.advance(SYNC)
        d.step()
        assert heard(sock) == []


def test_run_tells_systemd_it_is_ready_pings_its_watchdog_and_says_when_it_stops(netns: str, tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    write(state / "web.yaml", SVC_YAML.format(name="web", ip="10.96.0.10", port=80))
    path = str(tmp_path / "notify")
    env = dict(os.environ, NOTIFY_SOCKET=path, WATCHDOG_USEC="600000")  # (a ping every 0.3 s)
    env.pop("WATCHDOG_PID", None)
    proc = None
    with notify_socket(path) as sock:
        try:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", netns, sys.executable, "-m", "reconciler", "run", "--source", str(state),
                 "--node-name", "node-a", "--healthz-bind-address", "", "--metrics-bind-address", ""],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=str(ROOT))
            notes: list[str] = []
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and sum(n == "WATCHDOG=1" for n in notes) < 3:
                notes += heard(sock, quiet=1.0, most=1.0)
            assert any(n.startswith("READY=1\nSTATUS=in sync: 1 service port (nftables)") for n in notes), notes
            assert sum(n == "WATCHDOG=1" for n in notes) >= 3, notes  # (the loop goes round while idle)
            assert "10.96.0.10" in nft_table(netns)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0
            assert heard(sock, quiet=0.5)[-1:] == ["STOPPING=1"]
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)

"""The one-shot pass around the backend: the plan described in service terms while the kernel
takes the transaction, and kernel tools fed their input from a file in memory."""

from __future__ import annotations

import os
import threading
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

import pytest
from helpers import build, endpoint, endpoint_slice, service

from reconciler.backends.base import KernelError, Operation, run_tool
from reconciler.reconcile import apply, make_plan


class SlowKernel:
    """A kernel model {service port id: digest} whose transaction waits until the plan is being
    described (or 5 s): it tells whether the two overlapped."""

    mode = "fake"

    def __init__(self, fail: bool = False) -> None:
        self.kernel: dict[str, str] = {}
        self.describing = threading.Event()
        self.overlapped: bool | None = None
        self.apply_thread: int | None = None
        self.written: tuple[int, bool] | None = None  # prepare(): (its thread, describing already?)
        self.fail = fail

    def render(self, desired: Any) -> dict[str, str]:
        return {s.id: s.digest() for s in desired.services}

    def observe(self, beside_work: bool = False) -> dict[str, str]:
        return dict(self.kernel)

    def diff(self, want: dict[str, str], have: dict[str, str]) -> list[Operation]:
        return [Operation("+", "service", sid, f"add {sid} {d}", sid) for sid, d in sorted(want.items())
                if have.get(sid) != d] + [Operation("-", "service", sid, f"delete {sid}", sid)
                                          for sid in sorted(have) if sid not in want]

    def unconverged(self, want: dict[str, str]) -> list[Operation]:
        return self.diff(want, self.observe())

    def prepare(self, ops: list[Operation]) -> Callable[[], list[int] | None]:
        self.written = (threading.get_ident(), self.describing.is_set())
        return lambda: self.apply(ops)

    def apply(self, ops: list[Operation]) -> list[int] | None:
        self.apply_thread = threading.get_ident()
        self.overlapped = self.describing.wait(5)
        if self.fail:
            raise KernelError("refused")
        for op in ops:
            if op.action == "-":
                self.kernel.pop(op.name, None)
            else:
                self.kernel[op.name] = op.text.split()[-1]
        return None

    def generation(self) -> int | None:
        return None

    def service_view(self, model: dict[str, str], only: set[str] | None = None) -> dict[str, dict[str, Any]]:
        self.describing.set()
        return {sid: {"addresses": [d], "endpoints": []} for sid, d in model.items() if only is None or sid in only}

    def removed_unnamed(self, observed, operations) -> set:  # (every operation names its service port)
        return set()


def desired():
    return build([service("web", "10.96.0.10", [{"name": "http", "port": 80}]),
                  service("db", "10.96.0.11", [{"name": "sql", "port": 5432}]),
                  endpoint_slice("web", [endpoint("10.244.1.5")])])


def test_apply_describes_the_plan_while_the_kernel_takes_the_transaction() -> None:
    backend = SlowKernel()
    planned = make_plan(backend, desired(), observed_model={}, describe=False)
    assert not planned.described and planned.plan.services == []
    assert apply(backend, planned) == backend.kernel
    assert backend.overlapped and backend.apply_thread != threading.get_ident()
    assert backend.written == (threading.get_ident(), False)  # its text written here, before describing
    assert planned.described
    assert sorted((s.action, s.service) for s in planned.plan.services) == [
        ("+", "default/db:sql/TCP"), ("+", "default/web:http/TCP")]


def test_a_described_plan_applies_in_this_thread_and_a_refused_transaction_still_raises() -> None:
    backend = SlowKernel()
    planned = make_plan(backend, desired(), observed_model={})  # described here, as `plan` does
    assert len(planned.plan.services) == 2  # (which set backend.describing: apply will not wait)
    apply(backend, planned)
    assert backend.apply_thread == threading.get_ident()
    failing = SlowKernel(fail=True)
    with pytest.raises(KernelError, match="refused"):
        apply(failing, make_plan(failing, desired(), observed_model={}, describe=False))


def test_kernel_tools_get_their_whole_input_from_a_file_in_memory() -> None:
    text = "".join(f"add element ip t s {{ 10.0.{i // 256}.{i % 256} }}\n" for i in range(40000))  # ~1.3 MB
    proc = run_tool(["sh", "-c", "test ! -p /dev/stdin && cat"], text)  # not a pipe, and all of it
    assert proc.returncode == 0 and proc.stdout == text
    lines = text.splitlines()  # as lines (iptables-restore's input): written in pieces, same bytes
    assert run_tool(["cat"], lines).stdout == text
    assert run_tool(["sh", "-c", "echo out; echo err >&2; exit 3"]).stderr == "err\n"
    with pytest.raises(KernelError, match="no-such-tool"):
        run_tool(["/nonexistent/no-such-tool"], "x")


def test_kernel_tools_write_their_output_into_files_in_memory() -> None:
    # a listing (10k services: ~10 MB) is written at the tool's pace, not a pipe's; both streams whole
    script = "test ! -p /dev/stdout && test ! -p /dev/stderr && seq 1 600000 && echo done >&2; exit 5"
    proc = run_tool(["sh", "-c", script])
    assert proc.returncode == 5 and proc.stderr == "done\n"
    assert proc.stdout == "".join(f"{i}\n" for i in range(1, 600001))  # ~4 MB


def test_a_kernel_tool_without_input_reads_nothing_rather_than_our_stdin() -> None:
    read_end, write_end = os.pipe()
    os.write(write_end, b"not for the tool\n")
    os.close(write_end)
    saved = os.dup(0)
    try:
        os.dup2(read_end, 0)  # this process's stdin holds something the tool must not consume
        assert run_tool(["cat"]).stdout == ""
        assert os.read(0, 100) == b"not for the tool\n"
    finally:
        os.dup2(saved, 0)
        os.close(saved)
        os.close(read_end)


def test_a_failing_transaction_is_reported_even_when_describing_fails_too() -> None:
    class Broken(SlowKernel):
        def service_view(self, model, only=None):
            self.describing.set()
            raise KeyError("describe")

    backend = Broken(fail=True)
    with pytest.raises(KernelError, match="refused"):
        apply(backend, make_plan(backend, desired(), observed_model={}, describe=False))


def test_release_lets_the_plan_go_before_the_kernel_is_read_back() -> None:
    seen = {}

    class Verifying(SlowKernel):
        def unconverged(self, want):
            seen["operations"], seen["services"] = list(planned.plan.operations), list(planned.plan.services)
            return super().unconverged(want)

    backend = Verifying()
    planned = make_plan(backend, desired(), observed_model={})
    assert planned.plan.operations and planned.plan.services
    apply(backend, planned, release=True)
    assert seen == {"operations": [], "services": []} and len(backend.kernel) == 2
    backend = Verifying()
    planned = make_plan(backend, desired(), observed_model={})
    apply(backend, planned)  # without release (the CLI prints the plan afterwards): all still there
    assert len(seen["operations"]) == 2 and len(seen["services"]) == 2


def test_the_run_loop_counts_service_changes_without_describing_them() -> None:
    from collections import Counter

    backend = SlowKernel()
    kernel = {"default/db:sql/TCP": "stale", "default/gone:x/TCP": "x"}
    planned = make_plan(backend, desired(), observed_model=kernel, describe=False)
    counts = planned.count_services(backend)
    assert counts == Counter({"+": 1, "~": 1, "-": 1}) and planned.plan.services == []
    from reconciler import reconcile
    old_chunk, reconcile.COUNT_CHUNK = reconcile.COUNT_CHUNK, 1  # a service port at a time: the same
    try:
        assert planned.count_services(backend) == counts
    finally:
        reconcile.COUNT_CHUNK = old_chunk
    planned.describe(backend)
    assert Counter(s.action for s in planned.plan.services) == counts == planned.count_services(backend)


@pytest.mark.parametrize("other_generation", [None, 7], ids=["legacy iptables", "nf_tables"])
def test_a_trusting_resync_looks_for_leftovers_only_where_the_generation_cannot_see(monkeypatch, other_generation):
    from reconciler import reconcile

    class Other:
        looked = 0

        def generation(self):
            return other_generation

        def cleanup(self, look_first=False):
            Other.looked += 1
            return [Operation("-", "chain", "iptables nat RECONCILER-SERVICES", "-X RECONCILER-SERVICES")]

    monkeypatch.setattr(reconcile, "get_backend", lambda mode: Other())
    found = reconcile.other_mode_leftovers("nftables", unseen_only=True)
    assert (len(found), Other.looked) == ((1, 1) if other_generation is None else (0, 0))
    assert len(reconcile.other_mode_leftovers("nftables")) == 1  # a read always looks


class CountingKernel(SlowKernel):
    """SlowKernel with an nf_tables-like generation: each commit that changes something moves it
    by one and is named by apply(); `beside` is somebody else's commit landing just before ours."""

    def __init__(self, generation: int | None = 7) -> None:
        super().__init__()
        self.describing.set()  # (no waiting for the description)
        self.gen = generation
        self.reads = 0
        self.beside: dict[str, str] | None = None

    def generation(self) -> int | None:
        return self.gen

    def unconverged(self, want: dict[str, str]) -> list[Operation]:
        self.reads += 1
        return super().unconverged(want)

    def apply(self, ops: list[Operation]) -> list[int] | None:
        if self.beside is not None:
            self.kernel.update(self.beside)
            self.gen = None if self.gen is None else self.gen + 1
        before = dict(self.kernel)
        super().apply(ops)
        if self.gen is None:
            return None
        if self.kernel == before:
            return []
        self.gen += 1
        return [self.gen]


def test_apply_is_verified_by_the_generation_when_only_its_own_commit_moved_it() -> None:
    backend = CountingKernel()
    planned = make_plan(backend, desired())
    assert planned.observed_at == 7 and planned.plan.operations
    assert apply(backend, planned) == backend.kernel
    assert backend.reads == 0 and planned.verified_by == "generation" and planned.verified_at == 8
    again = make_plan(backend, desired())  # nothing to do, and nobody committed since the read
    apply(backend, again)
    assert not again.plan.operations and backend.reads == 0 and again.verified_by == "generation"
    backend.gen += 1  # somebody committed after that read: the kernel is read back
    apply(backend, again)
    assert backend.reads == 1 and again.verified_by == "read" and again.verified_at == 9


@pytest.mark.parametrize("case", ["foreign commit", "somebody was quicker", "no generation", "read back asked"])
def test_apply_reads_the_kernel_back_when_the_generation_cannot_vouch(case: str) -> None:
    backend = CountingKernel(generation=None if case == "no generation" else 7)
    planned = make_plan(backend, desired())
    if case == "foreign commit":  # something unrelated, but it might have been anything
        backend.beside = {"other": "x"}
    if case == "somebody was quicker":  # with our very change: ours then commits nothing
        backend.beside = {op.name: op.text.split()[-1] for op in planned.plan.operations}
    with pytest.raises(KernelError, match="did not converge") if case == "foreign commit" else nullcontext():
        apply(backend, planned, read_back=case == "read back asked")
    assert backend.reads == 1 and planned.verified_by == "read"


def test_a_transaction_that_committed_nothing_is_not_vouched_for() -> None:
    backend = CountingKernel()
    planned = make_plan(backend, desired())
    backend.kernel = dict(planned.desired_model)  # it was there already: nothing to commit
    apply(backend, planned)  # the generation did not move, as if our plan had been a no-op
    assert planned.generations is None and backend.reads == 1 and planned.verified_by == "read"


def test_a_commit_during_the_plans_read_is_not_taken_for_ours() -> None:
    class CommitDuringRead(CountingKernel):
        def observe(self, beside_work: bool = False) -> dict[str, str]:
            seen = super().observe()
            self.gen += 1  # somebody commits once the read has its copy: the plan may be stale
            return seen

    backend = CommitDuringRead()
    planned = make_plan(backend, desired())
    assert planned.observed_at == 7
    apply(backend, planned)
    assert backend.reads == 1 and planned.verified_by == "read"


class OtherMode(CountingKernel):
    """The other mode's backend, committing in the same namespace's generation as `main`."""

    def __init__(self, main: CountingKernel, produces: str) -> None:
        super().__init__()
        self.main, self.produces = main, produces

    def apply(self, ops: list[Operation]) -> list[int] | None:
        if self.produces == "nothing":
            return []
        self.main.gen += 1
        return [self.main.gen] if self.produces == "its commit" else None


@pytest.mark.parametrize("case", ["its commit", "unknown", "nothing", "ours nothing"])
def test_the_other_modes_cleanup_counts_in_the_proof(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    from reconciler import reconcile

    backend = CountingKernel()
    other = OtherMode(backend, "its commit" if case == "ours nothing" else case)
    monkeypatch.setattr(reconcile, "get_backend", lambda mode: other)
    monkeypatch.setitem(reconcile.OTHER_MODE, "fake", "other")
    leftovers = [Operation("-", "chain", "nat OLD", "-X OLD")]
    planned = make_plan(backend, desired(), other_mode=True, leftovers=leftovers)
    if case == "ours nothing":  # our part committed nothing; the cleanup's commit must not hide that
        backend.kernel = dict(planned.desired_model)
    apply(backend, planned)
    if case == "its commit":  # ours, then the cleanup's: consecutive, both named
        assert planned.generations == [8, 9] and backend.reads == 0 and planned.verified_by == "generation"
    else:
        assert backend.reads == 1 and planned.verified_by == "read"


def test_a_plan_made_against_a_given_model_is_not_vouched_for() -> None:
    backend = CountingKernel()
    planned = make_plan(backend, desired(), observed_model={})  # (not read now: no generation known)
    assert planned.observed_at is None
    apply(backend, planned)
    assert backend.reads == 1 and planned.verified_by == "read"


@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_a_change_to_rules_alone_is_a_changed_service_port_in_the_plan(mode: str) -> None:
    """Source ranges, affinity or traffic policy changed, addresses and endpoints the same: the
    plan still names the service port as changed (not "0 to change" beside kernel operations)."""
    from reconciler.backends import get_backend

    def state(**spec: Any) -> Any:
        return build([service("web", "10.96.0.10", [{"name": "http", "port": 80}], **spec),
                      endpoint_slice("web", [endpoint("10.244.1.5")])])

    before = get_backend(mode).render(state(sessionAffinity="ClientIP",
                                            sessionAffinityConfig={"clientIP": {"timeoutSeconds": 600}}))
    backend = get_backend(mode)
    planned = make_plan(backend, state(sessionAffinity="ClientIP",
                                       sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}}),
                        observed_model=before, other_mode=False)
    assert planned.plan.operations
    assert [(s.action, s.service) for s in planned.plan.services] == [("~", "default/web:http/TCP")]
    undescribed = make_plan(backend, state(sessionAffinity="ClientIP",
                                           sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}}),
                            observed_model=before, other_mode=False, describe=False)
    assert undescribed.count_services(backend) == {"~": 1}  # (the run loop's count)


class _SlowReader:
    """A backend whose read, in the forked worker, takes a while and notes when it runs."""

    observe_in = "process"

    def __init__(self, log: str) -> None:
        self.log = log

    def observe(self, beside_work: bool = False) -> str:
        _note(self.log, "read starts")
        import time
        time.sleep(0.3)
        _note(self.log, "read ends")
        return "model"


def _note(path: str, what: str) -> None:
    with open(path, "a") as fh:
        fh.write(what + "\n")


def test_the_one_shot_worker_reads_the_kernel_before_it_parses_anything(tmp_path: Path) -> None:
    """One worker: the manifests it is given to parse wait for the kernel read, so that a long
    read keeps its core (the loading parses them itself meanwhile)."""
    from reconciler.reconcile import _workers
    log = str(tmp_path / "log")
    with _workers(_SlowReader(log)) as (observed, pool):
        assert pool is not None
        parsed = pool.submit(_note, log, "parse")
        assert observed.result(timeout=30) == "model" and parsed.result(timeout=30) is None
    assert open(log).read().split("\n")[:3] == ["read starts", "read ends", "parse"]

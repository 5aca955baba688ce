"""One reconcile pass: desired state -> plan against the kernel -> apply -> verify."""

from __future__ import annotations

import logging
import multiprocessing
import threading
from collections import Counter
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from . import conntrack
from .backends import get_backend
from .backends.base import KernelError, Operation
from .backends.generation import follows
from .backends.generation import generation as nf_tables_generation
from .config import Options
from .desired import build_desired_state
from .plan import Plan, service_change_counts, service_changes
from .sources.manifests import load_directory
from .sources.objects import SERVICE_KINDS, InputErrors, InputWarning
from .state import DesiredState, Family

log = logging.getLogger(__name__)


def load_desired(source: str, options: Options, pool: Executor | None = None,
                 after: Future[Any] | None = None) -> DesiredState:
    """Read a manifest directory into the canonical document (raises InputError(s)); a process
    pool, when given, parses part of the files once `after` is done (see load_directory)."""
    try:
        loaded = load_directory(source, pool, after)
    except InputErrors as exc:  # the objects that did load are checked too: all errors at once
        partial = getattr(exc, "loaded", None)
        if partial is not None:
            try:
                desired = build_desired_state(partial.objects, options.build_options())
            except InputErrors as more:
                raise InputErrors(exc.errors + more.errors, [*partial.warnings, *more.warnings]) from None
            raise InputErrors(exc.errors, [*partial.warnings, *desired.warnings]) from None
        raise
    try:
        desired = build_desired_state(loaded.objects, options.build_options())
    except InputErrors as exc:
        exc.warnings = [*loaded.warnings, *exc.warnings]
        raise
    for w in (*loaded.warnings, *desired.warnings):
        log.warning("%s", w)
    if not any(o.kind in SERVICE_KINDS for o in loaded.objects):  # (a wrong --source, or only a Node
        # written so far: applied, it removes every service port of ours)
        log.warning("%s", InputWarning(source, "no Service or EndpointSlice in it: the desired state has no "
                                               "service ports"))
    return desired


OTHER_MODE = {"nftables": "iptables", "iptables": "nftables"}


@dataclass
class Planned:
    plan: Plan
    desired_model: Any
    observed_model: Any  # None once apply() has verified
    desired: DesiredState  # what desired_model renders (the UDP conntrack cleanup's frontends and endpoints)
    other_mode_cleanup: list[Operation] = field(default_factory=list)
    described: bool = True  # plan.services filled in (see describe())
    # the ruleset generation (see backends/generation.py) before observed_model was read (None:
    # not known, or the model is not a fresh read)
    observed_at: int | None = None
    # what apply() learnt of it: the generations its commits produced (None: not known which),
    # and the one at which it verified the kernel (how: verified_by)
    generations: list[int] | None = field(default_factory=list)
    verified_at: int | None = None
    _touched: set[str] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def verified_by(self) -> str | None:
        """How apply() verified the kernel: "generation" (our commits were all that changed it
        since observed_at) or "read" (read back); None before."""
        return self.plan.verified_by

    def committed(self, generations: list[int] | None) -> None:
        """A transaction of the plan ran and committed these generations. None (not known which)
        and [] (it committed nothing, though planned to change something: the plan was no
        change to the kernel after all) both leave the generations unable to vouch for it."""
        self.generations = None if not generations or self.generations is None else self.generations + generations

    def describe(self, backend: Any) -> None:
        """Fill in plan.services, the plan in service terms (once): what the service ports touched
        by the operations look like before and after."""
        if self.described:
            return
        views = self._views(backend)
        if views:
            self.plan.services = service_changes(*views, self.touched(backend))
        self.described = True

    def count_services(self, backend: Any) -> Counter[str]:
        """How many service ports the plan adds, changes, removes ("+", "~", "-"): plan.services
        counted, or (not described) found without describing them, a few thousand service ports
        at a time (the run loop's way: its peak RSS)."""
        if self.described:
            return Counter(s.action for s in self.plan.services)
        touched = sorted(self.touched(backend))
        counts: Counter[str] = Counter()
        for i in range(0, len(touched), COUNT_CHUNK):
            part = set(touched[i:i + COUNT_CHUNK])
            counts += service_change_counts(backend.service_view(self.observed_model, part),
                                            backend.service_view(self.desired_model, part), part)
        return counts

    @property
    def own_operations(self) -> list[Operation]:
        """The plan's operations on this mode's objects (the other mode's cleanup comes last)."""
        ops = self.plan.operations
        return ops[:len(ops) - len(self.other_mode_cleanup)]

    def touched(self, backend: Any) -> set[str]:
        """The service ports the plan's own operations change: those they name, and those whose
        objects go without an operation naming them (see touched_services). Found once."""
        if self._touched is None:
            self._touched = touched_services(self.own_operations, backend, self.observed_model)
        return self._touched

    def _views(self, backend: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
        touched = self.touched(backend)
        if not touched:
            return None
        return backend.service_view(self.observed_model, touched), backend.service_view(self.desired_model, touched)


COUNT_CHUNK = 2000  # service ports whose views count_services() holds at once


def make_plan(backend: Any, desired: DesiredState, observed_model: Any = None,
              other_mode: bool | None = None, want: Any = None,
              leftovers: list[Operation] | None = None, describe: bool = True,
              observed_at: int | None = None) -> Planned:
    """Diff the rendered desired model (`want`: rendered now unless given) against the kernel
    (observed now unless given; `observed_at`: the generation before a given model was read).

    A full plan (by default when the kernel is observed here) also removes what the other mode
    left behind (`leftovers`: found already), so switching `--mode` leaves only one mode's objects.
    describe=False leaves the plan in service terms to Planned.describe() (apply() fills it in
    while the kernel works).
    """
    if want is None:
        want = backend.render(desired)
    if observed_model is None:
        observed_at = backend.generation()
        have = backend.observe()
    else:
        have = observed_model
    ops: list[Operation] = backend.diff(want, have)
    other: list[Operation] = []
    if other_mode if other_mode is not None else observed_model is None:
        other = other_mode_leftovers(backend.mode) if leftovers is None else leftovers
    plan = Plan(backend.mode, desired.node.name, operations=ops + other,
                other_mode=OTHER_MODE.get(backend.mode) if other else None, other_mode_operations=len(other))
    planned = Planned(plan, want, have, desired, other,
                      described=False, observed_at=observed_at)
    if describe:
        planned.describe(backend)
    return planned


def plan_against_kernel(backend: Any, source: str, options: Options, describe: bool = True) -> Planned:
    """Read the kernel while the manifests load and render, then plan: the one-shot commands' path.

    A backend whose model pickles cheaply (observe_in = "process": nftables' rules read as
    strings, iptables' chains kept as strings) reads in a forked child: the tools it runs and the
    parsing of their output use the other core without waiting for this process's interpreter
    lock, and the model comes back pickled; then the child parses part of the manifests, if any
    are left. Otherwise (a
    process that already has threads) a thread reads. A thread looks for the other mode's
    leftovers meanwhile, listing what is there first (see Backend.cleanup).
    """
    # the generation before the read starts (nf_tables' own: a backend's may first look for its
    # flavour, which would hold up the read; where that counter does not cover the backend's
    # objects, its generation() is None and apply() reads back all the same)
    observed_at = nf_tables_generation()
    with _workers(backend) as (observed, pool), ThreadPoolExecutor(max_workers=1) as side:
        other = side.submit(other_mode_leftovers, backend.mode, True)
        try:
            desired = load_desired(source, options, pool, observed)
            want = backend.render(desired)  # while the kernel is still being read
            backend.before_diff(want)
        except BaseException:
            observed.cancel()
            raise
        try:
            observed_model = observed.result()
        except BrokenProcessPool as exc:  # the child died (killed, out of memory): read here instead
            log.warning("reading the kernel in a child process failed (%s); reading it here", exc)
            observed_model = backend.observe()
        return make_plan(backend, desired, observed_model, other_mode=True, want=want, leftovers=other.result(),
                         describe=describe, observed_at=observed_at)


def _observe(backend: Any) -> Any:
    """The read beside the manifests loading (in the forked child, or a thread): the backend keeps
    to one kernel tool at a time (more tools than cores would take the loading's core)."""
    return backend.observe(beside_work=True)


@contextmanager
def _workers(backend: Any) -> Iterator[tuple[Future[Any], Executor | None]]:
    """backend.observe() started now, and the process pool it runs in (None: it runs in a thread).

    Processes only when the backend asks for it and this process has no other thread yet (the
    one-shot commands have none): forking a threaded process could inherit a held lock. The pool
    forks its worker before it starts its own thread. One worker: it reads, then parses manifests
    if the loading has not got to them (load_directory); a second one parsing meanwhile took CPU
    from the read and the loading when both were long (10k services, iptables no-op plan: ~0.2 s
    slower), and spared little when the read was short (a cold apply, where this one parses).
    """
    pool: Executor | None = None
    if getattr(backend, "observe_in", "thread") == "process" and threading.active_count() == 1:
        try:
            pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("fork"))
            future = pool.submit(_observe, backend)
        except (OSError, ValueError, RuntimeError) as exc:
            log.debug("observing in a thread: %s", exc)
            pool = None
    processes = pool
    if pool is None:
        pool = ThreadPoolExecutor(max_workers=1)
        future = pool.submit(_observe, backend)
    try:
        yield future, processes
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def touched_services(ops: list[Operation], backend: Any = None, observed: Any = None) -> set[str]:
    """The service ports the operations name; with the backend and the model they were planned
    against, also those whose objects go without an operation naming them (Backend.removed_unnamed:
    with a whole table, with a shared chain rewritten whole)."""
    named = {op.service for op in ops if op.service}
    if backend is None or observed is None:
        return named
    return named | backend.removed_unnamed(observed, ops)


def other_mode_leftovers(mode: str, look_first: bool = False, unseen_only: bool = False) -> list[Operation]:
    """Operations removing the objects of the other mode (empty when its tools are missing);
    `look_first`: see Backend.cleanup. `unseen_only`: only where the ruleset generation does not
    cover them (legacy iptables), for a resync that trusts the generation (see drift.py)."""
    other_mode = OTHER_MODE.get(mode)
    if other_mode is None:
        return []
    try:
        other = get_backend(other_mode)
        if unseen_only and other.generation() is not None:
            return []
        return other.cleanup(look_first)
    except (KernelError, OSError) as exc:
        log.debug("cannot inspect %s objects: %s", other_mode, exc)
        return []


def apply(backend: Any, planned: Planned, verify: bool = True, release: bool = False,
          read_back: bool = False) -> Any:
    """Run the plan atomically (describing it in service terms meanwhile, if not done yet), remove
    the other mode's leftovers, clear stale UDP conntrack entries when due (see
    conntrack.Reconciler: never an error of the apply), then verify that the kernel holds the
    desired model.

    The generation verifies it when it can: the plan took the kernel as read at
    planned.observed_at to the desired model, and when our commits were the very ones that
    followed that read and nothing has committed since, the kernel holds exactly what the read
    found changed by our transaction (atomic: all of it), so reading it back would find nothing
    to do (10k services: ~3-7 s spared) — as long as the plan was right: that rendering, the
    kernel and our parser of its listing agree, which the tests check (apply, then plan: no
    changes) and a read-back checks again (the run loop's hourly one, or `read_back`).
    Otherwise (or `read_back`) the kernel is re-observed and must need no change; that first
    drops planned.observed_model: two read-backs of a big ruleset need not be alive at once. With verify=False (the run loop's syncs that did not read the kernel
    either: it knows what the kernel held, see drift.py) nothing is verified.

    Returns the model the kernel now holds (the desired one). What apply learns of the ruleset
    generation is left in planned.generations, planned.verified_at and planned.verified_by.
    release=True (the run loop, which has taken its counts): the plan is not described, its
    service changes are let go at once and its operations once applied, before the kernel is read
    back (10k services, cold start: the run process's peak 345 -> ~300 MiB).
    """
    own = planned.own_operations
    if release:
        planned.plan.services = []
    if own:
        if planned.described or release:
            planned.committed(backend.apply(own))
        else:  # describe the plan while the kernel takes the transaction (10k services, cold:
            # 0.4 s nftables, 0.7 s iptables, against seconds of `nft -f` / `iptables-restore`),
            # written first: its text written beside the describing would take twice as long
            transaction = backend.prepare(own)
            with ThreadPoolExecutor(max_workers=1) as kernel:
                done = kernel.submit(transaction)
                try:
                    planned.describe(backend)
                finally:
                    planned.committed(done.result())  # the transaction's outcome first: its error wins
    conntrack.RECONCILER.take(planned.desired, _unseen_udp_frontends(backend, planned))
    if planned.other_mode_cleanup:
        planned.committed(get_backend(OTHER_MODE[backend.mode]).apply(planned.other_mode_cleanup))
        log.info("removed %d object(s) left by %s mode", len(planned.other_mode_cleanup), OTHER_MODE[backend.mode])
    conntrack.RECONCILER.run()
    if release:
        planned.plan.operations, planned.plan.other_mode_operations = [], 0
        del own
    else:
        planned.describe(backend)  # (when nothing of ours was applied)
    if not verify:
        return planned.desired_model
    now = backend.generation()
    if not read_back and now is not None and follows(planned.observed_at, planned.generations) == now:
        planned.verified_at, planned.plan.verified_by = now, "generation"
        log.debug("verified by the ruleset generation: %s, reached from the read at %s by our commits %s alone",
                  now, planned.observed_at, planned.generations)
        return planned.desired_model
    planned.observed_model = None  # not needed any more: let it go before the kernel is read again
    planned.verified_at, planned.plan.verified_by = now, "read"
    remaining = backend.unconverged(planned.desired_model)
    if remaining:
        raise KernelError(f"kernel did not converge: {len(remaining)} operations still pending, first: "
                          f"{remaining[0].text}")
    return planned.desired_model  # equal to what was read back; one copy in memory is enough


def clean_conntrack(planned: Planned) -> conntrack.Result | None:
    """Clear stale UDP conntrack entries if due (see conntrack.Reconciler; None: not due), the
    plan's desired state taken in. apply() does this; the run loop also after a sync with nothing
    to apply: serving endpoints may change without the rules, and a failed cleanup is retried."""
    conntrack.RECONCILER.take(planned.desired)
    return conntrack.RECONCILER.run()


def _unseen_udp_frontends(backend: Any, planned: Planned) -> set[tuple[Family, conntrack.Frontend]]:
    """On a process's first apply, the frontends the UDP service ports the plan touches had, as the
    kernel held them, that no UDP service port has now (a port removed, or one that lost an
    externalIP, its nodePort, its port number, a family): they were frontends before this process,
    which cannot know it otherwise (the run loop, which saw them, compares its ports itself)."""
    if not conntrack.RECONCILER.first or planned.observed_model is None:
        return set()
    touched = {s for s in planned.touched(backend) if s.endswith("/UDP")}
    if not touched:
        return set()
    had = conntrack.view_frontends(backend.service_view(planned.observed_model, touched))
    wanted = {(family, frontend) for sp in planned.desired.services if sp.protocol == "UDP"
              for family, frontend, _ in conntrack.frontends(sp)}
    return had - wanted

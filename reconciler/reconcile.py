"""One reconcile pass: desired state -> plan against the kernel -> apply -> verify."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from . import conntrack
from .backends.base import KernelError, Operation
from .config import Options
from .desired import build_desired_state
from .plan import Plan, service_changes
from .sources.manifests import load_directory
from .state import DesiredState

log = logging.getLogger(__name__)


def load_desired(source: str, options: Options) -> DesiredState:
    """Read a manifest directory into the canonical document (raises InputError(s))."""
    loaded = load_directory(source)
    desired = build_desired_state(loaded.objects, options.build_options())
    for w in (*loaded.warnings, *desired.warnings):
        log.warning("%s", w)
    return desired


@dataclass
class Planned:
    plan: Plan
    desired_model: Any
    observed_model: Any


def make_plan(backend: Any, desired: DesiredState, observed_model: Any = None) -> Planned:
    """Diff the rendered desired model against the kernel (observed now unless given)."""
    want = backend.render(desired)
    have = backend.observe() if observed_model is None else observed_model
    ops: list[Operation] = backend.diff(want, have)
    plan = Plan(backend.mode, desired.node.name, operations=ops)
    if ops:
        plan.services = service_changes(backend.service_view(have), backend.service_view(want))
    return Planned(plan, want, have)


def apply(backend: Any, planned: Planned) -> Any:
    """Run the plan as one transaction and verify: re-observed, the kernel must need no change.

    Returns the observed model after apply.
    """
    if planned.plan.operations:
        backend.apply(planned.plan.operations)
        stale = conntrack.stale_udp_flows(backend.service_view(planned.observed_model),
                                          backend.service_view(planned.desired_model))
        if stale:
            log.info("clearing %d stale UDP conntrack flow filter(s)", conntrack.clear(stale))
    after = backend.observe()
    remaining = backend.diff(planned.desired_model, after)
    if remaining:
        raise KernelError(f"kernel did not converge: {len(remaining)} operations still pending, first: "
                          f"{remaining[0].text}")
    return after

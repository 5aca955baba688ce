"""A plan: what changes per service port (for people), then the kernel operations (for the kernel).

Service-level changes come from deepdiff over the per-service views of the observed and the
desired kernel models; only the service ports whose views differ are diffed.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .backends.base import Operation


@dataclass(frozen=True)
class ServiceChange:
    service: str
    action: str  # + added, - removed, ~ changed
    details: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"service": self.service, "action": self.action, "changes": list(self.details),
                "items": [_item(line) for line in self.details]}


def _item(line: str) -> dict[str, str]:
    """A change line as data (-o json): {action, kind, value[, verdict]}, e.g. "+ address
    172.30.1.10:443/tcp (drop)" -> {"action": "+", "kind": "address", "value": "172.30.1.10:443/tcp",
    "verdict": "drop"}; "~ its rules ..." -> {"action": "~", "kind": "rules"}."""
    sign, _, rest = line.partition(" ")
    for noun, kind in _ITEM_KINDS:
        if rest.startswith(noun + " "):
            value = rest[len(noun) + 1:]
            item = {"action": sign, "kind": kind}
            if kind == "address" and value.endswith(")"):
                value, _, verdict = value[:-1].partition(" (")
                item["verdict"] = verdict
            item["value"] = "any" if kind == "sourceRange" and value == ANY_SOURCE else value
            return item
    return {"action": sign, "kind": "rules"}


@dataclass
class Plan:
    mode: str
    node: str
    services: list[ServiceChange] = field(default_factory=list)
    operations: list[Operation] = field(default_factory=list)
    verified_by: str | None = None  # apply: "generation" or "read" (see reconcile.apply)
    # the nf_tables ruleset generation the kernel was read at (None: not known, or legacy iptables):
    # `apply --plan` runs a saved plan only while it is still that
    observed_generation: int | None = None
    # the last `other_mode_operations` operations remove what `other_mode` (the other mode) left
    other_mode: str | None = None
    other_mode_operations: int = 0

    @property
    def empty(self) -> bool:
        return not self.operations

    def counts(self) -> dict[str, int]:
        """Service ports to add, change and remove ("+", "~", "-")."""
        return {a: sum(1 for s in self.services if s.action == a) for a in "+~-"}

    def summary(self) -> str:
        counts = self.counts()
        if self.empty:
            return "No changes. The kernel matches the desired state."
        ports = "service port" if counts["+"] == 1 else "service ports"
        ops = f"{len(self.operations)} kernel operation{'' if len(self.operations) == 1 else 's'}"
        if self.other_mode_operations:
            ops += f", {self.other_mode_operations} of them removing what {self.other_mode} mode left"
        return f"Plan: {counts['+']} {ports} to add, {counts['~']} to change, {counts['-']} to remove; {ops}."

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode, "node": self.node, "inSync": self.empty,
            "services": [s.to_dict() for s in self.services],
            "operations": [o.to_dict() for o in self.operations],
            "summary": self.summary(),
            "counts": dict(zip(("add", "change", "remove"), self.counts().values()), operations=len(self.operations)),
            **({"otherMode": {"mode": self.other_mode, "operations": self.other_mode_operations}}
               if self.other_mode_operations else {}),
            **({"verifiedBy": self.verified_by} if self.verified_by else {}),
            **({"observedGeneration": self.observed_generation} if self.observed_generation is not None else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_text(self, max_operations: int = 200) -> str:
        lines = [f"service-reconciler plan: mode {self.mode}, node {self.node}", ""]
        if self.services:
            lines.append("Service ports:")
            for s in self.services:
                lines.append(f"  {s.action} {s.service}")
                lines += [f"      {d}" for d in s.details]
            lines.append("")
        if self.operations:
            lines.append(f"Kernel operations ({len(self.operations)}; grouped by service port, "
                         f"-o json lists them in execution order):")
            if any(op.drops or op.restates for op in self.operations):
                lines.append(REWRITE_LEGEND)
            groups: dict[str, list[Operation]] = {}
            own = len(self.operations) - self.other_mode_operations
            for op in self.operations[:own]:
                groups.setdefault(op.service or "(shared objects)", []).append(op)
            leftovers = f"(what {self.other_mode} mode left)"
            if self.other_mode_operations:  # (they run last; headed second, where it is seen)
                groups[leftovers] = self.operations[own:]
            # each group gets a share of the budget (the shared objects must not use it all up),
            # and groups past the budget are counted, not headed
            share = max(5, max_operations // len(groups))
            shown = omitted = 0
            for name in sorted(groups, key=lambda g: (g != "(shared objects)", g != leftovers, g)):
                ops = groups[name]
                room = min(share, max_operations - shown)
                if room <= 0:
                    omitted += len(ops)
                    continue
                lines.append(f"  # {name}")
                for op in ops[:room]:
                    lines.append(f"  {'=' if op.restates else op.action} {_shown(op)}")
                    lines += _dropped(op)
                shown += min(room, len(ops))
                if len(ops) > room:
                    lines.append(f"    ... {len(ops) - room} more of {name}")
                    omitted += len(ops) - room
            if omitted:
                lines.append(f"  ... {omitted} more in all (use -o json for all)")
            lines.append("")
        lines.append(self.summary())
        return "\n".join(lines)


REWRITE_LEGEND = "  (a chain rewritten whole: `-` under its flush, a rule it loses; `=`, a rule it held, written back)"
DROPS_SHOWN = 20  # per flushed chain; -o json lists them all


def _dropped(op: Operation) -> list[str]:
    """The rules a flushed chain loses, under its flush (see Operation.drops)."""
    lines = [f"      - {rule}" for rule in op.drops[:DROPS_SHOWN]]
    if len(op.drops) > DROPS_SHOWN:
        lines.append(f"      ... {len(op.drops) - DROPS_SHOWN} more rules it loses")
    return lines


def _shown(op: Operation) -> str:
    """An operation's command as the text plan shows it: an iptables restore line after its tool
    and table ("[ip6tables nat] -A ..."), which the line itself does not name (nft's do)."""
    tool, _, rest = op.name.partition(" ")
    if tool in ("iptables", "ip6tables"):
        return f"[{tool} {rest.partition(' ')[0]}] {op.text}"
    return op.text


RULES_ONLY = "~ its rules (traffic policy, masquerading...): see its kernel operations"


def service_changes(observed: dict[str, dict[str, Any]], desired: dict[str, dict[str, Any]],
                    touched: frozenset[str] | set[str] = frozenset()) -> list[ServiceChange]:
    """Per service port, what differs between two views ({id: {addresses: [...], endpoints: [...], ...}},
    see backends.base.view_entry); a port in `touched` (the plan has operations of it) whose views
    are the same changes in its rules alone."""
    out = []
    for sid in sorted(set(observed) | set(desired)):
        old, new = observed.get(sid), desired.get(sid)
        action = _action(old, new, sid in touched)
        if action == "~" and old == new:
            out.append(ServiceChange(sid, "~", (RULES_ONLY,)))
            continue
        if action == "+":
            out.append(ServiceChange(sid, "+", _describe(new or {}, "+")))
        elif action == "-":
            out.append(ServiceChange(sid, "-", _describe(old or {}, "-")))
        elif action == "~":
            out.append(ServiceChange(sid, "~", _changed(old or {}, new or {})))
    return out


def service_change_counts(observed: dict[str, dict[str, Any]], desired: dict[str, dict[str, Any]],
                          touched: frozenset[str] | set[str] = frozenset()) -> Counter[str]:
    """How many service ports service_changes() would list per action, without describing them."""
    actions = (_action(observed.get(sid), desired.get(sid), sid in touched) for sid in set(observed) | set(desired))
    return Counter(a for a in actions if a is not None)


def _action(old: dict[str, Any] | None, new: dict[str, Any] | None, touched: bool = False) -> str | None:
    """"+", "-" or "~" for a service port's views before and after; None when they are equal
    (unless the plan touches its rules: "~")."""
    if old == new:
        return "~" if touched and old is not None else None
    return "+" if old is None else "-" if new is None else "~"


_NOUNS = {"addresses": "address", "endpoints": "endpoint", "externalEndpoints": "external traffic only to endpoint",
          "sourceRanges": "source range", "affinity": "session affinity"}  # a view's lists, in the order shown
CHANGED_EXTERNAL = "external traffic to endpoint"  # (externalEndpoints' noun in a changed service port)
_KINDS = {"addresses": "address", "endpoints": "endpoint", "externalEndpoints": "externalEndpoint",
          "sourceRanges": "sourceRange", "affinity": "affinity"}  # a view's lists as -o json's items name them
_ITEM_KINDS = (*((noun, _KINDS[key]) for key, noun in _NOUNS.items()), (CHANGED_EXTERNAL, "externalEndpoint"))


def _describe(view: dict[str, Any], sign: str) -> tuple[str, ...]:
    return tuple(f"{sign} {noun} {v}" for k, noun in _NOUNS.items() for v in view.get(k, []))


def _changed(old: dict[str, Any], new: dict[str, Any]) -> tuple[str, ...]:
    from deepdiff import DeepDiff  # imported when needed: it is slow to import

    # every list present on both sides: a list that appears or goes is items added or removed
    old, new = ({k: view.get(k, []) for k in _NOUNS} for view in (old, new))
    dd = DeepDiff(old, new, ignore_order=True, view="tree")
    added: dict[str, list[str]] = {}
    removed: dict[str, list[str]] = {}
    for kind, target, attr in (("iterable_item_added", added, "t2"), ("iterable_item_removed", removed, "t1")):
        for level in dd.get(kind, []):
            key = str(level.path(output_format="list")[0])
            target.setdefault(key, []).append(str(getattr(level, attr)))
    for level in dd.get("values_changed", []):
        key = str(level.path(output_format="list")[0])
        removed.setdefault(key, []).append(str(level.t1))
        added.setdefault(key, []).append(str(level.t2))
    _external_change(old, new, added, removed)
    if bool(old["sourceRanges"]) != bool(new["sourceRanges"]) and old["addresses"] == new["addresses"]:
        # (no range, the same load balancer IPs: every source is let in)
        (removed if new["sourceRanges"] else added).setdefault("sourceRanges", []).append(ANY_SOURCE)
    lines = []
    for key in _NOUNS:
        noun = CHANGED_EXTERNAL if key == "externalEndpoints" else _NOUNS[key]
        for v in sorted(removed.get(key, []), key=lambda v: (v != ANY_SOURCE, v)):
            lines.append(f"- {noun} {v}")
        for v in sorted(added.get(key, []), key=lambda v: (v == ANY_SOURCE, v)):
            lines.append(f"+ {noun} {v}")
    return tuple(lines)


ANY_SOURCE = "any (no range: every source reaches the load balancer IPs)"


def _external_reach(view: dict[str, Any]) -> set[str]:
    """The endpoints a view's external traffic reaches: those listed for it, else none where its
    external addresses drop (a traffic policy Local without a local endpoint), else the cluster
    traffic's."""
    if view["externalEndpoints"]:
        return set(view["externalEndpoints"])
    if any(a.endswith("(drop)") for a in view["addresses"]):
        return set()
    return set(view["endpoints"])


def _external_change(old: dict[str, Any], new: dict[str, Any], added: dict[str, list[str]],
                     removed: dict[str, list[str]]) -> None:
    """The endpoints external traffic reaches, listed (externalEndpoints) only while they differ
    from cluster traffic's, change as the endpoints it actually reaches change: those (the
    listed ones, else the cluster ones) before and after; nothing when that is the cluster
    traffic's change itself (a policy made Local whose endpoints are all local, hints that move
    cluster traffic alone)."""
    added.pop("externalEndpoints", None)
    removed.pop("externalEndpoints", None)
    if not old["externalEndpoints"] and not new["externalEndpoints"]:
        return
    before, after = _external_reach(old), _external_reach(new)
    if (after - before, before - after) == (set(new["endpoints"]) - set(old["endpoints"]),
                                           set(old["endpoints"]) - set(new["endpoints"])):
        return
    added["externalEndpoints"], removed["externalEndpoints"] = sorted(after - before), sorted(before - after)

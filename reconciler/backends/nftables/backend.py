"""The nftables backend: render / observe / diff / apply / cleanup behind the Backend interface."""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

from ...state import DesiredState
from ..base import KernelError, Operation, nodeport_address, view_entry, view_sets
from ..generation import generation
from . import kernel
from .diff import diff, foreign, owner, script, services_of_deleted_tables
from .objects import TABLE, Ruleset, Table, duration_seconds
from .observe import each_table, observe
from .render import Renderer, shard_of, shard_table_name

log = logging.getLogger(__name__)

FIREWALL_ALLOW = "firewall-allow"  # (render's set: LB IP . protocol . port . a source it allows)
_SERVICE_MAPS = {"service-ips": "", "no-endpoint-services": "", "service-nodeports": "nodePort ",
                 "no-endpoint-nodeports": "nodePort "}
_V4_EP = re.compile(r"(\d+\.\d+\.\d+\.\d+) \. (\d+)|to (\d+\.\d+\.\d+\.\d+):(\d+)")
_V6_EP = re.compile(r"([0-9a-f:]*:[0-9a-f:]*) \. (\d+)|to \[([0-9a-f:]+)\]:(\d+)")
# how render's ext- rules for this node's own traffic begin (its pods, the node itself)
_SHORT_CIRCUIT = ("ip saddr @cluster-cidrs ", "ip6 saddr @cluster-cidrs ", "fib saddr type local ")


class NftablesBackend:
    mode = "nftables"
    observe_in = "process"  # see reconcile.plan_against_kernel: the Ruleset is strings, cheap to pickle

    def __init__(self) -> None:
        self._renderer = Renderer()  # keeps per-service fragments: later renders cost O(changes)
        self._rendered: Ruleset | None = None  # the last render: set definitions for script()

    def render(self, desired: DesiredState) -> Ruleset:
        self._rendered = self._renderer.render(desired)
        return self._rendered

    def observe(self, beside_work: bool = False) -> Ruleset:
        """Our tables as the kernel holds them; `beside_work`: the read shares the machine with
        other heavy work (see reconcile.plan_against_kernel), so one `nft` runs at a time."""
        return observe(tools_at_once=1 if beside_work else 3)

    def diff(self, desired: Ruleset, observed: Ruleset) -> list[Operation]:
        return diff(desired, observed)

    def before_diff(self, desired: Ruleset) -> None:
        pass  # (the diff's work is all comparing with what is read)

    def unconverged(self, desired: Ruleset) -> list[Operation]:
        """diff(desired, observe()), one table at a time: the read-back is never whole in memory."""
        ops: list[Operation] = []
        seen = set()
        for table in each_table():
            seen.add(table.ref)
            ops += diff(Ruleset({table.ref: desired.tables[table.ref]} if table.ref in desired.tables else {}),
                        Ruleset({table.ref: table}))
        missing = {ref: t for ref, t in desired.tables.items() if ref not in seen}
        return ops + diff(Ruleset(missing), Ruleset())

    def apply(self, operations: list[Operation]) -> list[int] | None:
        return self.prepare(operations)()

    def prepare(self, operations: list[Operation]) -> Callable[[], list[int] | None]:
        """The transaction's text written now; the function returned runs it, once."""
        light = kernel.spooled_script()  # (written, not held as one string: see SpooledInput)
        try:
            script(operations, self._rendered, light)
        except BaseException:
            light.close()
            raise

        def run() -> list[int] | None:
            if light.closed:
                raise RuntimeError("a prepared nftables transaction runs once")
            try:
                return kernel.run_script(light).generations
            except KernelError as exc:
                plain = script(operations)
                same = plain == light.text()
                light.close()  # (before the retry: a 10k cold start's ~15 MB)
                if same:
                    raise
                # the kernel refused a set as script() restated it (one made by something else,
                # or another nft version): nothing was changed, so the plain commands may try
                log.warning("nftables transaction failed as written for speed (%s); retrying it plainly", exc)
                return kernel.run_script(plain).generations
            finally:
                light.close()
        return run

    def foreign(self, operation: Operation) -> str | None:
        return foreign(operation)

    def generation(self) -> int | None:
        return generation()

    def script(self, operations: list[Operation]) -> str:
        """The transaction text; the operations are those planned from the last render."""
        return script(operations, self._rendered)

    def cleanup(self, look_first: bool = False) -> list[Operation]:
        return diff(Ruleset(), observe(look_first))

    def removed_unnamed(self, observed: Ruleset, operations: list[Operation]) -> set[str]:
        return services_of_deleted_tables(observed, operations)

    def model_to_dict(self, model: Ruleset) -> dict[str, Any]:
        return model.to_dict()

    def service_view(self, model: Ruleset, only: set[str] | None = None) -> dict[str, dict[str, Any]]:
        return service_view(model, only)


def _addr(key: str, prefix: str) -> str:
    parts = key.split(" . ")
    if prefix:  # nodeport: proto . port
        return f"nodePort {parts[1]}/{parts[0]}"
    ip = f"[{parts[0]}]" if ":" in parts[0] else parts[0]
    return f"{ip}:{parts[2]}/{parts[1]}"


def _owned_chains(chains: dict[str, Any], only: set[str] | None) -> list[tuple[str, Any]]:
    """All chains, or (with `only`) just those service ports' svc-/ext- chains, found by name:
    O(len(only)). (Their ep- chains are read where a rule goes to one.)"""
    if only is None:
        return list(chains.items())
    out = []
    for sid in only:
        ns_name, _, rest = sid.partition(":")
        port, _, proto = rest.rpartition("/")
        key = f"{ns_name}/{port}/{proto.lower()}"
        out += [(prefix + key, chains[prefix + key]) for prefix in ("svc-", "ext-") if prefix + key in chains]
    return out


def _dnats(rule: str, chains: dict[str, Any]) -> tuple[str, ...]:
    """The rules that DNAT for `rule`: itself, or the ep- chain's it goes to (session affinity)."""
    if "goto ep-" in rule:
        target = chains.get(rule.rsplit("goto ", 1)[1])
        return tuple(r for r in target.rules if "dnat" in r) if target is not None else ()
    return (rule,) if "dnat" in rule else ()


_ENTRY_TIMEOUT = re.compile(r"^update @(\S+) \{ ip6? saddr timeout (\S+) \}$")


def _affinity_timeout(table: Table, rule: str) -> int | None:
    """The affinity timeout of a `... saddr @aff-X goto ep-X` rule: the one its endpoint chain's
    `update @aff-X { ip saddr timeout T }` gives each entry (or, as earlier versions made the
    set, the set's own)."""
    name = "aff-" + rule.split(" saddr @aff-", 1)[1].split(" ", 1)[0]
    target = rule.rsplit(" goto ", 1)[-1] if " goto " in rule else None
    for r in table.chains[target].rules if target in table.chains else ():
        m = _ENTRY_TIMEOUT.match(r)
        if m and m.group(1) == name:
            return duration_seconds(m.group(2))
    aff = table.sets.get(name)
    return aff.timeout if aff is not None else None


def service_view(model: Ruleset, only: set[str] | None = None) -> dict[str, dict[str, Any]]:
    """Per service port: where it is reachable (and with which verdict), which endpoints its cluster
    traffic reaches and which its external traffic does (its ext- chain, see base.view_entry).

    With `only`, just those service ports (the cost then follows their number, not the model's).
    """
    view: dict[str, dict[str, Any]] = {}

    def entry(sid: str) -> dict[str, Any]:
        return view.setdefault(sid, view_sets())

    tables = list(model.tables.values())
    if only is not None:  # their shard tables and the main ones: O(len(only)), not O(services)
        names = {TABLE} | {shard_table_name(shard_of(sid)) for sid in only}
        tables = [t for t in tables if t.name in names]
    for table in tables:
        for name, s in table.sets.items():
            if name == FIREWALL_ALLOW:  # LB IP . protocol . port . allowed source
                for key, (_, comment) in s.elements.items():
                    if comment and (only is None or comment in only):
                        entry(comment)["sources"].add(key.rsplit(" . ", 1)[-1])
                continue
            if name not in _SERVICE_MAPS:
                continue
            for key, (value, comment) in s.elements.items():
                if not comment or (only is not None and comment not in only):
                    continue
                addr = _addr(key, _SERVICE_MAPS[name])
                if value and value.startswith("goto reject"):
                    addr += " (reject)"
                elif value == "drop":
                    addr += " (drop)"
                entry(comment)["addresses"].add(nodeport_address(addr, "ipv6" if table.family == "ip6" else "ipv4"))
        for name, chain in _owned_chains(table.chains, only):
            if name.startswith("ep-"):  # (read through the rules that go to it)
                continue
            sid = owner(name)
            if sid is None or (only is not None and sid not in only):
                continue
            # ext-: external traffic (see render), but for its ETP Local short-circuit rules:
            # traffic of this node's pods and of the node itself, not listed
            external = name.startswith("ext-")
            found: set[str] = set()
            for rule in chain.rules:
                if " saddr @aff-" in rule:  # the endpoint this source was sent to before: affinity
                    seconds = _affinity_timeout(table, rule)
                    if seconds is not None:
                        entry(sid)["affinity"].add(f"ClientIP {seconds}s")
                if external and rule.startswith(_SHORT_CIRCUIT):
                    continue
                for dnat in _dnats(rule, table.chains):
                    for m in (_V6_EP if table.family == "ip6" else _V4_EP).finditer(dnat.split("dnat", 1)[1]):
                        ip, port = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
                        found.add(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
            if found:
                sets = entry(sid)
                (sets.setdefault("external", set()) if external else sets["endpoints"]).update(found)
    return {k: view_entry(v) for k, v in sorted(view.items())}

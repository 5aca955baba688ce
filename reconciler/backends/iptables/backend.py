"""The iptables backend: render / observe / diff / apply / cleanup behind the Backend interface.

Layout: see render.py. Observed state is `<cmd>-<flavour>-save` (filter and nat) for iptables and
ip6tables, keeping only our chains (RECONCILER-*) and the rules of built-in chains that jump into them.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Iterator

from ...state import DesiredState
from ..base import Operation
from . import kernel
from .diff import diff, restore_lines, rule_owner, script
from .render import (
    COMMANDS, ENDPOINTS_CHECK, EXT_PREFIX, FW_PREFIX, NODEPORTS, SEP_PREFIX, SERVICES, SVC_PREFIX, TABLES,
    IptablesModel, Renderer, TableState, chain_hash, is_builtin, is_ours, is_service_chain,
)
from .save import Rule, Ruleset, parse_save

log = logging.getLogger(__name__)


class IptablesBackend:
    mode = "iptables"
    # see reconcile.plan_against_kernel: the `-save` tools are processes of their own, and the
    # parse takes less than pickling the model back from a child would (10k: 0.8 s vs 0.7 s + 0.4 s)
    observe_in = "thread"

    def __init__(self, flavour: str | None = None):
        if flavour is not None and flavour not in kernel.FLAVOURS:
            raise ValueError(f"unknown iptables flavour {flavour!r}")
        self._flavour = flavour
        self.last_restore_seconds: dict[str, float] = {}
        self._renderer = Renderer()  # keeps per-service fragments: later renders cost O(changes)

    @property
    def flavour(self) -> str:
        """'nft' or 'legacy' (detected once, like iptables-wrapper)."""
        if self._flavour is None:
            self._flavour = kernel.detect_flavour()
            log.debug("iptables flavour: %s", self._flavour)
        return self._flavour

    def render(self, desired: DesiredState) -> IptablesModel:
        return self._renderer.render(desired)

    def observe(self) -> IptablesModel:
        """Our chains and jumps: one `<cmd>-save` of all tables per family (see kernel.read_save),
        both run at once, each parsed as it is read."""
        flavour = self.flavour

        def read(cmd: str) -> dict[str, TableState]:
            return kernel.read_save(cmd, flavour, parse_our_tables)

        families: dict[str, dict[str, TableState]] = {}
        with ThreadPoolExecutor(max_workers=len(COMMANDS)) as pool:
            for family, tables in zip(COMMANDS, pool.map(read, COMMANDS.values())):
                tables = {t: state for t, state in tables.items() if not state.empty}
                if tables:
                    families[family] = tables
        return IptablesModel(families, flavour)

    def diff(self, desired: IptablesModel, observed: IptablesModel) -> list[Operation]:
        return diff(desired, observed)

    def unconverged(self, desired: IptablesModel) -> list[Operation]:
        return diff(desired, self.observe())

    def apply(self, operations: list[Operation]) -> None:
        """One `<cmd>-restore --noflush` per family (iptables first), each table committed atomically."""
        self.last_restore_seconds = {}
        for cmd, lines in restore_lines(operations).items():
            self.last_restore_seconds[cmd] = kernel.restore(cmd, self.flavour, lines)

    def script(self, operations: list[Operation]) -> str:
        return script(operations)

    def cleanup(self) -> list[Operation]:
        return diff(IptablesModel(), self.observe())

    def model_to_dict(self, model: IptablesModel) -> dict[str, Any]:
        return model.to_dict()

    def service_view(self, model: IptablesModel, only: set[str] | None = None) -> dict[str, dict[str, Any]]:
        return service_view(model, only)


def _service_chains(chains: dict[str, tuple[Rule, ...]], only: set[str] | None
                    ) -> Iterable[tuple[str, tuple[Rule, ...]]]:
    """Every service chain, or (with `only`) those service ports' chains and the SEP chains they jump to."""
    if only is None:
        return [(name, rules) for name, rules in chains.items() if is_service_chain(name)]
    out = []
    for sid in only:
        for prefix in (SVC_PREFIX, EXT_PREFIX, FW_PREFIX):
            name = prefix + chain_hash(sid)
            if name in chains:
                out.append((name, chains[name]))
                out += [(r.target, chains[r.target]) for r in chains[name]
                        if r.target and r.target.startswith(SEP_PREFIX) and r.target in chains]
    return out


def parse_our_tables(lines: Iterable[str]) -> dict[str, TableState]:
    """Our chains and jumps in each of TABLES from the lines of a save of all tables, as they are
    read; the lines of other tables (mangle, raw, ...) are passed over unparsed."""
    rs = parse_save(_only_tables(lines, TABLES))
    return {table: _ours(rs, table) for table in TABLES}


def _only_tables(lines: Iterable[str], tables: tuple[str, ...]) -> Iterator[str]:
    """The lines, with those of tables not in `tables` blanked (line numbers stay right)."""
    heads = {f"*{t}" for t in tables}
    keep = True
    for line in lines:
        if line[:1] == "*":
            keep = line.rstrip() in heads
        yield line if keep else ""


def _ours(rs: Ruleset, table: str) -> TableState:
    if table not in rs:
        return TableState()
    chains: dict[str, tuple[Rule, ...]] = {}
    jumps: list[Rule] = []
    for name, chain in rs[table].chains.items():
        if is_builtin(table, name):
            jumps += [r.without_counters() for r in chain.rules if r.target and is_ours(r.target)]
        elif is_ours(name):
            chains[name] = tuple(r.without_counters() for r in chain.rules)
    return TableState(chains, tuple(jumps))


# --------------------------------------------------------------------------- service view


def _value(args: tuple[str, ...], opt: str) -> str | None:
    for i, a in enumerate(args[:-1]):
        if a == opt and (i == 0 or args[i - 1] != "!"):
            return args[i + 1]
    return None


def _addr(args: tuple[str, ...]) -> str | None:
    """`10.96.0.10:53/udp`, `[fd00::1]:443/tcp` or `nodePort 30080/tcp` for a dispatch or check rule."""
    proto, port = _value(args, "-p"), _value(args, "--dport")
    if proto is None or port is None:
        return None
    dst = _value(args, "-d")
    if dst is None or "addrtype" in args:
        return f"nodePort {port}/{proto}"
    ip = dst.rsplit("/", 1)[0]
    return f"[{ip}]:{port}/{proto}" if ":" in ip else f"{ip}:{port}/{proto}"


def service_view(model: IptablesModel, only: set[str] | None = None) -> dict[str, dict[str, Any]]:
    """Per service port: where it is reachable (and with which verdict) and which endpoints it uses.

    With `only`, just those service ports: rules that do not carry one of them as a token (their
    comment) are skipped at C speed, and only their own chains (found by name) are read.
    """
    view: dict[str, dict[str, set[str]]] = {}

    def entry(sid: str) -> dict[str, set[str]]:
        return view.setdefault(sid, {"addresses": set(), "endpoints": set()})

    for tables in model.families.values():
        nat, filt = tables.get("nat", TableState()), tables.get("filter", TableState())
        for name in (SERVICES, NODEPORTS):
            for r in nat.chains.get(name, ()):
                if only is not None and only.isdisjoint(r.args):
                    continue
                sid, addr = rule_owner(r), _addr(r.args)
                if sid and addr and (only is None or sid in only):
                    entry(sid)["addresses"].add(addr)
        for r in filt.chains.get(ENDPOINTS_CHECK, ()):
            if only is not None and only.isdisjoint(r.args):
                continue
            sid, addr = rule_owner(r), _addr(r.args)
            if sid and addr and r.target in ("REJECT", "DROP") and (only is None or sid in only):
                entry(sid)["addresses"].add(f"{addr} ({r.target.lower()})")
        for name, rules in _service_chains(nat.chains, only):
            for r in rules:  # DNATs inline in SVC/EXT, and in SEP chains for hairpin / affinity endpoints
                ep, sid = _value(r.args, "--to-destination"), rule_owner(r)
                if ep and sid and r.target == "DNAT" and (only is None or sid in only):
                    entry(sid)["endpoints"].add(ep)
    return {k: {"addresses": sorted(v["addresses"]), "endpoints": sorted(v["endpoints"])}
            for k, v in sorted(view.items())}

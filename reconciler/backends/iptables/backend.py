"""The iptables backend: render / observe / diff / apply / cleanup behind the Backend interface.

Layout: see render.py. Observed state is `<cmd>-<flavour>-save` (filter and nat) for iptables and
ip6tables, keeping only our chains (RECONCILER-*) and the rules of built-in chains that jump into them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ...state import EVERY_ADDRESS, DesiredState
from ..base import KernelError, Operation, nodeport_address, view_entry, view_sets
from ..generation import commits_between, generation
from . import kernel
from .diff import diff, foreign, restore_lines, rule_owner, script, services_of_rewritten_chains
from .observed import canonical_texts, read_our_tables
from .render import (
    COMMANDS, ENDPOINTS_CHECK, EXT_PREFIX, EXTERNAL_CHECK, FW_PREFIX, NODEPORTS, SEP_PREFIX, SERVICES, SVC_PREFIX,
    TABLES, IptablesModel, Renderer, TableState, chain_hash,
)
from .save import Rule

log = logging.getLogger(__name__)


class IptablesBackend:
    mode = "iptables"
    # see reconcile.plan_against_kernel: what comes back from the child is our chains as strings
    # (observed.SavedChains), cheap to pickle, and the child's splitting of the save's lines then
    # runs beside the manifests being read here instead of taking turns with them
    observe_in = "process"

    def __init__(self, flavour: str | None = None):
        if flavour is not None and flavour not in kernel.FLAVOURS:
            raise ValueError(f"unknown iptables flavour {flavour!r}")
        self._flavour = flavour
        self.last_restore_seconds: dict[str, float] = {}
        self.kept: list[str] = []  # see cleanup()
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

    def observe(self, beside_work: bool = False) -> IptablesModel:
        """Our chains and jumps: one `<cmd>-save` of all tables per family (see kernel.read_save),
        each parsed as it is read; both at once, or (`beside_work`: the read shares the machine
        with other heavy work, see reconcile.plan_against_kernel) one after the other."""
        flavour = self.flavour

        def read(cmd: str) -> dict[str, TableState]:
            return kernel.read_save(cmd, flavour, read_our_tables)

        families: dict[str, dict[str, TableState]] = {}
        with ThreadPoolExecutor(max_workers=1 if beside_work else len(COMMANDS)) as pool:
            for family, tables in zip(COMMANDS, pool.map(read, COMMANDS.values())):
                tables = {t: state for t, state in tables.items() if not state.empty}
                if tables:
                    families[family] = tables
        return IptablesModel(families, flavour)

    def diff(self, desired: IptablesModel, observed: IptablesModel) -> list[Operation]:
        if self._flavour is None and observed.flavour:  # observed in a child: apply where it read
            self._flavour = observed.flavour
        return diff(desired, observed)

    def before_diff(self, desired: IptablesModel) -> None:
        """Each chain's canonical string, for comparing with a save's (see observed.py); kept with
        the model (at 10k ~20 MB) for the diff and apply's verifying diff."""
        for tables in desired.families.values():
            for state in tables.values():
                state.texts = canonical_texts(state.chains)

    def unconverged(self, desired: IptablesModel) -> list[Operation]:
        return diff(desired, self.observe())

    def apply(self, operations: list[Operation]) -> list[int] | None:
        """One `<cmd>-restore --noflush` per family (iptables first), each table committed
        atomically; the generations its commits produced. The legacy flavour makes no nf_tables
        commit ([]). The nft flavour's tools do not say which commits are theirs: a run's are the
        generations between the one before it and the one after it when they are as many as the
        commits it is certain to make (see expected_commits), else not known (None)."""
        return self.prepare(operations)()

    def prepare(self, operations: list[Operation]) -> Callable[[], list[int] | None]:
        inputs = [(cmd, lines, expected_commits(lines) if self.flavour == "nft" else None)
                  for cmd, lines in restore_lines(operations).items()]

        def run() -> list[int] | None:
            self.last_restore_seconds = {}
            produced: list[int] | None = []
            for cmd, lines, expected in inputs:
                before = generation() if expected else None
                try:
                    self.last_restore_seconds[cmd] = kernel.restore(cmd, self.flavour, lines)
                except KernelError as exc:
                    if self.last_restore_seconds:  # (each family's restore commits on its own)
                        done = " and ".join(self.last_restore_seconds)
                        error = KernelError(f"{exc}\n(before it, the {done} restore was applied in full)")
                        error.partial = True
                        raise error from None
                    raise
                if self.flavour == "nft":
                    ours = commits_between(before, generation() if before is not None else None, expected)
                    produced = None if produced is None or ours is None else produced + ours
            return produced
        return run

    def foreign(self, operation: Operation) -> str | None:
        return foreign(operation)

    def generation(self) -> int | None:
        """nf_tables' generation in the nft flavour; the legacy one keeps none."""
        return generation() if self.flavour == "nft" else None

    def script(self, operations: list[Operation]) -> str:
        return script(operations)

    def cleanup(self, look_first: bool = False) -> list[Operation]:  # (one save reads everything anyway)
        """(Also leaves in self.kept the chains of ours it empties but keeps: rules of others jump
        to them.)"""
        observed = self.observe()
        self.kept = sorted({r.target for tables in observed.families.values() for state in tables.values()
                            for r in state.foreign if r.target})
        return diff(IptablesModel(), observed)

    def removed_unnamed(self, observed: IptablesModel, operations: list[Operation]) -> set[str]:
        return services_of_rewritten_chains(observed, operations)

    def model_to_dict(self, model: IptablesModel) -> dict[str, Any]:
        return model.to_dict()

    def service_view(self, model: IptablesModel, only: set[str] | None = None) -> dict[str, dict[str, Any]]:
        return service_view(model, only)

    def rule_counts(self, model: IptablesModel) -> dict[str, int]:
        """Our rules per table, both families (kube-proxy's sync_proxy_rules_iptables_total)."""
        out = dict.fromkeys(TABLES, 0)
        for tables in model.families.values():
            for name, state in tables.items():
                out[name] = out.get(name, 0) + len(state.jumps) + sum(len(rules) for rules in state.chains.values())
        return out

    @staticmethod
    def rules_written(operations: list[Operation]) -> dict[str, int]:
        """Rules these operations write, per table (kube-proxy's sync_proxy_rules_iptables_last)."""
        out = dict.fromkeys(TABLES, 0)
        for op in operations:
            if op.kind == "rule" and op.action == "+":
                table = op.name.split()[1]
                out[table] = out.get(table, 0) + 1
        return out


_VIEWED = (SVC_PREFIX, EXT_PREFIX, FW_PREFIX)  # the chains service_view reads (SEP: where jumped to)


def _service_chains(chains: Mapping[str, tuple[Rule, ...]], only: set[str] | None
                    ) -> Iterable[tuple[str, tuple[Rule, ...]]]:
    """Every SVC, EXT and FW chain, or (with `only`) those service ports', found by name. (Their SEP
    chains are read where a rule jumps to one.)"""
    if only is None:
        return [(name, rules) for name, rules in chains.items() if name.startswith(_VIEWED)]
    return [(name, chains[name]) for sid in only for name in (p + chain_hash(sid) for p in _VIEWED) if name in chains]


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


def _endpoint(rule: Rule, chains: Mapping[str, tuple[Rule, ...]]) -> str | None:
    """The endpoint a rule DNATs to, inline or in the SEP chain it jumps to (hairpin, affinity)."""
    if rule.target == "DNAT":
        return _value(rule.args, "--to-destination")
    if rule.target and rule.target.startswith(SEP_PREFIX) and rule.target in chains:
        return next((ep for r in chains[rule.target] if r.target == "DNAT"
                     and (ep := _value(r.args, "--to-destination"))), None)
    return None


def service_view(model: IptablesModel, only: set[str] | None = None) -> dict[str, dict[str, Any]]:
    """Per service port: where it is reachable (and with which verdict), which endpoints its cluster
    traffic reaches and which its external traffic does (its EXT chain, see base.view_entry).

    With `only`, just those service ports: rules that do not carry one of them as a token (their
    comment) are skipped at C speed, and only their own chains (found by name) are read.
    """
    view: dict[str, dict[str, set[str]]] = {}

    def entry(sid: str) -> dict[str, set[str]]:
        return view.setdefault(sid, view_sets())

    for family, tables in model.families.items():
        nat, filt = tables.get("nat", TableState()), tables.get("filter", TableState())
        for name in (SERVICES, NODEPORTS):
            for r in nat.chains.get(name, ()):
                if only is not None and only.isdisjoint(r.args):
                    continue
                sid, addr = rule_owner(r), _addr(r.args)
                if sid and addr and (only is None or sid in only):
                    entry(sid)["addresses"].add(nodeport_address(addr, family))
        for r in (*filt.chains.get(ENDPOINTS_CHECK, ()), *filt.chains.get(EXTERNAL_CHECK, ())):
            if only is not None and only.isdisjoint(r.args):
                continue
            sid, addr = rule_owner(r), _addr(r.args)
            if sid and addr and r.target in ("REJECT", "DROP") and (only is None or sid in only):
                entry(sid)["addresses"].add(nodeport_address(f"{addr} ({r.target.lower()})", family))
        for name, rules in _service_chains(nat.chains, only):
            # EXT: external traffic (see render), but for its ETP Local short-circuit rules (-s, or a
            # LOCAL source): traffic of this node's pods and of the node itself, not listed
            external = name.startswith(EXT_PREFIX)
            # (the short-circuit rules all come before the local path's, the LOCAL-source ones last:
            # with a cluster CIDR of every address the pods' have no -s to tell them by)
            short = max((i for i, r in enumerate(rules) if "--src-type" in r.args), default=-1) if external else -1
            for i, r in enumerate(rules):
                sid = rule_owner(r)
                if not sid or (only is not None and sid not in only):
                    continue
                if name.startswith(FW_PREFIX):
                    if r.target and r.target.startswith((EXT_PREFIX, SVC_PREFIX)):  # a source the LB IPs allow
                        # (no -s: every source, a range of /0, which iptables-save does not print)
                        entry(sid)["sources"].add(_value(r.args, "-s") or EVERY_ADDRESS[family])
                    continue
                if "--rcheck" in r.args and (seconds := _value(r.args, "--seconds")):
                    entry(sid)["affinity"].add(f"ClientIP {seconds}s")
                if external and (i <= short or _value(r.args, "-s")):
                    continue
                if ep := _endpoint(r, nat.chains):
                    sets = entry(sid)
                    (sets.setdefault("external", set()) if external else sets["endpoints"]).add(ep)
    return {k: view_entry(v) for k, v in sorted(view.items())}


# restore lines that change the table whenever its commit succeeds: a rule appended or inserted
# is always a new one; deleting what is not there fails it. (Not `-N`: when the kernel moved on
# meanwhile, iptables-nft retries with a chain that now exists flushed instead of created.)
_ALWAYS_CHANGES = ("-A ", "-I ", "-D ", "-X ")


def expected_commits(lines: list[str]) -> int | None:
    """How many nf_tables commits a successful `restore` of `lines` makes, when every table's
    part is certain to change something; None when one might change nothing (then it might
    commit nothing). iptables-nft's restore commits each table at its COMMIT line, as the
    legacy one does (its source says it could commit all at once but keeps that behaviour;
    tests/e2e/test_generation.py checks it on the iptables installed)."""
    commits, certain = 0, False
    for line in lines:
        if line.startswith("*"):
            certain = False
        elif line == "COMMIT":
            if not certain:
                return None
            commits += 1
        elif line.startswith(_ALWAYS_CHANGES):
            certain = True
    return commits

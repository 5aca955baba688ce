"""IptablesModel (desired) vs IptablesModel (observed) -> the minimal `iptables-restore --noflush` lines.

Chains are compared one by one (argument for argument, as iptables-save prints them), so a change to
one service port rewrites only the chains that changed: its own SVC/EXT chains (and SEP chains, which
only hairpin and affinity endpoints have), and a shared chain only when an address of it comes or goes.
Per table, the restore input is ordered

    :CHAIN - [0:0]     create or flush every chain that is (re)written or deleted
    -A CHAIN ...       the full contents of (re)written chains
    -D / -I CHAIN      a long chain of which a few rules changed (a service port's rules in the
                       shared SERVICES chain): just those rules
    -D / -I BUILTIN    our jump rules in built-in chains: stale ones removed, missing ones inserted at 1
    -X CHAIN           chains that are gone (empty and unreferenced by then)

Operation.name is "<command> <table> <chain>" (e.g. "iptables nat RECONCILER-SERVICES"), which is how
script() groups the lines into one restore per command (iptables / ip6tables) and table.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping

from ..base import Operation
from .observed import Ahead, SavedChains
from .render import (
    COMMANDS, JUMP_COMMENT, TABLES, IptablesModel, TableState, is_our_jump, is_ours, is_service_chain, wanted_jumps,
)
from .save import Rule, RuleOp

RESTORE_ARGS = ("--noflush", "-w", "5")

log = logging.getLogger(__name__)


def rule_owner(rule: Rule) -> str | None:
    """The service port id a rule belongs to (its comment), or None for shared rules."""
    c = rule.comment
    return c if c and not c.startswith(JUMP_COMMENT) else None


def chain_owner(name: str, rules: Iterable[Rule]) -> str | None:
    if not is_service_chain(name):
        return None
    for r in rules:
        if (sid := rule_owner(r)) is not None:
            return sid
    return None


def diff(desired: IptablesModel, observed: IptablesModel) -> list[Operation]:
    ops: list[Operation] = []
    for family, cmd in COMMANDS.items():
        for table in TABLES:
            want, have = desired.table(family, table), observed.table(family, table)
            if want.empty and have.empty:
                continue
            ops += _diff_table(cmd, table, want, have)
    return ops


def _diff_table(cmd: str, table: str, want: TableState, have: TableState) -> list[Operation]:
    declare: list[Operation] = []
    fill: list[Operation] = []
    edits: list[Operation] = []
    jumps: list[Operation] = []
    delete: list[Operation] = []

    def obj(chain: str) -> str:
        return f"{cmd} {table} {chain}"

    for name in sorted(want.chains):
        rules = want.chains[name]
        if _holds(have.chains, name, rules, want.texts):
            continue
        old = have.chains.get(name)
        edit = _edit_in_place(cmd, table, name, old, rules) if old is not None else None
        if edit is not None:
            edits += edit
            continue
        svc = chain_owner(name, rules)
        where = obj(name)  # one string for the chain and all its rules
        wanted = {r.args for r in rules} if old else set()
        declare.append(Operation("+" if old is None else "~", "chain", where, f":{name} - [0:0]", svc,
                                 drops=tuple(_inside(r) for r in old if r.args not in wanted) if old else ()))
        # a rule the chain already holds is only restated (the whole chain is rewritten): it is the
        # chain's, not a change of the service port it serves (one service added to a shared
        # chain listed every other one there as changed)
        kept = {r.args for r in old} if old else set()
        for r in rules:
            restated = r.args in kept
            owner = svc if restated else rule_owner(r) or svc
            fill.append(Operation("+", "rule", where, r.to_text(counters=False), owner, restates=restated))
    # a rule that jumps to one of ours but is not one of our jumps (in another chain, or without our
    # comment) is somebody else's: left alone, and the chain it jumps to is emptied, not deleted
    others = (*have.foreign, *(r for r in have.jumps if not is_our_jump(r)))  # (foreign: whatever their comment)
    referenced = {r.target: r.without_counters() for r in others}
    for name in sorted(set(have.chains) - set(want.chains)):
        old = have.chains[name]
        svc = chain_owner(name, old)
        if old:
            declare.append(Operation("~", "chain", obj(name), f":{name} - [0:0]", svc))
        if name in referenced:
            log.warning("%s %s: chain %s is kept (emptied), not deleted: a rule that is not ours jumps to it: %s",
                        cmd, table, name, referenced[name].to_text(counters=False))
            continue
        delete.append(Operation("-", "chain", obj(name), f"-X {name}", svc))

    remaining = [r.without_counters() for r in have.jumps if is_our_jump(r)]
    inserts: list[Rule] = []
    for r in want.jumps:
        found = next((i for i, h in enumerate(remaining) if h.chain == r.chain and h.args == r.args), None)
        if found is None:
            inserts.append(r)
        else:
            remaining.pop(found)
    for r in remaining:  # our stale or duplicate jumps
        jumps.append(Operation("-", "rule", obj(r.chain), RuleOp(table, "delete", r).to_text()))
    for r in inserts:
        jumps.append(Operation("+", "rule", obj(r.chain), RuleOp(table, "insert", r, 1).to_text()))
    return declare + fill + edits + jumps + delete


def _inside(rule: Rule) -> str:
    """A rule as it reads inside its chain: its `-A CHAIN` line without `-A CHAIN`."""
    return rule.to_text(counters=False).partition(" ")[2].partition(" ")[2]


def services_of_rewritten_chains(observed: IptablesModel, ops: list[Operation]) -> set[str]:
    """The service ports whose rules go with a chain rewritten whole (a short shared chain, e.g.
    SERVICES, flushed and filled again) without a rule of theirs among those written back: the
    flush names no service port, so these are read from the chain as `observed` holds it."""
    # (a service port's own chain rewritten is named by its operations: only shared ones count)
    rewritten = {op.name for op in ops if op.kind == "chain" and op.action == "~" and op.service is None}
    if not rewritten:
        return set()
    written: dict[str, set[str]] = {}
    for op in ops:
        if op.name in rewritten and op.kind == "rule" and op.action == "+":
            written.setdefault(op.name, set()).add(op.text)
    family_of = {cmd: family for family, cmd in COMMANDS.items()}
    out: set[str] = set()
    for where in rewritten:
        cmd, table, chain = where.split(" ", 2)
        old = observed.table(family_of[cmd], table).chains.get(chain, ())
        kept = written.get(where, set())
        out.update(sid for r in old if (sid := rule_owner(r)) and r.to_text(counters=False) not in kept)
    return out


def _holds(chains: Mapping[str, tuple[Rule, ...]], name: str, rules: tuple[Rule, ...],
           texts: dict[str, Ahead] | None) -> bool:
    """Whether chains[name] is there with these rules, argument for argument: a chain read from a
    save is compared as the string it was kept as (with the rules' own, if made ahead), without
    parsing it."""
    if isinstance(chains, SavedChains):
        return chains.holds(name, rules, texts.get(name) if texts else None)
    old = chains.get(name)
    return old is rules or (old is not None and [r.args for r in old] == [r.args for r in rules])


EDIT_MIN_RULES = 32  # shorter chains are rewritten whole


def _edit_in_place(cmd: str, table: str, name: str, old: tuple[Rule, ...], new: tuple[Rule, ...]
                   ) -> list[Operation] | None:
    """For a long chain of which only a few rules changed (a service port's dispatch rules in the
    shared SERVICES chain), `-D` the rules that went and `-I` the new ones at their places instead
    of rewriting the whole chain: iptables-restore's cost follows the rules it is given.

    Only when every rule is unique (a delete names its rule) and the rules both keep stay in the
    same order; after the deletes, inserting in ascending final position rebuilds `new` exactly.
    None: rewrite the chain.
    """
    if len(old) < EDIT_MIN_RULES or len(new) < EDIT_MIN_RULES:
        return None
    old_args, new_args = [r.args for r in old], [r.args for r in new]
    old_set, new_set = set(old_args), set(new_args)
    if len(old_set) != len(old_args) or len(new_set) != len(new_args):
        return None
    gone = [r for r in old if r.args not in new_set]
    added = [i for i, a in enumerate(new_args) if a not in old_set]
    if len(gone) + len(added) > max(8, len(new) // 4):
        return None
    if [a for a in old_args if a in new_set] != [a for a in new_args if a in old_set]:
        return None  # kept rules reordered
    obj = f"{cmd} {table} {name}"
    ops = [Operation("-", "rule", obj, RuleOp(table, "delete", r).to_text(), rule_owner(r)) for r in gone]
    ops += [Operation("+", "rule", obj, RuleOp(table, "insert", new[i], i + 1).to_text(), rule_owner(new[i]))
            for i in added]
    return ops


_LINE = re.compile(r"(?::(\S+) - \[0:0\]$|-([ADIX]) (\S+)(?: |$))")


BUILTIN_CHAINS = frozenset(("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"))
# the lines diff() makes, by their command: the kind and actions of their operations
_MADE = {":": ("chain", ("+", "~")), "X": ("chain", ("-",)), "A": ("rule", ("+",)), "I": ("rule", ("+",)),
         "D": ("rule", ("-",))}


def foreign(op: Operation) -> str | None:
    """Why an operation is not one diff() makes (see Backend.foreign): one restore line of a
    chain of ours, or of one of our jump rules in a built-in chain, in the chain it names."""
    cmd, _, rest = op.name.partition(" ")
    table, _, chain = rest.partition(" ")
    if cmd not in COMMANDS.values() or table not in TABLES or not chain:
        return f"not an iptables object of ours: {op.name!r}"
    m = _LINE.match(op.text)
    if m is None or "\n" in op.text or "\r" in op.text:
        return f"not one restore line of ours: {op.text!r}"
    if (m.group(1) or m.group(3)) != chain:
        return f"its line is not about chain {chain}: {op.text!r}"
    kind, actions = _MADE[m.group(2) or ":"]
    if op.kind != kind or op.action not in actions:
        return f"a {op.kind} operation ({op.action}) is not made as {op.text.split(' ', 1)[0]}: {op.text!r}"
    if is_ours(chain):
        return None
    if m.group(2) in ("D", "I") and chain in BUILTIN_CHAINS:  # (only our jump rules, inserted or deleted)
        words = op.text.split(" ", 2)[2]
        if m.group(2) == "I":
            position, _, words = words.partition(" ")
            if position != "1":  # (ours go first)
                return f"our jumps are inserted first, not at {position}: {op.text!r}"
        try:
            rule = Rule.from_text(f"-A {chain} {words}")
        except ValueError:
            rule = None
        # inserted: one of the jumps we put there, exactly; deleted: a jump of ours to a chain of
        # ours (an older version's too), not any rule that carries our comment
        if rule is not None and (rule.args in {r.args for r in wanted_jumps(table) if r.chain == chain}
                                 if m.group(2) == "I" else is_our_jump(rule) and is_ours(rule.target or "")):
            return None
    return f"chain {chain} is not ours, nor is the rule one of our jumps: {op.text!r}"


def _phase(text: str) -> int:
    if text.startswith(":"):
        return 0
    if text.startswith("-A "):
        return 1
    if text.startswith("-X "):
        return 3
    return 2  # -D, -I


def restore_lines(ops: list[Operation]) -> dict[str, list[str]]:
    """command ('iptables' / 'ip6tables') -> the lines of its `<command>-restore --noflush` input
    (the operations' own strings: at 10k services the text would be 24 MB more)."""
    groups: dict[str, dict[str, list[str]]] = {}
    for op in ops:
        cmd, table, _ = op.name.split(" ", 2)
        groups.setdefault(cmd, {}).setdefault(table, []).append(op.text)
    out: dict[str, list[str]] = {}
    for cmd in sorted(groups, key=lambda c: list(COMMANDS.values()).index(c) if c in COMMANDS.values() else 9):
        lines: list[str] = []
        for table, texts in groups[cmd].items():
            lines.append(f"*{table}")
            lines += sorted(texts, key=_phase)  # stable: keeps the order inside each phase
            lines.append("COMMIT")
        out[cmd] = lines
    return out


def restore_inputs(ops: list[Operation]) -> dict[str, str]:
    """command ('iptables' / 'ip6tables') -> its `<command>-restore --noflush` input."""
    return {cmd: "\n".join(lines) + "\n" for cmd, lines in restore_lines(ops).items()}


def script(ops: list[Operation]) -> str:
    """All restore inputs, each headed by the command that runs it (`#` lines are comments to restore)."""
    return "".join(f"# {cmd}-restore {' '.join(RESTORE_ARGS)}\n{text}" for cmd, text in restore_inputs(ops).items())

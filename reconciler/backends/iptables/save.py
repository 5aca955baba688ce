"""Parser and writer for the iptables-save / iptables-restore text format.

Tokenising follows iptables-restore (``add_param_to_argv``), not the shell:
only double quotes group, a backslash escapes the next character *inside*
double quotes only, single quotes are ordinary characters, and a closing
quote ends the token.  Quoting on output follows iptables-save
(``xtables_save_string``), so ``parse_save(text).to_text()`` reproduces
iptables-save output byte for byte (minus the ``#`` comment lines).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from sys import intern
from typing import Literal

__all__ = [
    "BUILTIN_CHAINS",
    "Chain",
    "Counters",
    "ParseError",
    "Rule",
    "RuleOp",
    "Ruleset",
    "Table",
    "format_probability",
    "parse_save",
    "quote_arg",
    "render_restore",
    "split_args",
]

Counters = tuple[int, int]
"""``(packets, bytes)``."""

BUILTIN_CHAINS: Mapping[str, tuple[str, ...]] = {
    "filter": ("INPUT", "FORWARD", "OUTPUT"),
    "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
    "mangle": ("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"),
    "raw": ("PREROUTING", "OUTPUT"),
    "security": ("INPUT", "FORWARD", "OUTPUT"),
}

# Options whose value iptables-save prints through xtables_save_string().
_STRING_OPTIONS = frozenset(
    {"--comment", "--log-prefix", "--nflog-prefix", "--ulog-prefix", "--helper", "--nfacct-name"}
)
_SAFE_RE = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPED_RE = re.compile(r"[\"\\']")
_NEEDS_QUOTES_RE = re.compile(r'[ \t\n"]')
_QUOTE_OR_BREAK_RE = re.compile(r'[\t\n"]')  # _NEEDS_QUOTES_RE but the blank (see _join)
_WS = " \t\n"
_JUMPS = frozenset({"-j", "--jump", "-g", "--goto"})
_VALUED_OPTIONS = _STRING_OPTIONS | _JUMPS | {"-m", "--match"}  # each takes the next token as its value
_COUNTERS_RE = re.compile(r"\[(\d+):(\d+)\]")
_RULE_COUNTERS_RE = re.compile(r"\[(\d+):(\d+)\][ \t]*")
_CHAIN_NAME_RE = re.compile(r"[^\s!\"'][^\s\"']*")


class ParseError(ValueError):
    """Malformed iptables-save text; names the line number and the offending text."""

    def __init__(self, message: str, lineno: int | None = None, line: str | None = None) -> None:
        self.message, self.lineno, self.line = message, lineno, line
        where = f"line {lineno}: " if lineno is not None else ""
        what = f": {line!r}" if line is not None else ""
        super().__init__(f"{where}{message}{what}")


# --------------------------------------------------------------------------- tokens


_OTHER_SPACE = re.compile(r"[\r\v\f\x1c-\x1f\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]")


def split_args(text: str) -> list[str]:
    """Split a rule line into arguments exactly like iptables-restore does."""
    # Fast path (what iptables-save writes): no backslash, no whitespace str.split() knows but
    # iptables does not, and every opening quote starts a token. Then the regions between quotes
    # split on whitespace and each quoted region is one token, all done by str.split in C.
    if "\\" not in text and not _OTHER_SPACE.search(text):
        parts = text.split('"')
        if len(parts) % 2 == 1:
            args: list[str] = []
            for i in range(0, len(parts) - 1, 2):
                bare = parts[i]
                if bare and bare[-1] not in _WS:
                    return _split_args_slowly(text)  # a quote opening mid-token joins it
                args += bare.split()
                args.append(parts[i + 1])
            args += parts[-1].split()
            return args
    return _split_args_slowly(text)


def _split_args_slowly(text: str) -> list[str]:
    """The general case, character by character (a quote may open mid-token: a"b c" -> 'ab c')."""
    args: list[str] = []
    buf: list[str] = []
    in_quote = escaped = False
    for ch in text:
        if in_quote:
            if escaped:
                buf.append(ch)
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_quote = False
                args.append("".join(buf))  # a closing quote always ends the token
                buf.clear()
            else:
                buf.append(ch)
        elif ch == '"':
            in_quote = True  # may open mid-token: a"b c" -> 'ab c'
        elif ch in _WS:
            if buf:
                args.append("".join(buf))
                buf.clear()
        else:
            buf.append(ch)
    if in_quote:
        raise ParseError("unterminated double quote")
    if buf:
        args.append("".join(buf))
    return args


def _save_string(value: str) -> str:
    """Quote like xtables_save_string(): bare only if non-empty and [A-Za-z0-9_-]."""
    if _SAFE_RE.fullmatch(value):
        return value
    return '"' + _ESCAPED_RE.sub(r"\\\g<0>", value) + '"'


def quote_arg(arg: str, *, after: str | None = None) -> str:
    """Quote one argument for an iptables-restore line.

    ``after`` is the preceding option; values of free-text options such as
    ``--comment`` are quoted exactly as iptables-save does, everything else
    only when it would not survive :func:`split_args` unchanged.
    """
    if after in _STRING_OPTIONS or not arg or _NEEDS_QUOTES_RE.search(arg):
        return _save_string(arg)
    return arg


def _join(args: tuple[str, ...] | list[str]) -> str:
    """quote_arg() of each argument (after the one before it), joined by spaces. This runs for
    every rule a plan writes (10k services: 134k), so the usual rule is answered by a few scans
    of its joined text in C: no argument empty or holding a blank or a quote, and only the
    values of free-text options (the comments) quoted, found by index."""
    joined = " ".join(args)
    if "" in args or joined.count(" ") != len(args) - 1 or _QUOTE_OR_BREAK_RE.search(joined):
        out: list[str] = []
        quote = False
        for a in args:
            out.append(_save_string(a) if quote or not a or _NEEDS_QUOTES_RE.search(a) else a)
            quote = a in _STRING_OPTIONS
        return " ".join(out)
    if _STRING_OPTIONS.isdisjoint(args):
        return joined
    quoted = list(args)
    last = len(args) - 1
    for option in _STRING_OPTIONS.intersection(args):
        i = args.index(option)
        while True:  # every argument after one of these options is its value: quoted
            if i < last:
                quoted[i + 1] = _save_string(args[i + 1])
            try:
                i = args.index(option, i + 1)
            except ValueError:
                break
    return " ".join(quoted)


def _parse_counters(text: str) -> Counters | None:
    m = _COUNTERS_RE.fullmatch(text)
    return (int(m[1]), int(m[2])) if m else None


def _fmt_counters(c: Counters | None) -> str:
    p, b = c if c is not None else (0, 0)
    return f"[{p}:{b}]"


@lru_cache(maxsize=1024)  # a cascade over n endpoints asks for 1/n ... 1/2: few values, asked 100k times
def format_probability(p: float) -> str:
    """The string iptables-save prints for ``--probability p``.

    The kernel keeps ``round(p * 2**31)``, printed back with ``%.11f``
    (0.5 -> ``0.50000000000``, 0.1 -> ``0.10000000009``).
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"probability out of range: {p}")
    return f"{round(p * 0x80000000) / 0x80000000:.11f}"


# --------------------------------------------------------------------------- model


def _check_rule_chain(chain: str) -> None:
    if not chain or not _CHAIN_NAME_RE.fullmatch(chain):
        raise ValueError(f"invalid chain name {chain!r}")


@dataclass(frozen=True, slots=True)
class Rule:
    """One ``-A CHAIN args...`` line; ``args`` are the unquoted tokens after the chain."""

    chain: str
    args: tuple[str, ...]
    counters: Counters | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.args, tuple):
            object.__setattr__(self, "args", tuple(self.args))
        _check_rule_chain(self.chain)

    @classmethod
    def chain_of(cls, chain: str, rules: Iterable[tuple[str, ...]]) -> tuple[Rule, ...]:
        """The rules of one chain from their argument tuples: the name checked once, not per rule."""
        _check_rule_chain(chain)
        out = []
        for args in rules:
            rule = _new_rule(cls)
            _set(rule, "chain", chain)
            _set(rule, "args", args if type(args) is tuple else tuple(args))
            _set(rule, "counters", None)
            out.append(rule)
        return tuple(out)

    @classmethod
    def from_text(cls, text: str) -> Rule:
        """Parse ``[pkts:bytes] -A CHAIN args...`` (counters optional)."""
        line = text.strip(_WS)
        counters = None
        if line.startswith("["):
            m = _RULE_COUNTERS_RE.match(line)
            if m is None:
                raise ParseError("malformed rule counters", line=text)
            counters, line = (int(m[1]), int(m[2])), line[m.end():]
        try:
            tokens = split_args(line)
        except ParseError as e:
            raise ParseError(e.message, line=text) from None
        if len(tokens) < 2 or tokens[0] not in ("-A", "--append"):
            raise ParseError("expected '-A CHAIN ...'", line=text)
        try:
            # most tokens repeat (-m, comment, -j, chain names, ports): share one string each
            return cls(intern(tokens[1]), tuple(map(intern, tokens[2:])), counters)
        except ValueError as e:
            raise ParseError(str(e), line=text) from None

    def _options(self) -> Iterator[tuple[str, str | None]]:
        """(option, value) pairs, skipping free-text values so they never look like options."""
        args, i, n = self.args, 0, len(self.args)
        while i < n:
            a = args[i]
            if a in _VALUED_OPTIONS:
                yield a, args[i + 1] if i + 1 < n else None
                i += 2
            else:
                yield a, None
                i += 1

    @property
    def comment(self) -> str | None:
        """Value of the first ``-m comment --comment X``, or None."""
        args, n = self.args, len(self.args)
        if "--comment" not in args:  # (a tuple search in C: rules without one answer here)
            return None
        i, seen_match = 0, False
        while i < n:  # _options() without the generator, as in target
            a = args[i]
            if a in _VALUED_OPTIONS:
                value = args[i + 1] if i + 1 < n else None
                if a == "--comment" and seen_match:
                    return value
                if a in ("-m", "--match") and value == "comment":
                    seen_match = True
                i += 2
            else:
                i += 1
        return None

    @property
    def target(self) -> str | None:
        """Value of ``-j`` / ``-g`` (jump or goto), or None."""
        args, i, n = self.args, 0, len(self.args)
        while i < n:  # _options() without the generator: this runs for every rule of a plan
            a = args[i]
            if a in _VALUED_OPTIONS:
                if a in _JUMPS:
                    return args[i + 1] if i + 1 < n else None
                i += 2
            else:
                i += 1
        return None

    @property
    def is_goto(self) -> bool:
        return any(opt in ("-g", "--goto") for opt, _ in self._options())

    def without_counters(self) -> Rule:
        return replace(self, counters=None) if self.counters is not None else self

    def spec(self) -> str:
        """The quoted arguments (what follows ``-A CHAIN``)."""
        return _join(self.args)

    def to_text(self, *, counters: bool = True, command: str = "-A", position: int | None = None) -> str:
        """Render as iptables-save does; ``counters`` prints ``[p:b]`` if the rule has them.

        ``command``/``position`` allow ``-I CHAIN 2 ...`` and ``-D CHAIN ...``.
        """
        parts = [command, self.chain]
        if position is not None:
            parts.append(str(position))
        if self.args:
            parts.append(self.spec())
        line = " ".join(parts)
        if counters and self.counters is not None:
            line = f"{_fmt_counters(self.counters)} {line}"
        return line

    def __str__(self) -> str:
        return self.to_text()


@dataclass
class Chain:
    """A chain; ``policy`` is None for user-defined chains (``-`` is accepted and normalised)."""

    name: str
    policy: str | None = None
    counters: Counters | None = None
    rules: list[Rule] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.policy == "-":
            self.policy = None
        if not _CHAIN_NAME_RE.fullmatch(self.name):
            raise ValueError(f"invalid chain name {self.name!r}")
        self.rules = list(self.rules)
        for r in self.rules:
            if r.chain != self.name:
                raise ValueError(f"rule for chain {r.chain!r} placed in chain {self.name!r}")

    @property
    def is_builtin(self) -> bool:
        return self.policy is not None

    def declaration(self, *, counters: bool = True) -> str:
        """``:NAME POLICY [p:b]`` (``-`` for user chains; ``[0:0]`` unless counters known and wanted)."""
        c = self.counters if counters else None
        return f":{self.name} {self.policy or '-'} {_fmt_counters(c)}"

    def without_counters(self) -> Chain:
        return Chain(self.name, self.policy, None, [r.without_counters() for r in self.rules])


@dataclass
class Table:
    name: str
    chains: dict[str, Chain] = field(default_factory=dict)

    def __getitem__(self, chain: str) -> Chain:
        return self.chains[chain]

    def to_text(self, *, counters: bool = True) -> str:
        """The table in iptables-save layout (``*name`` ... ``COMMIT``)."""
        lines = [f"*{self.name}"]
        lines += [c.declaration(counters=counters) for c in self.chains.values()]
        lines += [r.to_text(counters=counters) for c in self.chains.values() for r in c.rules]
        lines.append("COMMIT")
        return "\n".join(lines) + "\n"

    def without_counters(self) -> Table:
        return Table(self.name, {n: c.without_counters() for n, c in self.chains.items()})


@dataclass
class Ruleset:
    """All tables of one iptables-save run, in file order."""

    tables: dict[str, Table] = field(default_factory=dict)

    def __getitem__(self, table: str) -> Table:
        return self.tables[table]

    def __contains__(self, table: object) -> bool:
        return table in self.tables

    def to_text(self, *, counters: bool = True) -> str:
        """iptables-save format without the ``#`` comment lines."""
        return "".join(t.to_text(counters=counters) for t in self.tables.values())

    def without_counters(self) -> Ruleset:
        return Ruleset({n: t.without_counters() for n, t in self.tables.items()})


# --------------------------------------------------------------------------- parse


def parse_save(text: str | Iterable[str]) -> Ruleset:
    """Parse ``iptables-save`` / ``ip6tables-save`` output (with or without ``-c``): the text, or
    its lines as they are read (then the text is never whole in memory).

    Besides save output this accepts the ``-F CHAIN`` lines :func:`render_restore`
    emits for built-in chains (they empty that chain).  Raises :class:`ParseError`.
    """
    rs = Ruleset()
    table: Table | None = None
    table_line = 0
    for lineno, raw in enumerate(text.split("\n") if isinstance(text, str) else text, 1):
        line = raw.strip(" \t\n")
        if not line or line.startswith("#"):
            continue
        if line.startswith("*"):
            if table is not None:
                raise ParseError(f"table {table.name!r} not committed before new table", lineno, raw)
            name = line[1:]
            if not name or any(c in _WS for c in name):
                raise ParseError("bad table name", lineno, raw)
            if name in rs.tables:
                raise ParseError(f"duplicate table {name!r}", lineno, raw)
            table, table_line = Table(name), lineno
            continue
        if table is None:
            raise ParseError("line outside of a *table ... COMMIT block", lineno, raw)
        if line[:3] == "-A " and _add_simple_rule(table, line):
            continue
        if line == "COMMIT":
            rs.tables[table.name] = table
            table = None
        elif line.startswith(":"):
            _parse_chain_line(table, line, lineno, raw)
        else:
            _parse_rule_line(table, line, lineno, raw)
    if table is not None:
        raise ParseError(f"missing COMMIT for table {table.name!r}", table_line, f"*{table.name}")
    return rs


def _parse_chain_line(table: Table, line: str, lineno: int, raw: str) -> None:
    parts = line[1:].split()
    if len(parts) not in (2, 3):
        raise ParseError("expected ':CHAIN POLICY [pkts:bytes]'", lineno, raw)
    name, policy = parts[0], parts[1]
    counters = None
    if len(parts) == 3:
        counters = _parse_counters(parts[2])
        if counters is None:
            raise ParseError("malformed chain counters", lineno, raw)
    if name in table.chains:
        raise ParseError(f"duplicate chain {name!r}", lineno, raw)
    try:
        table.chains[name] = Chain(intern(name), policy, counters)
    except ValueError as e:
        raise ParseError(str(e), lineno, raw) from None


def simple_tokens(line: str) -> list[str] | None:
    """The hot path for what iptables-save writes: a line in plain printable ASCII, no backslash,
    at most one quoted region opening a token (a comment), split as split_args() does, in fewer
    steps; None for any other line."""
    if "\\" in line or not (line.isascii() and line.isprintable()):  # printable ASCII: no tab, \r, \v, \f
        return None
    parts = line.split('"')
    if len(parts) == 1:
        return line.split()
    if len(parts) == 3 and parts[0][-1:] == " ":
        tokens = parts[0].split()
        tokens.append(parts[1])
        tokens += parts[2].split()
        return tokens
    return None


def _add_simple_rule(table: Table, line: str) -> bool:
    """`-A CHAIN` of a declared chain in simple_tokens()' shape, added; False (nothing done) for
    any other line."""
    tokens = simple_tokens(line)
    if tokens is None:
        return False
    chain = table.chains.get(tokens[1])
    if chain is None:
        return False  # the general path reports it
    rule = _new_rule(Rule)  # the chain was checked when it was declared
    _set(rule, "chain", chain.name)
    _set(rule, "args", tuple(map(intern, tokens[2:])))  # tokens repeat: share one string each
    _set(rule, "counters", None)
    chain.rules.append(rule)
    return True


_new_rule = object.__new__
_set = object.__setattr__


def _parse_rule_line(table: Table, line: str, lineno: int, raw: str) -> None:
    head = line.split(None, 1)[0]
    if head in ("-F", "--flush"):
        args = line.split()
        if len(args) != 2 or args[1] not in table.chains:
            raise ParseError("'-F' needs one declared chain", lineno, raw)
        table.chains[args[1]].rules.clear()
        return
    if not (head.startswith("[") or head in ("-A", "--append")):
        raise ParseError("unexpected line (only '-A' rules are valid in save output)", lineno, raw)
    try:
        rule = Rule.from_text(line)
    except ParseError as e:
        raise ParseError(e.message, lineno, raw) from None
    chain = table.chains.get(rule.chain)
    if chain is None:
        raise ParseError(f"rule for undeclared chain {rule.chain!r}", lineno, raw)
    chain.rules.append(rule)


# --------------------------------------------------------------------------- render


@dataclass(frozen=True)
class RuleOp:
    """A single-rule edit in a chain we do not own (e.g. a jump from ``INPUT``).

    ``insert`` renders ``-I CHAIN [position] ...`` (1-based; None = top),
    ``delete`` renders ``-D CHAIN ...`` (the rule must exist, or the whole
    restore fails), ``append`` renders ``-A CHAIN ...``.
    """

    table: str
    action: Literal["append", "insert", "delete"]
    rule: Rule
    position: int | None = None

    def __post_init__(self) -> None:
        if self.action not in ("append", "insert", "delete"):
            raise ValueError(f"bad action {self.action!r}")
        if self.position is not None and (self.action != "insert" or self.position < 1):
            raise ValueError("position is only valid for insert, and is 1-based")

    def to_text(self) -> str:
        cmd = {"append": "-A", "insert": "-I", "delete": "-D"}[self.action]
        return self.rule.to_text(counters=False, command=cmd, position=self.position)


def render_restore(
    tables: Ruleset | Mapping[str, Table],
    chains_to_write: Mapping[str, Iterable[str]] | None = None,
    *,
    delete_chains: Mapping[str, Iterable[str]] | None = None,
    rule_ops: Iterable[RuleOp] = (),
    counters: bool = False,
) -> str:
    """Render input for ``iptables-restore --noflush`` (pure; no I/O).

    - ``tables``: desired state; ``chains_to_write`` maps table -> names of
      chains in it to (re)write with their full contents (default: every chain).
    - ``delete_chains``: table -> chains to remove; each is declared (flushed)
      first and deleted with ``-X`` at the end of its table.
    - ``rule_ops``: single-rule ``-A``/``-I``/``-D`` in chains we don't own,
      emitted in order after the written chains and before any ``-X``.
    - ``counters``: emit model counters (for ``iptables-restore -c``).

    In ``--noflush`` mode a ``:CHAIN - [0:0]`` line creates the chain or
    FLUSHES it if it exists; built-in chains are not flushed by their
    ``:CHAIN POLICY`` line (which only sets the policy), so written built-in
    chains also get ``-F CHAIN``.  A chain may only be deleted (``-X``) once it
    is empty and nothing references it any more (no ``-j``/``-g`` to it left,
    including rules deleted via ``rule_ops``); otherwise the restore fails.
    """
    tmap: Mapping[str, Table] = tables.tables if isinstance(tables, Ruleset) else tables
    write = {t: list(tmap[t].chains) for t in tmap} if chains_to_write is None else {
        t: list(names) for t, names in chains_to_write.items()
    }
    delete = {t: list(names) for t, names in (delete_chains or {}).items()}
    ops: dict[str, list[RuleOp]] = {}
    for op in rule_ops:
        ops.setdefault(op.table, []).append(op)

    order: list[str] = []
    for t in [*tmap, *write, *delete, *ops]:
        if t not in order and (write.get(t) or delete.get(t) or ops.get(t)):
            order.append(t)

    out: list[str] = []
    for t in order:
        chains: list[Chain] = []
        for name in write.get(t, []):
            if t not in tmap or name not in tmap[t].chains:
                raise KeyError(f"chain {name!r} to write is not in table {t!r}")
            chains.append(tmap[t].chains[name])
        gone = delete.get(t, [])
        for name in gone:
            if name in write.get(t, []):
                raise ValueError(f"chain {name!r} in {t!r} is both written and deleted")
            if name in BUILTIN_CHAINS.get(t, ()):
                raise ValueError(f"cannot delete built-in chain {name!r} in {t!r}")
        out.append(f"*{t}")
        out += [c.declaration(counters=counters) for c in chains]
        out += [f":{name} - [0:0]" for name in gone]
        out += [f"-F {c.name}" for c in chains if c.is_builtin]
        out += [r.to_text(counters=counters) for c in chains for r in c.rules]
        out += [op.to_text() for op in ops.get(t, [])]
        out += [f"-X {name}" for name in gone]
        out.append("COMMIT")
    return "\n".join(out) + "\n" if out else ""

"""Our part of an `iptables-save`, read lean: each of our chains is kept as one canonical string
and turned into Rules only when something asks for it.

A no-op plan compares every chain we render with the kernel's. Parsing all of a 10k-service save
into Rule objects takes ~0.9 s of an interpreter; this read takes ~0.3 s (runs of our rules as
iptables-save writes them become canonical by a few string replacements, see _canonical_run),
and comparing a rendered chain with the kernel's is then one string comparison
(SavedChains.holds). Only the chains that differ, or that a plan describes, are ever parsed
(O(changes)).

The canonical form of a rule is ``"\\n" + "".join("\\0" + arg for arg in args)``; a chain's is the
concatenation of its rules'. No argument iptables-save prints can hold a NUL or a newline (the
read refuses one), so two chains' strings are equal exactly when their argument lists are, and
SavedChains.holds checks the rendered side for separators inside arguments.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from sys import intern

from .render import PREFIX, TABLES, TableState, is_builtin, is_our_jump, is_ours
from .save import ParseError, Rule, parse_save, simple_tokens

Args = tuple[str, ...]


def canonical(rules: Iterable[Args]) -> str:
    """The canonical string of a chain whose rules have these arguments."""
    return "".join(["\n\0" + "\0".join(args) if args else "\n" for args in rules])


def _canonical_if_clean(rules: list[Args] | list[list[str]]) -> str | None:
    """canonical(rules), or None when an argument holds a separator itself (then the string could
    also be another chain's): there are more separators than rules and arguments."""
    text = canonical(rules)
    return text if text.count("\n") == len(rules) and text.count("\0") == sum(map(len, rules)) else None


Ahead = tuple[tuple[Rule, ...], str]  # a chain's rules and their canonical string, made ahead


def canonical_texts(chains: Mapping[str, tuple[Rule, ...]]) -> dict[str, Ahead]:
    """name -> (rules, canonical string), for the chains none of whose arguments holds a separator
    itself (SavedChains.holds works the others out)."""
    out = {}
    for name, rules in chains.items():
        text = _canonical_if_clean([r.args for r in rules])
        if text is not None:
            out[name] = (rules, text)
    return out


class SavedChains(Mapping[str, tuple[Rule, ...]]):
    """Our chains of one table, as read: name -> rules, each chain parsed on first access."""

    __slots__ = ("_parsed", "_texts")

    def __init__(self, texts: dict[str, str]):
        self._texts = texts  # name -> canonical string
        self._parsed: dict[str, tuple[Rule, ...]] = {}

    def holds(self, name: str, rules: tuple[Rule, ...], ahead: Ahead | None = None) -> bool:
        """Whether chain `name` is there with exactly these rules (argument for argument);
        `ahead`: from canonical_texts, used if made of these very rules."""
        text = self._texts.get(name)
        if text is None:
            return False
        if ahead is not None and ahead[0] is rules:
            return text == ahead[1]
        return text == _canonical_if_clean([r.args for r in rules])  # (the read strings are clean)

    def __getitem__(self, name: str) -> tuple[Rule, ...]:
        rules = self._parsed.get(name)
        if rules is None:
            text = self._texts[name]
            rules = Rule.chain_of(name, [tuple(map(intern, rule.split("\0")[1:])) for rule in text.split("\n")[1:]])
            self._parsed[name] = rules
        return rules

    def __iter__(self) -> Iterator[str]:
        return iter(self._texts)

    def __len__(self) -> int:
        return len(self._texts)

    def __contains__(self, name: object) -> bool:
        return name in self._texts

    def __getstate__(self) -> dict[str, str]:
        return self._texts  # pickled (from a child process) without what was parsed

    def __setstate__(self, texts: dict[str, str]) -> None:
        self._texts, self._parsed = texts, {}


def read_our_tables(lines: Iterable[str]) -> dict[str, TableState]:
    """Our chains and jumps in each of TABLES from the lines of a save of all tables, as they are
    read. The save's structure (tables, chain declarations, COMMIT) and the rules of other chains
    that name one of ours (our jumps in built-in chains; rules of others jumping to ours: foreign)
    go through parse_save; the rules of our own chains are split here and kept canonical; other
    tables' lines, and other chains' rules naming none of ours, are passed over unparsed."""
    ours: dict[tuple[str, str], list[str]] = {}
    rs = parse_save(_keep_ours(lines, ours))
    out: dict[str, TableState] = {}
    for table in TABLES:
        if table not in rs:
            out[table] = TableState()
            continue
        texts: dict[str, str] = {}
        jumps: list[Rule] = []
        foreign: list[Rule] = []
        for name, chain in rs[table].chains.items():
            if is_ours(name) and not chain.rules:
                texts[name] = "".join(ours.get((table, name), ()))
            elif is_ours(name):  # a rule line of a form _keep_ours does not take
                raise ParseError(f"rule of our chain {name!r} in an unexpected form")
            else:
                for r in chain.rules:
                    if r.target and is_ours(r.target):
                        mine = is_builtin(table, name) and is_our_jump(r)
                        (jumps if mine else foreign).append(r.without_counters())
        out[table] = TableState(SavedChains(texts), tuple(jumps), tuple(foreign))
    return out


def _keep_ours(lines: Iterable[str], ours: dict[tuple[str, str], list[str]]) -> Iterator[str]:
    """The lines for parse_save: those of other tables, and the rules of other chains (built-in or
    not) that name none of our chains, blanked, unsplit (line numbers stay right); the rules of our
    declared chains go, canonical, into ours[table, chain] instead. A rule for an undeclared chain
    goes to parse_save, which reports it."""
    table: str | None = ""  # "": outside any table, None: in one of the others
    declared: dict[str, int] = {}  # the current table's chains: _OURS, _BUILTIN or _OTHER
    run: list[str] = []  # rule lines of one of our chains, no other of ours between: made canonical together
    run_lines: list[int] = []  # their line numbers
    run_key = ("", "")  # (table, chain) of the run

    def end_run() -> None:
        ours.setdefault(run_key, []).append(_canonical_run(run_key[1], run, run_lines))
        run.clear()
        run_lines.clear()

    for lineno, raw in enumerate(lines, 1):
        if raw[:3] == "-A " and table and (end := raw.find(" ", 3)) > 0 and (kind := declared.get(raw[3:end])):
            # the usual line, on a short path: a rule of a declared chain
            if kind == _OURS:
                if run and raw[3:end] != run_key[1]:
                    end_run()
                if not run:
                    run_key = (table, raw[3:end])
                run.append(raw)
                run_lines.append(lineno)
                yield ""
                continue
            if PREFIX not in raw:  # (a rule naming none of ours cannot jump to one of them)
                yield ""
                continue
        if run:
            end_run()
        line = raw.strip(" \t\n")
        head = line[:1]
        if head == "*":
            table = line[1:] if line[1:] in TABLES else None
            declared = {}
            if table is None:
                raw = ""
        elif table is None:
            table, raw = ("" if line == "COMMIT" else None), ""
        elif line == "COMMIT" or not table:
            table = ""
        elif head == ":":
            name = line[1:].split(None, 1)[0] if line[1:].strip() else ""
            declared[name] = _BUILTIN if is_builtin(table, name) else _OURS if is_ours(name) else _OTHER
        elif line:
            words = line.split(None, 3)
            word = words[0]
            if word in ("-A", "--append") or head == "[":
                named = words[2 if head == "[" else 1] if len(words) > (2 if head == "[" else 1) else ""
                if declared.get(named) in (_OTHER, _BUILTIN) and PREFIX not in line:
                    yield ""  # passed over unsplit, as on the short path
                    continue
                chain, args = _rule(line, lineno)
                if chain not in declared:
                    pass  # parse_save's error
                elif declared[chain] != _OURS:
                    if PREFIX not in line:
                        raw = ""
                else:
                    ours.setdefault((table, chain), []).append(_canonical_rule(args, lineno, line))
                    raw = ""
            elif word in ("-F", "--flush") and len(parts := line.split()) == 2:
                ours.pop((table, parts[1]), None)  # (as parse_save empties the chain)
        yield raw
    if run:  # (the output ended without COMMIT: parse_save reports it)
        end_run()


_OTHER, _BUILTIN, _OURS = 1, 2, 3


_QUOTED = re.compile(r' "[^ "\n]*"(?![^ \n])')  # a quoted argument without spaces, after a space


def _canonical_run(chain: str, run: list[str], linenos: list[int]) -> str:
    """The canonical string of these `-A CHAIN ...` lines (at these line numbers).

    As iptables-save writes our rules (printable ASCII, one space between arguments, no
    backslash, quoted arguments without spaces), taking the `-A CHAIN` heads and the quotes out
    and writing NULs for the spaces is splitting them: done for the whole run at once, in C.
    Any other run is split line by line as parse_save splits it.
    """
    head = f"\n-A {chain} "
    text = "\n" + "".join(run)
    if text[-1] == "\n":
        text = text[:-1]
    if (text.count(head) == len(run) and "\\" not in text and "  " not in text and " \n" not in text
            and text[-1] != " " and text.isascii() and text.replace("\n", " ").isprintable()):
        quotes = text.count('"')
        if not quotes or 2 * len(_QUOTED.findall(text)) == quotes:
            return text.replace(head, "\n\0").replace('"', "").replace(" ", "\0")
    out = []
    for raw, lineno in zip(run, linenos):
        line = raw.strip(" \t\n")
        out.append(_canonical_rule(_rule(line, lineno)[1], lineno, line))
    return "".join(out)


def _rule(line: str, lineno: int) -> tuple[str, list[str] | tuple[str, ...]]:
    """(chain, arguments) of a rule line, split exactly as parse_save splits it."""
    tokens = simple_tokens(line) if line[:3] == "-A " else None
    if tokens is not None:
        return tokens[1], tokens[2:]
    try:
        rule = Rule.from_text(line)
    except ParseError as e:
        raise ParseError(e.message, lineno, line) from None
    return rule.chain, rule.args


def _canonical_rule(args: list[str] | tuple[str, ...], lineno: int, line: str) -> str:
    text = _canonical_if_clean([args])
    if text is None:
        raise ParseError("NUL or newline inside an argument of our rule", lineno, line)
    return text

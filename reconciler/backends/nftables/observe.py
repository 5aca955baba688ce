"""`nft list table` output -> the same Ruleset model the renderer produces."""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

from . import kernel
from .objects import FAMILIES, TABLE, BaseHook, Chain, NftSet, Ruleset, Table, duration_seconds
from .render import SHARDS, shard_table_name


def table_names() -> list[str]:
    """Our tables' names: the main one and the DNAT shards."""
    return [TABLE] + [shard_table_name(n) for n in range(SHARDS)]


def observe(look_first: bool = False, tools_at_once: int = 3) -> Ruleset:
    """Our tables (main and shards, both families), read in parallel: one `nft list table` each
    (see each_table)."""
    return Ruleset(dict(sorted((t.ref, t) for t in each_table(look_first, tools_at_once))))


def each_table(look_first: bool = False, tools_at_once: int = 3) -> Iterator[Table]:
    """Our tables as they are read (`nft list table` of each, up to `tools_at_once` at once, in
    order).

    Three workers read and parse, each table as soon as it is read, so only a few tables' text is
    ever in memory at once; `tools_at_once=1` keeps to one `nft` at a time, the others parsing
    meanwhile: for a read beside other work (the one-shot commands load the manifests
    meanwhile, and more tools than cores would take the core they need). With `look_first`,
    the tables there are listed over netlink first (one dump, kernel.existing_tables) and only
    those are read: for when most are expected missing (the other mode's leftovers).
    """
    one_tool = threading.BoundedSemaphore(max(1, tools_at_once))

    def read(ref: tuple[str, str]) -> Table | None:
        with one_tool:
            text = kernel.list_table(*ref)
        return None if text is None else parse_table(text, *ref)

    wanted = [(family, name) for family in FAMILIES.values() for name in table_names()]
    existing = kernel.existing_tables() if look_first else None
    if existing is not None:
        wanted = [ref for ref in wanted if ref in existing]
    with ThreadPoolExecutor(max_workers=3) as pool:
        for table in pool.map(read, wanted):
            if table is not None:
                yield table


def parse_table(text: str, family: str, name: str) -> Table:
    """Parse `nft list table FAMILY NAME` output into the model render() makes.

    Rules are kept as the lines nft prints (one rule per line, the text the renderer writes), so
    a rule nft prints otherwise than we render is a difference, never a crash: the planner
    rewrites it. The table's flags are kept (the planner clears them). Blocks other than chains,
    sets and maps (flowtables, named counters, ...) and lines the model has no place for
    (comments, set sizes) are passed over, as the model does not compare them.
    """
    lines = [line.strip() for line in text.split("\n")]
    chains: dict[str, Chain] = {}
    sets: dict[str, NftSet] = {}
    flags: tuple[str, ...] = ()
    i, depth = 0, 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if depth == 1 and line.endswith(" {"):
            kind, _, obj = line[:-2].partition(" ")
            body, i = _until_closed(lines, i, 1)
            body = body[:-1]  # (its closing brace)
            if kind == "chain":
                chains[obj] = _parse_chain(obj, body)
            elif kind in ("set", "map"):
                sets[obj] = _parse_set(obj, body, is_map=kind == "map")
            continue
        if depth == 1 and line.startswith("flags "):
            flags = tuple(line[6:].split(","))
        depth += _braces(line)
    return Table(family, name, chains, sets, flags)


def _until_closed(lines: list[str], i: int, depth: int) -> tuple[list[str], int]:
    """From line i, the lines through the one that closes the `depth` braces opened before it,
    and the index after that one."""
    taken: list[str] = []
    while i < len(lines) and depth > 0:
        depth += _braces(lines[i])
        taken.append(lines[i])
        i += 1
    return taken, i


def _braces(line: str) -> int:
    """Braces opened minus closed, outside quoted strings."""
    if '"' not in line:
        return line.count("{") - line.count("}")
    outside = line.split('"')[::2]
    return sum(part.count("{") - part.count("}") for part in outside)


_HOOK = re.compile(r"type (\S+) hook (\S+) priority (.+); policy (\S+);")


def _parse_chain(name: str, body: list[str]) -> Chain:
    base = None
    rules: list[str] = []
    for line in body:
        if not line:
            continue
        if not rules and base is None and line.startswith('comment "'):
            continue  # the chain's comment (nft prints it first)
        if not rules and base is None and line.startswith("type "):
            m = _HOOK.fullmatch(line)
            prio = _priority(m.group(3)) if m else None
            base = (BaseHook(m.group(1), m.group(2), prio, m.group(4)) if m and prio is not None
                    else BaseHook(f"<unparsed: {line}>", "", 0))
            continue
        rules.append(line)
    return Chain(name, tuple(rules), base)


# the standard priority names of the ip, ip6 and inet families
_PRIORITIES = {"raw": -300, "mangle": -150, "dstnat": -100, "filter": 0, "security": 50, "srcnat": 100}
_PRIORITY = re.compile(r"(-?\d+)|([a-z]+)(?: ([+-]) (\d+))?")


def _priority(text: str) -> int | None:
    """`-110`, `dstnat`, `filter - 10` -> the number; None when it is none of those."""
    m = _PRIORITY.fullmatch(text)
    if m is None:
        return None
    if m.group(1):
        return int(m.group(1))
    if m.group(2) not in _PRIORITIES:
        return None
    offset = int(m.group(4)) if m.group(4) else 0
    return _PRIORITIES[m.group(2)] + (-offset if m.group(3) == "-" else offset)


_FLAG_ORDER = {"dynamic": 0, "interval": 1, "timeout": 2}
_ELEMENT = re.compile(r'(?P<key>.+?)(?: comment "(?P<comment>[^"]*)")?(?: : (?P<value>.+))?')


def _parse_set(name: str, body: list[str], is_map: bool) -> NftSet:
    key_type, value_type = "", None
    flags: list[str] = []
    timeout: int | None = None
    elements: dict[str, tuple[str | None, str | None]] = {}
    i = 0
    while i < len(body):
        line = body[i]
        i += 1
        if line.startswith("type "):
            key_type, _, value = line[5:].partition(" : ")
            value_type = value if is_map else None
            if not is_map and value:
                key_type = line[5:]
        elif line.startswith("flags "):
            flags = line[6:].split(",")
        elif line.startswith("timeout "):
            timeout = duration_seconds(line[8:])
        elif line.startswith("elements = {"):
            first = line[len("elements = {"):]
            more, i = _until_closed(body, i, 1 + _braces(first))  # wrapped over several lines
            for item in _split_elements(" ".join([first, *more]).rstrip()[:-1]):
                m = _ELEMENT.fullmatch(item)  # (any item matches: the key takes what is left)
                if m:
                    elements[m["key"]] = (m["value"] if is_map else None, m["comment"])
    if (timeout is not None or "timeout" in flags) and "dynamic" not in flags:
        flags = ["dynamic", *flags]  # timeouts imply it (older nft leave it out)
    return NftSet(name=name, key_type=key_type, value_type=value_type,
                  flags=tuple(sorted(flags, key=lambda f: _FLAG_ORDER.get(f, 9))), timeout=timeout,
                  elements={} if "dynamic" in flags else elements)


def _split_elements(text: str) -> list[str]:
    """`a, b comment "x, y" : goto c, ...` -> its elements: commas outside quotes and braces."""
    items: list[str] = []
    depth, quoted, start = 0, False, 0
    for pos, ch in enumerate(text):
        if ch == '"':
            quoted = not quoted
        elif quoted:
            continue
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:pos].strip())
            start = pos + 1
    items.append(text[start:].strip())
    return [item for item in items if item]

"""`nft -j list table` output -> the same Ruleset model the renderer produces."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

from . import kernel
from .expr import Unsupported, element, rule_text, verdict_or_value
from .objects import FAMILIES, TABLE, BaseHook, Chain, NftSet, Ruleset, Table
from .render import SHARDS, shard_table_name


def table_names() -> list[str]:
    """Our tables' names: the main one and the DNAT shards."""
    return [TABLE] + [shard_table_name(n) for n in range(SHARDS)]


def observe(look_first: bool = False) -> Ruleset:
    """Our tables (main and shards, both families), read in parallel: one `nft -j list table` each
    (see each_table for `look_first`)."""
    return Ruleset(dict(sorted((t.ref, t) for t in each_table(look_first))))


def each_table(look_first: bool = False) -> Iterator[Table]:
    """Our tables as they are read (several `nft -j list table` at once, in order).

    Each worker parses its table as soon as it is read, so only a few tables' JSON is ever in
    memory at once (at 10k services all of it would be ~300 MB). With `look_first`, the tables
    there are listed over netlink first and only those are read: for when most are expected
    missing (the other mode's leftovers), as it costs an import of ~0.2 s and 20 MB.
    """
    def read(ref: tuple[str, str]) -> Table | None:
        doc = kernel.list_table(*ref)
        return None if doc is None else parse_table(doc, *ref)

    wanted = [(family, name) for family in FAMILIES.values() for name in table_names()]
    existing = kernel.existing_tables() if look_first else None
    if existing is not None:
        wanted = [ref for ref in wanted if ref in existing]
    with ThreadPoolExecutor(max_workers=3) as pool:
        for table in pool.map(read, wanted):
            if table is not None:
                yield table


def parse_table(doc: dict[str, Any], family: str, name: str) -> Table:
    """Parse one table from nft's JSON (a {"nftables": [...]} document)."""
    chains: dict[str, Chain] = {}
    rules: dict[str, list[str]] = {}
    sets: dict[str, NftSet] = {}
    for item in doc.get("nftables", []):
        if "chain" in item:
            c = item["chain"]
            if c["table"] != name or c["family"] != family:
                continue
            base = None
            if "hook" in c:
                base = BaseHook(c.get("type", "filter"), c["hook"], int(c.get("prio", 0)), c.get("policy", "accept"))
            chains[c["name"]] = Chain(c["name"], (), base)
            rules.setdefault(c["name"], [])
        elif "rule" in item:
            r = item["rule"]
            if r["table"] != name or r["family"] != family:
                continue
            try:
                text = rule_text(r.get("expr", []))
            except (Unsupported, KeyError, TypeError) as exc:
                text = f"<unparsed {exc}: {json.dumps(r.get('expr'))}>"
            rules.setdefault(r["chain"], []).append(text)
        elif "set" in item or "map" in item:
            s = item.get("set") or item["map"]
            if s["table"] != name or s["family"] != family:
                continue
            sets[s["name"]] = _parse_set(s, is_map="map" in item)
    for cname, c in chains.items():
        chains[cname] = Chain(cname, tuple(rules.get(cname, ())), c.base)
    return Table(family, name, chains, sets)


def _type_text(t: Any) -> str:
    return " . ".join(t) if isinstance(t, list) else str(t)


def _parse_set(s: dict[str, Any], is_map: bool) -> NftSet:
    flags = s.get("flags", [])
    flags = [flags] if isinstance(flags, str) else list(flags)
    timeout = s.get("timeout")
    if timeout is not None and "dynamic" not in flags:
        flags = ["dynamic", *flags]  # nft 1.0.x JSON omits "dynamic"
    elements: dict[str, tuple[str | None, str | None]] = {}
    for e in s.get("elem", []):
        try:
            if is_map:
                key, comment = element(e[0])
                elements[key] = (verdict_or_value(e[1]), comment)
            else:
                key, comment = element(e)
                elements[key] = (None, comment)
        except (Unsupported, KeyError, TypeError, IndexError) as exc:
            elements[f"<unparsed {exc}>"] = (None, None)
    order = {"dynamic": 0, "interval": 1, "timeout": 2}
    return NftSet(
        name=s["name"], key_type=_type_text(s["type"]), value_type=_type_text(s["map"]) if is_map else None,
        flags=tuple(sorted(flags, key=lambda f: order.get(f, 9))), timeout=timeout,
        elements={} if timeout is not None else elements,
    )

"""nft JSON (libnftables-json) -> the canonical rule and element text `nft list` prints.

Covers the vocabulary the renderer writes. Anything else raises Unsupported; the observer then
records the rule as unparsed, which never equals a rendered rule, so the planner rewrites it.
"""

from __future__ import annotations

import json
from typing import Any


class Unsupported(ValueError):
    pass


_MARK_KEYS = {"mark"}


def rule_text(exprs: list[dict[str, Any]]) -> str:
    return " ".join(statement(e) for e in exprs)


def statement(e: dict[str, Any]) -> str:
    if len(e) != 1:
        raise Unsupported(json.dumps(e))
    (kind, v), = e.items()
    if kind == "match":
        return _match(v)
    if kind in ("jump", "goto"):
        return f"{kind} {v['target']}"
    if kind in ("drop", "accept", "return", "continue"):
        return kind
    if kind == "reject":
        if not v or (v.get("expr") == "port-unreachable" and v.get("type") in ("icmp", "icmpv6", "icmpx")):
            return "reject"
        raise Unsupported(json.dumps(e))
    if kind == "masquerade":
        flags = v.get("flags") if v else None
        if not flags:
            return "masquerade"
        return "masquerade " + (flags if isinstance(flags, str) else ",".join(flags))
    if kind == "mangle":
        key = expression(v["key"])
        return f"{key} set {expression(v['value'], hexa=_is_mark(v['key']))}"
    if kind == "dnat":
        return _dnat(v)
    if kind == "vmap":
        return f"{expression(v['key'])} vmap {_data(v['data'])}"
    if kind == "set":
        if v.get("op") in ("update", "add"):
            return f"{v['op']} {v['set']} {{ {expression(v['elem'])} }}"
    raise Unsupported(json.dumps(e))


def _is_mark(e: Any) -> bool:
    return isinstance(e, dict) and "meta" in e and e["meta"].get("key") in _MARK_KEYS


def _match(v: dict[str, Any]) -> str:
    left, right, op = v["left"], v["right"], v["op"]
    hexa = _is_mark(left) or (isinstance(left, dict) and any(
        k in left and _is_mark(left[k][0]) for k in ("&", "|", "^")))
    lt = expression(left, hexa)
    rt = expression(right, hexa)
    if op in ("==", "in"):
        binop = isinstance(left, dict) and any(k in left for k in ("&", "|", "^"))
        return f"{lt} == {rt}" if binop else f"{lt} {rt}"
    return f"{lt} {op} {rt}"


def expression(x: Any, hexa: bool = False) -> str:
    if isinstance(x, bool):
        raise Unsupported(json.dumps(x))
    if isinstance(x, int):
        return f"0x{x:08x}" if hexa else str(x)
    if isinstance(x, str):
        return x
    if isinstance(x, list):
        return ",".join(expression(i, hexa) for i in x)
    if not isinstance(x, dict) or len(x) != 1:
        raise Unsupported(json.dumps(x))
    (kind, v), = x.items()
    if kind == "payload":
        return f"{v['protocol']} {v['field']}"
    if kind == "meta":
        return f"meta {v['key']}"
    if kind == "ct":
        if "dir" in v:
            return f"ct {v['dir']} {v['key']}"
        return f"ct {v['key']}"
    if kind == "fib":
        flags = v.get("flags", [])
        flags = [flags] if isinstance(flags, str) else flags
        return f"fib {' . '.join(flags)} {v['result']}"
    if kind == "concat":
        return " . ".join(expression(i) for i in v)
    if kind == "prefix":
        return f"{v['addr']}/{v['len']}"
    if kind == "range":
        return f"{expression(v[0])}-{expression(v[1])}"
    if kind in ("&", "|", "^"):
        return f"{expression(v[0], hexa)} {kind} {expression(v[1], hexa)}"
    if kind == "set":
        items = v if isinstance(v, list) else [v]
        return _anon(items)
    if kind == "numgen":
        off = f" offset {v['offset']}" if v.get("offset") else ""
        return f"numgen {v['mode']} mod {v['mod']}{off}"
    if kind == "map":
        return f"{expression(v['key'])} map {_data(v['data'])}"
    if kind in ("jump", "goto"):
        return f"{kind} {v['target']}"
    if kind == "elem":
        return expression(v["val"])
    raise Unsupported(json.dumps(x))


def _data(d: Any) -> str:
    if isinstance(d, str):
        return d
    if isinstance(d, dict) and "set" in d:
        return _anon(d["set"])
    raise Unsupported(json.dumps(d))


def _anon(items: list[Any]) -> str:
    parts = []
    for it in items:
        if isinstance(it, list) and len(it) == 2:
            parts.append(f"{expression(it[0])} : {verdict_or_value(it[1])}")
        else:
            parts.append(expression(it))
    if len(parts) == 1 and not any(isinstance(it, list) for it in items):
        return parts[0]
    return "{ " + ", ".join(parts) + " }"


def verdict_or_value(x: Any) -> str:
    if isinstance(x, dict) and len(x) == 1:
        (k, v), = x.items()
        if k in ("jump", "goto"):
            return f"{k} {v['target']}"
        if k in ("drop", "accept", "return"):
            return k
    return expression(x)


def element(e: Any) -> tuple[str, str | None]:
    """A set element (JSON) -> (key text, comment)."""
    comment = None
    if isinstance(e, dict) and "elem" in e:
        comment = e["elem"].get("comment")
        e = e["elem"]["val"]
    return expression(e), comment


def _dnat(v: dict[str, Any]) -> str:
    addr = v.get("addr")
    fam = f" {v['family']}" if v.get("family") and not isinstance(addr, str) else ""
    if isinstance(addr, str):
        target = f"[{addr}]" if ":" in addr else addr
        if "port" in v:
            target += f":{expression(v['port'])}"
        return f"dnat to {target}"
    return f"dnat{fam} to {expression(addr)}"

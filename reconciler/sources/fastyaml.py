"""A fast YAML 1.2 loader for plain Kubernetes manifests.

Two fast paths, tried in order: yaml-rs (a compiled YAML 1.2 parser that builds the Python objects
itself, ~5x faster than the next), then libyaml's event parser (ruamel.yaml.clib) with a small
constructor in Python, ~4x faster than ruamel's safe constructor. They handle the YAML that
manifests use (mappings, sequences, plain and quoted scalars, anchors and aliases); what either
would read differently from the reference (explicit tags, merge keys, numbers in other notations,
...) makes it decline (None or Unsupported), and the caller falls back to ruamel.yaml's own
loader, which stays the reference (and gives the precise error marks).
"""

from __future__ import annotations

import re
from sys import intern
from typing import Any

from ruamel.yaml import events as ev
from ruamel.yaml.error import MarkedYAMLError

try:
    from _ruamel_yaml import CParser  # ruamel.yaml.clib
except ImportError:  # pragma: no cover - the clib wheel is a dependency
    CParser = None
try:
    import yaml_rs
except ImportError:  # pragma: no cover - a dependency; without it the event parser does all
    yaml_rs = None


class Unsupported(Exception):
    pass


class AmbiguousNumber(MarkedYAMLError):
    """An integer with a leading zero (`0120`) that YAML 1.1 readers such as kubectl's read as
    octal (80) or as a string (`089`), and YAML 1.2 as decimal (120): refused, never guessed."""


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
            if _LEADING_ZERO.match(value) and _yaml11_int(value) != int(value):
                raise _Ambiguous(value)
            return int(value)
        if _FLOAT.match(value):
            return float(value)
        if "_" in value or _RADIX.match(value) or value.lower() in (".inf", "-.inf", "+.inf", ".nan"):
            raise Unsupported(value)  # 8_080, 0x1F, .NaN, ...: the reference decides
    return value


_RADIX = re.compile(r"[-+]?0[xXoObB]")
_LEADING_ZERO = re.compile(r"[-+]?0[0-9]")


class _Ambiguous(Exception):
    pass


def _yaml11_int(value: str) -> int | str:
    """What a YAML 1.1 reader makes of a plain integer with a leading zero: octal, else a string."""
    try:
        return int(value, 8)
    except ValueError:
        return value


# A document start alone on its line ("---", maybe a comment after it), and any line that starts
# like a marker or a directive: when the two counts differ the text is not split by us.
_DOC_START = re.compile(r"^---(?:[ \t]+#[^\n]*)?[ \t]*(?:\n|\Z)", re.M)
_MARKER_LIKE = re.compile(r"^(?:---|\.\.\.|%)", re.M)
_CONTENT_LINE = re.compile(r"^[ \t]*[^ \t\r\n#]", re.M)
# What the compiled path leaves to the others, as yaml-rs reads it differently from the reference:
# tags (it drops unknown ones), merge keys (it keeps "<<" as a key), tabs (it takes them as
# indentation), carriage returns and NEL/LS/PS (line breaks: files are read with newlines made
# "\n"), a byte order mark past the start, characters YAML does not allow (it stops at a NUL
# without a word), complex keys ("? ", or a key that is a flow collection), and plain scalars
# that start like a number in a notation it reads more loosely (0x/0o/0b in any case, "_1",
# ".Nan"). The patterns may also match harmless text: that text just takes the slower path.
_BAD_CHARS = re.compile(r"[^\n\x20-\x7e\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]|[\ufeff\x85\u2028\u2029]")
_SUSPECT = re.compile(r"^[ -]*\?(?:[ \n]|$)|(?:^[ -]*|[{,\[] *)[\[{][^\n]*?[}\]] *:(?:[ \n]|$)"
                      r"|(?:^[ -]*|[:,\[] *)[+-]?(?:_|0[xXoObB]|\.[A-Za-z])"
                      r"|(?:^[ -]*|[:,\[] *)[+-]?0[0-9]+ *(?:$|[,\]}#])", re.M)


def _declines(text: str) -> bool:
    """True when yaml-rs may read `text` differently from the reference (see above): substring
    checks first (10k manifests: ~0.1 s), the precise pattern only when one of them hits."""
    if text.isascii():
        if not text.replace("\n", " ").isprintable():
            return True  # a control character, a tab or a carriage return
    elif _BAD_CHARS.search(text):
        return True
    if "!" in text or "<<" in text:
        return True
    low = text.lower()
    if ("?" in text or "_" in text or "]:" in text or "}:" in text or " :" in text
            or "0x" in low or "0o" in low or "0b" in low or ".inf" in low or ".nan" in low
            or " 0" in text or "[0" in text or ",0" in text or "+0" in text):  # (a leading zero?)
        return _SUSPECT.search(text) is not None
    return False


def load_all(text: str, share_keys: bool = False) -> list[Any]:
    """All documents of `text` as plain Python data (raises Unsupported, or a ruamel error).

    share_keys: mapping keys as one shared string each, for data kept alive long (yaml-rs makes
    a string per key: 10k manifests take 40 MiB more). yaml-rs's documents are then rebuilt with
    shared keys, which costs a third of parsing them (10k manifests: 1.4 s + 0.5 s, where the
    event path, which shares them as it goes, takes 5.7 s).
    """
    if yaml_rs is not None:
        docs = _load_all_compiled(text)
        if docs is not None:  # (yaml-rs declines nesting deeper than ~256: _shared recurses less)
            return [_shared(d) for d in docs] if share_keys else docs
    return _load_all_events(text)


def _shared(x: Any) -> Any:
    """x with every mapping key (a string) replaced by the one interned string of its text."""
    if type(x) is dict:
        return {intern(k) if type(k) is str else k: _shared(v) for k, v in x.items()}
    if type(x) is list:
        return [_shared(v) for v in x]
    return x


def _load_all_compiled(text: str) -> list[Any] | None:
    """yaml-rs, one document at a time (its loads() folds a stream of documents and a top-level
    sequence into the same list, so the text is split at the "---" lines here). None when the
    text has what yaml-rs would read differently (see _declines) or markers this split does not
    handle, or does not parse."""
    if text.startswith("\ufeff"):
        text = text[1:]  # a byte order mark opening the stream is no content (yaml-rs keeps it)
    if _declines(text):
        return None
    parts = _DOC_START.split(text)
    if len(_MARKER_LIKE.findall(text)) != len(parts) - 1:
        return None
    docs: list[Any] = []
    try:
        for i, part in enumerate(parts):
            if i == 0 and not _CONTENT_LINE.search(part):
                continue  # nothing but comments before the first "---": not a document
            docs.append(yaml_rs.loads(part, parse_datetime=False))
    except (yaml_rs.YAMLDecodeError, ValueError, TypeError, RecursionError):
        return None
    return docs


def _load_all_events(text: str) -> list[Any]:
    """libyaml's events, built into Python data here."""
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
            if value in container:  # ruamel.yaml's loader names the place (kubectl refuses it too)
                raise Unsupported("duplicate key")
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
            try:
                value = _plain(e.value) if e.style in ("", None) and e.implicit[0] else e.value
            except _Ambiguous:
                raise AmbiguousNumber(problem=f"{e.value} is {_yaml11_int(e.value)!r} to YAML 1.1 readers such as "
                                      f"kubectl and {int(e.value)} in YAML 1.2: write it without the leading zero",
                                      problem_mark=e.start_mark) from None
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

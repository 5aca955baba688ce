"""The records every source produces: a Kubernetes object plus where it came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

Path = tuple[str | int, ...]

KINDS = ("Service", "EndpointSlice", "Node")
SERVICE_KINDS = KINDS[:2]  # (a source without any is taken for a mistake: see the run loop)


@dataclass(frozen=True)
class Location:
    """A place in the input: a file with line/column (1-based), or another origin such as 'kubernetes'."""

    origin: str
    line: int | None = None
    column: int | None = None

    def __str__(self) -> str:
        if self.line is None:
            return self.origin
        if self.column is None:
            return f"{self.origin}:{self.line}"
        return f"{self.origin}:{self.line}:{self.column}"


def in_place_order(items: Iterable[Any]) -> list[Any]:
    """Errors or warnings sorted by file, line and column (those without a place first), as a
    compiler lists them; otherwise in the order found."""
    def key(item: Any) -> tuple[str, int, int, str]:
        loc = getattr(item, "location", None)
        if isinstance(loc, Location):
            return loc.origin, loc.line or 0, loc.column or 0, str(item)
        return (str(loc) if loc is not None else ""), 0, 0, str(item)
    return sorted(items, key=key)


def name_some(names: list[str], shown: int, none: str = "nothing", total: int | None = None) -> str:
    """The first `shown` names, and how many more ("a, b and 3 more"); `none` for none. `total`:
    how many there are in all, when `names` holds only the first few."""
    if not names:
        return none
    more = (len(names) if total is None else total) - min(shown, len(names))
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


def format_path(path: Path) -> str:
    """('spec', 'ports', 0, 'port') -> 'spec.ports[0].port'."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


@dataclass(frozen=True)
class SourceObject:
    """One Kubernetes object (Service, EndpointSlice or Node) as plain JSON-like data.

    `locate(path)` gives the best known input location of a field path (the object's own
    location when the field has none); sources that cannot tell return `location`.
    """

    kind: str
    namespace: str
    name: str
    body: Mapping[str, Any]
    location: Location
    locate: Callable[[Path], Location] | None = field(default=None, compare=False, repr=False)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.kind, self.namespace, self.name)

    def release_body(self) -> None:
        """Keep only apiVersion, kind and metadata name/namespace of the body.

        For a source that keeps its objects only so the builder can recognise them by identity
        (a watched directory): once built, the rest of the body is never read again, and at 10k
        Services it is most of the process's memory.
        """
        meta = self.body.get("metadata")
        keep = {k: meta[k] for k in ("name", "namespace") if k in meta} if isinstance(meta, dict) else {}
        object.__setattr__(self, "body", {"apiVersion": self.body.get("apiVersion"), "kind": self.kind,
                                          "metadata": keep})

    def where(self, path: Path = ()) -> Location:
        if self.locate is None:
            return self.location
        return self.locate(path)


_TYPE_NAMES = {int: "integer", str: "string", list: "list", dict: "mapping", bool: "boolean", float: "number",
               type(None): "null"}


def type_name(kind: type) -> str:
    """A value's type as the input speaks of it: 'integer', 'mapping', ... (not Python's names)."""
    # (the first of its classes with a name: ruamel's round-trip loader, which reads the --config
    # file, makes subclasses, CommentedSeq of list, ScalarInt of int)
    return next((_TYPE_NAMES[k] for k in kind.__mro__ if k in _TYPE_NAMES), kind.__name__)


def undecodable_at(path: str, raw: bytes, exc: UnicodeDecodeError) -> Location:
    """Where in a file (line and column, not a codec's byte offset) the byte that is not UTF-8 is."""
    line_start = raw.rfind(b"\n", 0, exc.start) + 1
    column = len(raw[line_start:exc.start].decode("utf-8", "replace")) + 1
    return Location(path, raw.count(b"\n", 0, exc.start) + 1, column)


class InputError(Exception):
    """Bad input, named by place and field: 'state/web.yaml:12:7: spec.ports[0].port: must be 1-65535'."""

    def __init__(self, location: Location | str, message: str, path: Path = ()):
        self.location = location
        self.path = path
        self.message = message
        super().__init__(diagnostic_text(location, path, message))

    def to_dict(self) -> dict[str, Any]:
        """The error for machines (`-o json`): its place, field path and message."""
        return diagnostic(self.location, self.path, self.message)


class SourceUnavailable(InputError):
    """The source itself cannot be used (its directory is gone, or holds no object at all): a
    failure of the source, not of an object in it."""


class InputWarning(str):
    """A warning about the input, as its text ('state/web.yaml:12:7: spec.ports[0].nodePort: ...';
    without a place, the message alone), which also keeps its parts for to_dict()."""

    location: Location | str | None
    path: Path
    message: str

    def __new__(cls, location: Location | str | None, message: str, path: Path = ()) -> InputWarning:
        self = super().__new__(cls, diagnostic_text(location, path, message))
        self.location, self.path, self.message = location, path, message
        return self

    def __reduce__(self) -> tuple[Any, ...]:  # (pickled by the process pool that parses manifests)
        return InputWarning, (self.location, self.message, self.path)

    def to_dict(self) -> dict[str, Any]:
        return diagnostic(self.location, self.path, self.message)


def diagnostic_text(location: Location | str | None, path: Path, message: str) -> str:
    """An error or warning for people: 'place: field: message' (each part only when known)."""
    parts = [str(location)] if location is not None else []
    if path:
        parts.append(format_path(path))
    return ": ".join([*parts, message])


def diagnostic(location: Location | str | None, path: Path, message: str) -> dict[str, Any]:
    """An error or warning for machines: file, line and column (when known), field and message;
    schemas/diagnostics.schema.json."""
    out: dict[str, Any] = {}
    if isinstance(location, Location):
        out["file"] = location.origin
        if location.line is not None:
            out["line"] = location.line
        if location.column is not None:
            out["column"] = location.column
    elif location is not None:
        out["file"] = str(location)
    if path:
        out["field"] = format_path(path)
    out["message"] = message
    return out


class InputConflict(InputError):
    """Bad input that two objects make together (one ClusterIP and port, or one nodePort, for
    two Services): which of them is meant cannot be told from either."""


class InputErrors(Exception):
    """Several InputErrors collected from one pass over the input, with the warnings that pass
    found (shown beside the errors: fixing those first should not hide these)."""

    def __init__(self, errors: list[InputError], warnings: list[str] | None = None):
        self.errors = errors
        self.warnings = warnings or []
        super().__init__("\n".join(str(e) for e in errors))

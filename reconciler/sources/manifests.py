"""Read a directory of Kubernetes manifests (YAML or JSON) into SourceObjects.

Parsing takes a fast path first (fastyaml.py: yaml-rs, else libyaml's events), falling back to
ruamel.yaml's loaders; when an error needs a precise place, the file is re-read with the round-trip
loader, which knows the line and column of every key.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from pathlib import Path as FsPath
from typing import Any, Iterable

from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError, YAMLError

from . import fastyaml
from .objects import (
    KINDS, InputError, InputErrors, InputWarning, Location, Path, SourceObject, SourceUnavailable, type_name,
    undecodable_at,
)

log = logging.getLogger(__name__)

SUFFIXES = (".yaml", ".yml", ".json")
PARALLEL_MIN_FILES = 512  # fewer files parse faster here than a worker's round trip takes
PARALLEL_CHUNK = 256

# (apiVersion, kind) pairs that we read; everything else is skipped with a warning.
_ACCEPTED = {
    ("v1", "Service"),
    ("discovery.k8s.io/v1", "EndpointSlice"),
    ("v1", "Node"),
}
_IGNORED_QUIETLY = {"List", "ServiceList", "EndpointSliceList", "NodeList"}
_OUR_GROUPS = {"", "discovery.k8s.io"}  # the API groups of _ACCEPTED: core, discovery


def _group(api_version: Any) -> str | None:
    """'discovery.k8s.io/v1' -> 'discovery.k8s.io', 'v1' -> '' (core); None when there is none."""
    if not isinstance(api_version, str):
        return None if api_version is not None else ""
    return api_version.rpartition("/")[0]


_DOCUMENT_START = re.compile(r"^---(?=[ \t]|$)", re.M)
_DOCUMENT_END = re.compile(r"^\.\.\.(?=[ \t]|$)", re.M)
_SPLIT_MIN_CHARS = 64 * 1024  # smaller files are parsed whole (no gain worth the split)


class _FileLocator:
    """Lazily re-parses one file with the round-trip loader to answer 'where is this field?':
    just the document asked about when the file splits into documents at its `---` lines the
    way the first parse did (the pure-Python loader takes ~7 s a MB: one error in a big file
    took 18 s to place), else all of it."""

    def __init__(self, path: str, documents: int = 0):
        self.path = path
        self.documents = documents  # how many the first parse found (0: not known, never split)
        self._docs: list[Any] | None = None
        self._split: tuple[str, list[int]] | None | bool = False  # (text, document bounds); None: no split
        self._one: dict[int, tuple[Any, int] | None] = {}  # doc index -> (document, its first line)

    def docs(self) -> list[Any]:
        if self._docs is None:
            try:
                self._docs = list(YAML(typ="rt").load_all(_text(read_bytes(self.path))))
            except (InputError, YAMLError, ValueError, RecursionError):  # (nesting deeper than its
                self._docs = []  # recursive loader goes, which the first parse took: no line, then)
        return self._docs

    def _documents(self) -> tuple[str, list[int]] | None:
        """The file's text and where its documents start and end, split at its `---` lines (read
        once): None when that split may not be the first parse's (a small file, a `...` after
        which a document may start with no `---`, another count of documents)."""
        if self._split is False:
            self._split = None
            try:
                text = _text(read_bytes(self.path))
            except (InputError, ValueError):
                return None
            if len(text) <= _SPLIT_MIN_CHARS or _DOCUMENT_END.search(text):
                return None
            starts = [m.start() for m in _DOCUMENT_START.finditer(text)]
            if starts and _no_document(text[:starts[0]]):  # a first `---` opens document 0
                starts = starts[1:]
            bounds = [0, *starts, len(text)]
            if len(bounds) - 1 == self.documents:
                self._split = (text, bounds)
        return self._split  # type: ignore[return-value]

    def _document(self, doc_index: int, item_path: Path, ident: tuple[Any, Any, str]) -> tuple[Any, int] | None:
        """Document `doc_index` and the file line it starts at (0-based), parsed alone; None
        when the file cannot be split so (the whole file is parsed then), or this document
        does not hold the very object (kind, namespace, name) the first parse found there."""
        if doc_index not in self._one:
            self._one[doc_index] = None
            split = self._documents()
            if split is not None:
                text, bounds = split
                try:
                    docs = list(YAML(typ="rt").load_all(text[bounds[doc_index]:bounds[doc_index + 1]]))
                except (YAMLError, ValueError, RecursionError):
                    docs = []
                if len(docs) == 1 and docs[0] is not None and _same_object(docs[0], item_path, ident):
                    self._one[doc_index] = (docs[0], text.count("\n", 0, bounds[doc_index]))
        return self._one[doc_index]

    def locate(self, doc_index: int, item_path: Path, path: Path, ident: tuple[Any, Any, str] | None = None
               ) -> Location:
        """Where field `path` of the object at item_path in document doc_index (kind, namespace
        and name `ident`, as the first parse read them) is in the file."""
        one = self._document(doc_index, item_path, ident) if ident and ident[2] else None
        if one is not None:
            node, offset = one
        else:
            docs = self.docs()
            if doc_index >= len(docs):
                return Location(self.path)
            node, offset = docs[doc_index], 0
        line, col = _start(node)
        for part in tuple(item_path) + tuple(path):
            try:
                if hasattr(node, "lc") and isinstance(part, str) and part in node:
                    line, col = node.lc.key(part)
                elif hasattr(node, "lc") and isinstance(part, int) and part < len(node):
                    line, col = node.lc.item(part)
                else:
                    break
                node = node[part]
            except (KeyError, IndexError, TypeError, AttributeError):
                break
        return Location(self.path, offset + line + 1, col + 1)


def _text(raw: bytes) -> str:
    """A manifest's bytes as text with "\n" line breaks, as the first parse reads them: UTF-8, or
    UTF-16 with its byte order mark (PowerShell's `>`, as kubectl's reader takes it too); CRLF too.
    Raises UnicodeDecodeError."""
    return _lf(raw.decode("utf-16") if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else raw.decode("utf-8"))


def _lf(text: str) -> str:
    """Line breaks as text mode reads them ("\r\n", "\r" -> "\n"; the fast YAML path wants "\n")."""
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


def _no_document(text: str) -> bool:
    """Text before a file's first `---` that is no document: blank lines, comments, directives."""
    return all(not line.strip() or line.lstrip().startswith("#") or line.startswith("%") for line in text.split("\n"))


def _same_object(doc: Any, item_path: Path, ident: tuple[Any, Any, str]) -> bool:
    """Whether the document parsed alone holds, at item_path, the object (kind, namespace, name)
    the first parse found there (a Deployment and its Service are often both `web`)."""
    kind, namespace, name = ident
    node = doc
    try:
        for part in item_path:
            node = node[part]
        meta = node["metadata"]
        return (meta["name"] == name and meta.get("namespace") == namespace
                and node.get("kind", kind) == kind)
    except (KeyError, IndexError, TypeError, AttributeError):
        return False


def _start(node: Any) -> tuple[int, int]:
    lc = getattr(node, "lc", None)
    if lc is not None and lc.line is not None:
        return lc.line, lc.col or 0
    return 0, 0


@dataclass
class LoadResult:
    objects: list[SourceObject] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def manifest_files(root: str | os.PathLike[str], linked_dirs: list[str] | None = None) -> list[str]:
    """Every manifest file under root (recursively, sorted, hidden entries skipped). A symbolic
    link to a directory is not followed: it is added to `linked_dirs`, for a warning
    (linked_dir_warning). A folder that cannot be listed raises InputErrors (its manifests are
    not known, which is no reason to take them for removed)."""
    root_path = FsPath(root)
    if root_path.is_file():
        return [str(root_path)]
    if not root_path.is_dir():
        raise SourceUnavailable(Location(str(root_path)), "no such directory")
    out: list[str] = []
    unreadable: list[InputError] = []

    def cannot_list(exc: OSError) -> None:  # (os.walk would skip the folder: its manifests taken for gone)
        if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
            return  # gone (or made a file) while the walk went on: as if listed a moment later
        unreadable.append(InputError(Location(exc.filename or str(root_path)),
                                     f"cannot read this directory: {exc.strerror or exc}"))

    for dirpath, dirnames, filenames in os.walk(root_path, onerror=cannot_list):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        if linked_dirs is not None:
            linked_dirs += [os.path.join(dirpath, d) for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        for name in sorted(filenames):
            if not name.startswith(".") and name.endswith(SUFFIXES):
                out.append(os.path.join(dirpath, name))
    if unreadable:
        raise InputErrors(unreadable)
    return out


_NODE_KIND = re.compile(r"^[ \t-]*kind:[ \t]*[\"']?Node[\"']?[ \t]*(#.*)?$" r'|"kind"\s*:\s*"Node"', re.M)


def linked_dir_warning(path: str) -> InputWarning:
    return InputWarning(Location(path), "a symbolic link to a directory: not followed, its manifests are not read "
                                        "(link the files, or copy the directory)")


def may_hold_a_node(path: str) -> bool:
    """Whether a file that does not parse may still hold a Node object (its text says
    `kind: Node`), or cannot be read at all."""
    try:
        return _NODE_KIND.search(read_bytes(path).decode("utf-8", "replace")) is not None
    except InputError:
        return True


def load_file(path: str, docs: list[Any] | None = None, share_keys: bool = False,
              errors: list[InputError] | None = None) -> LoadResult:
    """Parse one manifest file into SourceObjects; raises InputError on syntax errors, and on the
    first object that is none of ours to read (no kind, apiVersion or name we take). With
    `errors`, those objects' errors go there instead and the file's other objects are read (a
    one-shot command reports all that is wrong at once; the watched directory holds a file with
    an error back whole). `docs`: the file's documents when they were already parsed (see
    parse_files). `share_keys`: see fastyaml.load_all (for bodies kept alive long: the daemon's)."""
    result = LoadResult()
    if docs is None:
        docs = _parse(path, share_keys)
    locator = _FileLocator(path, len(docs))
    for doc_index, doc in enumerate(docs):
        if doc is None:
            continue
        for item_path, obj in _expand(doc):
            try:
                _collect(path, locator, doc_index, item_path, obj, result)
            except InputError as exc:
                if errors is None:
                    raise
                errors.append(exc)
    return result


def parse_files(paths: list[str]) -> list[list[Any] | None]:
    """Each file's documents as plain data, or None where that failed (load_file then reads the
    file again and reports the error). Runs in a worker process: everything it returns pickles."""
    out: list[list[Any] | None] = []
    for path in paths:
        try:
            out.append(_parse(path))
        except Exception:  # noqa: BLE001 - any failure: the caller parses this file itself
            out.append(None)
    return out


_NOT_REGULAR = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"))


def read_bytes(path: str) -> bytes:
    """A manifest file's bytes; InputError for anything but a regular file (a FIFO, a socket or a
    device named x.yaml is refused before it is opened, and opened without blocking in case one
    took the file's place meanwhile), or one that cannot be read (a link to nothing is named so):
    never an OSError."""
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISREG(mode):
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as fh:  # bytes, decoded at once: no incremental decoder per file
                mode = os.fstat(fd).st_mode
                if stat.S_ISREG(mode):
                    return fh.read()
    except FileNotFoundError as exc:
        try:
            target = os.readlink(path)
        except OSError:
            raise InputError(Location(path), f"cannot read: {exc}") from exc
        raise InputError(Location(path), f"a symbolic link to nothing ({target})") from exc
    except OSError as exc:
        raise InputError(Location(path), f"cannot read: {exc}") from exc
    kind = next((what for test, what in _NOT_REGULAR if test(mode)), "not a file")
    raise InputError(Location(path), f"not a regular file ({kind}): manifests are read from files only")


def _parse(path: str, share_keys: bool = False) -> list[Any]:
    """The documents of one file (InputError naming the place of a syntax error)."""
    try:
        raw = read_bytes(path)
        text = _text(raw)
    except UnicodeDecodeError as exc:
        raise InputError(undecodable_at(path, raw, exc), f"not UTF-8 text (byte 0x{raw[exc.start]:02x}): manifests are read as UTF-8 (or "
                              "UTF-16 with a byte order mark), as kubectl reads them") from exc
    try:
        if path.endswith(".json"):
            text = text.removeprefix("\ufeff")  # a byte order mark, as YAML files may have too
            try:
                return [json.loads(text, object_pairs_hook=_unique_keys)] if text.strip() else []
            except _DuplicateKey:  # (the YAML reader, which JSON is a part of, names its place)
                return _load_yaml(text, share_keys)
        return _load_yaml(text, share_keys)
    except json.JSONDecodeError as exc:
        raise InputError(Location(path, exc.lineno, exc.colno), f"invalid JSON: {exc.msg}") from exc
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        loc = Location(path, mark.line + 1, mark.column + 1) if mark else Location(path)
        what = "JSON" if path.endswith(".json") else "YAML"
        raise InputError(loc, f"invalid {what}: {exc.problem or exc.context}") from exc
    except YAMLError as exc:
        raise InputError(Location(path), f"invalid YAML: {exc}") from exc


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused when a key is in it twice (json.loads keeps the last one; the API
    server and kubectl refuse it, as the YAML reader here does)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _DuplicateKey
    return out


def _load_yaml(text: str, share_keys: bool = False) -> list[Any]:
    """Fast path first; ruamel.yaml's loaders have the final word (and the precise error marks)."""
    try:
        return fastyaml.load_all(text, share_keys)
    except fastyaml.AmbiguousNumber:
        raise
    except (fastyaml.Unsupported, YAMLError):
        pass
    try:
        return list(YAML(typ="safe", pure=False).load_all(text))
    except YAMLError:
        # libyaml speaks YAML 1.1 (e.g. no ':' inside flow scalars such as [fd00::1]); the pure
        # loader is YAML 1.2.
        return list(YAML(typ="safe", pure=True).load_all(text))


def _expand(doc: Any, at: Path = ()) -> Iterable[tuple[Path, Any]]:
    """Yield (path within the document, object) for a document or a kind: List (Lists inside
    Lists too). The items of a typed list (ServiceList, ...) as the API serves it have no
    apiVersion or kind of their own: they are the list's (kind without "List")."""
    kind = doc.get("kind") if isinstance(doc, dict) else None
    if isinstance(kind, str) and kind.endswith("List") and isinstance(doc.get("items"), list):
        typed = kind[:-len("List")] if kind != "List" else None
        for i, item in enumerate(doc["items"]):
            if typed and isinstance(item, dict) and "kind" not in item and "apiVersion" not in item:
                item = {"apiVersion": doc.get("apiVersion"), "kind": typed, **item}
            yield from _expand(item, (*at, "items", i))
    else:
        yield at, doc


def _collect(path: str, locator: _FileLocator, doc_index: int, item_path: Path, obj: Any,
             result: LoadResult) -> None:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    ident = ((obj.get("kind"), meta.get("namespace"), meta["name"])
             if isinstance(meta, dict) and isinstance(meta.get("name"), str) else None)

    def locate(p: Path, _ip: Path = item_path) -> Location:
        return locator.locate(doc_index, _ip, p, ident)

    if not isinstance(obj, dict):
        raise InputError(locate(()), f"expected a Kubernetes object (a mapping), got {type_name(type(obj))}")
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    for key, value in (("apiVersion", api_version), ("kind", kind)):
        if value is not None and not isinstance(value, str):
            raise InputError(locate((key,)), f"expected string, got {type_name(type(value))}", (key,))
    if kind in _IGNORED_QUIETLY:
        return
    if (api_version, kind) not in _ACCEPTED:
        if kind in KINDS and _group(api_version) not in _OUR_GROUPS:  # (a custom resource of that
            result.warnings.append(InputWarning(locate(()), f"skipping {api_version} {kind}: not the "  # name)
                                                f"Kubernetes {kind}"))
            return
        if kind in KINDS:
            expected = " or ".join(sorted(v for v, k in _ACCEPTED if k == kind))
            if api_version is None:
                raise InputError(locate(()), f"{kind} without apiVersion (expected {expected})", ("apiVersion",))
            raise InputError(locate(("apiVersion",)), f"unsupported apiVersion {api_version!r} for {kind} "
                             f"(expected {expected})", ("apiVersion",))
        proper = next((k for k in KINDS if isinstance(kind, str) and k.lower() == kind.lower()
                       and (api_version, k) in _ACCEPTED), None)
        if proper is not None:  # (skipped with a warning, a Service written `kind: service` went unnoticed)
            raise InputError(locate(("kind",)), f"unknown kind {kind!r}: kinds are case-sensitive (did you mean "
                             f"{proper}?)", ("kind",))
        what = (f"unsupported kind {api_version}/{kind}" if api_version is not None and kind is not None
                else f"a document with apiVersion {api_version} and no kind" if api_version is not None
                else f"kind {kind} without apiVersion" if kind is not None
                else "a document without apiVersion and kind (no Kubernetes object)")
        result.warnings.append(InputWarning(locate(()), f"skipping {what}"))
        return
    if meta is not None and not isinstance(meta, dict):
        raise InputError(locate(("metadata",)), f"expected a mapping, got {type_name(type(meta))}", ("metadata",))
    if isinstance(meta, dict) and meta.get("name") is not None and not isinstance(meta["name"], str):
        raise InputError(locate(("metadata", "name")), f"expected string, got {type_name(type(meta['name']))}",
                         ("metadata", "name"))
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str) or not meta["name"]:
        raise InputError(locate(("metadata",)), "is required", ("metadata", "name"))
    namespace = "" if kind == "Node" else meta.get("namespace") or "default"
    if not isinstance(namespace, str):
        raise InputError(locate(("metadata", "namespace")), f"expected string, got {type_name(type(namespace))}",
                         ("metadata", "namespace"))
    result.objects.append(SourceObject(kind, namespace, meta["name"], obj, Location(path), locate))


def load_directory(root: str | os.PathLike[str], pool: Executor | None = None,
                   after: Future[Any] | None = None) -> LoadResult:
    """Load every manifest under root; collects all syntax errors and rejects duplicates.

    With `pool` (the one-shot commands' process pool, see reconcile.plan_against_kernel) and many
    files, the pool's worker parses the second half of the files, chunk by chunk from the end,
    while this process parses from the start and itself parses every chunk not done by the time
    it gets there (it never waits). Reading and parsing 10k files takes ~1.2 s on one core with
    the cyclic GC off as one-shot commands run (yaml-rs; ~2.6 s with libyaml's events). The
    worker reads the kernel first (`after`: the chunks are given to it once that is done, only
    those this process has not reached): a short read (an empty kernel, a cold apply) leaves it
    most of the half to parse; a long one (a no-op plan at 10k services) none, and its core to
    the kernel tool, which a second worker parsing at once would share, and no chunk queued for
    nothing behind it.
    """
    result = LoadResult()
    errors: list[InputError] = []
    linked: list[str] = []
    files = manifest_files(root, linked)
    result.warnings += [linked_dir_warning(d) for d in linked]
    chunks: dict[int, Future[list[list[Any] | None]]] = {}
    to_give = (list(reversed(range(len(files) // 2, len(files), PARALLEL_CHUNK)))
               if pool is not None and len(files) >= PARALLEL_MIN_FILES else [])

    def give(reached: int) -> None:  # (the chunks this process has not reached, to the idle worker)
        assert pool is not None
        try:
            for start in to_give:
                if start > reached:
                    chunks[start] = pool.submit(parse_files, files[start:start + PARALLEL_CHUNK])
        except RuntimeError as exc:  # (the worker died, BrokenProcessPool, or the pool is shut: parsed here)
            log.debug("parsing every manifest here: %s", exc)
        to_give.clear()

    parsed: dict[str, list[Any] | None] = {}
    for i, path in enumerate(files):
        if to_give and (after is None or (i % 32 == 0 and after.done())):
            give(i)
        if i in chunks:
            parsed = {}
            if chunks[i].done() and not chunks[i].cancelled() and chunks[i].exception() is None:
                parsed = dict(zip(files[i:i + PARALLEL_CHUNK], chunks[i].result()))
            else:  # not done yet (or the worker died): parsed here rather than waited for
                chunks[i].cancel()
        try:
            part = load_file(path, parsed.get(path), errors=errors)  # (an object's error: the others read)
        except InputError as exc:
            errors.append(exc)
            continue
        result.objects.extend(part.objects)
        result.warnings.extend(part.warnings)
    errors.extend(duplicate_errors(result.objects))
    if errors:
        failed = InputErrors(errors)
        failed.loaded = result  # type: ignore[attr-defined]  # what did load (see reconcile.load_desired)
        raise failed
    return result


def duplicate_errors(objects: Iterable[SourceObject]) -> list[InputError]:
    """One error per object defined twice (same kind/namespace/name), naming both places."""
    seen: dict[tuple[str, str, str], SourceObject] = {}
    errors = []
    for obj in objects:
        first = seen.setdefault((obj.kind, obj.namespace, obj.name), obj)
        if first is not obj:
            ident = f"{obj.kind} {obj.namespace + '/' if obj.namespace else ''}{obj.name}"
            errors.append(InputError(obj.where(()), f"duplicate {ident}, first defined at {first.where(())}"))
    return errors

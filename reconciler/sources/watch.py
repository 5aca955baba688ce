"""A watched manifest directory: watchfiles events + a per-file cache of parsed results.

The watcher thread only records which paths changed and calls `on_change`; the daemon's loop
then calls `snapshot()`, which re-reads just the files that were added or modified (by event,
or because their stat signature changed: that also catches ConfigMap-style symlink swaps and
missed events) and drops the deleted ones. Everything else comes from the cache.

Writers that change several files at once are given the time to finish:
* a change is handed on once the directory has been quiet for STEP_MS (at most DEBOUNCE_MS
  into a continuous burst);
* while git holds its index lock (a checkout, pull or merge writing the work tree),
  snapshot() waits for it, up to LOCK_WAIT_SECONDS (a lock left behind by a crashed git is
  then warned about once and no longer waited for);
* hidden paths (.git, an editor's .swp) wake no one; `..`-prefixed ones do (a ConfigMap
  volume's `..data` swap);
* the root itself is followed when it is replaced (`git-sync --link` swapping a symlink,
  `rm -rf` + a new clone): the watch starts again on what the path now names.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Container, Iterable

from .manifests import SUFFIXES, LoadResult, duplicate_errors, linked_dir_warning, load_file, manifest_files
from .objects import InputError, InputErrors, InputWarning, SourceObject, name_some

log = logging.getLogger(__name__)

LOGGED_PATHS = 10  # files a log line names (a first start or a big pull: 10k names, ~1 MB a line)

Signature = tuple[int, int, int, int]
Identity = tuple[str, int, int]  # the root's real path, st_dev, st_ino

STEP_MS = 20  # quiet time before a change is handed on (watchfiles' step)
DEBOUNCE_MS = 1600  # the most a continuous burst is held for (watchfiles' debounce)
ROOT_CHECK_MS = 1000  # how often, with no events, the root's identity is checked
POLL_DELAY_MS = 300  # when inotify cannot be used (its limits reached): how often the tree is scanned
WATCH_RETRY_MAX = 30.0  # the longest wait before a watch that failed is tried again
LOCK_WAIT_SECONDS = 10.0
LOCK_POLL_SECONDS = 0.05


@dataclass
class _Entry:
    signature: Signature | None
    result: LoadResult | None = None
    error: InputError | None = None
    held: int = 0  # objects of the file's last read without an error


@dataclass
class Snapshot:
    """The directory's content: objects and warnings of the readable files, every error
    (syntax errors per file, then duplicates). `changed` is False when nothing was re-read
    or dropped since the previous snapshot; added_objects/removed_objects say what changed."""

    objects: list[SourceObject] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    errors: list[InputError] = field(default_factory=list)
    changed: bool = True
    reread: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    # what changed since the previous snapshot (None when the source cannot tell)
    added_objects: list[SourceObject] | None = None
    removed_objects: list[SourceObject] | None = None
    # every error is a file that could not be read, whose objects are left out: the rest is a
    # consistent input (not so with duplicates, or with the directory itself gone)
    skippable: bool = False
    stopped: bool = False  # a stop came while git wrote the tree: nothing was read (build nothing)


def _signature(path: str) -> Signature | None:
    try:
        st = os.stat(path)  # follows symlinks: a swapped target changes the signature
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)


_REMOVED: Identity = ("", -1, -1)  # the watched root was removed: whatever is there next is new


def _hidden(rel: str) -> bool:
    return any(part.startswith(".") for part in rel.split(os.sep))


def _identity(path: str) -> Identity | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (os.path.realpath(path), st.st_dev, st.st_ino)


def _inotify_exhausted(exc: Exception) -> bool:
    """watchfiles' error when fs.inotify.max_user_watches or max_user_instances is reached."""
    return isinstance(exc, OSError) and (exc.errno in (errno.ENOSPC, errno.EMFILE)
                                         or "watch limit" in str(exc))


def _git_dir(root: str) -> str | None:
    """The git directory of the work tree `root` is in, if any (`.git` a folder, or a file
    naming one, as in worktrees and submodules)."""
    folder = os.path.realpath(root)
    while True:
        dot_git = os.path.join(folder, ".git")
        if os.path.isdir(dot_git):
            return dot_git
        if os.path.isfile(dot_git):
            try:
                with open(dot_git, encoding="utf-8") as fh:
                    line = fh.readline().strip()
            except OSError:
                return None
            if line.startswith("gitdir:"):
                return os.path.join(folder, line[len("gitdir:"):].strip())
            return None
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


class DirectorySource:
    """Manifests under `root`, kept current by a watchfiles thread."""

    kind = "directory"
    deltas = True  # snapshot(objects=False) + added_objects/removed_objects: O(changes)

    def __init__(self, root: str, on_change: Callable[[], None] | None = None, *,
                 debounce_ms: int = DEBOUNCE_MS, step_ms: int = STEP_MS, root_check_ms: int = ROOT_CHECK_MS,
                 lock_wait: float = LOCK_WAIT_SECONDS, force_polling: bool | None = None,
                 stop_event: threading.Event | None = None) -> None:
        self.root = os.path.abspath(root)
        self._on_change = on_change
        self._debounce = debounce_ms
        self._step = step_ms
        self._root_check = root_check_ms
        self._lock_wait = lock_wait
        self._stale_lock: tuple[int, int] | None = None  # (st_ino, st_mtime_ns) of a lock given up on
        self._force_polling = force_polling
        self._lock = threading.Lock()
        self._cache: dict[str, _Entry] = {}
        self._dirty: set[str] = set()
        self._stop = stop_event or threading.Event()  # (the caller's: it ends a wait for git too)
        self._thread: threading.Thread | None = None
        self._first = True
        self._linked_dirs: list[InputWarning] = []  # (found by the last walk of the tree)
        self.waited_for_git = 0.0  # seconds the last snapshot waited for git's index lock
        self._rescan = False  # see rescan()
        self._files: set[str] | None = None  # manifest files as of the last snapshot
        self._dirs: set[str] = set()  # the folders those are in (and were in since the last walk)
        self._keys: dict[tuple[str, str, str], SourceObject] | None = None  # for duplicate checks
        self._unreleased: list[SourceObject] = []  # read since the last release_bodies()
        self._errors: dict[str, InputError] = {}  # per file, kept current as files are re-read
        self._warnings: dict[str, list[str]] = {}
        self.failures = 0

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        if not os.path.isdir(self.root):
            raise InputError(self.root, "no such directory")
        self._thread = threading.Thread(target=self._watch, name="watch-manifests", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def ready(self) -> bool:
        return True

    def node(self, name: str) -> dict | None:
        """This node's Node object if the directory has one."""
        with self._lock:
            for e in self._cache.values():
                for o in (e.result.objects if e.result else ()):
                    if o.kind == "Node" and o.name == name:
                        return dict(o.body)
        return None

    def release_bodies(self, keep: Container[int] = (), built: Container[int] = ()) -> None:
        """The caller has built every object of the last snapshot (desired.BuildCache keeps what
        it parsed, keyed by object identity): drop the bodies of the Services and EndpointSlices
        read since the last call, but those whose id() is in `keep` (not built yet). O(objects
        read since then). Node bodies stay (see node())."""
        released, self._unreleased = self._unreleased, []
        for obj in released:
            if id(obj) in keep:
                self._unreleased.append(obj)
            elif obj.kind != "Node":
                obj.release_body()

    # -- watching ------------------------------------------------------------------------

    def _visible(self, _change: object, path: str) -> bool:
        """watchfiles' filter: no hidden path under the root, but `..` ones (a ConfigMap's swap)."""
        rel = path[len(self.root) + 1:] if path.startswith(self.root + os.sep) else ""
        return not any(part.startswith(".") and not part.startswith("..") for part in rel.split(os.sep))

    def _watch(self) -> None:
        import watchfiles

        watched: Identity | None = None  # what the path named when the current watch began
        failed, said = 0, ""  # watches in a row that failed; the last failure logged
        while not self._stop.is_set():
            now = _identity(self.root)
            if now is None or not os.path.isdir(self.root):
                self._stop.wait(self._root_check / 1000)  # gone: wait for it to come back
                continue
            anew = watched is not None and now != watched
            if anew:
                log.info("%s now is %s: watching it", self.root, now[0])
                self._mark_root_dirty()
            watched = now
            try:
                for changes in watchfiles.watch(self.root, watch_filter=self._visible, debounce=self._debounce,
                                                step=self._step, stop_event=self._stop,
                                                rust_timeout=self._root_check, yield_on_timeout=True,
                                                raise_interrupt=False, force_polling=self._force_polling,
                                                poll_delay_ms=POLL_DELAY_MS):
                    failed, said = 0, ""  # (it watches: at least every ROOT_CHECK_MS)
                    if anew:  # (what changed before this watch began is read too)
                        anew = False
                        self._mark_root_dirty()
                    if changes:
                        paths = {os.path.abspath(p) for _, p in changes}
                        if log.isEnabledFor(logging.DEBUG):
                            log.debug("manifest changes: %s",
                                      name_some(sorted(f"{c.name} {p}" for c, p in changes), LOGGED_PATHS))
                        with self._lock:
                            self._dirty |= paths
                        self._notify()
                        if (watchfiles.Change.deleted, self.root) in changes:
                            watched = _REMOVED  # (a new one may already be there, even with its inode)
                            break
                    if _identity(self.root) != watched:
                        break  # replaced or gone: the watch still follows the old directory
            except Exception as exc:  # noqa: BLE001 - e.g. the directory vanished: retry
                if self._stop.is_set():
                    break
                if _identity(self.root) == watched:  # (not because the root was replaced)
                    self.failures += 1
                    self._mark_root_dirty()
                    if not self._force_polling and _inotify_exhausted(exc):
                        log.warning("watching %s with inotify failed: %s; polling it every %d ms instead",
                                    self.root, exc, POLL_DELAY_MS)
                        self._force_polling = True
                        continue
                    # retried 1 s, 2 s, ... 30 s later; said once while it fails the same way (a
                    # folder without read permission: not two lines a second for as long as it lasts)
                    delay = min(WATCH_RETRY_MAX, 2.0 ** min(failed, 10))
                    failed += 1
                    level = logging.WARNING if str(exc) != said else logging.DEBUG
                    said = str(exc)
                    log.log(level, "watching %s failed: %s; retrying in %gs", self.root, exc, delay)
                    self._stop.wait(delay)
                    continue
            if self._stop.is_set():
                break
            if _identity(self.root) is None:
                log.info("%s is gone; waiting for it to come back", self.root)
                self._mark_root_dirty()
                watched = _REMOVED  # (what comes back may have the same inode: still a new one)

    def _mark_root_dirty(self) -> None:
        with self._lock:
            self._dirty.add(self.root)
        self._notify()

    def _notify(self) -> None:
        if self._on_change is not None:
            try:
                self._on_change()
            except Exception:  # noqa: BLE001 - a bad callback must not kill the watcher
                log.exception("on_change callback failed")

    # -- reading -------------------------------------------------------------------------

    def rescan(self) -> None:
        """The next snapshot walks the whole tree and compares every file (SIGHUP)."""
        self._rescan = True

    def _only_files(self, dirty: set[str]) -> bool:
        """True when every changed path is a manifest file (added, modified or deleted): then
        only those are looked at, not the whole tree."""
        if self._rescan:
            self._rescan = False
            return False
        if self._first or not dirty or self._files is None:
            return False
        for path in dirty:
            rel = os.path.relpath(path, self.root)
            if rel == "." or rel.startswith(".."):
                return False
            parts = rel.split(os.sep)
            if any(part.startswith("..") for part in parts):
                return False  # a ConfigMap volume's ..data swap (anywhere): what its links name changed
            if any(part.startswith(".") for part in parts):
                continue  # hidden: never read (an editor's temporary file, a .git folder)
            if self._through_link(parts):
                if path.endswith(SUFFIXES):  # not read from there (the walk does not follow the link);
                    return False  # a file of ours may link to it, though: the walk compares them all
                continue
            if path in self._dirs or os.path.isdir(path):
                return False  # a folder: new, or one that held manifests (gone, renamed, replaced);
                # other files are irrelevant (a README, an editor's temporary file)
        return True

    def _through_link(self, parts: list[str]) -> bool:
        """Whether a path under the root (its parts) lies in a folder reached through a symbolic
        link, which the walk does not follow (the watcher may: inotify follows them)."""
        folder = self.root
        for part in parts[:-1]:
            folder = os.path.join(folder, part)
            if os.path.islink(folder):
                return True
        return False

    @staticmethod
    def _listed(path: str) -> bool:
        """Whether the walk lists this path as a file: anything there but a folder (a FIFO or a
        symbolic link to nothing is read as an error then, not taken for a file removed)."""
        return os.path.lexists(path) and not os.path.isdir(path)

    def _add_dirs(self, files: Iterable[str]) -> None:
        for path in files:
            folder = os.path.dirname(path)
            while folder not in self._dirs and len(folder) > len(self.root):
                self._dirs.add(folder)
                folder = os.path.dirname(folder)

    def snapshot(self, objects: bool = True) -> Snapshot:
        """Bring the cache up to date (re-reading only added/modified files) and return it all
        (with objects=False, all but the full object list: the changes are in added_objects and
        removed_objects).

        When the watcher named only manifest files, only those are checked: the cost follows the
        change, not the tree. Otherwise (start, periodic resync, directories) the tree is walked.
        """
        # (before taking the changes: those made meanwhile come too; after a wait, the tree is
        # walked: the watcher may still hold back the events of git's last writes)
        began, self.waited_for_git = time.monotonic(), 0.0
        waited = self._wait_for_git()
        self.waited_for_git = time.monotonic() - began if waited is not False else 0.0
        if waited is None:  # stopping while git writes the tree: nothing of it is read
            log.info("stopping while git holds the index lock of %s: its changes are not read", self.root)
            return Snapshot(changed=False, added_objects=[], removed_objects=[], stopped=True)
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        walked: list[str] | None = None  # the tree's manifest files in walk order, when walked
        linked_before = self._linked_dirs  # (a walk replaces the list)
        present: set[str] = set()  # the manifest files the watcher named that are there
        if not waited and self._only_files(dirty):
            assert self._files is not None
            # (none is under a linked folder: _only_files walks the tree for those)
            check = {p for p in dirty if p.endswith(SUFFIXES) and not _hidden(os.path.relpath(p, self.root))}
            present = {p for p in check if self._listed(p)}
            self._files |= present  # in place: O(changes)
            self._files -= check - present
            self._add_dirs(present)
        else:
            linked: list[str] = []
            try:
                walked = manifest_files(self.root, linked)
                self._linked_dirs = [linked_dir_warning(d) for d in linked]
            except (InputError, InputErrors) as exc:  # the directory itself is gone, or a folder in it cannot
                # be listed: an input error, not "empty"
                self._first = True  # whatever comes back next is a change
                self._files = None
                return Snapshot(errors=list(exc.errors) if isinstance(exc, InputErrors) else [exc], changed=True,
                                added_objects=[], removed_objects=[])
            check = None
            self._files = set(walked)
            self._dirs = set()
            self._add_dirs(walked)
        files = self._files

        def ordered() -> list[str]:
            return walked if walked is not None else sorted(files)

        current = files if check is None else present  # of the files looked at, those there
        reread: list[str] = []
        removed: list[str] = []
        old_entries: dict[str, _Entry | None] = {}
        with self._lock:
            for path in list(self._cache) if check is None else [p for p in check if p in self._cache]:
                if path not in current:
                    old_entries[path] = self._cache[path]
                    del self._cache[path]
                    removed.append(path)
        for path in walked if walked is not None else sorted(present):
            sig = _signature(path)
            with self._lock:
                entry = self._cache.get(path)
            if entry is not None and entry.signature == sig and sig is not None and path not in dirty:
                continue
            old_entries.setdefault(path, entry)
            new = _Entry(sig)
            try:
                new.result = load_file(path, share_keys=True)  # kept until built: RSS counts
                self._unreleased += new.result.objects
                new.held = len(new.result.objects)
                if entry is not None and entry.held and not new.held:  # (a template that wrote nothing, a
                    log.warning("%s holds no object any more (it held %d): removing them",  # write cut short)
                                path, entry.held)
            except InputError as exc:
                new.error = exc
                new.held = entry.held if entry is not None else 0  # (what is kept meanwhile)
            reread.append(path)
            with self._lock:
                self._cache[path] = new
        # (a link to a folder made or gone changes no file, but its warning is news)
        changed = bool(reread or removed) or self._first or self._linked_dirs != linked_before
        self._first = False
        snap = Snapshot(changed=changed, reread=reread, removed=removed, added_objects=[], removed_objects=[])
        with self._lock:
            for path, old in old_entries.items():
                if old is not None and old.result is not None:
                    snap.removed_objects += old.result.objects  # type: ignore[operator]
                self._errors.pop(path, None)
                self._warnings.pop(path, None)
                e = self._cache.get(path)
                if e is None:
                    continue
                if e.error is not None:
                    self._errors[path] = e.error
                elif e.result is not None:
                    snap.added_objects += e.result.objects  # type: ignore[operator]
                    if e.result.warnings:
                        self._warnings[path] = e.result.warnings
            order = ordered() if objects else sorted(set(self._errors) | set(self._warnings))
            snap.errors = [self._errors[p] for p in order if p in self._errors]
            snap.warnings = [*self._linked_dirs, *(w for p in order for w in self._warnings.get(p, ()))]

        @functools.cache  # the object list and the duplicate check may both need it
        def all_objects() -> list[SourceObject]:
            with self._lock:
                entries = [self._cache.get(path) for path in ordered()]
            return [o for e in entries if e is not None and e.error is None and e.result is not None
                    for o in e.result.objects]

        if objects:
            snap.objects = all_objects()
        duplicates = self._duplicates(all_objects, check, old_entries)
        snap.skippable = bool(snap.errors) and not duplicates
        snap.errors.extend(duplicates)
        return snap

    def _wait_for_git(self) -> bool | None:
        """While git holds the index lock of the work tree the root is in, it may be writing
        files: wait, up to lock_wait (polling), then read anyway. A lock held that long (a long
        git command, or one that crashed) is warned about once, and not waited for again. True
        when it waited; None when a stop ended the wait (the tree is not to be read: git may be
        half-way)."""
        git_dir = _git_dir(self.root)
        if git_dir is None:
            return False
        lock = os.path.join(git_dir, "index.lock")
        waited = 0.0
        while True:
            try:
                st = os.stat(lock)
            except OSError:
                return waited > 0
            held = (st.st_ino, st.st_mtime_ns)
            if held == self._stale_lock:
                return waited > 0
            if waited >= self._lock_wait:
                self._stale_lock = held
                log.warning("%s has been held for %gs (a long git command, or one that crashed): reading %s "
                            "anyway, and not waiting for this lock again; if no git runs there, remove it",
                            lock, self._lock_wait, self.root)
                return True
            if self._stop.wait(LOCK_POLL_SECONDS):
                return None
            waited += LOCK_POLL_SECONDS

    def _duplicates(self, all_objects: Callable[[], list[SourceObject]], check: set[str] | None,
                    old_entries: dict[str, _Entry | None]) -> list[InputError]:
        """duplicate_errors(all objects), in O(changed files) when only some files changed."""
        index = self._keys
        if check is None or index is None:
            objects = all_objects()
            errors = duplicate_errors(objects)
            self._keys = None if errors else {(o.kind, o.namespace, o.name): o for o in objects}
            return errors
        for path, old in old_entries.items():
            for o in (old.result.objects if old is not None and old.result else ()):
                if index.get((o.kind, o.namespace, o.name)) is o:
                    del index[(o.kind, o.namespace, o.name)]
        for path in old_entries:
            entry = self._cache.get(path)
            for o in (entry.result.objects if entry is not None and entry.result else ()):
                if index.setdefault((o.kind, o.namespace, o.name), o) is not o:
                    self._keys = None
                    return duplicate_errors(all_objects())
        return []

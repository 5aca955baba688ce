"""One `reconciler run` per network namespace: two would undo each other's syncs at every resync.

`run` holds an exclusive lock (flock) on /run/service-reconciler-netns-<inode>.lock, the inode being
that of the network namespace it programs, with its pid in it; a second `run` there exits, naming
the first. `apply` and `cleanup` only look: they warn that the running one will put its own state
back. Where /run is not writable (a container's read-only root: one pod per node anyway), there is
no lock, and nothing is said.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from typing import IO

log = logging.getLogger(__name__)

LOCK_DIR = "/run"


class AlreadyRunning(Exception):
    """Another `reconciler run` holds the lock of this network namespace."""

    def __init__(self, path: str, holder: str):
        super().__init__(f"another `reconciler run`{f' (pid {holder})' if holder else ''} already programs this "
                         f"network namespace (it holds {path}); two would undo each other's changes")


def lock_path(lock_dir: str | None = None) -> str | None:
    try:
        inode = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return None
    return os.path.join(lock_dir or LOCK_DIR, f"service-reconciler-netns-{inode}.lock")


def acquire(lock_dir: str | None = None) -> IO[str] | None:
    """The lock, held until release() (None: no lock can be made here). Raises AlreadyRunning when
    another process holds it."""
    path = lock_path(lock_dir)
    if path is None:
        return None
    for _ in range(3):  # (a holder that ended removes the file: one opened before then is no lock)
        try:
            fh = open(path, "a+")
        except OSError as exc:
            log.debug("no instance lock (%s): %s", path, exc)
            return None
        if not _lock(fh):
            fh.seek(0)
            pid = fh.read().strip()
            fh.close()
            raise AlreadyRunning(path, pid)
        try:
            same = os.stat(path).st_ino == os.fstat(fh.fileno()).st_ino
        except OSError:
            same = False
        if same:
            fh.seek(0)
            fh.truncate()
            fh.write(f"{os.getpid()}\n")
            fh.flush()
            return fh
        fh.close()
    return None


def _lock(fh: IO[str], tries: int = 5) -> bool:
    """flock(LOCK_EX) without waiting, tried a few times 20 ms apart: holder() takes the lock
    shared for a moment, which is no other run."""
    for attempt in range(tries):
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            if attempt + 1 < tries:
                time.sleep(0.02)
    return False


def release(fh: IO[str] | None) -> None:
    """Give the lock up, removing its file while it is still this one (/run keeps no file per
    namespace that has gone)."""
    if fh is None:
        return
    try:
        if os.stat(fh.name).st_ino == os.fstat(fh.fileno()).st_ino:
            os.unlink(fh.name)
    except OSError:
        pass
    fh.close()


def holder(lock_dir: str | None = None) -> str | None:
    """The pid of the `reconciler run` programming this network namespace ("" when it wrote none),
    or None when none does (or no lock can be looked at here)."""
    path = lock_path(lock_dir)
    if path is None or not os.path.exists(path):
        return None
    try:
        with open(path) as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                return fh.read().strip()
            return None  # (nobody holds it: a run that ended)
    except OSError:
        return None

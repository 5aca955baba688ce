"""The only place that talks to nftables: read our tables as text, run one atomic transaction.

Transactions go through `nft -f`, except small ones (the run loop's incremental syncs), which
go through libnftables in this process: no process start (see diff.script for how their text
spares nft a read of the whole ruleset). Big transactions keep using `nft -f`: whatever memory
nft needs to parse them goes away with the process. Reads run `nft list table` children, several
at once (one at a time beside other work, see observe.each_table).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import threading
import time
from typing import Any, NamedTuple

from ..base import KernelError, SpooledInput, run_tool
from ..generation import CommitWatch, commits_between, generation, list_tables, own_ports

log = logging.getLogger(__name__)

IN_PROCESS_MAX_BYTES = 256 * 1024  # bigger transactions run in an `nft -f` child


def nft_binary() -> str:
    path = shutil.which("nft")
    if not path:
        raise KernelError("nft not found: install the nftables package")
    return path


# nfgen family numbers (NFPROTO_*) -> nft's family names
_NFPROTO = {1: "inet", 2: "ip", 3: "arp", 5: "netdev", 7: "bridge", 10: "ip6"}


def existing_tables() -> set[tuple[str, str]] | None:
    """(family, name) of every nftables table in this namespace, from one netlink dump of the
    tables alone (generation.list_tables); None when netlink cannot be asked (then look table by
    table).

    `nft list tables` cannot stand in: nft 1.0.6 fetches every table's contents for it (26 s next
    to a 10k-service iptables-nft ruleset), and `nft list table` costs a process and ~7 ms of
    cache fetching per name."""
    tables = list_tables()
    if tables is None:
        log.debug("listing nftables tables over netlink failed: asking for each table")
        return None
    return {(_NFPROTO.get(family, str(family)), name) for family, name in tables}


def list_table(family: str, name: str) -> str | None:
    """`nft list table FAMILY NAME` (the text nft prints), or None when the table does not exist.

    Text, not `-j`: nft takes the same time for both, and parsing the text costs a sixth of
    parsing the JSON (10k services, our 17 tables: 0.38 s against 2.5 s)."""
    proc = run_tool([nft_binary(), "list", "table", family, name])
    if proc.returncode != 0:
        if "No such file or directory" in proc.stderr or "does not exist" in proc.stderr:
            return None
        raise KernelError(f"nft list table {family} {name}: {proc.stderr.strip()}")
    return proc.stdout


class Ran(NamedTuple):
    seconds: float  # what nft took
    # the ruleset generation the transaction produced ([] when it changed nothing; None when not
    # known: see run_script)
    generations: list[int] | None


def spooled_script() -> SpooledInput:
    """Somewhere to write a transaction's text (diff.script's `out`) for run_script."""
    return SpooledInput(IN_PROCESS_MAX_BYTES, _ALWAYS_CHANGES)


def run_script(script: str | SpooledInput) -> Ran:
    """Run `script` as one atomic transaction, all or nothing (`nft -f` semantics), and tell
    which generation its commit produced.

    In process, the commit is told from anybody else's by the socket that made it (see
    CommitWatch). An `nft -f` child is not watched (while anybody listens, the kernel announces
    each object a commit changes: 10k services, ~130k of them); its commit is the one between
    the generation before it and the one after it, when they are consecutive and the script is
    certain to commit (see certain_to_commit): one transaction, one commit, nobody else's beside it.
    """
    spooled = script if isinstance(script, SpooledInput) else None
    size = spooled.size if spooled is not None else len(script)
    if not (size if spooled is not None else script.strip()):  # (a text of blanks commits nothing)
        return Ran(0.0, [])
    start = time.monotonic()
    generations: list[int] | None = None
    if size <= IN_PROCESS_MAX_BYTES and _LIBNFT.available():
        how, (error, seen) = "libnftables", _LIBNFT.run(spooled.text() if spooled is not None else script)
        if seen is not None:
            ours = own_ports()
            generations = [g for g, port in seen if port in ours]
    else:
        certain = spooled.noticed if spooled is not None else certain_to_commit(script)
        before = generation() if certain else None
        proc = run_tool([nft_binary(), "-f", "-"], script)
        how, error = "nft -f", proc.stderr.strip() if proc.returncode != 0 else None
        generations = commits_between(before, generation() if before is not None and error is None else None, 1)
    elapsed = time.monotonic() - start
    if error is not None:
        raise KernelError(f"nft -f failed (nothing was changed): {error}")
    log.debug("%s: %d characters in %.4fs", how, size, elapsed)
    return Ran(elapsed, generations)


# commands that change the ruleset whenever their transaction succeeds: a rule added is always a
# new one (also inside a chain block: `add chain T C {` and a rule on each tab-indented line, as
# diff.script writes them); deleting or creating what is not there (is there) fails the whole
# transaction. (An `add` of a table, set or element that exists may change nothing: no commit.)
_ALWAYS_CHANGES = re.compile(
    r"^(?:(?:add rule|insert rule|replace rule|delete|create) "
    r"|add chain [^\n{]*\{\n\t(?!(?:type|policy|comment|devices|flags) ))", re.MULTILINE)


def certain_to_commit(script: str) -> bool:
    """Whether `script`, if it succeeds, surely commits (bumps the generation): it holds a
    command that always changes the ruleset. Then a generation that moved by exactly one across
    it moved by its commit alone."""
    return _ALWAYS_CHANGES.search(script) is not None


class _LibNftables:
    """libnftables.so.1 (the library behind `nft`, shipped with it) through ctypes: one context
    per network namespace, used under a lock (a context is not thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lib: Any = None
        self._loaded = False
        self._ctx: int | None = None
        self._netns: int | None = None
        self._watch: CommitWatch | None = None

    def available(self) -> bool:
        if not self._loaded:
            self._loaded = True
            if os.environ.get("RECONCILER_NFT_IN_PROCESS", "1") == "0":
                return False
            try:
                lib = ctypes.CDLL("libnftables.so.1")
            except OSError:
                return False
            lib.nft_ctx_new.restype = ctypes.c_void_p
            lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
            lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
            lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
            lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
            lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
            self._lib = lib
        return self._lib is not None

    def run(self, script: str) -> tuple[str | None, list[tuple[int, int]] | None]:
        """Run the script: (the error text when it failed, else None; the commits announced
        meanwhile, see CommitWatch.leave: None when not heard)."""
        with self._lock:
            ctx = self._context()
            watch = self._watch if self._watch is not None and self._watch.join() else None
            rc = self._lib.nft_run_cmd_from_buffer(ctx, script.encode())
            seen = watch.leave() if watch is not None else None
            self._lib.nft_ctx_get_output_buffer(ctx)  # reading a buffer empties it
            if rc != 0:
                err = (self._lib.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace").strip()
                return err or f"libnftables returned {rc}", seen
            self._lib.nft_ctx_get_error_buffer(ctx)
            return None, seen

    def _context(self) -> int:
        netns = os.stat("/proc/thread-self/ns/net").st_ino  # a context's socket stays where it was made
        if self._ctx is None or netns != self._netns:
            if self._ctx is not None:
                self._lib.nft_ctx_free(self._ctx)
            if self._watch is not None:
                self._watch.close()
            try:
                self._watch = CommitWatch()  # (made here: it hears the commits of this namespace)
            except OSError:
                self._watch = None
            ctx = self._lib.nft_ctx_new(0)
            if not ctx:
                raise KernelError("libnftables: cannot create a context")
            self._lib.nft_ctx_buffer_output(ctx)
            self._lib.nft_ctx_buffer_error(ctx)
            self._ctx, self._netns = ctx, netns
        return self._ctx


_LIBNFT = _LibNftables()

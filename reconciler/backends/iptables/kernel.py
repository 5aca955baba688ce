"""The only place that runs iptables tools: pick the flavour, read tables, run one restore.

Flavour (nft or legacy) is detected the way kubernetes-sigs/iptables-wrappers does it: nft when the
nft mangle table (IPv4, then IPv6) holds kubelet's KUBE-IPTABLES-HINT or KUBE-KUBELET-CANARY chain;
otherwise legacy when the legacy tables hold one; otherwise nft. RECONCILER_IPTABLES_FLAVOUR=nft|legacy
(or IptablesBackend(flavour=...)) overrides it. Binaries are then always the explicit
`iptables-nft-save`, `ip6tables-legacy-restore`, ... never the `iptables` alternative.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from typing import Callable, Iterator, TypeVar

from .. import base
from ..base import KernelError, run_tool

log = logging.getLogger(__name__)
T = TypeVar("T")

FLAVOURS = ("nft", "legacy")
FLAVOUR_ENV = "RECONCILER_IPTABLES_FLAVOUR"
HINT_CHAINS = ("KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY")  # kubelet's marks, in the mangle table
_HINT = re.compile(rf"^:({'|'.join(HINT_CHAINS)})\b", re.M)
RESTORE_WAIT = ("-w", "5")  # 1.8.x: -W (wait interval) is deprecated and ignored, legacy warns about it


def binary(cmd: str, flavour: str, tool: str) -> str:
    """`iptables-nft-save` etc.: cmd iptables|ip6tables, tool save|restore."""
    name = f"{cmd}-{flavour}-{tool}"
    path = shutil.which(name)
    if not path:
        raise KernelError(f"{name} not found: install the iptables package (>= 1.8.4)")
    return path


def detect_flavour() -> str:
    """The flavour the node's own tools use (as iptables-wrapper decides): the one whose mangle
    table holds one of kubelet's hint chains, nft first; with neither, nft unless only legacy
    is installed. RECONCILER_IPTABLES_FLAVOUR forces one."""
    forced = os.environ.get(FLAVOUR_ENV, "").strip().lower()
    if forced:
        if forced not in FLAVOURS:
            raise KernelError(f"{FLAVOUR_ENV}={forced!r}: expected one of {', '.join(FLAVOURS)}")
        return forced
    have_nft = shutil.which("iptables-nft-save") is not None
    have_legacy = shutil.which("iptables-legacy-save") is not None
    if have_nft:
        for cmd, family in (("iptables", "ip"), ("ip6tables", "ip6")):
            if _has_nft_hint(cmd, family):
                return "nft"
    if have_legacy:
        for cmd in ("iptables", "ip6tables"):
            # all tables, not -t mangle: that would load (create) the legacy mangle table
            if shutil.which(f"{cmd}-legacy-save") and _HINT.search(run_tool([f"{cmd}-legacy-save"]).stdout):
                return "legacy"
    if not have_nft and have_legacy:
        return "legacy"
    return "nft"


def _has_nft_hint(cmd: str, family: str) -> bool:
    """Whether the family's nft mangle table holds a hint chain, asked read-only: `nft list chain`
    of each by name fetches that chain alone. `<cmd>-nft-save -t mangle` (without nft) fetches
    every table (10k services: 0.8 s); `<cmd>-nft -S CHAIN` is no query before iptables 1.8.7,
    which adds mangle's built-in chains first."""
    nft = shutil.which("nft")
    if nft is None:
        return shutil.which(f"{cmd}-nft-save") is not None and bool(
            _HINT.search(run_tool([f"{cmd}-nft-save", "-t", "mangle"]).stdout))
    return any(run_tool([nft, "list", "chain", family, "mangle", chain]).returncode == 0 for chain in HINT_CHAINS)


def read_save(cmd: str, flavour: str, parse: Callable[[Iterator[str]], T]) -> T:
    """parse(lines of `<cmd>-<flavour>-save`, all tables) while the tool still writes them: the
    output text is never whole in memory (10k services: 24 MB). A table that is not there is
    simply not in the output; KernelError when the tool fails (whatever parse made of its output).

    All tables, not `-t`: the nft flavour fetches every table whatever `-t` says (10k services:
    `-t nat` then `-t filter` 2.85 s, all at once 2 s), and the legacy one would load a table
    it is asked for. A tool still running after TOOL_TIMEOUT seconds is killed: KernelError."""
    argv = [binary(cmd, flavour, "save")]
    with tempfile.TemporaryFile("w+") as err:
        try:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True)
        except OSError as exc:
            raise KernelError(f"{argv[0]}: {exc}") from None
        assert proc.stdout is not None
        killed = threading.Event()

        def kill() -> None:
            if proc.poll() is None:  # (not a tool that has ended while we still parse its output)
                killed.set()
                proc.kill()

        timeout = base.TOOL_TIMEOUT
        watchdog = threading.Timer(timeout, kill)
        watchdog.daemon = True
        watchdog.start()
        with proc:
            try:
                result: T | None = parse(proc.stdout)
                failure: Exception | None = None
            except Exception as exc:  # noqa: BLE001 - reported below unless the tool itself failed
                result, failure = None, exc
            for _ in proc.stdout:  # whatever parse left (it stops early on an error)
                pass
        watchdog.cancel()
        err.seek(0)
        stderr = err.read()
    if killed.is_set():
        raise base.timed_out(argv, timeout)
    if proc.returncode != 0:
        raise KernelError(f"{cmd}-{flavour}-save exited {proc.returncode}: {stderr.strip()}")
    if failure is not None:
        raise failure
    return result  # type: ignore[return-value]


def restore(cmd: str, flavour: str, lines: list[str]) -> float:
    """Run the input `lines` with `<cmd>-<flavour>-restore --noflush -w 5`; returns the seconds it
    took.

    Each table (between `*table` and `COMMIT`) is committed atomically; on failure the tool reports
    the failing line: that table and those after it are left unchanged, those before it were
    committed (the error says which).
    """
    if not any(line.strip() for line in lines):
        return 0.0
    argv = [binary(cmd, flavour, "restore"), "--noflush", *RESTORE_WAIT]
    start = time.monotonic()
    proc = run_tool(argv, lines)
    elapsed = time.monotonic() - start
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip() or (
            f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}")
        excerpt = "" if "xtables lock" in proc.stderr else f"\n--- input ---\n{_excerpt(lines, proc.stderr)}"
        committed = _committed(cmd, lines, proc.stderr)
        error = KernelError(f"{' '.join(argv)} failed: {said}\n{committed}{excerpt}")
        error.partial = "nothing was committed" not in committed
        raise error
    log.debug("%s-restore (%s): %d lines in %.4fs", cmd, flavour, len(lines), elapsed)
    return elapsed


def _failed_line(stderr: str) -> int | None:
    """The input line a restore's error names ('... line N', 'Error occurred at line: N')."""
    m = re.search(r"line:? (\d+)", stderr)
    return int(m.group(1)) if m else None


def _committed(cmd: str, lines: list[str], stderr: str) -> str:
    """What a failed restore had committed: the tables whose COMMIT line came before the line it
    failed at."""
    if "xtables lock" in stderr:  # ("Another app is currently holding the xtables lock"): before any table
        return f"{cmd}: nothing was committed (it did not get the xtables lock)"
    failed = _failed_line(stderr)
    if failed is None:
        return f"{cmd}: which of its tables were committed is not known (no line in the error)"
    table, done = "", []
    for line in lines[:failed - 1]:
        text = line.strip()
        if text.startswith("*"):
            table = text[1:]
        elif text == "COMMIT":
            done.append(table)
    if not done:
        return f"{cmd}: nothing was committed"
    return f"{cmd}: committed before it failed: table {', '.join(done)}; not the rest"


def _excerpt(lines: list[str], stderr: str) -> str:
    """The input around the line restore complained about ('... failed ... line N')."""
    n = _failed_line(stderr)
    if n is None:
        return "\n".join(lines[:20]) + ("\n..." if len(lines) > 20 else "")
    return "\n".join(f"{i + 1:5d} {lines[i]}" for i in range(max(0, n - 4), min(len(lines), n + 2)))

"""A throwaway network namespace for one test: made with `lo` up; afterwards, even when the test
fails, every process left inside is killed and the namespace deleted (a process inside would keep
it alive). The e2e lab (tests/e2e/lab.py) builds a whole topology of them the same way."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager


def skip_reason(*tools: str) -> str | None:
    """Why a namespace test cannot run here (for pytest.skip), or None."""
    if os.geteuid() != 0:
        return "needs root (creates network namespaces)"
    for tool in ("ip", *tools):
        if shutil.which(tool) is None:
            return f"needs `{tool}` on PATH"
    return None


def listed() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10, check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


@contextmanager
def throwaway(name: str) -> Iterator[str]:
    """`ip netns add NAME` (replacing a leftover of a killed run), yielded; removed afterwards."""
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10, check=False)
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, timeout=10)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, capture_output=True, timeout=10)
        yield name
    finally:
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=10,
                              check=False).stdout
        for pid in pids.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10, check=False)
        assert name not in listed(), f"network namespace {name} survived its test"

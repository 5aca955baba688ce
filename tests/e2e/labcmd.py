"""Checked subprocess helpers for the e2e lab (raise with command + stderr)."""

from __future__ import annotations

import functools
import subprocess
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor


class CommandError(RuntimeError):
    """A lab command failed; carries the argv, exit code and stderr."""

    def __init__(self, argv: Sequence[str], returncode: int, stdout: str, stderr: str,
                 stdin: str | None = None) -> None:
        self.argv, self.returncode, self.stdout, self.stderr = list(argv), returncode, stdout, stderr
        msg = f"command failed (rc={returncode}): {' '.join(argv)}\nstderr: {stderr.strip()}"
        if stdin:
            msg += f"\nstdin:\n{stdin.rstrip()}"
        super().__init__(msg)


def run(argv: Sequence[str], *, input: str | None = None, check: bool = True,
        timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (bounded by ``timeout``); raise CommandError on failure if ``check``."""
    try:
        cp = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise CommandError(argv, -1, "", f"timed out after {timeout}s", input) from exc
    if check and cp.returncode != 0:
        raise CommandError(argv, cp.returncode, cp.stdout, cp.stderr, input)
    return cp


def ns_argv(ns: str | None, argv: Sequence[str]) -> list[str]:
    """``argv`` prefixed to run inside netns ``ns`` (or unchanged if ``ns`` is None)."""
    return list(argv) if ns is None else ["ip", "netns", "exec", ns, *argv]


def ip_batch(ns: str | None, lines: Sequence[str], *, force: bool = False) -> None:
    """Run iproute2 commands (one per line, without the leading ``ip``) in one process."""
    if not lines:
        return
    argv = ["ip"] + (["-n", ns] if ns else []) + (["-force"] if force else []) + ["-batch", "-"]
    run(argv, input="\n".join(lines) + "\n", check=not force)


def run_all(calls: Sequence[Callable[[], object]]) -> None:
    """Run callables concurrently; after ALL finished, re-raise the first error."""
    with ThreadPoolExecutor(max_workers=max(1, len(calls))) as pool:
        futures = [pool.submit(c) for c in calls]
    for fut in futures:
        fut.result()


def parallel(groups: Sequence[Sequence[tuple[list[str], str | None]]]) -> None:
    """Run each group's (argv, stdin) commands in order, groups concurrently."""
    def _group(cmds: Sequence[tuple[list[str], str | None]]) -> None:
        for argv, stdin in cmds:
            run(argv, input=stdin)

    run_all([functools.partial(_group, g) for g in groups if g])

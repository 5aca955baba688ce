"""run_tool: a kernel tool's input and output go through files in memory, not pipes."""

from __future__ import annotations

import sys

import pytest

from reconciler.backends.base import KernelError, run_tool

ECHO = "import sys; data = sys.stdin.read(); sys.stdout.write(data * 3); sys.stderr.write(f'{len(data)} read'); sys.exit(7)"


def test_output_bigger_than_a_pipe_and_the_exit_code_come_back_whole():
    text = "".join(f"line {i}\n" for i in range(200_000))  # ~2 MB in, ~6 MB out
    proc = run_tool([sys.executable, "-c", ECHO], text)
    assert proc.returncode == 7
    assert proc.stdout == text * 3
    assert proc.stderr == f"{len(text)} read"


def test_input_given_as_lines_ends_each_with_a_newline():
    proc = run_tool([sys.executable, "-c", ECHO], [f"rule {i}" for i in range(20_000)])
    assert proc.stdout.splitlines()[:3] == ["rule 0", "rule 1", "rule 2"]
    assert proc.stdout.count("\n") == 60_000


def test_no_input_reads_nothing_and_a_missing_tool_is_a_kernel_error():
    assert run_tool([sys.executable, "-c", ECHO]).stderr == "0 read"  # stdin is empty, not inherited
    with pytest.raises(KernelError, match="no-such-tool"):
        run_tool(["/nonexistent/no-such-tool"])

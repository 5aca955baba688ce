"""benchmarks/run.py, loaded under its own name: tests check that it reads what the kernel modules log."""

from __future__ import annotations

import importlib.util
import os
import sys

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "run.py")
_spec = importlib.util.spec_from_file_location("benchmark_run", _PATH)
assert _spec is not None and _spec.loader is not None
_module = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _module  # (its dataclasses look themselves up there)
_spec.loader.exec_module(_module)

tool_seconds = _module.tool_seconds
sync_tool_seconds = _module.sync_tool_seconds
split_iptables_script = _module.split_iptables_script

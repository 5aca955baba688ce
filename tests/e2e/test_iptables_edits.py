"""iptables: a long shared chain (RECONCILER-SERVICES with dozens of services) is edited in place
with -D/-I by the real iptables-restore, and the result is what was planned (apply, asked to
verify by reading the kernel back, and a plan afterwards find nothing left) and still carries
traffic."""

from __future__ import annotations

import re

import pytest

from benchmark_log import tool_seconds
from manifests import common_flags, eps, reconciler, svc, write_state
from traffic import outcomes

pytestmark = pytest.mark.e2e

HTTP = [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]


def docs(indices) -> list[dict]:
    out = []
    for i in indices:
        out += [svc(f"s{i}", [f"10.96.7.{i + 1}"], HTTP), eps(f"s{i}", ["pod1"])]
    return out


def test_long_chain_edited_in_place_then_verified(lab, tmp_path):
    src = str(tmp_path / "state")
    write_state(src, docs(range(40)))
    try:
        reconciler(lab, "apply", *common_flags(src, "iptables"))
        write_state(src, docs([i for i in range(41) if i != 17]))  # one service goes, one comes
        proc = reconciler(lab, "apply", *common_flags(src, "iptables"), "-v", "--read-back")
        assert "Verified by reading the kernel back." in proc.stdout
        out = proc.stdout
        assert tool_seconds(proc.stderr.splitlines()) > 0  # restore's own time, as the benchmark reads it
        assert "-D RECONCILER-SERVICES -d 10.96.7.18/32" in out
        assert re.search(r"-I RECONCILER-SERVICES \d+ -d 10\.96\.7\.41/32", out)
        assert ":RECONCILER-SERVICES - [0:0]" not in out  # not rewritten
        again = reconciler(lab, "plan", *common_flags(src, "iptables"), check=False)
        assert again.returncode == 0, again.stdout
        assert outcomes(lab.tcp("node", "10.96.7.41", 80, count=3)) == {"ok": 3}
        assert outcomes(lab.tcp("node", "10.96.7.18", 80, count=1, timeout=1)) != {"ok": 1}
    finally:
        reconciler(lab, "cleanup", "--mode", "iptables", check=False)

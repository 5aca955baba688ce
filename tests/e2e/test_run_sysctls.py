"""`reconciler run` sets kube-proxy's conntrack sysctls at start, in a throwaway network namespace
(the TCP/UDP timeouts and be_liberal are per namespace; nf_conntrack_max is the host's, read-only
outside the initial namespace: a warning, and proxying goes on), also behind a read-only /proc/sys
as a non-privileged container has (warnings; with the host's net.netfilter mounted elsewhere and
--conntrack-sysctl-dir, as deploy/kubernetes/daemonset.yaml does: set)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests import netns as throwaway_netns  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

NF = "/proc/sys/net/netfilter"
FLAGS = ["--conntrack-tcp-timeout-established", "2h", "--conntrack-tcp-timeout-close-wait", "10m",
         "--conntrack-tcp-be-liberal", "--conntrack-udp-timeout", "45s", "--conntrack-udp-timeout-stream", "3m"]
PER_NS = {"nf_conntrack_tcp_timeout_established": 7200, "nf_conntrack_tcp_timeout_close_wait": 600,
          "nf_conntrack_tcp_be_liberal": 1, "nf_conntrack_udp_timeout": 45, "nf_conntrack_udp_timeout_stream": 180}
SERVICE = """apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80, protocol: TCP}]
"""
# a non-privileged container's /proc/sys: read-only (runc bind-mounts it so)
READ_ONLY_PROC_SYS = "mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys"


@pytest.fixture
def netns() -> Iterator[str]:
    reason = throwaway_netns.skip_reason("nft", "unshare", "mount")
    if reason or not os.path.exists(f"{NF}/nf_conntrack_max"):
        pytest.skip(reason or "nf_conntrack is not loaded")
    with throwaway_netns.throwaway(f"srsysctl{os.getpid()}") as name:
        yield name


def sysctls(ns: str | None, names: Any) -> dict[str, int]:
    prefix = ["ip", "netns", "exec", ns] if ns else []
    cp = subprocess.run([*prefix, "sh", "-c", 'cd "$0" && cat "$@"', NF, *names], capture_output=True, text=True,
                        timeout=10, check=True)
    return dict(zip(names, map(int, cp.stdout.split())))


def run_until_first_sync(ns: str, tmp_path: Path, flags: list[str], setup: str = "") -> list[dict[str, Any]]:
    """`reconciler run` in `ns` (in a mount namespace of its own, after the shell commands `setup`)
    until its first sync is done, then SIGTERM: its JSON log records."""
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    (state / "web.yaml").write_text(SERVICE)
    log_path = tmp_path / f"run{len(list(tmp_path.glob('run*.log')))}.log"
    argv = [sys.executable, "-m", "reconciler", "run", "--source", str(state), "--node-name", "node-a",
            "--cluster-cidr", "10.244.0.0/16", "--healthz-bind-address", "127.0.0.1:10256",
            "--metrics-bind-address", "127.0.0.1:10249", "--log-format", "json", *flags]
    script = f'{setup + " && " if setup else ""}exec "$@"'
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "-m", "sh", "-c", script, "sh", *argv],
                                stdout=log_file, stderr=subprocess.STDOUT, cwd=str(ROOT))
    try:
        deadline = time.monotonic() + 30
        while '"msg": "sync full' not in log_path.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()
            time.sleep(0.05)
        assert '"msg": "sync full' in log_path.read_text(), log_path.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]


def ruleset(ns: str) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "ruleset"], capture_output=True, text=True,
                          timeout=10, check=True).stdout


def messages(records: list[dict[str, Any]], level: str) -> list[str]:
    return [r["msg"] for r in records if r["level"] == level]


def test_run_sets_the_per_namespace_sysctls_and_warns_about_the_hosts_table_size(netns: str, tmp_path: Path) -> None:
    host_before = sysctls(None, [*PER_NS, "nf_conntrack_max"])
    before = sysctls(netns, [*PER_NS, "nf_conntrack_max"])
    assert {k: v for k, v in before.items() if k in PER_NS} != PER_NS
    table = before["nf_conntrack_max"] + 65536  # more than there is: to be raised (1 per CPU: the floor it is)
    records = run_until_first_sync(netns, tmp_path, [*FLAGS, "--conntrack-max-per-core", "1",
                                                     "--conntrack-min", str(table)])
    after = sysctls(netns, [*PER_NS, "nf_conntrack_max"])
    assert {k: v for k, v in after.items() if k in PER_NS} == PER_NS
    info = [m for m in messages(records, "info") if m.startswith("conntrack sysctls set: ")]
    assert len(info) == 1 and all(f"net.netfilter.{k}={v}" in info[0] for k, v in PER_NS.items()), records
    read_only_here = subprocess.run(["ip", "netns", "exec", netns, "stat", "-c", "%a", f"{NF}/nf_conntrack_max"],
                                    capture_output=True, text=True, timeout=10).stdout.strip() == "444"
    if read_only_here:  # (Linux: global sysctls are read-only outside the initial namespace)
        assert after["nf_conntrack_max"] == before["nf_conntrack_max"]
        assert any(m.startswith(f"cannot set net.netfilter.nf_conntrack_max to {table} ") and "Permission denied" in m
                   and m.endswith("proxying goes on without it (conntrack.maxPerCore: 0 leaves it alone)")
                   for m in messages(records, "warning")), records
    else:
        assert after["nf_conntrack_max"] == table
    assert "10.96.0.10" in ruleset(netns)  # proxying went on
    assert sysctls(None, [*PER_NS, "nf_conntrack_max"]) == host_before  # nothing leaked to the host


def test_read_only_proc_sys_is_warned_about_and_a_mount_of_the_hosts_is_written(netns: str, tmp_path: Path) -> None:
    host_before = sysctls(None, PER_NS)
    before = sysctls(netns, PER_NS)
    flags = [*FLAGS, "--conntrack-max-per-core", "0"]  # (the table size: the test above)
    records = run_until_first_sync(netns, tmp_path, flags, setup=READ_ONLY_PROC_SYS)
    assert sysctls(netns, PER_NS) == before
    warnings = messages(records, "warning")
    for name, value in PER_NS.items():
        assert any(m.startswith(f"cannot set net.netfilter.{name} to {value} (it is {before[name]}): ")
                   and "Read-only file system" in m and m.endswith("see --conntrack-sysctl-dir)")
                   for m in warnings), records
    assert not any(m.startswith("conntrack sysctls set") for m in messages(records, "info"))
    assert "10.96.0.10" in ruleset(netns)  # proxying went on

    # as deploy/kubernetes/daemonset.yaml: the host's net.netfilter mounted read-write elsewhere
    mount = tmp_path / "host-netfilter"
    mount.mkdir()
    records = run_until_first_sync(netns, tmp_path, [*flags, "--conntrack-sysctl-dir", str(mount)],
                                   setup=f"mount --bind {NF} {mount} && {READ_ONLY_PROC_SYS}")
    assert sysctls(netns, PER_NS) == PER_NS  # (the writer's namespace's values, whichever mount it writes through)
    assert not messages(records, "warning"), records
    assert sysctls(None, PER_NS) == host_before

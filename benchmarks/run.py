"""Benchmarks: S services x E endpoints, per backend, in private network namespaces.

    sudo .venv/bin/python benchmarks/run.py                       # 1k, 5k, 10k x 10 and 2k x 50
    sudo .venv/bin/python benchmarks/run.py --sizes 1000x10 --backends nftables

For every size and backend it measures, with the reconciler's own CLI in a fresh namespace:
cold apply, no-op plan, one endpoint changed (plan, then apply), one service added (apply), and the
`run` daemon: time from a file change to the kernel updated, and its peak RSS, starting on a kernel
already programmed (warm) and on an empty one (cold start: a node's first start; also the time
from the start to that first sync done, which programs everything) (cold apply
RSS: the largest of the command and its children, which at 10k is `nft -f` itself), and a periodic
resync: while nobody else commits (the ruleset generation vouches for the kernel: no read) and
right after somebody else's commit (it reads the kernel back; against the read floor).
Beside each figure it prints the floor measured in the same run: the kernel tool alone doing the
same work on exactly the input we generate. Cold apply: `nft -f` / `iptables-restore` of our
ruleset into an empty namespace (load); cold apply and load are medians of three, taken in turn. Plan: `nft list table` of each of our tables / one
`iptables-save` per family of what our apply programmed (read); the no-op plan and the read are
medians of three, taken in turn. A change (apply, `run`): the tool's own time for our
transaction, which the commands log with -v, plus (apply) the read before planning. Apply
verifies by the ruleset generation (nobody else committed meanwhile), which needs no read; an
apply that read the kernel back all the same is named under the table. A cold start: load, as
cold apply.
Before measuring, it writes to every page of up to 8 GiB of free memory once (--warm-memory): on a
virtual machine, a page the guest has not touched yet costs a fault in the host on first use, and
beside a process of ours holding ~500 MiB `nft -f` gets such pages while the floor, run alone,
reuses the pages its predecessor freed (10k x 10: `nft -f` 3.8 s instead of 2.4 s beside a
600 MiB process; 2.6 s once 6 GiB had been touched). A node that has been up a while has touched
its memory; a freshly booted VM has not.
Nothing here is a test: it prints a table (and --json FILE writes the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from generate import generate, service_yaml  # noqa: E402
from installed import compile_package  # noqa: E402

PY = sys.executable
NODE = "node-0"
FLAGS = ["--node-name", NODE, "--cluster-cidr", "10.128.0.0/12", "-v"]  # -v: the kernel tool's own time is logged
# what our kernel modules log (debug) after each transaction: the kernel tool's time for exactly our input
TOOL_LINE = re.compile(r"(?:libnftables|nft -f|ip6?tables-restore \(\w+\)): .* in ([0-9.]+)s$")


@dataclass
class Row:
    size: str
    backend: str
    figures: dict[str, Any] = field(default_factory=dict)


class Netns:
    def __init__(self, tag: str):
        self.name = f"bench-{os.getpid() % 10000}-{tag}"
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        self.run(["ip", "link", "set", "lo", "up"])

    def argv(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv: list[str], input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(argv), input=input, capture_output=True, text=True, check=check)

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], check=False)


def reconciler(*args: str) -> list[str]:
    return [PY, "-m", "reconciler", *args]


def timed(ns: Netns, argv: list[str]) -> float:
    t = time.monotonic()
    proc = subprocess.run(ns.argv(argv), capture_output=True, text=True)
    seconds = time.monotonic() - t
    if proc.returncode not in (0, 2):
        raise RuntimeError(f"{' '.join(argv[:6])} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return seconds


def kernel_script(state_dir: str, mode: str) -> dict[str, str]:
    """The exact cold-start input we generate for the kernel tool, per tool invocation."""
    from reconciler.backends import get_backend
    from reconciler.config import Options
    from reconciler.reconcile import load_desired

    opts = Options(mode=mode, node_name=NODE, cluster_cidrs=("10.128.0.0/12",))
    backend = get_backend(mode)
    desired = load_desired(state_dir, opts)
    model = backend.render(desired)
    if mode == "nftables":
        from reconciler.backends.nftables.objects import Ruleset
        return {"nft": backend.script(backend.diff(model, Ruleset()))}
    empty = type(model)() if callable(type(model)) else None
    ops = backend.diff(model, empty)
    return split_iptables_script(backend.script(ops))


def split_iptables_script(text: str) -> dict[str, str]:
    """The iptables backend's script is one restore input per family, each after a '# <cmd>' line."""
    parts: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines(keepends=True):
        m = re.match(r"# (ip6?tables)[\w-]*restore", line)
        if m:
            current = parts[m.group(1)] = []
        elif current is not None:
            current.append(line)  # (+= on a dict's string copied it: 10k services, 2 minutes)
    return {cmd: "".join(lines) for cmd, lines in parts.items()}


def load_floor(mode: str, scripts: dict[str, str]) -> float:
    """`nft -f` / `<fam>-restore` of exactly our generated ruleset into an empty namespace."""
    ns = Netns("floor")
    try:
        if mode == "nftables":
            return timed_input(ns, ["nft", "-f", "-"], scripts["nft"])
        return sum(timed_input(ns, [f"{fam}-restore", "--noflush", "-w", "5"], text) for fam, text in scripts.items())
    finally:
        ns.close()


def read_floor(ns: Netns, mode: str) -> float:
    """The kernel tool reading back what the namespace holds, as a plan needs it."""
    t = time.monotonic()
    if mode == "nftables":
        # `nft list table` of each of our tables, one after the other (what observe runs; `list
        # ruleset` is slower for many tables, so it would flatter us)
        from reconciler.backends.nftables.observe import table_names
        for family in ("ip", "ip6"):
            for name in table_names():
                ns.run(["nft", "list", "table", family, name], check=False)
    else:
        for fam in ("iptables", "ip6tables"):  # one save of all tables per family, as a plan reads
            ns.run([f"{fam}-save"])  # (the nft flavour fetches every table even for `-t`)
    return time.monotonic() - t


def timed_input(ns: Netns, argv: list[str], text: str) -> float:
    t = time.monotonic()
    ns.run(argv, input=text)
    return time.monotonic() - t


def change_one_endpoint(state_dir: str, services: int, endpoints: int, index: int) -> None:
    i = services // 2
    path = os.path.join(state_dir, f"ns{i % 50}", f"svc{i}.yaml")
    with open(path + ".tmp", "w") as fh:
        fh.write(service_yaml(i, endpoints, ep_offset=7_000_000 + index))
    os.replace(path + ".tmp", path)


def add_service(state_dir: str, endpoints: int, index: int) -> str:
    i = 60000 + index
    path = os.path.join(state_dir, "added", f"svc{i}.yaml")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as fh:
        fh.write(service_yaml(i, endpoints).replace(f"ns{i % 50}", "added"))
    os.replace(path + ".tmp", path)
    return path


READ_SAMPLES = 3  # no-op plan and read floor: medians, each plan followed by a read (the machine is noisy)


COLD_SAMPLES = 3  # cold apply and load floor: medians, taken in turn (the kernel's own noise is ~±15%)


def cold_apply(state_dir: str, mode: str) -> float:
    """One more cold apply, into a namespace of its own (bench_cli's is the last sample)."""
    ns = Netns("cold")
    try:
        return measure(ns, reconciler("apply", "--source", state_dir, "--mode", mode, *FLAGS))[0]
    finally:
        ns.close()


def bench_cli(state_dir: str, mode: str, services: int, endpoints: int,
              earlier_colds: list[float] | None = None) -> dict[str, Any]:
    ns = Netns("cli")
    f: dict[str, Any] = {}
    common = ["--source", state_dir, "--mode", mode, *FLAGS]
    try:
        cold, f["cold apply RSS MiB"], _ = measure(ns, reconciler("apply", *common))
        f["cold apply"] = statistics.median([*(earlier_colds or []), cold])
        plans, reads = [], []
        for _ in range(READ_SAMPLES):
            plans.append(measure(ns, reconciler("plan", *common), expect=0)[0])
            reads.append(read_floor(ns, mode))  # what our apply programmed: the same ruleset
        f["no-op plan"], f["floor: read"] = statistics.median(plans), statistics.median(reads)
        change_one_endpoint(state_dir, services, endpoints, 1)
        f["1 endpoint: plan"], _, _ = measure(ns, reconciler("plan", *common), expect=2)
        f["1 endpoint: apply"], _, f["1 endpoint: apply, tool"] = measure(ns, reconciler("apply", *common))
        added = add_service(state_dir, endpoints, 1)
        f["+1 service: apply"], _, f["+1 service: apply, tool"] = measure(ns, reconciler("apply", *common))
        for label in ("1 endpoint: apply", "+1 service: apply"):
            logged(f[label + ", tool"], label)
        os.unlink(added)
        f["run"] = bench_run(ns, state_dir, mode, services, endpoints)
        f["run"].update(bench_resync(ns, state_dir, mode))
    finally:
        ns.close()
    f["run"].update(bench_run_cold(state_dir, mode))
    return f


# Runs a command and reports its wall time and peak RSS. The command must be forked from a process
# that has been small all its life: a child's ru_maxrss counts the memory of the process it was
# forked from (with vfork even that process's peak), and this benchmark renders 10k services itself.
_LAUNCHER = """
import os, sys, time
report = int(sys.argv[1])
t = time.monotonic()
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
os.write(report, f"{time.monotonic() - t} {usage.ru_maxrss}".encode())
code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""


def measure(ns: Netns, argv: list[str], expect: int | None = None) -> tuple[float, float, float]:
    """Wall seconds and peak RSS (MiB) of one command (and the children it waited for) in the
    namespace, and the seconds its kernel transactions took in the kernel tool (as it logs them).
    An apply that verified by reading the kernel back (the generation could not vouch for its
    transaction) is counted in READ_BACKS: its floor has no read-back in it."""
    r, w = os.pipe()
    try:
        proc = subprocess.Popen([PY, "-c", _LAUNCHER, str(w), *ns.argv(argv)], pass_fds=(w,),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(w)
    with ThreadPoolExecutor(max_workers=1) as reader:  # drained meanwhile: a full pipe would stall it
        stderr = reader.submit(proc.stderr.read) if proc.stderr else None
        status = proc.wait()
        err = stderr.result() if stderr else ""
    with os.fdopen(r) as fh:
        report = fh.read().split()
    if status not in (0, 2) or (expect is not None and status != expect) or len(report) != 2:
        raise RuntimeError(f"{' '.join(argv[:6])} exited {status}: {err[-3000:]}")
    if argv[argv.index("reconciler") + 1:argv.index("reconciler") + 2] == ["apply"] and VERIFIED_LINE not in err:
        READ_BACKS.append(" ".join(argv))
    return float(report[0]), int(report[1]) / 1024, tool_seconds(err.splitlines())


VERIFIED_LINE = "verified by the ruleset generation"  # apply's debug line (-v)
READ_BACKS: list[str] = []


def logged(seconds: float, what: str) -> float:
    """A change's tool time, which must have been logged (else its floor would quietly be wrong)."""
    if seconds <= 0:
        raise RuntimeError(f"{what}: no kernel transaction logged (run with -v? log format changed?)")
    return seconds


def tool_seconds(messages: list[str]) -> float:
    """The kernel tool's time summed over the transactions these log messages report."""
    return sum(float(m.group(1)) for m in map(TOOL_LINE.search, messages) if m)


def run_argv(state_dir: str, mode: str, sync_period: str = "1h") -> list[str]:
    return reconciler("run", "--source", state_dir, "--mode", mode, *FLAGS, "--log-format", "json",
                      "--sync-period", sync_period, "--min-sync-period", "0s",
                      "--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0")


def daemon_peak_rss(proc: subprocess.Popen[str]) -> float:
    with open(f"/proc/{proc.pid}/status") as fh:  # `ip netns exec` execs: this is the daemon
        return int(re.search(r"VmHWM:\s+(\d+)", fh.read()).group(1)) / 1024


def stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def bench_run_cold(state_dir: str, mode: str) -> dict[str, float]:
    """`reconciler run` starting on an empty kernel (a node's first start: its first sync programs
    everything, where the other run figures start on a kernel already programmed): time from the
    start to that sync done, and peak RSS. NaNs (and a message) when that run fails."""
    ns = Netns("runcold")
    proc: subprocess.Popen[str] | None = None
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        try:
            t = time.time()
            proc = subprocess.Popen(ns.argv(run_argv(state_dir, mode)), stdout=log, stderr=log, text=True)
            done = wait_for_syncs(log.name, 1, timeout=600, proc=proc)
            return {"cold start": done - t, "cold start RSS MiB": daemon_peak_rss(proc)}
        except (RuntimeError, OSError, AttributeError) as exc:
            print(f"run from an empty kernel failed: {exc}", file=sys.stderr)
            return {"cold start": float("nan"), "cold start RSS MiB": float("nan")}
        finally:
            if proc is not None:
                stop(proc)
            ns.close()


def bench_run(ns: Netns, state_dir: str, mode: str, services: int, endpoints: int) -> dict[str, Any]:
    """`reconciler run`: event -> kernel latency for one endpoint change and one added service."""
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen(ns.argv(run_argv(state_dir, mode)), stdout=log, stderr=log, text=True)
    out: dict[str, Any] = {}
    try:
        wait_for_syncs(log.name, 1, timeout=600, proc=proc)
        for label, action in (("1 endpoint", lambda k: change_one_endpoint(state_dir, services, endpoints, 10 + k)),
                              ("+1 service", lambda k: add_service(state_dir, endpoints, 10 + k))):
            samples, tool = [], []
            for k in range(5):
                n = count_syncs(log.name)
                time.sleep(0.3)
                t = time.time()
                action(k)
                done = wait_for_syncs(log.name, n + 1, timeout=60)
                samples.append(done - t)
                tool.append(logged(sync_tool_seconds(log.name, n + 1), f"run: {label}"))
            out[label] = statistics.median(samples)
            out[label + ", tool"] = statistics.median(tool)
        out["peak RSS MiB"] = daemon_peak_rss(proc)
    finally:
        stop(proc)
        shutil.rmtree(os.path.join(state_dir, "added"), ignore_errors=True)
        os.unlink(log.name)
    return out


RESYNC_PERIOD = "2s"
RESYNC_SAMPLES = 3


def bench_resync(ns: Netns, state_dir: str, mode: str) -> dict[str, float]:
    """`reconciler run` with a short sync period on the kernel the CLI runs programmed: how long a
    periodic resync takes, and the CPU it costs (the daemon and the tools it ran), while nobody
    else commits (its drift check trusts the ruleset generation) and right after somebody else's
    commit (an unrelated nftables table: it reads the kernel back)."""
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        proc = subprocess.Popen(ns.argv(run_argv(state_dir, mode, RESYNC_PERIOD)), stdout=log, stderr=log, text=True)
        try:
            wait_for_syncs(log.name, 1, timeout=600, proc=proc)  # a start reads the kernel
            wait_for_syncs(log.name, 2, timeout=600, proc=proc)  # (and collects garbage after its log line)
            n = count_syncs(log.name)
            cpu = cpu_seconds(proc.pid)
            wait_for_syncs(log.name, n + RESYNC_SAMPLES, timeout=600, proc=proc)
            cpu = (cpu_seconds(proc.pid) - cpu) / RESYNC_SAMPLES
            quiet = sync_lines(log.name)[n:n + RESYNC_SAMPLES]
            n = count_syncs(log.name)
            ns.run(["nft", "add", "table", "ip", "bench-bystander"])
            try:  # the first sync logged may have started before the commit: wait for one that read
                deadline = time.monotonic() + 600
                while not any(r.get("kernel_read") for r in sync_lines(log.name)[n:]):
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise RuntimeError("no resync read the kernel after a foreign commit")
                    time.sleep(0.05)
            finally:
                ns.run(["nft", "delete", "table", "ip", "bench-bystander"])
            read = next(r for r in sync_lines(log.name)[n:] if r.get("kernel_read"))
        finally:
            stop(proc)
    return {"resync, untouched": statistics.median(r["duration_ms"] / 1000 for r in quiet),
            "resync, untouched: reads": sum(bool(r.get("kernel_read")) for r in quiet),
            "resync, untouched: CPU": cpu, "resync, after a foreign commit": read["duration_ms"] / 1000}


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and of the children it has waited for."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def log_records(path: str) -> list[dict[str, Any]]:
    out = []
    with open(path) as fh:
        for line in fh:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def is_sync(rec: dict[str, Any]) -> bool:
    return str(rec.get("msg", "")).startswith("sync ")


def sync_lines(path: str) -> list[dict[str, Any]]:
    return [rec for rec in log_records(path) if is_sync(rec)]


def sync_tool_seconds(path: str, n: int) -> float:
    """The kernel tool's time in the daemon's n-th sync (what it logged since the sync before)."""
    messages: list[str] = []
    seen = 0
    for rec in log_records(path):
        if is_sync(rec):
            seen += 1
            if seen == n:
                return tool_seconds(messages)
            messages = []
        else:
            messages.append(str(rec.get("msg", "")))
    raise RuntimeError(f"no sync #{n} in {path}")


def count_syncs(path: str) -> int:
    return len(sync_lines(path))


def wait_for_syncs(path: str, n: int, timeout: float, proc: subprocess.Popen[str] | None = None) -> float:
    """Wait until the log holds n sync lines, the n-th a success; returns the wall time it was
    written. Gives up early when `proc` (the daemon) has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = sync_lines(path)
        if len(lines) >= n:
            if " failed" in str(lines[n - 1].get("msg", "")):
                raise RuntimeError(f"sync #{n} failed: {lines[n - 1].get('msg')}")
            ts = lines[n - 1].get("ts")
            return parse_ts(ts) if ts else time.time()
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.005)
    with open(path) as fh:
        tail = fh.read()[-2000:]
    raise RuntimeError(f"no sync #{n} within {timeout}s (daemon exit code {proc and proc.poll()}); log tail: {tail}")


def parse_ts(ts: Any) -> float:
    if isinstance(ts, (int, float)):
        return float(ts)
    from datetime import datetime
    return datetime.fromisoformat(str(ts).replace("Z", "+00:00")).timestamp()


def fmt(v: Any) -> str:
    if isinstance(v, float):
        if v < 0.01:
            return f"{v * 1000:.1f} ms"
        return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"
    return str(v)


WARM_CHUNK = 256 << 20
PAGE = 4096


def warm_memory(gib: float) -> tuple[float, float]:
    """Write to every page of up to `gib` GiB (leaving 2 GiB free), in a child that then exits:
    the guest's free memory is then memory the host has mapped (see the module's docstring).
    Returns (GiB touched, seconds)."""
    with open("/proc/meminfo") as fh:
        available = next(int(line.split()[1]) << 10 for line in fh if line.startswith("MemAvailable:"))
    size = max(0, min(int(gib * (1 << 30)), available - (2 << 30))) // WARM_CHUNK * WARM_CHUNK
    if size <= 0:
        return 0.0, 0.0
    code = ("import sys\nchunks = []\nfor _ in range(int(sys.argv[1])):\n"
            f"    b = bytearray({WARM_CHUNK})\n    b[::{PAGE}] = b'\\x01' * len(b[::{PAGE}])\n    chunks.append(b)\n")
    t = time.monotonic()
    subprocess.run([PY, "-c", code, str(size // WARM_CHUNK)], check=True)
    return size / (1 << 30), time.monotonic() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1000x10,5000x10,10000x10,2000x50")
    p.add_argument("--backends", default="nftables,iptables")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--workdir", default=os.path.join(HERE, "out"))
    p.add_argument("--warm-memory", type=float, default=8.0, metavar="GIB",
                   help="touch this much free memory once before measuring (0: do not); default 8")
    a = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("benchmarks need root (they create network namespaces)")
    compile_package()  # (as installed: not compiled again at each command's start)
    gib, seconds = warm_memory(a.warm_memory) if a.warm_memory > 0 else (0.0, 0.0)
    print(f"warmed {gib:.2f} GiB of free memory in {seconds:.1f} s", file=sys.stderr, flush=True)
    rows = []
    for size in a.sizes.split(","):
        s, e = (int(x) for x in size.split("x"))
        for mode in a.backends.split(","):
            state = os.path.join(a.workdir, f"{s}x{e}")
            shutil.rmtree(state, ignore_errors=True)
            generate(state, s, e)
            print(f"== {size} {mode}", file=sys.stderr, flush=True)
            scripts = kernel_script(state, mode)
            loads, colds = [], []
            for _ in range(COLD_SAMPLES - 1):
                loads.append(load_floor(mode, scripts))
                colds.append(cold_apply(state, mode))
            loads.append(load_floor(mode, scripts))
            figs = bench_cli(state, mode, s, e, colds)
            figs["floor: load"] = statistics.median(loads)
            rows.append(Row(size, mode, figs))
            print_row(rows[-1], file=sys.stderr)
    print(f"Free memory touched once before measuring: {gib:.2f} GiB (--warm-memory).\n")
    print_table(rows)
    if READ_BACKS:
        print("\nApplies that read the kernel back (the ruleset generation could not vouch for them):")
        for argv in READ_BACKS:
            print(f"- {argv}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump([r.__dict__ for r in rows], fh, indent=2)


def print_row(r: Row, file: Any = sys.stdout) -> None:
    print(json.dumps(r.__dict__, default=str), file=file, flush=True)


def print_table(rows: list[Row]) -> None:
    """Two tables: the one-shot commands, then the `run` daemon. Floors: load = the kernel tool
    loading our cold-start input, read = reading our tables back; a change's floor is the tool's
    own time for our transaction (as logged), plus, for the commands, the read before the plan
    (apply verifies by the ruleset generation: see measure)."""
    print("| size | backend | cold apply (load floor, ratio) "
          "| no-op plan (read floor, ratio) | 1 endpoint: plan (ratio to read floor) "
          "| 1 endpoint: apply (floor, ratio) | +1 service: apply (floor, ratio) | cold apply RSS |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        f = r.figures
        load, read = f["floor: load"], f["floor: read"]
        print(f"| {r.size} | {r.backend} | {against(f['cold apply'], load)} "
              f"| {against(f['no-op plan'], read)} | {fmt(f['1 endpoint: plan'])} ({f['1 endpoint: plan'] / read:.2f}x) "
              f"| {against(f['1 endpoint: apply'], read + f['1 endpoint: apply, tool'])} "
              f"| {against(f['+1 service: apply'], read + f['+1 service: apply, tool'])} "
              f"| {f['cold apply RSS MiB']:.0f} MiB |")
    print()
    print("| size | backend | run: 1 endpoint, event->kernel (kernel tool, ratio) "
          "| run: +1 service, event->kernel (kernel tool, ratio) "
          "| run cold start: start->first sync done (load floor, ratio) | run peak RSS: warm / cold start "
          "| run: resync, kernel untouched (daemon CPU per sync period) "
          "| run: resync after a foreign commit (read floor, ratio) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        run = r.figures.get("run", {})
        nan = float("nan")
        print(f"| {r.size} | {r.backend} "
              f"| {against(run.get('1 endpoint', nan), run.get('1 endpoint, tool', nan))} "
              f"| {against(run.get('+1 service', nan), run.get('+1 service, tool', nan))} "
              f"| {against(run.get('cold start', nan), r.figures['floor: load'])} "
              f"| {run.get('peak RSS MiB', 0):.0f} / {run.get('cold start RSS MiB', 0):.0f} MiB "
              f"| {fmt(run.get('resync, untouched', nan))} ({fmt(run.get('resync, untouched: CPU', nan))}) "
              f"| {against(run.get('resync, after a foreign commit', nan), r.figures['floor: read'])} |")


def against(seconds: float, floor: float) -> str:
    """'figure (floor, ratio)'."""
    ratio = seconds / floor if floor > 0 else float("nan")
    return f"{fmt(seconds)} ({fmt(floor)}, {ratio:.2f}x)"


if __name__ == "__main__":
    main()

"""The nf_tables ruleset generation on a real kernel, in a throwaway namespace: reads leave it,
every commit that changes something (ours or anybody's) moves it by one, a refused transaction
or one that changes nothing does not; and what each backend's apply() says of its commits is
what the kernel did (the run loop's drift check and apply's verification rely on it, see
reconciler/drift.py and reconcile.apply): nftables names the generation each of its
transactions produced (in process and through `nft -f`), iptables in the nft flavour the ones
its restores made (one per table), the legacy flavour makes no nf_tables commit; and a commit
of anybody else's beside ours leaves ours unnamed (None)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import netns

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import ipaddress, json, shutil, subprocess, sys, tempfile
from reconciler.backends import get_backend
from reconciler.backends.base import KernelError, Operation
from reconciler.backends.generation import generation
from reconciler.backends.iptables.backend import IptablesBackend
from reconciler.backends.iptables import kernel as iptables_kernel
from reconciler.backends.nftables import kernel as nftables_kernel
from reconciler.config import Options
from reconciler.reconcile import load_desired

mode, flavour, state = sys.argv[1], sys.argv[2], sys.argv[3]
kernel = nftables_kernel if mode == "nftables" else iptables_kernel
backend = IptablesBackend(flavour) if mode == "iptables" else get_backend(mode)
opts = Options(mode=mode, node_name="node-a",
               cluster_cidrs=(ipaddress.ip_network("10.244.0.0/16"), ipaddress.ip_network("fd00:244::/32")))
smaller = tempfile.mkdtemp()
shutil.copytree(state, smaller, dirs_exist_ok=True)
subprocess.run(["rm", "-r", f"{smaller}/shop"], check=True)  # two services fewer

steps = []
def step(name, ops):
    certain = nftables_kernel.certain_to_commit(backend.script(ops)) if mode == "nftables" else None
    before = generation()
    produced = backend.apply(ops)
    after = generation()
    steps.append({"step": name, "ops": len(ops), "produced": produced, "moved": after - before, "after": after,
                  "certain": certain,
                  "backend_generation": backend.generation()})

start = generation()
backend.observe()
subprocess.run(["nft", "list", "ruleset"], capture_output=True, check=True)
subprocess.run(["iptables-nft-save"], capture_output=True, check=True)
reads_moved = generation() - start
step("cold apply", backend.diff(backend.render(load_desired(state, opts)), backend.observe()))
step("two services removed", backend.diff(backend.render(load_desired(smaller, opts)), backend.observe()))
if mode == "nftables":  # an `add` of what exists changes nothing: no commit, no generation
    step("no change", [Operation("+", "table", "ip reconciler", "add table ip reconciler")])
real_run_tool = kernel.run_tool
def with_a_foreign_commit(argv, stdin=None):  # somebody commits just before our tool's transaction
    if stdin is not None:  # (not before a read: `nft list table` runs through run_tool too)
        subprocess.run(["nft", "add", "table", "ip", f"beside-{len(steps)}"], check=True)
    return real_run_tool(argv, stdin)
real_lib_run = nftables_kernel._LIBNFT.run
def lib_with_a_foreign_commit(script):
    subprocess.run(["nft", "add", "table", "ip", f"beside-{len(steps)}"], check=True)
    return real_lib_run(script)
kernel.run_tool, nftables_kernel._LIBNFT.run = with_a_foreign_commit, lib_with_a_foreign_commit
step("beside a foreign commit", backend.diff(backend.render(load_desired(state, opts)), backend.observe()))
kernel.run_tool, nftables_kernel._LIBNFT.run = real_run_tool, real_lib_run
step("cleanup", backend.cleanup())
refused_at = generation()
try:
    if mode == "nftables":
        kernel.run_script("add table ip sr-gen\nadd rule ip sr-gen no-such-chain counter\n")
    else:
        kernel.restore("iptables", flavour, ["*nat", ":RECONCILER-GEN - [0:0]", "-A RECONCILER-NO-SUCH -j ACCEPT",
                                             "COMMIT"])
    refused = False
except KernelError:
    refused = True
refused_moved = generation() - refused_at
subprocess.run(["nft", "add", "table", "ip", "somebody-else"], check=True)
print(json.dumps({"start": start, "reads_moved": reads_moved, "steps": steps, "refused": refused,
                  "refused_moved": refused_moved, "foreign_moved": generation() - refused_at}))
"""

CASES = [("nftables", "in process"), ("nftables", "nft -f"), ("iptables", "nft"), ("iptables", "legacy")]


@pytest.fixture
def ns() -> Iterator[str]:
    reason = netns.skip_reason("nft", "iptables-nft-save", "iptables-legacy-save")
    if reason:
        pytest.skip(reason)
    with netns.throwaway(f"gen-e2e-{os.getpid()}") as name:
        yield name


@pytest.mark.parametrize(("mode", "flavour"), CASES, ids=[f"{m}-{f}" for m, f in CASES])
def test_apply_reports_the_commits_the_kernel_made(ns: str, mode: str, flavour: str) -> None:
    in_process = "0" if flavour == "nft -f" else "1"
    proc = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", PROBE, mode, flavour,
                           str(REPO / "state")], capture_output=True, text=True, timeout=120, check=False,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "RECONCILER_NFT_IN_PROCESS": in_process})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["start"] >= 1 and out["reads_moved"] == 0
    steps = {s["step"]: s for s in out["steps"]}
    assert all(s["ops"] > 0 for s in steps.values()), steps
    beside = steps.pop("beside a foreign commit")
    named = lambda s: list(range(s["after"] - s["moved"] + 1, s["after"] + 1))  # noqa: E731
    if flavour == "legacy":
        assert all(s["moved"] == 0 and s["produced"] == [] and s["backend_generation"] is None
                   for s in steps.values())
        assert beside["produced"] == []
    elif flavour == "in process":  # its own commit is told from the other one by its socket
        assert beside["moved"] == 2 and beside["produced"] == [beside["after"]]
    else:  # two commits where one was expected: which one is ours, nobody can tell
        assert beside["produced"] is None and beside["moved"] >= 2
        assert beside["certain"] is not False  # (not for want of a transaction certain to commit)
    if mode == "nftables":  # one transaction each, and it names the generation it produced
        assert [s["moved"] for s in steps.values()] == [1, 1, 0, 1]
        assert [s["produced"] for s in steps.values()] == [
            named(s) if s["moved"] else [] if flavour == "in process" else None  # (nft -f: an `add`
            for s in steps.values()]                                             # might commit nothing)
    elif flavour == "nft":  # one commit per table, both families (nat + filter each), all named
        assert steps["cold apply"]["moved"] == 4
        assert steps["cold apply"]["produced"] == named(steps["cold apply"])
        assert steps["cleanup"]["produced"] == named(steps["cleanup"])
        # the filter table's part only empties a chain (the firewall of a service gone): emptying
        # an empty chain commits nothing, so a commit beside it would be taken for it: not named
        assert steps["two services removed"]["produced"] is None
    if flavour != "legacy":
        assert all(s["backend_generation"] == s["after"] for s in steps.values())
    assert out["refused"] and out["refused_moved"] == 0 and out["foreign_moved"] == 1


def test_generation_is_per_network_namespace(ns: str) -> None:
    probe = "from reconciler.backends.generation import generation; print(generation())"
    run = lambda: int(subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", probe],  # noqa: E731
                                     capture_output=True, text=True, timeout=30, check=True, cwd=REPO,
                                     env={**os.environ, "PYTHONPATH": str(REPO)}).stdout)
    before = run()
    assert shutil.which("nft")
    subprocess.run(["ip", "netns", "exec", ns, "nft", "add", "table", "ip", "t"], check=True, timeout=30)
    assert run() == before + 1


WATCH = r"""
import json, subprocess
from reconciler.backends.generation import CommitWatch, generation, own_ports
from reconciler.backends.nftables import kernel

w = CommitWatch()
subprocess.run(["nft", "add", "table", "ip", "before"], check=True)  # not joined yet: not heard
assert w.join()
child = subprocess.Popen(["nft", "add", "table", "ip", "somebody"]); child.wait()
ran = kernel.run_script("add table ip ours\nadd chain ip ours c\n")  # (its own watch, joined meanwhile)
heard = w.leave()
subprocess.run(["nft", "add", "table", "ip", "after"], check=True)  # left: not heard
assert w.join()
print(json.dumps({"heard": heard, "mine": sorted(own_ports()), "ran": ran.generations, "later": w.leave(),
                  "now": generation()}))
"""


@pytest.mark.parametrize("pid_namespace", [False, True], ids=["host pids", "own pid namespace, as in a pod"])
def test_a_watch_hears_whose_commit_each_generation_is(ns: str, pid_namespace: bool) -> None:
    if pid_namespace and shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")
    inner = ["unshare", "--pid", "--fork", "--mount-proc"] if pid_namespace else []
    proc = subprocess.run(["ip", "netns", "exec", ns, *inner, sys.executable, "-c", WATCH], capture_output=True,
                          text=True, timeout=60, check=False, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    theirs, ours = out["heard"]
    assert ours[0] == theirs[0] + 1 and ours[1] in out["mine"] and theirs[1] not in out["mine"]
    assert out["ran"] == [ours[0]]  # run_script keeps only the generation its own socket committed
    assert out["later"] == [] and out["now"] == ours[0] + 1  # ("after" was not heard, but counted)

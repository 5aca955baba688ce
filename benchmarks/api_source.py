"""`reconciler run --source kubernetes` at scale: start to first sync, peak and steady RSS, and one
endpoint change from the API server to the kernel, against the test suite's fake API server.

    sudo .venv/bin/python benchmarks/api_source.py                      # 10k services x 10 endpoints
    sudo .venv/bin/python benchmarks/api_source.py --services 1000 --bare

Runs as root in a private network namespace (removed afterwards), nftables mode. Objects are
shaped as a real cluster serves them (managedFields, the last-applied annotation, status, an
endpoint's targetRef and zone; `--bare`: only what a proxy reads), every Service with one
EndpointSlice. The fake server lists from memory (its lists at resourceVersion "0" are whole, as a
real API server's watch cache answers them) and is itself Python: start times include its
serialising of the lists. Prints one table row per run (medians of `--changes` changes).
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
import uuid
from datetime import datetime
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from installed import compile_package  # noqa: E402
NODE = "node-0"


def _managed(manager: str, api_version: str, fields: dict[str, Any]) -> dict[str, Any]:
    return {"manager": manager, "operation": "Update", "apiVersion": api_version, "time": "2026-01-01T00:00:00Z",
            "fieldsType": "FieldsV1", "fieldsV1": fields}


def service(i: int, realistic: bool) -> dict[str, Any]:
    ns, name = f"ns{i % 50}", f"svc{i}"
    ip = f"10.{96 + i // 65000}.{(i // 250) % 256}.{i % 250 + 1}"
    nodeport = i % 10 == 0 and i // 10 < 2700
    port: dict[str, Any] = {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}
    if nodeport:
        port["nodePort"] = 30000 + i // 10
    spec: dict[str, Any] = {"type": "NodePort" if nodeport else "ClusterIP", "clusterIP": ip, "clusterIPs": [ip],
                            "ports": [port]}
    obj: dict[str, Any] = {"kind": "Service", "metadata": {"name": name, "namespace": ns}, "spec": spec}
    if realistic:
        spec.update(selector={"app": name}, sessionAffinity="None", ipFamilies=["IPv4"],
                    ipFamilyPolicy="SingleStack", internalTrafficPolicy="Cluster")
        obj["status"] = {"loadBalancer": {}}
        applied = {"apiVersion": "v1", "kind": "Service",
                   "metadata": {"labels": {"app": name}, "name": name, "namespace": ns},
                   "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8080}], "selector": {"app": name},
                            "type": spec["type"]}}
        obj["metadata"].update(
            uid=str(uuid.UUID(int=i)), labels={"app": name},
            annotations={"kubectl.kubernetes.io/last-applied-configuration": json.dumps(applied) + "\n"},
            managedFields=[_managed("kubectl-client-side-apply", "v1", {
                "f:metadata": {"f:annotations": {".": {}, "f:kubectl.kubernetes.io/last-applied-configuration": {}},
                               "f:labels": {".": {}, "f:app": {}}},
                "f:spec": {"f:internalTrafficPolicy": {}, "f:ports": {".": {}, 'k:{"port":80,"protocol":"TCP"}': {
                    ".": {}, "f:name": {}, "f:port": {}, "f:protocol": {}, "f:targetPort": {}}},
                    "f:selector": {}, "f:sessionAffinity": {}, "f:type": {}}})])
    return obj


def endpoint_slice(i: int, endpoints: int, realistic: bool, offset: int = 0, stamp: str = "") -> dict[str, Any]:
    ns, name = f"ns{i % 50}", f"svc{i}"
    eps = []
    for j in range(endpoints):
        k = i * endpoints + j + offset
        ep: dict[str, Any] = {"addresses": [f"10.{128 + k // 65000}.{(k // 250) % 256}.{k % 250 + 1}"],
                              "conditions": {"ready": True}, "nodeName": f"node-{k % 100}"}
        if realistic:
            ep["conditions"].update(serving=True, terminating=False)
            ep.update(zone=f"zone-{k % 3}", targetRef={"kind": "Pod", "name": f"{name}-7d4b9c8f6d-{k:05x}",
                                                       "namespace": ns, "uid": str(uuid.UUID(int=k))})
        eps.append(ep)
    meta: dict[str, Any] = {"name": f"{name}-abcde", "namespace": ns, "labels": {"kubernetes.io/service-name": name}}
    obj = {"kind": "EndpointSlice", "metadata": meta, "addressType": "IPv4",
           "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}], "endpoints": eps}
    if stamp:
        meta["annotations"] = {"endpoints.kubernetes.io/last-change-trigger-time": stamp}
    if realistic:
        meta["labels"].update({"endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"})
        meta.setdefault("annotations", {"endpoints.kubernetes.io/last-change-trigger-time": "2026-01-01T00:00:00Z"})
        meta.update(generateName=f"{name}-", generation=1, uid=str(uuid.UUID(int=10**9 + i)),
                    ownerReferences=[{"apiVersion": "v1", "kind": "Service", "name": name, "controller": True,
                                      "blockOwnerDeletion": True, "uid": str(uuid.UUID(int=i))}])
        per_endpoint = {f'k:{{"addresses":["{ep["addresses"][0]}"]}}': {
            ".": {}, "f:addresses": {}, "f:conditions": {".": {}, "f:ready": {}, "f:serving": {}, "f:terminating": {}},
            "f:nodeName": {}, "f:targetRef": {}, "f:zone": {}} for ep in eps}
        meta["managedFields"] = [_managed("kube-controller-manager", "discovery.k8s.io/v1", {
            "f:addressType": {}, "f:endpoints": per_endpoint, "f:ports": {},
            "f:metadata": {"f:annotations": {}, "f:generateName": {}, "f:labels": {}, "f:ownerReferences": {}}})]
    return obj


def serve(a: argparse.Namespace) -> None:
    """The fake API server, filled (run inside the namespace); SIGUSR1 replaces the endpoints of
    one Service's slice and prints {"changed": wall time}."""
    sys.path.insert(0, ROOT)
    from tests.fakeapi import FakeAPIServer

    api = FakeAPIServer(bookmark_interval=1.0)
    realistic = not a.bare
    for i in range(a.services):
        api.create(service(i, realistic))
        api.create(endpoint_slice(i, a.endpoints, realistic))
    api.create({"kind": "Node", "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}},
                "status": {"addresses": [{"type": "InternalIP", "address": "192.168.0.10"}]}})
    api.compact()
    api.start()
    with open(a.serve, "w") as fh:
        fh.write(f"apiVersion: v1\nkind: Config\nclusters: [{{name: f, cluster: {{server: '{api.url}'}}}}]\n"
                 "users: [{name: u, user: {token: t}}]\ncontexts: [{name: f, context: {cluster: f, user: u}}]\n"
                 "current-context: f\n")
    print(json.dumps({"ready": api.url}), flush=True)
    changes = [0]

    def change(*_: object) -> None:
        changes[0] += 1
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        obj = endpoint_slice(a.services // 2, a.endpoints, realistic, 7_000_000 + changes[0], stamp)
        changed = time.time()
        api.update(obj)
        print(json.dumps({"changed": changed}), flush=True)

    signal.signal(signal.SIGUSR1, change)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        signal.pause()


def _child(pid: int) -> int:
    """The process `timeout` started (its only child)."""
    for _ in range(500):
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as fh:
                kids = fh.read().split()
        except OSError:
            kids = []
        if kids:
            return int(kids[0])
        time.sleep(0.01)
    raise RuntimeError(f"process {pid} started nothing")


def _memory(pid: int) -> dict[str, float]:
    with open(f"/proc/{pid}/status") as fh:
        text = fh.read()
    return {k: int(re.search(rf"{k}:\s+(\d+)", text).group(1)) / 1024 for k in ("VmRSS", "VmHWM")}  # type: ignore[union-attr]


def _syncs(log: str) -> list[dict[str, Any]]:
    out = []
    with open(log) as fh:
        for line in fh:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if str(rec.get("msg", "")).startswith("sync "):
                out.append(rec)
    return out


def _when(rec: dict[str, Any]) -> float:
    t = rec["ts"]
    return float(t) if isinstance(t, (int, float)) else datetime.fromisoformat(str(t).replace("Z", "+00:00")).timestamp()


def measure(a: argparse.Namespace) -> dict[str, Any]:
    ns = f"bench-api-{os.getpid()}"
    work = tempfile.mkdtemp(prefix="bench-api-")
    kubeconfig, log = os.path.join(work, "kubeconfig"), os.path.join(work, "run.log")

    def inside(argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, "timeout", "900", *argv]

    server = daemon = None
    subprocess.run(["ip", "netns", "add", ns], check=True, timeout=30)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True, timeout=30)
        server = subprocess.Popen(inside([sys.executable, __file__, "--serve", kubeconfig, "--services",
                                          str(a.services), "--endpoints", str(a.endpoints)]
                                         + (["--bare"] if a.bare else [])), stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None
        json.loads(server.stdout.readline())  # (filled and listening)
        server_pid = _child(server.pid)
        flags = ["--source", "kubernetes", "--kubeconfig", kubeconfig, "--mode", "nftables", "--node-name", NODE,
                 "--cluster-cidr", "10.128.0.0/12", "--service-cidr", "10.96.0.0/12", "--log-format", "json",
                 "--sync-period", "1h", "--min-sync-period", "0s", "--healthz-bind-address", "127.0.0.1:19256",
                 "--metrics-bind-address", "127.0.0.1:19249", "--conntrack-max-per-core", "0"]
        started = time.time()
        with open(log, "w") as out:
            daemon = subprocess.Popen(inside([os.path.join(ROOT, ".venv", "bin", "reconciler"), "run", *flags]),
                                      stdout=out, stderr=out)
        pid = _child(daemon.pid)

        def syncs_at_least(n: int, timeout: float) -> dict[str, Any]:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                got = _syncs(log)
                if len(got) >= n:
                    return got[n - 1]
                if daemon.poll() is not None:
                    raise RuntimeError("run exited: " + open(log).read()[-2000:])
                time.sleep(0.005)
            raise RuntimeError(f"no sync {n} within {timeout} s")

        first = syncs_at_least(1, 600)
        figures: dict[str, Any] = {"start->first sync s": _when(first) - started}
        latencies = []
        for _ in range(a.changes):
            n = len(_syncs(log))
            time.sleep(0.3)
            os.kill(server_pid, signal.SIGUSR1)
            done = syncs_at_least(n + 1, 60)
            changed = json.loads(server.stdout.readline())["changed"]
            latencies.append((_when(done) - changed) * 1000)
        time.sleep(2)
        memory = _memory(pid)
        figures.update({"1 endpoint ms": statistics.median(latencies), "peak RSS MiB": memory["VmHWM"],
                        "steady RSS MiB": memory["VmRSS"]})
        return figures
    finally:
        for proc in (daemon, server):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        subprocess.run(["ip", "netns", "del", ns], timeout=30)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--services", type=int, default=10000)
    p.add_argument("--endpoints", type=int, default=10)
    p.add_argument("--bare", action="store_true", help="objects with only what a proxy reads")
    p.add_argument("--changes", type=int, default=5, help="endpoint changes timed (median)")
    p.add_argument("--serve", metavar="KUBECONFIG", help=argparse.SUPPRESS)  # (the server, in the namespace)
    a = p.parse_args()
    if a.serve:
        serve(a)
        return
    compile_package()  # (as installed: not compiled again at the daemon's start)
    f = measure(a)
    print("| size | objects | run: start->first sync | run peak RSS | steady RSS | 1 endpoint, API->kernel (median) |")
    print("|---|---|---|---|---|---|")
    print(f"| {a.services}x{a.endpoints} | {'bare' if a.bare else 'realistic'} | {f['start->first sync s']:.2f} s "
          f"| {f['peak RSS MiB']:.0f} MiB | {f['steady RSS MiB']:.0f} MiB | {f['1 endpoint ms']:.0f} ms |")


if __name__ == "__main__":
    main()

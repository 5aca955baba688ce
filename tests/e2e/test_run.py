"""`reconciler run --source DIR` as a background process in the lab's node namespace, real kernel:
file changes reach the kernel within the coalescing period and traffic follows; a flushed or deleted
table is repaired by the next full resync (and counted); a broken file keeps traffic flowing and is
logged with file:line and counted; /healthz, /livez, /readyz, /metrics and a healthCheckNodePort answer;
SIGTERM exits 0 with the rules in place and a following `plan` finds nothing to do.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from reconciler.backends.nftables.render import shard_of, shard_table_name
from prometheus_client.parser import text_string_to_metric_families
from ruamel.yaml import YAML

from lab import ADDR, Lab
from labcmd import ns_argv
from manifests import RECONCILER, common_flags, eps, reconciler, svc
from traffic import outcomes, servers

pytestmark = pytest.mark.e2e

NODE_IP = ADDR["node"][4]
HEALTHZ = f"{NODE_IP}:10256"
METRICS = "127.0.0.1:10249"
WEB_IP = "10.96.0.10"
LB_IP = "172.30.1.40"
HC_PORT = 32100
SYNC_PERIOD = 2.0
MIN_SYNC_PERIOD = 0.2

HTTP_CLIENT = r"""
import json, sys, urllib.request, urllib.error
try:
    r = urllib.request.urlopen(sys.argv[1], timeout=5)
    code, headers, body = r.status, dict(r.headers), r.read()
except urllib.error.HTTPError as e:
    code, headers, body = e.code, dict(e.headers), e.read()
print(json.dumps({"code": code, "headers": headers, "body": body.decode()}))
"""


def wait_for(pred: Callable[[], Any], timeout: float, interval: float = 0.05, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value or time.monotonic() > deadline:
            assert value, f"timed out after {timeout}s waiting for {what or pred}"
            return value
        time.sleep(interval)


def http_get(lab: Lab, host: str, url: str) -> tuple[int, dict[str, str], str]:
    cp = lab.exec(host, [sys.executable, "-I", "-c", HTTP_CLIENT, url], timeout=20)
    out = json.loads(cp.stdout)
    return out["code"], out["headers"], out["body"]


def state_docs(web_pods: tuple[str, ...] = ("pod1", "pod2", "pod3"),
               lb_pods: tuple[str, ...] = ("pod1", "pod3")) -> dict[str, dict]:
    return {
        "web-svc": svc("web", [WEB_IP], [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP",
                                          "nodePort": 30080}], type="NodePort"),
        "web-eps": eps("web", web_pods),
        "lb-svc": svc("lb-local", ["10.96.0.40"], [{"name": "http", "port": 80, "targetPort": 8080,
                                                     "protocol": "TCP", "nodePort": 30040}],
                      type="LoadBalancer", externalTrafficPolicy="Local", healthCheckNodePort=HC_PORT,
                      status={"loadBalancer": {"ingress": [{"ip": LB_IP}]}}),
        "lb-eps": eps("lb-local", lb_pods),
    }


def put(directory: str, docs: dict[str, dict]) -> None:
    """Write each doc to <key>.yaml atomically (temp file + rename), like a careful writer."""
    y = YAML(typ="safe", pure=True)
    for key, doc in docs.items():
        tmp = os.path.join(directory, f".{key}.tmp")
        with open(tmp, "w") as fh:
            y.dump(doc, fh)
        os.replace(tmp, os.path.join(directory, f"{key}.yaml"))


@dataclass
class Running:
    proc: subprocess.Popen
    src: str
    log: Path

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                out.append({"msg": line, "level": "raw"})
        return out

    def logged(self, pattern: str) -> list[dict[str, Any]]:
        rx = re.compile(pattern)
        return [rec for rec in self.lines() if rx.search(rec.get("msg", ""))]


def flags(src: str) -> list[str]:
    return common_flags(src)


@contextmanager
def reconciler_run(lab: Lab, src: str, log: Path) -> Iterator[Running]:
    """`reconciler run` on `src` in the lab's node, logging JSON into `log`, once its first sync
    is done; stopped with SIGTERM (else killed) at the end."""
    argv = ns_argv(lab.node, [*RECONCILER, "run", *flags(src),
                              "--sync-period", f"{SYNC_PERIOD:g}s", "--min-sync-period", f"{MIN_SYNC_PERIOD:g}s",
                              "--healthz-bind-address", HEALTHZ, "--metrics-bind-address", METRICS,
                              "--log-format", "json"])
    with open(log, "w") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT)
    r = Running(proc, src, log)
    try:
        wait_for(lambda: r.logged(r"^sync full") or proc.poll() is not None, 15, what="the first sync")
        assert proc.poll() is None, log.read_text()
        yield r
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@pytest.fixture(scope="module")
def running(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    src = str(tmp_path_factory.mktemp("run-state"))
    put(src, state_docs())
    log = Path(str(tmp_path_factory.mktemp("run-log"))) / "reconciler.log"
    try:
        with reconciler_run(lab, src, log) as r:
            yield r
    finally:
        reconciler(lab, "cleanup", "--mode", "nftables", check=False)


def metric(lab: Lab, name: str, labels: dict[str, str] | None = None) -> float:
    code, _, body = http_get(lab, "node", f"http://{METRICS}/metrics")
    assert code == 200
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                return sample.value
    return 0.0


def nft_table(lab: Lab) -> str:
    cp = lab.exec("node", ["nft", "list", "ruleset"], check=False)  # our main and shard tables
    return cp.stdout if cp.returncode == 0 else ""


def web_chain(lab: Lab) -> str:
    """The web service port's chain (its endpoints' DNAT rules)."""
    m = re.search(r"chain svc-default/web/http/tcp \{.*?\n\t\}", nft_table(lab), re.S)
    return m.group(0) if m else ""


def serving(lab: Lab, client: str = "pod2", ip: str = WEB_IP, port: int = 80, count: int = 30) -> set[str]:
    res = lab.tcp(client, ip, port, count=count)
    assert outcomes(res) == {"ok": count}, outcomes(res)
    return set(servers(res))


def test_serves_the_directory(lab: Lab, running: Running) -> None:
    assert serving(lab) == {"pod1", "pod2", "pod3"}
    assert serving(lab, "ext1", NODE_IP, 30080) == {"pod1", "pod2", "pod3"}


def test_file_change_reaches_kernel_within_the_coalescing_period(lab: Lab, running: Running) -> None:
    assert "dnat to 10.244.2.10:8080" in web_chain(lab)
    t0 = time.monotonic()
    put(running.src, {"web-eps": eps("web", ("pod1", "pod2"))})
    wait_for(lambda: "10.244.2.10" not in web_chain(lab), timeout=5, interval=0.02, what="endpoint removal")
    elapsed = time.monotonic() - t0
    assert elapsed < MIN_SYNC_PERIOD + 1.5, elapsed  # watch latency + at most one coalescing period
    assert serving(lab) == {"pod1", "pod2"}
    put(running.src, {"web-eps": eps("web", ("pod1", "pod2", "pod3"))})
    wait_for(lambda: "10.244.2.10" in web_chain(lab), timeout=5, interval=0.02, what="endpoint re-added")
    assert serving(lab) == {"pod1", "pod2", "pod3"}
    sync = running.logged(r"^sync incremental: service ports \+0 ~1 -0 \(default/web:http/TCP\), \d+ operations")
    assert sync and sync[-1]["sync"] == "incremental" and sync[-1]["changed"] == 1


WEB_SHARD = shard_table_name(shard_of("default/web:http/TCP"))


@pytest.mark.parametrize("damage", ["flush table ip reconciler", "delete table ip reconciler",
                                    f"delete table ip {WEB_SHARD}", f"flush table ip {WEB_SHARD}",
                                    f"add table ip {WEB_SHARD} {{ flags dormant; }}"])
def test_drift_is_repaired_by_the_next_resync_and_counted(lab: Lab, running: Running, damage: str) -> None:
    before = metric(lab, "reconciler_drift_repairs_total")
    repaired_before = len(running.logged(r"^repaired drift: \d+ operations"))
    lab.exec("node", ["nft", damage])
    wait_for(lambda: metric(lab, "reconciler_drift_repairs_total") > before, timeout=2 * SYNC_PERIOD + 5,
             interval=0.2, what="the drift repair")
    assert len(running.logged(r"^repaired drift: \d+ operations")) > repaired_before
    assert serving(lab) == {"pod1", "pod2", "pod3"}
    assert serving(lab, "ext1", NODE_IP, 30080) == {"pod1", "pod2", "pod3"}
    plan = reconciler(lab, "plan", *flags(running.src), check=False)
    assert plan.returncode == 0, plan.stdout


def test_resync_reads_the_kernel_only_after_somebody_else_committed(lab: Lab, running: Running) -> None:
    reads, skipped = metric(lab, "reconciler_kernel_reads_total"), metric(lab, "reconciler_kernel_reads_skipped_total")
    repairs = metric(lab, "reconciler_drift_repairs_total")
    wait_for(lambda: metric(lab, "reconciler_kernel_reads_skipped_total") >= skipped + 2,
             timeout=3 * SYNC_PERIOD + 5, interval=0.2, what="two resyncs that trust the generation")
    assert metric(lab, "reconciler_kernel_reads_total") == reads  # the kernel was not read back
    seen = len(running.logged(r"^sync full"))
    lab.exec("node", ["nft", "add", "table", "ip", "bystander"])  # a commit, nothing of ours touched
    try:
        wait_for(lambda: metric(lab, "reconciler_kernel_reads_total") > reads, timeout=2 * SYNC_PERIOD + 5,
                 interval=0.2, what="the resync that reads")
    finally:
        lab.exec("node", ["nft", "delete", "table", "ip", "bystander"])
    assert metric(lab, "reconciler_drift_repairs_total") == repairs  # read, and found nothing to repair
    read = [rec for rec in running.logged(r"^sync full")[seen:] if rec.get("kernel_read")]
    assert read and read[0]["operations"] == 0


SHARED_IP = "172.30.1.77"


def same_shard_names() -> tuple[str, str]:
    """Two Service names whose port ids hash to one shard table (where the element went lost)."""
    seen: dict[int, str] = {}
    for i in range(500):
        name = f"shared{i}"
        n = shard_of(f"default/{name}:http/TCP")
        if n in seen:
            return seen[n], name
        seen[n] = name
    raise AssertionError("no two names in one shard")


def reached(lab: Lab, ip: str, port: int, count: int = 6) -> set[str]:
    """Who answers TCP from ext1 (none while nothing DNATs there)."""
    return set(servers(lab.tcp("ext1", ip, port, count=count, timeout=0.5)))


def test_an_external_ip_two_services_claim_stays_served_when_one_goes(lab: Lab, running: Running) -> None:
    """Two Services on one externalIP and port (the API server accepts it): the first by id serves
    it; when that one goes, the other does at once and stays so. (The daemon used to delete the
    address's element when either went: unserved until a restart.)"""
    first, second = sorted(same_shard_names())
    ports = [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]
    docs = {f"{first}-svc": svc(first, ["10.96.0.71"], ports, externalIPs=[SHARED_IP]),
            f"{first}-eps": eps(first, ("pod1",)),
            f"{second}-svc": svc(second, ["10.96.0.72"], ports, externalIPs=[SHARED_IP]),
            f"{second}-eps": eps(second, ("pod3",))}
    put(running.src, docs)
    try:
        wait_for(lambda: reached(lab, SHARED_IP, 80) == {"pod1"}, timeout=10, interval=0.2, what=f"{first} serving")
        for key in (f"{first}-svc", f"{first}-eps"):
            os.remove(os.path.join(running.src, f"{key}.yaml"))
        wait_for(lambda: reached(lab, SHARED_IP, 80) == {"pod3"}, timeout=10, interval=0.2, what=f"{second} serving")
        time.sleep(SYNC_PERIOD + 1)  # a resync (which trusts what it programmed) changes nothing
        assert reached(lab, SHARED_IP, 80) == {"pod3"}
        assert serving(lab, "ext1", "10.96.0.72", 80) == {"pod3"}
    finally:
        for key in docs:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(running.src, f"{key}.yaml"))
        wait_for(lambda: "shared" not in nft_table(lab), timeout=10, interval=0.2, what="the shared services gone")


BROKEN = """apiVersion: v1
kind: Service
metadata:
  name: broken
  namespace: default
spec:
  clusterIP: 10.96.0.99
  ports:
  - name: http
    port: 70000
    protocol: TCP
"""


def test_broken_file_keeps_traffic_and_is_reported(lab: Lab, running: Running) -> None:
    before = metric(lab, "reconciler_source_errors_total", {"reason": "invalid"})
    path = os.path.join(running.src, "zz-broken.yaml")
    with open(path, "w") as fh:
        fh.write(BROKEN)
    # a valid change in the same batch must not be applied either (all-or-nothing input)
    put(running.src, {"web-eps": eps("web", ("pod1",))})
    try:
        wait_for(lambda: metric(lab, "reconciler_source_errors_total", {"reason": "invalid"}) > before,
                 timeout=5, interval=0.1, what="the error count")
        errors = running.logged(r"^invalid input .*zz-broken\.yaml:10:5: spec\.ports\[0\]\.port")
        assert errors and errors[-1]["level"] == "error"
        # (and each sync holding changes back names it)
        pattern = r"^sync .*zz-broken\.yaml:10:5: .*: changes since the last valid input are held back"
        wait_for(lambda: running.logged(pattern), timeout=5, interval=0.1, what="a sync holding changes back")
        assert all(rec["level"] == "info" for rec in running.logged(pattern))
        assert serving(lab) == {"pod1", "pod2", "pod3"}  # the last good state stays
        code, _, body = http_get(lab, "node", f"http://{HEALTHZ}/healthz")
        health = json.loads(body)
        assert code == 200 and health["healthy"] is True and health["degraded"] is True
        assert re.search(r"zz-broken\.yaml:10:5", health["lastError"])
    finally:
        os.unlink(path)
        put(running.src, {"web-eps": eps("web", ("pod1", "pod2", "pod3"))})
    wait_for(lambda: json.loads(http_get(lab, "node", f"http://{HEALTHZ}/healthz")[2])["degraded"] is False,
             timeout=5, interval=0.1, what="degraded to clear")
    assert serving(lab) == {"pod1", "pod2", "pod3"}


def test_healthz_livez_and_metrics(lab: Lab, running: Running) -> None:
    code, headers, body = http_get(lab, "node", f"http://{HEALTHZ}/healthz")
    assert code == 200
    assert headers["Content-Type"] == "application/json" and headers["X-Content-Type-Options"] == "nosniff"
    health = json.loads(body)
    assert list(health)[:4] == ["lastUpdated", "currentTime", "nodeEligible", "healthy"]
    assert health["healthy"] is True and health["nodeEligible"] is True and health["degraded"] is False
    assert set(health["status"]) == {"IPv4", "IPv6"}
    code, _, body = http_get(lab, "ext1", f"http://{HEALTHZ}/livez")  # like a load balancer would
    assert code == 200 and "nodeEligible" not in json.loads(body)
    code, _, body = http_get(lab, "node", f"http://{HEALTHZ}/readyz")  # (the kernel is programmed)
    assert code == 200 and json.loads(body)["ready"] is True
    assert http_get(lab, "node", f"http://{HEALTHZ}/nope")[0] == 404
    code, headers, text = http_get(lab, "node", f"http://{METRICS}/metrics")
    assert code == 200
    for name in ("kubeproxy_sync_proxy_rules_duration_seconds", "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
                 "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
                 "kubeproxy_network_programming_duration_seconds",
                 "kubeproxy_sync_proxy_rules_endpoint_changes_total", "kubeproxy_sync_proxy_rules_service_changes_total",
                 "kubeproxy_sync_proxy_rules_no_local_endpoints_total", "reconciler_drift_repairs_total",
                 "reconciler_source_errors_total", "reconciler_kernel_errors_total",
                 "reconciler_kernel_operations_total"):
        assert f"# TYPE {name} " in text, name
    assert metric(lab, "kubeproxy_sync_proxy_rules_last_timestamp_seconds") > time.time() - 2 * SYNC_PERIOD - 5
    assert metric(lab, "reconciler_kernel_operations_total", {"action": "add"}) > 0
    assert metric(lab, "reconciler_kernel_errors_total") == 0


def test_health_check_node_port(lab: Lab, running: Running) -> None:
    url = f"http://{NODE_IP}:{HC_PORT}/"
    code, headers, body = wait_for(lambda: (r := http_get(lab, "ext1", url))[0] == 200 and r, timeout=5,
                                   what="health check server")
    assert headers["Content-Type"] == "application/json"
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["X-Load-Balancing-Endpoint-Weight"] == "1"
    assert json.loads(body) == {"service": {"namespace": "default", "name": "lb-local"},
                                "localEndpoints": 1, "serviceProxyHealthy": True}
    assert serving(lab, "ext1", LB_IP, 80, count=10) == {"pod1"}  # ETP Local: the local endpoint only
    put(running.src, {"lb-eps": eps("lb-local", ("pod3",))})  # no local endpoint any more
    try:
        code, headers, body = wait_for(lambda: (r := http_get(lab, "ext1", url))[0] == 503 and r, timeout=5,
                                       what="503 without local endpoints")
        assert json.loads(body)["localEndpoints"] == 0 and headers["X-Load-Balancing-Endpoint-Weight"] == "0"
    finally:
        put(running.src, {"lb-eps": eps("lb-local", ("pod1", "pod3"))})
    wait_for(lambda: http_get(lab, "ext1", url)[0] == 200, timeout=5, what="200 again")


def test_sigterm_exits_0_and_leaves_the_rules(lab: Lab, running: Running) -> None:
    running.proc.send_signal(signal.SIGTERM)
    assert running.proc.wait(timeout=15) == 0, running.log.read_text()[-3000:]
    assert running.logged(r"^received SIGTERM")
    assert WEB_IP in nft_table(lab)
    assert serving(lab) == {"pod1", "pod2", "pod3"}
    assert serving(lab, "ext1", LB_IP, 80, count=5) == {"pod1"}
    plan = reconciler(lab, "plan", *flags(running.src), check=False)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    # the health servers went away with the process
    assert lab.exec("node", [sys.executable, "-I", "-c", HTTP_CLIENT, f"http://{HEALTHZ}/healthz"],
                    check=False).returncode != 0

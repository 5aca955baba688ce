"""/healthz + /livez (kube-proxy's ProxyHealthServer semantics), /metrics and the
healthCheckNodePort servers, on real sockets on 127.0.0.1 with an injected clock."""

from __future__ import annotations

import errno
import gzip
import http.client
import json
import socket
import urllib.error
import urllib.request
from typing import Any, Iterator

import pytest
from prometheus_client import REGISTRY, generate_latest

from reconciler.health import (
    GO_ZERO_TIME, BindError, FakeClock, ProxyHealth, ServiceHealthServers, default_hosts,
    node_eligible, parse_bind_address, rfc3339, start_metrics_server, start_proxy_health_server,
)
from reconciler.metrics import Metrics
from reconciler.state import HealthCheck

SYNC_PERIOD = 30.0


def get(url: str, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback here")


# ---------------------------------------------------------------------------------------- state


def test_rfc3339_is_utc_with_trimmed_fraction() -> None:
    assert rfc3339(0) == "1970-01-01T00:00:00Z"
    assert rfc3339(1.5) == "1970-01-01T00:00:01.5Z"
    assert rfc3339(1_700_000_000.25) == "2023-11-14T22:13:20.25Z"


def test_healthy_while_starting_up() -> None:
    h = ProxyHealth(2 * SYNC_PERIOD, FakeClock())
    h.queued_update()  # never updated yet: still healthy, like upstream
    code, body = h.body(with_node=True)
    assert code == 200 and body["healthy"] is True
    assert "status" not in body


def test_unhealthy_exactly_at_twice_the_sync_period() -> None:
    clock = FakeClock(1_700_000_000.0)
    h = ProxyHealth(2 * SYNC_PERIOD, clock)
    h.updated()
    clock.advance(5)
    h.queued_update()
    clock.advance(10)
    h.queued_update()  # does not move the oldest pending time
    clock.advance(2 * SYNC_PERIOD - 10 - 0.001)
    code, body = h.body(with_node=True)
    assert code == 200 and body["healthy"] is True
    assert body["lastUpdated"] == body["currentTime"] == rfc3339(clock.time())  # "recent" when healthy
    clock.advance(0.001)  # now - oldest pending == 2 x syncPeriod
    code, body = h.body(with_node=True)
    assert code == 503
    assert body["healthy"] is False
    assert body["lastUpdated"] == rfc3339(1_700_000_000.0)  # the real last update
    assert body["currentTime"] == rfc3339(clock.time())
    assert body["status"] == {f: {"lastUpdated": rfc3339(1_700_000_000.0), "healthy": False}
                              for f in ("IPv4", "IPv6")}
    assert list(body)[:4] == ["lastUpdated", "currentTime", "nodeEligible", "healthy"]
    assert h.body(with_node=False)[0] == 503
    h.updated()
    assert h.body(with_node=True)[0] == 200


def test_node_eligibility_only_affects_healthz() -> None:
    eligible = [False]
    h = ProxyHealth(60, FakeClock(), node_eligible=lambda: eligible[0])
    h.updated()
    code, body = h.body(with_node=True)
    assert code == 503 and body["nodeEligible"] is False and body["healthy"] is True
    code, body = h.body(with_node=False)
    assert code == 200 and "nodeEligible" not in body
    eligible[0] = True
    assert h.body(with_node=True)[0] == 200


def test_never_updated_and_ineligible_prints_go_zero_time() -> None:
    h = ProxyHealth(60, FakeClock(), node_eligible=lambda: False)
    code, body = h.body(with_node=True)
    assert code == 503 and body["lastUpdated"] == GO_ZERO_TIME


def test_node_eligible_rules() -> None:
    assert node_eligible(None) is False
    assert node_eligible({"metadata": {"name": "n"}}) is True
    assert node_eligible({"metadata": {"name": "n", "deletionTimestamp": "2024-01-01T00:00:00Z"}}) is False
    tainted = {"metadata": {"name": "n"},
               "spec": {"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]}}
    assert node_eligible(tainted) is False
    other = {"metadata": {"name": "n"}, "spec": {"taints": [{"key": "x", "effect": "NoSchedule"}]}}
    assert node_eligible(other) is True


def test_degraded_input_keeps_healthz_200() -> None:
    clock = FakeClock()
    h = ProxyHealth(60, clock)
    h.updated()
    h.set_input_error("state/web.yaml:12:7: spec.ports[0].port: must be 1-65535")
    code, body = h.body(with_node=True)
    assert code == 200
    assert body["degraded"] is True
    assert body["lastError"].startswith("state/web.yaml:12:7")
    since = body["lastErrorTime"]
    clock.advance(30)  # the same error found again (each sync): its time is when it was first found
    h.set_input_error("state/web.yaml:12:7: spec.ports[0].port: must be 1-65535")
    assert h.body(with_node=True)[1]["lastErrorTime"] == since
    h.set_input_error("state/web.yaml:12:7: spec.ports[0].port: must be 1-65535 (and 1 more)",
                      first="state/web.yaml:12:7: spec.ports[0].port: must be 1-65535")  # one more beside it
    assert h.body(with_node=True)[1]["lastErrorTime"] == since
    h.set_input_error("state/web.yaml:14:7: spec.ports[1].port: must be 1-65535")  # another one: now
    assert h.body(with_node=True)[1]["lastErrorTime"] != since
    h.set_input_error(None)
    code, body = h.body(with_node=True)
    assert body["degraded"] is False and "lastError" not in body


def test_parse_bind_address() -> None:
    assert parse_bind_address("0.0.0.0:10256", "x") == ("0.0.0.0", 10256)
    assert parse_bind_address("[::]:10256", "x") == ("::", 10256)
    assert parse_bind_address(":10249", "x") == ("0.0.0.0", 10249)
    for bad in ("10256", "localhost:10256", "1.2.3.4:port", "1.2.3.4:70000"):
        with pytest.raises(ValueError):
            parse_bind_address(bad, "--healthz-bind-address")



# ----------------------------------------------------------------------------------------- http


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


def test_readyz_waits_for_the_first_sync_that_programs_the_kernel() -> None:
    """Up (/livez 200) is not ready: the API out of reach, its lists not done or no valid input
    yet leave the kernel unprogrammed, and a rollout should wait for that node."""
    clock = FakeClock()
    h = ProxyHealth(2 * SYNC_PERIOD, clock)
    srv = start_proxy_health_server("127.0.0.1:0", h)
    assert srv is not None
    try:
        base = f"http://127.0.0.1:{srv.port}"
        h.updated()  # (the loop starting; a sync with no valid input yet)
        assert get(base + "/livez")[0] == 200
        code, _, raw = get(base + "/readyz")
        assert code == 503 and json.loads(raw)["ready"] is False
        assert json.loads(raw)["firstProgrammed"] == "0001-01-01T00:00:00Z"
        clock.advance(3)
        h.programmed()
        code, _, raw = get(base + "/readyz")
        assert code == 200 and json.loads(raw)["ready"] is True
        first = json.loads(raw)["firstProgrammed"]
        clock.advance(5)
        h.programmed()
        assert json.loads(get(base + "/readyz")[2])["firstProgrammed"] == first
        h.queued_update()  # a change not applied for 2 x syncPeriod: neither live nor ready
        clock.advance(2 * SYNC_PERIOD)
        assert get(base + "/readyz")[0] == 503 and get(base + "/livez")[0] == 503
    finally:
        srv.close()


def test_healthz_and_livez_over_http(metrics: Metrics) -> None:
    clock = FakeClock()
    h = ProxyHealth(2 * SYNC_PERIOD, clock)
    srv = start_proxy_health_server("127.0.0.1:0", h, metrics)
    assert srv is not None
    try:
        base = f"http://127.0.0.1:{srv.port}"
        h.updated()
        code, headers, raw = get(base + "/healthz")
        assert code == 200
        assert headers["Content-Type"] == "application/json"
        assert headers["X-Content-Type-Options"] == "nosniff"
        body = json.loads(raw)
        assert body["healthy"] is True and body["nodeEligible"] is True
        assert b'"lastUpdated":"' in raw  # compact like Go's json.Marshal
        code, _, raw = get(base + "/livez")
        assert code == 200 and "nodeEligible" not in json.loads(raw)
        h.queued_update()
        clock.advance(2 * SYNC_PERIOD)
        code, _, raw = get(base + "/healthz")
        assert code == 503 and json.loads(raw)["healthy"] is False
        assert get(base + "/livez")[0] == 503
        assert get(base + "/other")[0] == 404
        reg = metrics.registry
        assert reg.get_sample_value("kubeproxy_proxy_healthz_total", {"code": "200"}) == 1
        assert reg.get_sample_value("kubeproxy_proxy_healthz_total", {"code": "503"}) == 1
        assert reg.get_sample_value("kubeproxy_proxy_livez_total", {"code": "503"}) == 1
    finally:
        srv.close()


@needs_ipv6
@pytest.mark.parametrize("address", ["0.0.0.0:0", "[::]:0", ":0"])
def test_a_wildcard_address_takes_both_families(address: str) -> None:
    """As Go's net.Listen("tcp", "0.0.0.0:10256"): IPv6 probes of an IPv4 wildcard are answered too."""
    h = ProxyHealth(60, FakeClock())
    srv = start_proxy_health_server(address, h)
    assert srv is not None
    try:
        for host in ("127.0.0.1", "[::1]"):
            assert get(f"http://{host}:{srv.port}/livez")[0] == 200, host
    finally:
        srv.close()


def test_a_wildcard_address_is_ipv4_where_there_is_no_ipv6(monkeypatch: pytest.MonkeyPatch) -> None:
    real = socket.socket

    def no_ipv6(family: int = socket.AF_INET, *args: Any, **kwargs: Any) -> socket.socket:
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real(family, *args, **kwargs)

    for address in ("0.0.0.0:0", "[::]:0"):
        with monkeypatch.context() as m:
            m.setattr(socket, "socket", no_ipv6)
            srv = start_proxy_health_server(address, ProxyHealth(60, FakeClock()))
        assert srv is not None
        try:
            assert srv.server.address_family == socket.AF_INET
            assert get(f"http://127.0.0.1:{srv.port}/livez")[0] == 200
        finally:
            srv.close()


def request(port: int, method: str, path: str, host: str = "127.0.0.1",
            body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request(method, path, body=body)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


METHODS = ("POST", "PUT", "DELETE", "OPTIONS", "PATCH", "PROPFIND")


def test_every_method_gets_the_same_answer_and_no_server_header(metrics: Metrics) -> None:
    """kube-proxy's handlers ignore the method; Go's net/http sends no Server header."""
    h = ProxyHealth(60, FakeClock())
    h.updated()
    srv = start_proxy_health_server("127.0.0.1:0", h, metrics)
    assert srv is not None
    try:
        for path in ("/healthz", "/livez"):
            want = request(srv.port, "GET", path)
            assert want[0] == 200 and "Server" not in want[1]
            for method in METHODS:
                code, headers, raw = request(srv.port, method, path, body=b'{"x": 1}')
                assert (code, headers["Content-Type"]) == (200, "application/json"), (method, path)
                assert json.loads(raw).keys() == json.loads(want[2]).keys()
                assert "Server" not in headers
        assert request(srv.port, "POST", "/other")[0] == 404
        # a request body is read past: the next request on the connection is answered
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
        try:
            for method in ("POST", "GET"):
                conn.request(method, "/livez", body=b"x" * 1000 if method == "POST" else None)
                resp = conn.getresponse()
                assert resp.status == 200 and json.loads(resp.read())["healthy"] is True
        finally:
            conn.close()
        assert metrics.registry.get_sample_value("kubeproxy_proxy_healthz_total", {"code": "200"}) == 1 + len(METHODS)
    finally:
        srv.close()


def test_bind_error_is_clear() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(BindError, match=rf"healthz: cannot listen on 127.0.0.1:{port}: .*in use"):
            start_proxy_health_server(f"127.0.0.1:{port}", ProxyHealth(60, FakeClock()))


METRIC_NAMES = [
    "kubeproxy_sync_proxy_rules_duration_seconds",
    "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
    "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
    "kubeproxy_network_programming_duration_seconds",
    "kubeproxy_sync_proxy_rules_endpoint_changes_total",
    "kubeproxy_sync_proxy_rules_service_changes_total",
    "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
    "reconciler_drift_repairs_total",
    "reconciler_source_errors_total",
    "reconciler_kernel_errors_total",
    "reconciler_kernel_operations_total",
]


def test_metrics_exposition(metrics: Metrics) -> None:
    srv = start_metrics_server("127.0.0.1:0", metrics.registry, "nftables")
    assert srv is not None
    try:
        code, headers, raw = get(f"http://127.0.0.1:{srv.port}/metrics")
        assert code == 200 and headers["Content-Type"].startswith("text/plain")
        text = raw.decode()
        for name in METRIC_NAMES:
            assert f"# TYPE {name} " in text, name
        assert 'kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy="internal"} 0.0' in text
        # bounds as Go writes them (kube-proxy's series on Prometheus 2: le="1", not le="1.0")
        assert 'kubeproxy_sync_proxy_rules_duration_seconds_bucket{le="16.384"}' in text
        assert 'kubeproxy_sync_proxy_rules_duration_seconds_bucket{le="0.001"}' in text
        assert 'kubeproxy_network_programming_duration_seconds_bucket{le="300"}' in text
        assert 'kubeproxy_network_programming_duration_seconds_bucket{le="0"}' in text
        assert 'kubeproxy_network_programming_duration_seconds_bucket{le="+Inf"}' in text
        assert ".0\"}" not in text
        # the text format whatever Prometheus accepts (kube-proxy never answers in OpenMetrics),
        # gzipped when it takes that
        request = urllib.request.Request(f"http://127.0.0.1:{srv.port}/metrics", headers={
            "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
            "Accept-Encoding": "gzip"})
        with urllib.request.urlopen(request, timeout=5) as resp:
            assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            assert resp.headers["Content-Encoding"] == "gzip"
            zipped = gzip.decompress(resp.read()).decode()
        kinds = [line for line in text.splitlines() if line.startswith("# TYPE")]
        assert [line for line in zipped.splitlines() if line.startswith("# TYPE")] == kinds
        assert "# TYPE rest_client_requests_total counter" in kinds and "# EOF" not in zipped
        assert get(f"http://127.0.0.1:{srv.port}/proxyMode")[2] == b"nftables"
        assert get(f"http://127.0.0.1:{srv.port}/nope")[0] == 404
    finally:
        srv.close()
    # a label that ends in "le" is no bucket bound (iptables mode's table="filter")
    ipt = Metrics("iptables")
    ipt.iptables_rules.labels("filter").set(3)
    srv = start_metrics_server("127.0.0.1:0", ipt.registry, "iptables")
    assert srv is not None
    try:
        code, _, raw = get(f"http://127.0.0.1:{srv.port}/metrics")
        assert code == 200 and 'kubeproxy_sync_proxy_rules_iptables_total{table="filter"} 3.0' in raw.decode()
    finally:
        srv.close()
    # its own registry: nothing of ours in the global one
    assert "reconciler_drift_repairs_total" not in generate_latest(REGISTRY).decode()


# ------------------------------------------------------------------------- healthCheckNodePort


@pytest.fixture
def service_servers() -> Iterator[tuple[ServiceHealthServers, list[bool]]]:
    healthy = [True]
    servers = ServiceHealthServers(lambda: healthy[0], hosts=["127.0.0.1"])
    yield servers, healthy
    servers.close()


def hc(port: int, path: str = "/") -> tuple[int, dict[str, str], Any]:
    code, headers, raw = get(f"http://127.0.0.1:{port}{path}")
    return code, headers, raw


def test_service_health_answers_like_upstream(service_servers) -> None:
    servers, healthy = service_servers
    port = free_port()
    assert servers.sync([HealthCheck("ns/svc", port, 2)]) == []
    code, headers, raw = hc(port, "/any/path")
    assert code == 200
    assert headers["Content-Type"] == "application/json"
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["X-Load-Balancing-Endpoint-Weight"] == "2"
    assert raw.decode() == ('{\n\t"service": {\n\t\t"namespace": "ns",\n\t\t"name": "svc"\n\t},\n'
                            '\t"localEndpoints": 2,\n\t"serviceProxyHealthy": true\n}')
    # counts change in place (same server)
    servers.sync([HealthCheck("ns/svc", port, 0)])
    code, headers, raw = hc(port)
    assert code == 503 and headers["X-Load-Balancing-Endpoint-Weight"] == "0"
    assert json.loads(raw)["localEndpoints"] == 0
    servers.sync([HealthCheck("ns/svc", port, 1)])
    assert hc(port)[0] == 200
    # the proxy itself unhealthy: 503 even with local endpoints
    healthy[0] = False
    code, _, raw = hc(port)
    assert code == 503 and json.loads(raw) == {"service": {"namespace": "ns", "name": "svc"},
                                               "localEndpoints": 1, "serviceProxyHealthy": False}


@needs_ipv6
def test_service_health_answers_with_the_count_of_the_family_reached() -> None:
    """A dual-stack Service is counted per family (kube-proxy runs one proxier, and one health
    server, per family): one socket for both families answers each with its own count."""
    servers = ServiceHealthServers(lambda: True, hosts=["0.0.0.0"])
    try:
        port = free_port()
        assert servers.sync([HealthCheck("ns/svc", port, 1, (("ipv4", 1), ("ipv6", 0)))]) == []
        code, headers, raw = get(f"http://127.0.0.1:{port}/")
        assert (code, headers["X-Load-Balancing-Endpoint-Weight"], json.loads(raw)["localEndpoints"]) == (200, "1", 1)
        code, headers, raw = get(f"http://[::1]:{port}/")
        assert (code, headers["X-Load-Balancing-Endpoint-Weight"], json.loads(raw)["localEndpoints"]) == (503, "0", 0)
        servers.sync([HealthCheck("ns/svc", port, 2, (("ipv4", 0), ("ipv6", 2)))])  # (in place)
        assert get(f"http://127.0.0.1:{port}/")[0] == 503 and get(f"http://[::1]:{port}/")[0] == 200
    finally:
        servers.close()


def test_service_health_servers_follow_services(service_servers) -> None:
    servers, _ = service_servers
    p1, p2, p3 = free_port(), free_port(), free_port()
    servers.sync([HealthCheck("ns/a", p1, 1), HealthCheck("ns/b", p2, 1)])
    assert servers.services == {"ns/a": p1, "ns/b": p2}
    assert hc(p1)[0] == 200 and hc(p2)[0] == 200
    servers.sync([HealthCheck("ns/a", p3, 1)])  # b gone, a moved
    assert servers.services == {"ns/a": p3}
    assert hc(p3)[0] == 200
    for gone in (p1, p2):
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"http://127.0.0.1:{gone}/", timeout=2)
    servers.sync([])
    assert servers.services == {}


def test_service_health_port_in_use_is_retried(service_servers) -> None:
    servers, _ = service_servers
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    port = blocker.getsockname()[1]
    errors = servers.sync([HealthCheck("ns/svc", port, 1)])
    assert len(errors) == 1 and 'failed to start healthcheck "ns/svc"' in errors[0]
    assert servers.services == {}
    blocker.close()
    assert servers.sync([HealthCheck("ns/svc", port, 1)]) == []
    assert hc(port)[0] == 200


def test_service_health_answers_every_method(service_servers) -> None:
    servers, _ = service_servers
    port = free_port()
    servers.sync([HealthCheck("ns/svc", port, 2)])
    want = hc(port)
    for method in METHODS:
        code, headers, raw = request(port, method, "/")
        assert code == 200 and raw.decode() == want[2].decode(), method
        assert headers["X-Load-Balancing-Endpoint-Weight"] == "2" and "Server" not in headers


def test_service_health_port_bound_on_only_some_addresses_is_retried_on_all() -> None:
    """As upstream's listenAndServeAll: a port that one address refuses is closed on all and left
    out, so that the next sync tries every address again."""
    servers = ServiceHealthServers(lambda: True, hosts=["127.0.0.1", "127.0.0.2"])
    port = free_port()
    blocker = socket.socket()
    try:
        blocker.bind(("127.0.0.2", port))
        blocker.listen()
        errors = servers.sync([HealthCheck("ns/svc", port, 1)])
        assert len(errors) == 1 and "127.0.0.2" in errors[0]
        assert servers.services == {}
        with pytest.raises(OSError):  # not left open on the address that worked
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        blocker.close()
        assert servers.sync([HealthCheck("ns/svc", port, 1)]) == []
        for host in ("127.0.0.1", "127.0.0.2"):
            assert get(f"http://{host}:{port}/")[0] == 200
    finally:
        blocker.close()
        servers.close()


def test_service_health_servers_move_when_the_addresses_they_take_change() -> None:
    """With `hosts` a function (nodePortAddresses primary: the Node's IP, which may change while
    running), each sync asks it again: a server on an address no longer named closes there and
    opens on the new one (the load balancer's checks go to the node's current IP)."""
    hosts = ["127.0.0.1"]
    asked: list[int] = []
    servers = ServiceHealthServers(lambda: True, hosts=lambda: asked.append(1) or list(hosts))
    port = free_port()
    try:
        assert servers.sync([HealthCheck("ns/svc", port, 1)]) == []
        assert get(f"http://127.0.0.1:{port}/")[0] == 200
        first = servers.entry("ns/svc")
        assert servers.sync([HealthCheck("ns/svc", port, 2)]) == []  # same addresses: kept, counts updated
        assert servers.entry("ns/svc") is first and get(f"http://127.0.0.1:{port}/")[0] == 200
        hosts[:] = ["127.0.0.2"]
        assert servers.sync([HealthCheck("ns/svc", port, 2)]) == []
        assert get(f"http://127.0.0.2:{port}/")[0] == 200
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        assert servers.sync([]) == [] and len(asked) == 3  # (no health check: nothing to ask)
    finally:
        servers.close()


@needs_ipv6
def test_service_health_default_hosts_are_one_dual_stack_socket() -> None:
    servers = ServiceHealthServers(lambda: True)
    port = free_port()
    try:
        assert servers.sync([HealthCheck("ns/svc", port, 1)]) == []
        entry = servers.entry("ns/svc")
        assert entry is not None and len(entry.servers) == 1
        for host in ("127.0.0.1", "[::1]"):
            assert get(f"http://{host}:{port}/")[0] == 200
    finally:
        servers.close()
    explicit = ServiceHealthServers(lambda: True, hosts=["::"])  # "::" is both families too
    try:
        assert explicit.sync([HealthCheck("ns/svc", port, 1)]) == []
        assert get(f"http://127.0.0.1:{port}/")[0] == 200
    finally:
        explicit.close()


def test_local_addresses_are_listed_once_each_and_only_bindable_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """One address on two links (a VIP on lo and eth0) is one address: listed twice, the health
    check server bound it twice and failed on every sync. Tentative or DAD-failed IPv6 addresses
    cannot be bound: left out."""
    import subprocess

    import reconciler.health as health_mod

    links = [{"ifname": "lo", "addr_info": [{"local": "10.9.0.5"}, {"local": "127.0.0.1"}]},
             {"ifname": "eth0", "addr_info": [{"local": "10.9.0.5"}, {"local": "fd00::5", "tentative": True},
                                              {"local": "fd00::6", "dadfailed": True}, {"local": "fd00::7"}]}]
    monkeypatch.setattr(health_mod.subprocess, "run",
                        lambda *a, **kw: subprocess.CompletedProcess(a, 0, stdout=json.dumps(links)))
    assert health_mod.local_addresses(["10.0.0.0/8", "fd00::/64"]) == ["10.9.0.5", "fd00::7"]


def answer_schema(kind: str) -> Any:
    """A validator of one of schemas/http-answers.schema.json's answers."""
    import json

    import jsonschema

    from helpers import REPO
    with open(f"{REPO}/schemas/http-answers.schema.json") as fh:
        schema = json.load(fh)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator({**schema, "anyOf": [{"$ref": f"#/$defs/{kind}"}]})


def test_the_health_answers_are_those_their_schema_describes() -> None:
    clock = FakeClock(1_700_000_000.5)
    healthz, readyz = answer_schema("healthz"), answer_schema("readyz")
    h = ProxyHealth(60, clock, node_eligible=lambda: False)
    bodies = [h.body(with_node=True)[1], h.body(with_node=False)[1]]  # (never updated)
    readies = [h.ready_body()[1]]
    h.updated()
    h.programmed()
    h.set_input_error("state/web.yaml:12:7: spec.ports[0].port: must be 1-65535")
    clock.advance(0.25)
    bodies += [h.body(with_node=True)[1], h.body(with_node=False)[1]]
    readies.append(h.ready_body()[1])
    assert {"status", "lastError", "nodeEligible"} <= set(bodies[2]) and "status" not in bodies[0]
    assert readies[0]["ready"] is False and readies[1]["ready"] is True
    for body in bodies:
        healthz.validate(body)
        assert not readyz.is_valid(body)
    for body in readies:
        readyz.validate(body)
        assert not healthz.is_valid(body)
    broken = dict(bodies[2], status={"IPv5": bodies[2]["status"]["IPv4"]})
    assert not healthz.is_valid(broken)  # (the schema tells a wrong answer)


def test_a_health_check_node_port_answer_is_the_one_its_schema_describes() -> None:
    from reconciler.health import _ServiceEntry, service_health_body
    from reconciler.state import HealthCheck
    schema = answer_schema("serviceHealth")
    entry = _ServiceEntry(HealthCheck("shop/web", 32000, 2, (("ipv4", 2), ("ipv6", 0))))
    for family, healthy in (("ipv4", True), ("ipv6", True), ("ipv4", False)):
        code, body, headers = service_health_body(entry, healthy, family)  # type: ignore[arg-type]
        answer = json.loads(body)
        schema.validate(answer)
        assert code == (200 if answer["localEndpoints"] and healthy else 503)
    assert not schema.is_valid(dict(answer, localEndpoints=-1))

"""HTTP endpoints of `reconciler run`, with kube-proxy's semantics (pkg/proxy/healthcheck):

* /healthz, /livez and /readyz (the proxier health server, default 0.0.0.0:10256);
* /metrics (Prometheus text, default 127.0.0.1:10249), with /proxyMode and /configz beside it;
* one healthCheckNodePort server per ETP=Local LoadBalancer Service (service health).

Every server is an http.server ThreadingHTTPServer in its own daemon thread. Time comes from an
injectable clock so the 2 x syncPeriod boundary can be tested without sleeping.
"""

from __future__ import annotations

import datetime as _dt
import errno
import ipaddress
import json
import logging
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socketserver import TCPServer
from typing import Any, Callable, Iterable, Sequence

from .state import Family, HealthCheck, family_name

log = logging.getLogger(__name__)

FAMILY_NAMES = ("IPv4", "IPv6")
TO_BE_DELETED_TAINT = "ToBeDeletedByClusterAutoscaler"


class Clock:
    """Wall time (for the JSON bodies) and monotonic time (for timeouts)."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


class FakeClock(Clock):
    """A clock that only moves when told to (tests)."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.t = start
        self._lock = threading.Lock()

    def time(self) -> float:
        with self._lock:
            return self.t

    def monotonic(self) -> float:
        return self.time()

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.t += seconds


SYSTEM_CLOCK = Clock()
GO_ZERO_TIME = "0001-01-01T00:00:00Z"  # how kube-proxy (Go) prints "never"


def rfc3339(ts: float) -> str:
    """Epoch seconds -> RFC 3339 in UTC with trailing fractional zeros trimmed (like Go's RFC3339Nano)."""
    t = _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc)
    text = t.strftime("%Y-%m-%dT%H:%M:%S")
    if t.microsecond:
        text += f".{t.microsecond:06d}".rstrip("0")
    return text + "Z"


def node_eligible(node: dict[str, Any] | None) -> bool:
    """kube-proxy's NodeEligible: the node exists, is not being deleted and is not about to be
    removed by the cluster autoscaler."""
    if node is None:
        return False
    meta = node.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return False
    taints = (node.get("spec") or {}).get("taints") or []
    return not any(isinstance(t, dict) and t.get("key") == TO_BE_DELETED_TAINT for t in taints)


class ProxyHealth:
    """kube-proxy's ProxyHealthServer state: healthy unless a queued update has waited at least
    `timeout` (2 x syncPeriod) without a successful sync.

    `queued_update()` when a change is queued (sets the oldest pending time if unset);
    `updated()` after each successful sync (clears it, records lastUpdated).
    Ours on top: `set_input_error()` marks the input degraded (the last good state is kept).
    """

    def __init__(self, timeout: float, clock: Clock = SYSTEM_CLOCK,
                 node_eligible: Callable[[], bool] | None = None,
                 families: Sequence[str] = FAMILY_NAMES) -> None:
        self.timeout = timeout
        self.clock = clock
        self._node_eligible = node_eligible or (lambda: True)
        self._families = tuple(families)
        self._lock = threading.Lock()
        self._last_updated: float | None = None  # wall time
        self._oldest_pending: float | None = None  # monotonic
        self._last_error: str | None = None
        self._last_error_time: float | None = None
        self._first_error: str | None = None  # (see set_input_error)
        self._programmed: float | None = None  # wall time of the first sync that programmed the kernel

    def queued_update(self) -> None:
        with self._lock:
            if self._oldest_pending is None:
                self._oldest_pending = self.clock.monotonic()

    def updated(self) -> None:
        with self._lock:
            self._oldest_pending = None
            self._last_updated = self.clock.time()

    def programmed(self) -> None:
        """updated(), by a sync that made the kernel hold what the source says (from then on
        /readyz answers 200 while healthy)."""
        self.updated()
        with self._lock:
            if self._programmed is None:
                self._programmed = self._last_updated

    def set_input_error(self, message: str | None, first: str | None = None) -> None:
        """The input's errors (None: valid again), as `message`; their time stays while the first
        of them (`first`, else the message) is the same one, found again by later syncs."""
        with self._lock:
            if message is None:
                self._last_error = self._last_error_time = self._first_error = None
                return
            if (first or message) != self._first_error:
                self._last_error_time = self.clock.time()
            self._last_error, self._first_error = message, first or message

    @property
    def healthy(self) -> bool:
        """The proxier part of the health (what the service health servers use)."""
        with self._lock:
            return self._healthy_locked(self.clock.monotonic())

    def _healthy_locked(self, mono: float) -> bool:
        if self._last_updated is None:  # never updated: starting up, healthy (like upstream)
            return True
        return self._oldest_pending is None or mono - self._oldest_pending < self.timeout

    def node_eligible(self) -> bool:
        try:
            return bool(self._node_eligible())
        except Exception:  # noqa: BLE001 - a broken probe must not break /healthz
            log.exception("node eligibility check failed")
            return False

    def body(self, with_node: bool) -> tuple[int, dict[str, Any]]:
        """(status code, JSON body) for /healthz (with_node) or /livez."""
        eligible = self.node_eligible() if with_node else True
        with self._lock:
            wall, mono = self.clock.time(), self.clock.monotonic()
            healthy = self._healthy_locked(mono)
            last = self._last_updated
            error, error_time = self._last_error, self._last_error_time
        ok = healthy and eligible
        last_text = rfc3339(wall) if ok else (rfc3339(last) if last is not None else GO_ZERO_TIME)
        body: dict[str, Any] = {"lastUpdated": last_text, "currentTime": rfc3339(wall)}
        if with_node:
            body["nodeEligible"] = eligible
        body["healthy"] = healthy
        if last is not None:
            body["status"] = {f: {"lastUpdated": rfc3339(last), "healthy": healthy} for f in self._families}
        body["degraded"] = error is not None
        if error is not None:
            body["lastError"] = error
            body["lastErrorTime"] = rfc3339(error_time or wall)
        return (200 if ok else 503), body

    def ready_body(self) -> tuple[int, dict[str, Any]]:
        """(status code, JSON body) for /readyz (ours; kube-proxy has none): 200 once a sync has
        programmed the kernel from the source, while healthy (/livez's rule). Before that (the
        API out of reach or its lists not done, no valid input yet) 503: a rollout waits for it."""
        with self._lock:
            wall = self.clock.time()
            healthy = self._healthy_locked(self.clock.monotonic())
            programmed = self._programmed
        ready = programmed is not None and healthy
        body: dict[str, Any] = {"ready": ready, "currentTime": rfc3339(wall),
                                "firstProgrammed": rfc3339(programmed) if programmed is not None else GO_ZERO_TIME,
                                "healthy": healthy}
        return (200 if ready else 503), body


# ----------------------------------------------------------------------------------------------
# HTTP plumbing


class BindError(Exception):
    """A server could not listen on its address."""


def parse_bind_address(text: str, what: str) -> tuple[str, int]:
    """'0.0.0.0:10256', '[::]:10256', ':10256' (all addresses) -> (host, port)."""
    host, sep, port_text = text.strip().rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"{what}: invalid bind address {text!r} (expected HOST:PORT, e.g. 0.0.0.0:10256)")
    host = host.strip("[]") or "0.0.0.0"
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"{what}: invalid port in {text!r}")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{what}: bind address {text!r} must be an IP address") from None
    return host, port


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str, port: int, handler: type[BaseHTTPRequestHandler], **attrs: Any) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.v6only = host != "::"  # "::" takes IPv4 too (as IPv4-mapped addresses), as Go's "tcp" does
        for k, v in attrs.items():
            setattr(self, k, v)
        super().__init__((host, port), handler)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(self.v6only))
        TCPServer.server_bind(self)  # HTTPServer's would do a (slow) reverse DNS lookup
        self.server_name = str(self.server_address[0])
        self.server_port = int(self.server_address[1])


def _listen(host: str, port: int, handler: type[BaseHTTPRequestHandler], **attrs: Any) -> _Server:
    """Listen on host:port; a wildcard host (0.0.0.0 or ::) is one socket for both families, as
    Go's net.Listen("tcp", ...) makes it, or IPv4 only where the host has no IPv6."""
    if not ipaddress.ip_address(host).is_unspecified:
        return _Server(host, port, handler, **attrs)
    try:
        return _Server("::", port, handler, **attrs)
    except OSError as exc:
        if exc.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):  # (not: no IPv6 here)
            raise
    return _Server("0.0.0.0", port, handler, **attrs)


class HTTPServerThread:
    """One listening server running serve_forever in a daemon thread."""

    def __init__(self, host: str, port: int, handler: type[BaseHTTPRequestHandler], what: str,
                 **attrs: Any) -> None:
        try:
            self.server = _listen(host, port, handler, **attrs)
        except OSError as exc:
            raise BindError(f"{what}: cannot listen on {format_address(host, port)}: {exc.strerror or exc}") from exc
        self.what = what
        self.host = host
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1},
                                       name=f"http-{what}-{self.port}", daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(2.0)


class RetryingListener:
    """A server started at once or, while its address cannot be bound, retried every `interval`
    seconds in a background thread (kube-proxy's wait.Until(serve, 5s) for its healthz and
    metrics servers); each new failure message is logged once. `on_error` (if set) is told of
    every failed attempt (the run loop records kube-proxy's FailedToStartProxierHealthcheck)."""

    def __init__(self, start: Callable[[], HTTPServerThread | None], interval: float) -> None:
        self._start = start
        self.interval = interval
        self.on_error: Callable[[BindError], None] | None = None
        self.server: HTTPServerThread | None = None
        self._error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, retry: bool = True) -> bool:
        """Try once (a ValueError, an invalid address, propagates); if that fails and `retry`,
        keep trying in the background. Returns whether it is listening (or disabled)."""
        if self._attempt(retry):
            return True
        if retry:
            self._thread = threading.Thread(target=self._retry, name="bind-retry", daemon=True)
            self._thread.start()
        return False

    def _attempt(self, retry: bool = True) -> bool:
        try:
            server = self._start()
        except BindError as exc:
            if str(exc) != self._error:
                log.error("%s%s", exc, f"; retrying every {self.interval:g}s" if retry else "")
                self._error = str(exc)
            if self.on_error is not None:
                self.on_error(exc)
            return False
        if server is not None:
            log.info("serving %s on %s", server.what, server.address, extra={"fields": {"address": server.address}})
        self.server, self._error = server, None
        return True

    def _retry(self) -> None:
        while not self._stop.wait(self.interval) and not self._attempt():
            pass

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        if self.server is not None:
            self.server.close()


class _Handler(BaseHTTPRequestHandler):
    """Answers every method alike (kube-proxy's handlers ignore it); subclasses define respond()."""

    protocol_version = "HTTP/1.1"
    timeout = 10  # idle keep-alive connections go away
    max_discarded_body = 256 << 10  # like Go's net/http: a bigger unread body closes the connection

    def __getattr__(self, name: str) -> Any:
        if name.startswith("do_"):  # http.server looks up do_<METHOD>
            return self._handle
        raise AttributeError(name)

    def _handle(self) -> None:
        length = self.headers.get("Content-Length", "0")
        if self.headers.get("Transfer-Encoding") or not length.isdigit() or int(length) > self.max_discarded_body:
            self.close_connection = True
        elif int(length):
            self.rfile.read(int(length))  # (the body is not used)
        self.respond()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        log.debug("%s %s", self.address_string(), format % args)

    def send_response(self, code: int, message: str | None = None) -> None:
        """As http.server's, without its Server header (Go's net/http sends none)."""
        self.log_request(code)
        self.send_response_only(code, message)
        self.send_header("Date", self.date_time_string())

    def send(self, code: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("X-Content-Type-Options", "nosniff")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def respond(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


class _ProxyHealthHandler(_Handler):
    server: Any

    def respond(self) -> None:
        path = self.path.split("?", 1)[0]
        if path not in ("/healthz", "/livez", "/readyz"):
            self.send(404, b"404 page not found\n", "text/plain; charset=utf-8")
            return
        health: ProxyHealth = self.server.health
        code, body = health.ready_body() if path == "/readyz" else health.body(with_node=path == "/healthz")
        counter = self.server.counters.get(path)
        if counter is not None:
            counter.labels(str(code)).inc()
        self.send(code, json.dumps(body, separators=(",", ":")).encode(), "application/json")


def start_proxy_health_server(address: str, health: ProxyHealth, metrics: Any = None) -> HTTPServerThread | None:
    """/healthz, /livez and /readyz on `address` ('' disables); raises BindError."""
    if not address:
        return None
    host, port = parse_bind_address(address, "--healthz-bind-address")
    counters = {"/healthz": metrics.healthz, "/livez": metrics.livez} if metrics is not None else {}
    return HTTPServerThread(host, port, _ProxyHealthHandler, "healthz", health=health, counters=counters)


class _MetricsHandler(_Handler):
    server: Any

    def respond(self) -> None:
        from .metrics import exposition

        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            body, headers = exposition(self.server.registry, self.headers.get("Accept-Encoding", ""))
            self.send(200, body, headers.pop("Content-Type"), headers)
        elif path == "/proxyMode":
            self.send(200, self.server.mode.encode(), "text/plain; charset=utf-8")
        elif path == "/configz" and self.server.configz is not None:
            self.send(200, json.dumps(self.server.configz).encode(), "application/json")
        elif path == "/healthz":
            self.send(200, b"ok", "text/plain; charset=utf-8")
        else:
            self.send(404, b"404 page not found\n", "text/plain; charset=utf-8")


def start_metrics_server(address: str, registry: Any, mode: str = "",
                         configz: dict[str, Any] | None = None) -> HTTPServerThread | None:
    """/metrics (+ /proxyMode, /configz, /healthz like kube-proxy's metrics server); '' disables."""
    if not address:
        return None
    host, port = parse_bind_address(address, "--metrics-bind-address")
    return HTTPServerThread(host, port, _MetricsHandler, "metrics", registry=registry, mode=mode, configz=configz)


# ----------------------------------------------------------------------------------------------
# healthCheckNodePort servers


@dataclass
class _ServiceEntry:
    check: HealthCheck  # the Service, its port and its local endpoints (per family), as last synced
    servers: list[HTTPServerThread] = field(default_factory=list)
    hosts: tuple[str, ...] = ()  # the addresses it listens on

    @property
    def port(self) -> int:
        return self.check.nodePort

    @property
    def namespace(self) -> str:
        return self.check.service.partition("/")[0]

    @property
    def name(self) -> str:
        return self.check.service.partition("/")[2]


def describe_counts(check: HealthCheck) -> str:
    """'2 local endpoints', or per family: 'local endpoints: IPv4 1, IPv6 0'."""
    if len(check.byFamily) > 1:
        return "local endpoints: " + ", ".join(f"{family_name(family)} {n}" for family, n in check.byFamily)
    return f"{check.localEndpoints} local endpoint{'s' if check.localEndpoints != 1 else ''}"


def service_health_body(entry: _ServiceEntry, proxy_healthy: bool, family: Family = "ipv4"
                        ) -> tuple[int, bytes, dict[str, str]]:
    """kube-proxy's service health answer to a request that reached an address of `family`: 200
    iff that family's proxying has local endpoints and the proxy is healthy."""
    count = entry.check.count(family)
    body = json.dumps({"service": {"namespace": entry.namespace, "name": entry.name},
                       "localEndpoints": count, "serviceProxyHealthy": proxy_healthy}, indent="\t")
    code = 200 if count != 0 and proxy_healthy else 503
    return code, body.encode(), {"X-Load-Balancing-Endpoint-Weight": str(count)}


class _ServiceHealthHandler(_Handler):
    server: Any

    def respond(self) -> None:  # any path, like upstream
        owner: ServiceHealthServers = self.server.owner
        entry = owner.entry(self.server.service)
        if entry is None:  # closed concurrently
            self.send(503, b"", "application/json")
            return
        code, body, headers = service_health_body(entry, owner.proxy_healthy(), self.reached_family())
        self.send(code, body, "application/json", headers)

    def reached_family(self) -> Family:
        """The family of the address this request reached (an IPv4-mapped one on a socket for
        both families: IPv4)."""
        ip = ipaddress.ip_address(self.connection.getsockname()[0].split("%", 1)[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is None:
            return "ipv6"
        return "ipv4"


def default_hosts() -> list[str]:
    """Every address of both families: one wildcard socket (see _listen)."""
    return ["0.0.0.0"]


def local_addresses(cidrs: Sequence[str]) -> list[str]:
    """This host's addresses inside `cidrs` (for --nodeport-addresses), via `ip -j addr`."""
    nets = [ipaddress.ip_network(c, strict=False) for c in cidrs]
    try:
        out = subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, text=True, timeout=10,
                             check=True).stdout
        links = json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        log.warning("cannot list local addresses (%s); health check servers listen on all", exc)
        return default_hosts()
    addrs: dict[str, None] = {}  # (once each: one address on two links, a VIP on lo and eth0, is one)
    for link in links:
        for info in link.get("addr_info", []):
            try:
                ip = ipaddress.ip_address(info.get("local", ""))
            except ValueError:
                continue
            if ip.is_link_local or info.get("tentative") or info.get("dadfailed"):  # (none can be bound)
                continue
            if any(ip.version == n.version and ip in n for n in nets):
                addrs[str(ip)] = None
    return list(addrs)


class ServiceHealthServers:
    """healthCheckNodePort servers, one per Service with a health check: opened when a service
    appears, closed when it goes (or moves port), counts updated in place. With `hosts` a function
    (the addresses NodePorts answer on, which follow the Node's IP with nodePortAddresses
    `primary`), each sync asks it again, and servers on other addresses move. A port that cannot be
    bound on every address is closed on all, logged (and passed to `on_failure`: service, message;
    the run loop records it as kube-proxy's FailedToStartServiceHealthcheck Event) and retried at
    the next sync."""

    def __init__(self, proxy_healthy: Callable[[], bool],
                 hosts: Callable[[], Sequence[str]] | Sequence[str] | None = None, node: str = "") -> None:
        self.proxy_healthy = proxy_healthy
        self._hosts = hosts
        self.node = node
        self.on_failure: Callable[[str, str], None] | None = None
        self._lock = threading.Lock()
        self._entries: dict[str, _ServiceEntry] = {}

    def hosts(self) -> list[str]:
        if self._hosts is None:
            return default_hosts()
        return list(self._hosts() if callable(self._hosts) else self._hosts)

    def entry(self, service: str) -> _ServiceEntry | None:
        with self._lock:
            return self._entries.get(service)

    @property
    def services(self) -> dict[str, int]:
        """Service -> port of every open server."""
        with self._lock:
            return {s: e.port for s, e in self._entries.items()}

    def sync(self, checks: Iterable[HealthCheck]) -> list[str]:
        """Make the servers match `checks`; returns the error messages of ports that failed."""
        want = {h.service: h for h in checks}
        to_close: list[_ServiceEntry] = []
        hosts: tuple[str, ...] | None = tuple(self.hosts()) if want and callable(self._hosts) else None
        with self._lock:
            for svc, e in list(self._entries.items()):
                h = want.get(svc)
                if h is None or h.nodePort != e.port or (hosts is not None and set(e.hosts) != set(hosts)):
                    to_close.append(self._entries.pop(svc))
                else:
                    e.check = h
            missing = [h for svc, h in want.items() if svc not in self._entries]
        for e in to_close:
            for srv in e.servers:
                srv.close()
            moved = " (its addresses changed)" if e.check.service in want and e.port == want[e.check.service].nodePort else ""
            log.info("closed health check server for %s on port %d%s", e.check.service, e.port, moved)
        errors = []
        if missing and hosts is None:
            hosts = tuple(self.hosts())
        for h in missing:
            entry = _ServiceEntry(h, hosts=hosts or ())
            try:
                for host in hosts:
                    entry.servers.append(HTTPServerThread(host, h.nodePort, _ServiceHealthHandler,
                                                          f"healthcheck {h.service}", owner=self,
                                                          service=h.service))
            except BindError as exc:  # all or nothing, as upstream: the next sync retries every address
                for srv in entry.servers:
                    srv.close()
                msg = f'node {self.node} failed to start healthcheck "{h.service}" on port {h.nodePort}: {exc}'
                log.warning("%s", msg)
                errors.append(msg)
                if self.on_failure is not None:
                    self.on_failure(h.service, msg)
                continue
            if entry.servers:
                with self._lock:
                    self._entries[h.service] = entry
                log.info("started health check server for %s on port %d (%s; on %s)", h.service, h.nodePort,
                         describe_counts(h), ", ".join(hosts or ()) or "no address")
        return errors

    def close(self) -> None:
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
        for e in entries:
            for srv in e.servers:
                srv.close()

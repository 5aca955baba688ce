"""Real-packet traffic helpers: background servers and batched probes in a netns.

All probes of one call run in ONE ``ip netns exec`` subprocess (a fresh socket
per probe).  Outcomes:

``ok``          a reply line was received (``server``/``seen_ip``/``seen_port`` set)
``refused``     TCP RST or ICMP port-unreachable (i.e. REJECT) -> ECONNREFUSED
``unreachable`` ICMP host/net-unreachable or admin-prohibited (EHOSTUNREACH,
                ENETUNREACH, EACCES for ICMPv6 admin-prohibited)
``timeout``     nothing came back within ``timeout`` (i.e. DROP)
``error``       anything else (see ``detail``)
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from labcmd import CommandError, ns_argv, run

AGENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "traffic_agent.py")
PYTHON = [sys.executable, "-I", "-S"]

Outcome = Literal["ok", "refused", "timeout", "unreachable", "error"]
T = TypeVar("T")


@dataclass(frozen=True)
class Result:
    """One probe: outcome, answering server name, the peer IP/port the server saw."""

    outcome: Outcome
    server: str | None
    seen_ip: str | None
    elapsed: float
    seen_port: int | None = None
    local_port: int | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


def _probe(proto: str, ns: str | None, ip: str, port: int, count: int, timeout: float,
           source_ip: str | None, source_port: int | None, interval: float) -> list[Result]:
    if count < 1:
        return []
    spec = {"proto": proto, "ip": ip, "port": port, "count": count, "timeout": timeout,
            "source_ip": source_ip, "source_port": source_port, "interval": interval}
    budget = count * (2 * timeout + interval) + 10.0
    cp = run(ns_argv(ns, [*PYTHON, AGENT, "probe", json.dumps(spec)]), timeout=budget)
    try:
        raw = json.loads(cp.stdout)
    except json.JSONDecodeError as exc:
        raise CommandError(list(cp.args), cp.returncode, cp.stdout, cp.stderr) from exc
    return [Result(**r) for r in raw]


def tcp_probe(ns: str | None, ip: str, port: int, count: int = 1, timeout: float = 1.0,
              source_ip: str | None = None, interval: float = 0.0) -> list[Result]:
    """``count`` TCP connects from netns ``ns`` to ``ip:port``, fresh socket each."""
    return _probe("tcp", ns, ip, port, count, timeout, source_ip, None, interval)


def udp_probe(ns: str | None, ip: str, port: int, count: int = 1, timeout: float = 1.0,
              source_port: int | None = None, source_ip: str | None = None,
              interval: float = 0.0) -> list[Result]:
    """``count`` UDP request/replies; with ``source_port`` every probe reuses that local port."""
    return _probe("udp", ns, ip, port, count, timeout, source_ip, source_port, interval)


def concurrently(calls: Sequence[Callable[[], T]]) -> list[T]:
    """Run independent probe calls in parallel threads (results in input order).

    Use it for negative (timeout) cases: N DROP probes then cost one timeout.
    ``concurrently([lambda: lab.tcp("pod1", ip, 80), lambda: lab.udp("ext1", ip, 53)])``
    """
    if not calls:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(calls))) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def outcomes(results: Iterable[Result]) -> Counter[str]:
    """Counter of outcomes, e.g. ``Counter({'ok': 9, 'timeout': 1})``."""
    return Counter(r.outcome for r in results)


def servers(results: Iterable[Result]) -> Counter[str]:
    """Counter of answering server names over the ``ok`` results."""
    return Counter(r.server for r in results if r.outcome == "ok" and r.server)


@dataclass
class Server:
    """A background ``traffic_agent.py serve`` process inside a netns."""

    ns: str | None
    name: str
    ports: tuple[int, ...]
    tcp: bool = True
    udp: bool = True
    proc: subprocess.Popen[str] | None = field(default=None, repr=False)
    argv: list[str] = field(default_factory=list, repr=False)

    def start(self) -> Server:
        """Spawn the server process (does not wait; see ``wait_ready``)."""
        argv = ns_argv(self.ns, [*PYTHON, AGENT, "serve", self.name, *map(str, self.ports)]
                       + ([] if self.tcp else ["--no-tcp"]) + ([] if self.udp else ["--no-udp"]))
        self.argv = argv
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        return self

    def wait_ready(self, ready_timeout: float = 5.0) -> Server:
        """Block until the server printed READY; raise CommandError if it died or timed out."""
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if ready:
                line = self.proc.stdout.readline()
                if line.strip() == "READY":
                    return self
                break  # EOF or garbage: the server died
        self.stop()
        err = self.proc.stderr.read() if self.proc.stderr else ""
        raise CommandError(self.argv, self.proc.returncode if self.proc.returncode is not None else -1,
                           "", err or f"server {self.name} not ready within {ready_timeout}s")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Kill the server process (idempotent)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


def start_servers(specs: Sequence[tuple[str | None, str, Sequence[int]]],
                  ready_timeout: float = 5.0) -> list[Server]:
    """Start ``(ns, name, ports)`` servers concurrently and wait until all are listening."""
    started = [Server(ns, name, tuple(ports)).start() for ns, name, ports in specs]
    try:
        return [s.wait_ready(ready_timeout) for s in started]
    except BaseException:
        for s in started:
            s.stop()
        raise


def start_server(ns: str | None, name: str, ports: Sequence[int], *, tcp: bool = True,
                 udp: bool = True, ready_timeout: float = 5.0) -> Server:
    """Start one server (TCP and/or UDP on all v4+v6 addresses) and wait until listening."""
    return Server(ns, name, tuple(ports), tcp, udp).start().wait_ready(ready_timeout)

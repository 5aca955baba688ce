"""Stale UDP conntrack cleanup: kube-proxy's conntrack reconciler (pkg/proxy/conntrack,
CleanStaleEntries, with its fixes for services without endpoints and for deleted services).

UDP has no teardown: a conntrack entry keeps sending a client that reuses its source port where
its first packet went until the entry times out, which a steady sender never lets happen. So,
per IP family, the UDP entries sent to a frontend of a UDP service port (a ClusterIP, externalIP
or LoadBalancer IP with the port; else its NodePort, on any address) are deleted when their
replies do not come from a serving endpoint of that service port: an endpoint that is gone, or
none at all (an entry made while the frontend did not forward). Serving is ready, or terminating
and still serving, whatever the traffic policies and topology chose (desired.py keeps that set in
servingEndpoints): a flow to an endpoint that is merely no longer picked goes on, as a TCP
connection does. A frontend that a UDP service port had and no longer has is cleaned as one
without endpoints. Every other entry is left alone. (Upstream compares the reply's IP alone; we
compare IP and port, so that flows to a port the endpoint no longer serves go too.)

select_stale() decides, from entries and frontends alone; Reconciler holds what a process knows
between runs (the UDP service ports last taken in, what is due); ConntrackTool is the kernel's
table (listed with the conntrack tool, deleted from over netlink).
"""

from __future__ import annotations

import errno
import logging
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any, Protocol

from .state import FAMILIES, DesiredState, Endpoint, Family, PortChanges, ServicePort

log = logging.getLogger(__name__)

Frontend = tuple[str | None, int]
"""Where a UDP service port is reached: (IP, port), or (None, nodePort) for its NodePort on any address."""


@dataclass(frozen=True, slots=True)
class Entry:
    """A UDP conntrack entry: its original tuple (which names it) and where its replies come from."""

    src: str
    sport: int
    dst: str
    dport: int
    reply_src: str
    reply_sport: int
    zone: int | None = None


def select_stale(entries: Iterable[Entry], serving: Mapping[Frontend, Set[Endpoint]]) -> list[Entry]:
    """The entries to delete, given each frontend's serving endpoints (one family): those sent to a
    frontend whose replies come from none of them. A service IP and port is looked up before a
    NodePort, as the data path does."""
    out = []
    for e in entries:
        endpoints = serving.get((e.dst, e.dport))
        if endpoints is None:
            endpoints = serving.get((None, e.dport))
        if endpoints is not None and Endpoint(e.reply_src, e.reply_sport) not in endpoints:
            out.append(e)
    return out


def frontends(sp: ServicePort) -> list[tuple[Family, Frontend, tuple[Endpoint, ...]]]:
    """A service port's frontends, per family, with that family's serving endpoints."""
    out: list[tuple[Family, Frontend, tuple[Endpoint, ...]]] = []
    for block in sp.families:
        for ip in (block.clusterIP, *block.externalIPs, *block.loadBalancerIPs):
            out.append((block.family, (ip, sp.port), block.servingEndpoints))
        if sp.nodePort is not None:
            out.append((block.family, (None, sp.nodePort), block.servingEndpoints))
    return out


def serving_by_frontend(ports: Iterable[ServicePort]) -> dict[Family, dict[Frontend, frozenset[Endpoint]]]:
    """Per family, the frontends of these (UDP) service ports with their serving endpoints (a
    frontend two ports share: both sets)."""
    sets: dict[Family, dict[Frontend, set[Endpoint]]] = {}
    for sp in ports:
        for family, frontend, endpoints in frontends(sp):
            sets.setdefault(family, {}).setdefault(frontend, set()).update(endpoints)
    return {f: {fe: frozenset(eps) for fe, eps in by.items()} for f, by in sets.items()}


def view_frontends(views: Mapping[str, Mapping[str, Any]]) -> set[tuple[Family, Frontend]]:
    """The frontends in backends' service views ("10.96.0.10:53/udp", "[fd00::a]:53/udp",
    "nodePort 30053/udp", each maybe with " (reject)"); a NodePort in each family the view's
    addresses are of (its clusterIPs are always there), or in the one it names ("IPv6 nodePort
    30053/udp (drop)": its families' verdicts differ, see base.view_entry)."""
    out: set[tuple[Family, Frontend]] = set()
    for view in views.values():
        ips: set[tuple[Family, Frontend]] = set()
        nodeports: set[tuple[Family | None, Frontend]] = set()
        for address in view["addresses"]:
            where = address.split(" (", 1)[0].rsplit("/", 1)[0]
            if where.startswith("nodePort "):
                nodeports.add((None, (None, int(where.split()[1]))))
            elif where.startswith(("IPv4 nodePort ", "IPv6 nodePort ")):
                nodeports.add(("ipv4" if where.startswith("IPv4") else "ipv6", (None, int(where.split()[2]))))
            else:
                host, _, port = where.rpartition(":")
                ip = host.strip("[]")
                ips.add(("ipv6" if ":" in ip else "ipv4", (ip, int(port))))
        families = {family for family, _ in ips}
        out |= ips
        out.update((family, frontend) for named, frontend in nodeports
                   for family in ((named,) if named else FAMILIES) if family in families or named)
    return out


# ---------------------------------------------------------------------------------------------
# The kernel


class Kernel(Protocol):
    def udp_entries(self, family: Family, to: Frontend | None = None) -> list[Entry]: ...

    def delete(self, family: Family, entries: Sequence[Entry]) -> int: ...


_AF = {"ipv4": socket.AF_INET, "ipv6": socket.AF_INET6}


class ConntrackTool:
    """This network namespace's conntrack table: listed with the conntrack tool (conntrack-tools),
    one family's UDP entries, all or those sent to one frontend (filtered by the kernel, >= 5.8);
    exact entries deleted over netlink (pyroute2), each a lookup by its tuple.

    Each side is the fast one: 20k entries listed and split in ~0.16 s, where pyroute2's decoder
    took ~5 s; but `conntrack -D` lists the table again for every entry it deletes (1000 of 20k:
    32 s), where a netlink delete costs ~0.5 ms. pyroute2 is imported only when there is
    something to delete."""

    timeout = 60.0  # seconds one listing may take

    def udp_entries(self, family: Family, to: Frontend | None = None) -> list[Entry]:
        binary = shutil.which("conntrack")
        if binary is None:
            raise OSError("the conntrack tool (conntrack-tools) is not installed")
        argv = [binary, "-L", "-f", family, "-p", "udp"]
        if to is not None:
            argv += ([] if to[0] is None else ["--orig-dst", to[0]]) + ["--orig-port-dst", str(to[1])]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout, check=False)
        if proc.returncode != 0:
            raise OSError(f"conntrack -L: exit {proc.returncode}: {proc.stderr.strip()[-200:]}")
        out = []
        for line in proc.stdout.splitlines():
            entry = parse_entry(line)
            if entry is not None and (to is None or (to[0] in (None, entry.dst) and entry.dport == to[1])):
                out.append(entry)
        return out

    def delete(self, family: Family, entries: Sequence[Entry]) -> int:
        """Delete these entries; returns how many were there to delete."""
        from pyroute2.netlink.exceptions import NetlinkError
        from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple, NFCTSocket

        af, deleted = _AF[family], 0
        with NFCTSocket(nfgen_family=af) as ct:
            for e in entries:
                key = NFCTAttrTuple(family=af, saddr=e.src, daddr=e.dst, proto=socket.IPPROTO_UDP,
                                    sport=e.sport, dport=e.dport)
                try:
                    ct.entry("del", tuple_orig=key, zone=e.zone)
                except NetlinkError as exc:
                    if exc.code != errno.ENOENT:  # (gone meanwhile: timed out, or deleted by another)
                        raise
                else:
                    deleted += 1
        return deleted


def parse_entry(line: str) -> Entry | None:
    """One line of `conntrack -L -p udp`: the first src/dst/sport/dport are the original tuple,
    the second the reply's; None for a line that is not a UDP entry."""
    fields: dict[str, list[str]] = {}
    for token in line.split():
        key, eq, value = token.partition("=")
        if eq:
            fields.setdefault(key, []).append(value)
    try:
        (src, reply_src), (dst, _), (sport, reply_sport), (dport, _) = (
            fields["src"][:2], fields["dst"][:2], fields["sport"][:2], fields["dport"][:2])
        zone = fields.get("zone")
        return Entry(src, int(sport), dst, int(dport), reply_src, int(reply_sport), int(zone[0]) if zone else None)
    except (KeyError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------
# Runs


@dataclass(frozen=True)
class FamilyRun:
    """One family's pass: its duration, the entries it deleted, and why it failed (None: it did not)."""

    family: Family
    seconds: float
    deleted: int
    error: str | None = None


@dataclass(frozen=True)
class Result:
    """One cleanup: a pass per family that has UDP frontends."""

    runs: tuple[FamilyRun, ...]

    @property
    def ok(self) -> bool:
        return all(r.error is None for r in self.runs)


Key = tuple[Family, Frontend]


class Reconciler:
    """The cleanup as a process runs it. take() each desired state as it is applied; run() then
    cleans what is due.

    A full pass (every UDP entry of each family, as kube-proxy's run) is due on the process's
    first run, after drift (recheck()) and after a full pass that failed. After that the table is
    clean, and stays so but where a frontend changes: new flows go to serving endpoints only. So
    a pass is then targeted at the frontends that appeared (flows sent to them before they
    forwarded answer from the frontend itself), that lost serving endpoints, or that are gone:
    only the entries sent to them are listed (the kernel filters them) and judged as a full pass
    would. More than TARGETED_MAX of them in a family: one listing of all (each filtered listing
    walks the whole table in the kernel). A failed pass stays due. Each run's Result goes to
    `listeners` (the metrics) and stays in `last`."""

    TARGETED_MAX = 4  # frontends per family read one by one (20k entries: 28 ms each, 0.17 s all)

    def __init__(self, kernel: Kernel | None = None) -> None:
        self.kernel: Kernel = kernel or ConntrackTool()
        self.full = True
        self.last: Result | None = None
        self.listeners: list[Callable[[Result], None]] = []
        self._changes = PortChanges()
        self._ports: dict[str, ServicePort] = {}  # the UDP service ports taken in, by id
        self._by_frontend: dict[Key, set[str]] = {}  # which of them have each frontend
        self._serving: dict[Key, frozenset[Endpoint]] = {}  # each frontend's serving endpoints
        self._due: set[Key] = set()  # frontends a targeted pass is due for
        self._taken = False

    @property
    def due(self) -> bool:
        return self.full or bool(self._due)

    @property
    def first(self) -> bool:
        """No desired state taken in yet: what was a frontend before this process is not known to it."""
        return not self._taken

    def recheck(self) -> None:
        """Make the next run a full pass (the kernel was not as we left it: entries may have been
        made while our rules were missing)."""
        self.full = True

    def take(self, desired: DesiredState, forgotten: Iterable[Key] = ()) -> None:
        """The desired state now in the kernel (cost: its changes since the last one taken).
        `forgotten`: frontends of UDP service ports the kernel had that this process never saw."""
        self._taken = True
        gone, new = self._changes.update(desired)
        old = [sp for sp in gone if sp.protocol == "UDP"]
        added = [sp for sp in new if sp.protocol == "UDP"]
        touched: set[Key] = set()
        for sp in old:
            self._ports.pop(sp.id, None)
            for family, frontend, _ in frontends(sp):
                self._by_frontend.get((family, frontend), set()).discard(sp.id)
                touched.add((family, frontend))
        for sp in added:
            self._ports[sp.id] = sp
            for family, frontend, _ in frontends(sp):
                self._by_frontend.setdefault((family, frontend), set()).add(sp.id)
                touched.add((family, frontend))
        for key in touched:
            before = self._serving.pop(key, None)
            ids = self._by_frontend.get(key)
            now: frozenset[Endpoint] | None = None
            if ids:
                self._serving[key] = now = serving_by_frontend(self._ports[i] for i in ids)[key[0]][key[1]]
            else:
                self._by_frontend.pop(key, None)
            if before is None or now is None or not before or before - now:  # (appeared, gone, lost)
                self._due.add(key)
        if forgotten:
            self.full = True
            self._due.update(forgotten)

    def run(self) -> Result | None:
        """Clean if due (None: it was not). A failed pass stays due."""
        if not self.due:
            return None
        runs = []
        for family in FAMILIES:
            due = sorted((frontend for f, frontend in self._due if f == family), key=str)
            if not self.full and not due:
                continue
            serving = {frontend: eps for (f, frontend), eps in self._serving.items() if f == family}
            if not serving and not due:
                continue  # no UDP frontend in this family: nothing to read
            for frontend in due:
                serving.setdefault(frontend, frozenset())  # gone: none serves it
            whole = self.full or len(due) > self.TARGETED_MAX
            runs.append(self._run_family(family, None if whole else due, serving))
        result = Result(tuple(runs))
        if result.ok:
            self.full = False
            self._due.clear()
        self.last = result
        for listener in self.listeners:
            listener(result)
        return result

    def _run_family(self, family: Family, targets: list[Frontend] | None,
                    serving: Mapping[Frontend, Set[Endpoint]]) -> FamilyRun:
        """One family's pass over all its UDP entries (targets None) or those sent to these frontends."""
        start = time.monotonic()
        try:
            if targets is None:
                entries = self.kernel.udp_entries(family)
            else:
                entries = [e for frontend in targets for e in self.kernel.udp_entries(family, frontend)]
            stale = select_stale(entries, serving)
            deleted = self.kernel.delete(family, stale) if stale else 0
        except Exception as exc:  # noqa: BLE001 - no conntrack tool, a kernel error: retried next time
            seconds = time.monotonic() - start
            log.warning("stale UDP conntrack cleanup (%s) failed, to be retried: %s", family, exc)
            return FamilyRun(family, seconds, 0, str(exc) or type(exc).__name__)
        seconds = time.monotonic() - start
        log.log(logging.INFO if deleted else logging.DEBUG, "deleted %d stale UDP conntrack entries (%s) in %.3f s",
                deleted, family, seconds)
        return FamilyRun(family, seconds, deleted)


RECONCILER = Reconciler()
"""The process's cleanup (reconcile.apply() runs it); read RECONCILER.last, or add a listener."""

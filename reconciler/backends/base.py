"""What every backend provides, and the records they exchange with the planner."""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Callable, IO, Any, Literal, Protocol

from ..state import DesiredState, family_name

Action = Literal["+", "-", "~"]


@dataclass(frozen=True, slots=True)
class Operation:
    """One kernel operation: `text` is what the backend executes (one line of its batch format).

    A chain rewritten whole (flushed, then filled again) says, for people reading the plan, what
    that changes: the flush's `drops` are the rules it held (each as it reads inside the chain)
    that are not written back, and a rule written back as it was `restates` it.
    """

    action: Action
    kind: str  # table, chain, rule, set, map, element
    name: str  # the object, e.g. "ip reconciler-07 chain svc-default/web/http/tcp"
    text: str
    service: str | None = None  # the service port it belongs to, when there is one
    drops: tuple[str, ...] = ()
    restates: bool = False

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"action": self.action, "kind": self.kind, "object": self.name, "command": self.text}
        if self.service:
            d["service"] = self.service
        if self.drops:
            d["drops"] = list(self.drops)
        if self.restates:
            d["restates"] = True
        return d


def view_sets() -> dict[str, set[str]]:
    """What a backend's service_view collects of one service port, for view_entry(). "endpoints"
    are those its cluster traffic (to its ClusterIP) reaches; a backend adds "external", the
    endpoints traffic to its external addresses (nodePort, externalIPs, LB IPs) from outside this
    node reaches, for a service port whose rules DNAT that traffic on a path of its own."""
    return {"addresses": set(), "endpoints": set(), "sources": set(), "affinity": set()}


def view_entry(sets: dict[str, set[str]]) -> dict[str, list[str]]:
    """One service port's view (Backend.service_view) from its view_sets(), sorted: its addresses,
    endpoints, the endpoints its external traffic reaches when they are others (see
    _other_endpoints), the sources its load balancer IPs allow ("172.30.0.0/24": a network,
    whatever the kernel tool printed) and its session affinity ("ClientIP 600s"); the last three
    only when it has them.

    An address that also has a verdict ("X (drop)", "X (reject)": new traffic to it is refused
    before any DNAT) is listed with its verdict alone: "X" beside "X (drop)" read as a
    contradiction."""
    addresses = _nodeports_by_family(sets["addresses"])
    refused = {a.split(" (", 1)[0] for a in addresses if a.endswith(")")}
    view = {"addresses": sorted(a for a in addresses if a not in refused), "endpoints": sorted(sets["endpoints"])}
    external = sets.get("external")
    if external and _other_endpoints(external, sets["endpoints"]):
        view["externalEndpoints"] = sorted(external)
    if sets["sources"]:
        nets = {ipaddress.ip_network(r, strict=False) for r in sets["sources"]}
        view["sourceRanges"] = [str(n) for n in sorted(nets, key=lambda n: (n.version, n))]  # type: ignore[operator]
    if sets["affinity"]:
        view["affinity"] = sorted(sets["affinity"])
    return view


def nodeport_address(addr: str, family: str) -> str:
    """An address for view_sets(): a nodePort one (no IP to tell its family by) with its family
    ("ipv4", "ipv6"), for view_entry to tell the families apart where their verdicts differ."""
    return f"{family}|{addr}" if addr.startswith("nodePort ") else addr


def _nodeports_by_family(addresses: set[str]) -> set[str]:
    """The nodePort addresses of nodeport_address() as one, "nodePort 30080/tcp[ (verdict)]", when
    every family has the same verdict; else one per family ("IPv4 nodePort 30080/tcp (drop)",
    "IPv6 nodePort 30080/tcp"): a dual-stack port dropped in one family (externalTrafficPolicy
    Local, no local endpoint of that family) still works in the other."""
    out: set[str] = set()
    verdicts: dict[str, dict[str, str]] = {}  # "nodePort 30080/tcp" -> family -> verdict ("": none)
    for a in addresses:
        family, tagged, addr = a.partition("|")
        if not tagged:
            out.add(a)
            continue
        port, _, verdict = addr.partition(" (")
        known = verdicts.setdefault(port, {})
        known[family] = known.get(family) or verdict.rstrip(")")  # (a verdict wins over none)
    for port, by_family in verdicts.items():
        if len(set(by_family.values())) == 1:
            verdict = next(iter(by_family.values()))
            out.add(f"{port} ({verdict})" if verdict else port)
            continue
        for family, verdict in by_family.items():
            label = f"{family_name(family)} {port}"  # type: ignore[arg-type]
            out.add(f"{label} ({verdict})" if verdict else label)
    return out


def _other_endpoints(external: set[str], cluster: set[str]) -> bool:
    """Whether external traffic reaches other endpoints than cluster traffic in an IP family it is
    DNATed in ("[...]:port" are IPv6): externalTrafficPolicy Local (this node's endpoints alone),
    or internalTrafficPolicy Local the other way round. (A family without external addresses,
    e.g. an externalIP of one family, differs in nothing; one whose external traffic is DNATed
    nowhere shows that as its addresses' verdict.)"""
    if external == cluster:
        return False
    return any({e for e in external if (e[0] == "[") == v6} != {e for e in cluster if (e[0] == "[") == v6}
               for v6 in {e[0] == "[" for e in external})


class Backend(Protocol):
    """A kernel load-balancing backend (nftables, iptables, ...)."""

    mode: str

    def render(self, desired: DesiredState) -> Any:
        """The kernel model that makes the kernel implement `desired`."""

    def observe(self, beside_work: bool = False) -> Any:
        """The kernel model read back from the kernel (only objects this tool owns). `beside_work`:
        other heavy work shares the machine meanwhile (the one-shot commands' read, in a child,
        while the manifests load): run one kernel tool at a time rather than several."""

    def diff(self, desired: Any, observed: Any) -> list[Operation]:
        """Minimal ordered operations turning `observed` into `desired`."""

    def before_diff(self, desired: Any) -> None:
        """Work for diffing `desired` that can be done before the kernel is read (the one-shot
        commands call it while the read runs; nothing it keeps may outlive the command)."""

    def unconverged(self, desired: Any) -> list[Operation]:
        """diff(desired, observe()): what the kernel still lacks (verification after apply)."""

    def apply(self, operations: list[Operation]) -> list[int] | None:
        """Execute operations atomically: one `nft -f` transaction; for iptables one restore per
        family whose tables each commit atomically. Raises on failure. Returns the nf_tables
        generations its commits produced, in order (none for a transaction that changed nothing,
        or for legacy iptables), or None when the backend cannot tell which (see drift.py and
        reconcile.apply, which trust the generation only as far as these name our commits)."""

    def foreign(self, operation: Operation) -> str | None:
        """Why `operation` (from a saved plan, which may have been edited) is not one this backend
        makes: it names an object the tool does not own, or its command is not about its object;
        None when it is one of ours."""

    def prepare(self, operations: list[Operation]) -> Callable[[], list[int] | None]:
        """apply(operations) in two steps: the transaction written now (its text), run when the
        returned function is called, once (reconcile.apply writes it before describing the plan
        in service terms beside the kernel tool: two threads writing at once would each go at
        half speed)."""

    def generation(self) -> int | None:
        """The kernel's ruleset generation, moved by every commit that changes anything, ours
        included (see backends/generation.py); None when it does not cover our objects (legacy
        iptables)."""

    def service_view(self, model: Any, only: set[str] | None = None) -> dict[str, dict[str, Any]]:
        """Per service port (or just those in `only`): its addresses, endpoints (its external
        traffic's too, when others), source ranges and affinity as a model shows them (for
        people; see view_entry)."""

    def removed_unnamed(self, observed: Any, operations: list[Operation]) -> set[str]:
        """The service ports whose objects the operations remove without naming them (with a whole
        table, or a shared chain rewritten whole, as `observed` holds it): with the operations'
        own, what a plan touches. Cheap when there are none (asked of every plan)."""

    def cleanup(self, look_first: bool = False) -> list[Operation]:
        """Operations removing every kernel object this tool owns (and nothing else). `look_first`:
        when little is expected to be there, list what is before reading it, if that costs a
        one-shot command less (it may cost a long-running one memory)."""

    def model_to_dict(self, model: Any) -> dict[str, Any]:
        """The model as plain data (for `observe -o json|yaml`)."""


class KernelError(Exception):
    """A kernel tool failed; carries its command and output. `partial`: part of the transaction
    may have been committed (an iptables restore commits table by table, and family by family;
    an nft transaction never)."""

    partial: bool = False


# The longest a kernel tool may run before it is killed and its sync fails (then retried as any
# failure is): a tool that hangs (a wedged netlink socket, a lock someone keeps) would otherwise
# stop the run loop for good, unseen while no change waits. ~30x what 10k services take here.
TOOL_TIMEOUT = 300.0


def timed_out(argv: list[str], seconds: float) -> KernelError:
    return KernelError(f"{argv[0]}: no answer in {seconds:g} s: killed (a tool that hangs, or a lock held that long)")


class SpooledInput:
    """A kernel tool's input, written a piece at a time (whole lines): kept as its pieces while it
    is at most `limit` characters, past that in a memory file, so that a big transaction is never
    one string beside the pieces it was made of (10k services, a cold start's `nft -f` text:
    ~15 MB twice, the run process's peak). `noticed`: whether a piece matched `notice`."""

    def __init__(self, limit: int, notice: re.Pattern[str] | None = None) -> None:
        self.limit = limit
        self.size = 0  # characters written
        self.noticed = False
        self._notice = notice
        self._parts: list[str] = []
        self._buffered = 0
        self._file: IO[bytes] | None = None
        self.closed = False

    def write(self, piece: str) -> None:
        self.size += len(piece)
        self._buffered += len(piece)
        self._parts.append(piece)
        if not self.noticed and self._notice is not None and self._notice.search(piece):
            self.noticed = True
        if self._buffered > (self.limit if self._file is None else _CHUNK):
            self._spill()

    @property
    def in_memory(self) -> bool:
        return self._file is None

    def text(self) -> str:
        """All of it as one string (a big one's only when it must be: a failed transaction's)."""
        if self.closed:
            raise ValueError("SpooledInput used after close()")
        if self._file is None:
            return "".join(self._parts)
        self._spill()
        self._file.seek(0)
        return self._file.read().decode()

    def file(self) -> IO[bytes]:
        """The memory file, all written and read from its start."""
        self._spill()
        assert self._file is not None
        self._file.seek(0)
        return self._file

    def close(self) -> None:
        self.closed = True
        self._parts = []
        if self._file is not None:
            self._file.close()

    def _spill(self) -> None:
        if self.closed:
            raise ValueError("SpooledInput used after close()")
        if self._file is None:
            self._file = _memory_file()
        parts, self._parts, self._buffered = self._parts, [], 0  # (a write that fails loses them: never twice)
        self._file.seek(0, os.SEEK_END)
        self._file.write("".join(parts).encode())


def run_tool(argv: list[str], stdin: str | list[str] | SpooledInput | None = None
             ) -> subprocess.CompletedProcess[str]:
    """Run a kernel tool (`nft -f -`, `iptables-restore`, `nft list table`, ...) to completion,
    its output captured. KernelError when it cannot be started.

    Its input (a text, its lines, or a SpooledInput) and its output are files in memory, not pipes: a big
    transaction (10k services: 10-24 MB) is read at the tool's own pace while this process's
    threads do other work, and a big listing (10k services: ~10 MB of `nft list table`) is
    written at the tool's pace and read here in one go. A pipe costs this process a wake-up and
    the interpreter lock every few KiB: reading the 10k listings through pipes took ~0.4 s of its
    CPU, from memory files ~0.02 s. The input is written a piece at a time: no second copy of it
    in this process. The output is read as UTF-8, a byte that is not becoming U+FFFD (a rule
    that then differs from ours is rewritten, never a crash); stdin is /dev/null without input.
    A tool still running after TOOL_TIMEOUT seconds is killed: KernelError.
    """
    timeout = TOOL_TIMEOUT
    try:
        with _memory_file() as out, _memory_file() as err:
            if stdin is None:
                proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, check=False,
                                      timeout=timeout)
            elif isinstance(stdin, SpooledInput):
                proc = subprocess.run(argv, stdin=stdin.file(), stdout=out, stderr=err, check=False, timeout=timeout)
            else:
                with _memory_file() as fh:
                    if isinstance(stdin, str):
                        for i in range(0, len(stdin), _CHUNK):
                            fh.write(stdin[i:i + _CHUNK].encode())
                    else:
                        for i in range(0, len(stdin), _CHUNK_LINES):
                            fh.write(("\n".join(stdin[i:i + _CHUNK_LINES]) + "\n").encode())
                    fh.seek(0)
                    proc = subprocess.run(argv, stdin=fh, stdout=out, stderr=err, check=False, timeout=timeout)
            return subprocess.CompletedProcess(argv, proc.returncode, _text(out), _text(err))
    except subprocess.TimeoutExpired:
        raise timed_out(argv, timeout) from None
    except OSError as exc:
        raise KernelError(f"{argv[0]}: {exc}") from None


_CHUNK = 1 << 20  # characters
_CHUNK_LINES = 8192


def _text(fh: IO[bytes]) -> str:
    fh.seek(0)
    return fh.read().decode(errors="replace")


def _memory_file() -> IO[bytes]:
    try:
        return open(os.memfd_create("service-reconciler-io"), "w+b")
    except (AttributeError, OSError):  # no memfd (not Linux, or an old kernel)
        return tempfile.TemporaryFile()

"""Dual-stack network-namespace lab for real-packet e2e tests (no product code).

Topology (namespace names are ``<prefix><host>``, prefix e.g. ``sr4711a-``)::

       ext1 .100     ext2 .101        LAN 172.30.0.0/24 + fd00:30::/64 = bridge
           |             |            br0 in ns "lan".  Also in "lan": veth
     +-----+--- br0 -----+-----+      "rtr" .1 / ::1 = upstream router with
     |    (ns lan, rtr .1)     |      forwarding off + blackhole defaults, so
     | eth0 .2         eth0 .3 |      whatever it is sent is silently dropped.
   [node] node-a        [node2] node-b
   calipod1  calipod2     calipod3
     |         |            |
   pod1       pod2         pod3
   10.244.1.10 10.244.1.11  10.244.2.10
   fd00:244:1::10 ::11      fd00:244:2::10

* Pods (Calico style): /32 + /128 on eth0, default via 169.254.1.1 (answered
  by proxy_arp on the node's cali veth) and via fe80::1 (assigned to every
  node-side cali veth).  Nodes route each pod with a /32 (/128) on its veth.
* node routes 10.244.2.0/24 / fd00:244:2::/64 via node2; node2 routes
  10.244.1.0/24 / fd00:244:1::/64 via node and defaults via node.
* node defaults via the lan router (172.30.0.1 / fd00:30::1), so locally
  originated ClusterIP traffic is routable (and then dropped if no rule hits).
* ext1/ext2 route the service CIDRs, the external/LB range and node's pod
  CIDR via node (172.30.0.2), pod3's CIDR via node2 (like BGP).
* LB / external IPs are NOT assigned anywhere; see ``add_node_address``.
* ICMP rate limiting is disabled in every namespace so REJECT is deterministic.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Literal

from labcmd import CommandError, ip_batch, ns_argv, parallel, run, run_all
from traffic import Result, Server, start_server, start_servers, tcp_probe, udp_probe

Family = Literal[4, 6]
FAMILIES: tuple[Family, Family] = (4, 6)

HOSTS: tuple[str, ...] = ("lan", "node", "node2", "pod1", "pod2", "pod3", "ext1", "ext2")
NODES: tuple[str, ...] = ("node", "node2")
PODS: dict[str, str] = {"pod1": "node", "pod2": "node", "pod3": "node2"}  # pod -> its node
EXTERNALS: tuple[str, ...] = ("ext1", "ext2")

ADDR: dict[str, dict[int, str]] = {
    "lan": {4: "172.30.0.1", 6: "fd00:30::1"},
    "node": {4: "172.30.0.2", 6: "fd00:30::2"},
    "node2": {4: "172.30.0.3", 6: "fd00:30::3"},
    "ext1": {4: "172.30.0.100", 6: "fd00:30::100"},
    "ext2": {4: "172.30.0.101", 6: "fd00:30::101"},
    "pod1": {4: "10.244.1.10", 6: "fd00:244:1::10"},
    "pod2": {4: "10.244.1.11", 6: "fd00:244:1::11"},
    "pod3": {4: "10.244.2.10", 6: "fd00:244:2::10"},
}
LAN_CIDR: dict[int, str] = {4: "172.30.0.0/24", 6: "fd00:30::/64"}
SERVICE_CIDR: dict[int, str] = {4: "10.96.0.0/16", 6: "fd00:96::/64"}
EXTERNAL_CIDR: dict[int, str] = {4: "172.30.1.0/24", 6: "fd00:31::/64"}
CLUSTER_CIDR: dict[int, str] = {4: "10.244.0.0/16", 6: "fd00:244::/32"}
POD_CIDR: dict[str, dict[int, str]] = {
    "node": {4: "10.244.1.0/24", 6: "fd00:244:1::/64"},
    "node2": {4: "10.244.2.0/24", 6: "fd00:244:2::/64"},
}
POD_GATEWAY: dict[int, str] = {4: "169.254.1.1", 6: "fe80::1"}
PLEN: dict[int, int] = {4: 32, 6: 128}
LAN_PLEN: dict[int, int] = {4: 24, 6: 64}
NODE_LAN_IF = "eth0"
SERVER_PORTS: tuple[int, ...] = (8080, 9090)

_COMMON_SYSCTLS = [
    "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0",
    "net.ipv4.conf.all.accept_redirects=0", "net.ipv4.conf.default.accept_redirects=0",
    "net.ipv4.conf.all.send_redirects=0", "net.ipv4.conf.default.send_redirects=0",
    "net.ipv6.conf.all.accept_redirects=0", "net.ipv6.conf.default.accept_redirects=0",
    "net.ipv6.conf.all.accept_dad=0", "net.ipv6.conf.default.accept_dad=0",
    "net.ipv6.conf.all.accept_ra=0", "net.ipv6.conf.default.accept_ra=0",
    "net.ipv4.icmp_ratelimit=0", "net.ipv4.icmp_ratemask=0",
    "net.ipv6.icmp.ratelimit=0",
]
_NODE_SYSCTLS = [
    "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1",
    "net.ipv4.conf.all.route_localnet=1", "net.ipv4.conf.default.route_localnet=1",
    # Re-assert after ip_forward (which resets per-device settings).
    "net.ipv4.conf.all.send_redirects=0", "net.ipv4.conf.default.send_redirects=0",
]

_live_labs: set[Lab] = set()
_counter_lock = threading.Lock()
_counter = 0


def _atexit_cleanup() -> None:
    for lab in list(_live_labs):
        lab.close()


atexit.register(_atexit_cleanup)


def skip_reason() -> str | None:
    """Why the lab cannot run on this machine (for ``pytest.skip``), or None."""
    if os.geteuid() != 0:
        return "e2e lab needs root (creates network namespaces)"
    for tool in ("ip", "sysctl"):
        if shutil.which(tool) is None:
            return f"e2e lab needs `{tool}` on PATH"
    return None


def list_netns() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    out = run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _new_prefix() -> str:
    global _counter
    existing = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
    with _counter_lock:
        while True:
            _counter += 1
            prefix = f"sr{os.getpid() % 10000:04d}{_counter:x}-"
            if not any(name.startswith(prefix) for name in existing):
                return prefix


class Lab:
    """The namespace lab.  Use ``with Lab() as lab:`` (or the ``lab`` pytest fixture).

    Attributes: ``prefix``; ``ns[host]`` namespace names (also ``lab.node``,
    ``lab.pod1``, ...); ``ip[host][family]`` addresses; ``node_lan_ip[family]``;
    ``node_if[host]`` node-side interface names (``"lan"`` -> ``eth0``,
    ``"pod1"`` -> ``calipod1``...); ``servers`` started via ``start_server``.
    """

    def __init__(self) -> None:
        self.prefix: str = _new_prefix()
        self.ns: dict[str, str] = {h: f"{self.prefix}{h}" for h in HOSTS}
        self.ip: dict[str, dict[int, str]] = {h: dict(a) for h, a in ADDR.items()}
        self.node_lan_ip: dict[int, str] = dict(ADDR["node"])
        self.node_if: dict[str, str] = {"lan": NODE_LAN_IF, **{p: f"cali{p}" for p in PODS}}
        self.servers: list[Server] = []
        self.setup_seconds: float = 0.0
        self._made: list[str] = []  # namespaces this instance created (only these are deleted)
        self._made_lock = threading.Lock()
        self.lan, self.node, self.node2 = self.ns["lan"], self.ns["node"], self.ns["node2"]
        self.pod1, self.pod2, self.pod3 = self.ns["pod1"], self.ns["pod2"], self.ns["pod3"]
        self.ext1, self.ext2 = self.ns["ext1"], self.ns["ext2"]

    # ------------------------------------------------------------ lifecycle --

    def __enter__(self) -> Lab:
        return self.setup()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def setup(self) -> Lab:
        """Create namespaces, links, addresses, routes and sysctls (~0.1-0.3 s)."""
        t0 = time.monotonic()
        _live_labs.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self.setup_seconds = time.monotonic() - t0
        return self

    def close(self) -> None:
        """Stop servers, kill leftover processes in our namespaces, delete them (idempotent)."""
        for srv in self.servers:
            srv.stop()
        self.servers.clear()
        mine = list(self._made)
        if mine:
            for name in mine:  # anything still running inside would keep the netns alive
                for pid in run(["ip", "netns", "pids", name], check=False).stdout.split():
                    try:
                        os.kill(int(pid), 9)
                    except (ProcessLookupError, ValueError):
                        pass
            ip_batch(None, [f"netns del {n}" for n in mine], force=True)
            self._made.clear()
            left = [n for n in list_netns() if n in mine]
            if left:
                raise CommandError(["ip", "netns", "del", *left], 1, "", "namespaces survived close()")
        _live_labs.discard(self)

    def _build(self) -> None:
        ns = self.ns

        def add_netns(name: str) -> None:
            run(["ip", "netns", "add", name])  # fails if the name exists: never adopt one
            with self._made_lock:
                self._made.append(name)

        names = list(ns.values())
        add_netns(names[0])  # the first one may have to turn /run/netns into a mount point
        run_all([functools.partial(add_netns, n) for n in names[1:]])

        # 1. sysctls first, so devices created later inherit the defaults (accept_dad=0...).
        def sysctls(h: str) -> list[str]:
            # lan: only rtr (not br0) may answer ARP for the router address
            extra = _NODE_SYSCTLS if h in NODES else ["net.ipv4.conf.all.arp_ignore=1"] if h == "lan" else []
            v6mask = ["net.ipv6.icmp.ratemask="] if os.path.exists("/proc/sys/net/ipv6/icmp/ratemask") else []
            return ns_argv(ns[h], ["sysctl", "-q", "-w", *_COMMON_SYSCTLS, *extra, *v6mask])
        parallel([[(sysctls(h), None)] for h in HOSTS])

        # 2. links (veth peers are created directly inside the peer namespace).  Every
        # device gets a lab-unique ifindex: a veth whose peer has the SAME ifindex (easy
        # across namespaces) gets its carrier-up handled by linkwatch as non-urgent,
        # i.e. up to 1 s later, and until then its qdisc is noop and drops packets.
        index = iter(range(10, 100))
        links: dict[str, list[str]] = {h: ["link set lo up"] for h in HOSTS}
        links["lan"] += [f"link add br0 index {next(index)} type bridge stp_state 0"
                         " forward_delay 0 mcast_snooping 0",
                         # The router address lives on a veth, not on br0: br0's own
                         # carrier-up is a non-urgent linkwatch event (up to 1 s).
                         f"link add rtr index {next(index)} type veth peer name p-rtr index {next(index)}"]
        for h in (*NODES, *EXTERNALS):
            links[h].append(f"link add eth0 index {next(index)} type veth"
                            f" peer name p-{h} index {next(index)} netns {ns['lan']}")
        for pod, node in PODS.items():
            links[node].append(f"link add cali{pod} index {next(index)} type veth"
                               f" peer name eth0 index {next(index)} netns {ns[pod]}")
        parallel([[(["ip", "-n", ns[h], "-batch", "-"], "\n".join(c) + "\n")] for h, c in links.items()])

        # 3. addresses + routes (per namespace, concurrently).
        cfg: dict[str, list[str]] = {h: [] for h in HOSTS}
        cfg["lan"] += ["link set br0 up"]
        for port in ("p-rtr", *(f"p-{h}" for h in (*NODES, *EXTERNALS))):
            cfg["lan"] += [f"link set {port} master br0", f"link set {port} up"]
        cfg["lan"] += ["link set rtr up", self._addr("rtr", ADDR["lan"], 4),
                       self._addr("rtr", ADDR["lan"], 6),
                       # the upstream router silently drops what it cannot deliver
                       # (without this, IPv6 answers ICMPv6 no-route even with forwarding off)
                       "route add blackhole 0.0.0.0/0", "route add blackhole ::/0"]
        for h in (*NODES, *EXTERNALS):
            cfg[h] += ["link set eth0 up", self._addr("eth0", ADDR[h], 4), self._addr("eth0", ADDR[h], 6)]
        for pod, node in PODS.items():
            dev = f"cali{pod}"
            cfg[node] += [f"link set {dev} up", f"addr add fe80::1/64 dev {dev} nodad",
                          f"route add {ADDR[pod][4]}/32 dev {dev} scope link",
                          f"route add {ADDR[pod][6]}/128 dev {dev}"]
            cfg[pod] += ["link set eth0 up",
                         f"addr add {ADDR[pod][4]}/32 dev eth0",
                         f"addr add {ADDR[pod][6]}/128 dev eth0 nodad",
                         f"route add {POD_GATEWAY[4]}/32 dev eth0 scope link",
                         f"route add 0.0.0.0/0 via {POD_GATEWAY[4]} dev eth0",
                         f"route add ::/0 via {POD_GATEWAY[6]} dev eth0"]
        for fam in FAMILIES:
            default = "0.0.0.0/0" if fam == 4 else "::/0"
            cfg["node"] += [f"route add {POD_CIDR['node2'][fam]} via {ADDR['node2'][fam]} dev eth0",
                            f"route add {default} via {ADDR['lan'][fam]} dev eth0"]
            cfg["node2"] += [f"route add {POD_CIDR['node'][fam]} via {ADDR['node'][fam]} dev eth0",
                             f"route add {default} via {ADDR['node'][fam]} dev eth0"]
            for h in EXTERNALS:
                for cidr in (SERVICE_CIDR[fam], EXTERNAL_CIDR[fam], POD_CIDR["node"][fam]):
                    cfg[h].append(f"route add {cidr} via {ADDR['node'][fam]} dev eth0")
                cfg[h].append(f"route add {POD_CIDR['node2'][fam]} via {ADDR['node2'][fam]} dev eth0")
        groups: list[list[tuple[list[str], str | None]]] = []
        for h, c in cfg.items():
            group: list[tuple[list[str], str | None]] = [
                (["ip", "-n", ns[h], "-batch", "-"], "\n".join(c) + "\n")]
            if h in NODES:
                # proxy_arp answers are randomly delayed up to 0.8 s unless proxy_delay=0
                # (Calico does the same; neigh/default/* only exists in the init netns).
                proxy = [f"net.ipv4.{k}.cali{p}.{v}" for p, n in PODS.items() if n == h
                         for k, v in (("conf", "proxy_arp=1"), ("neigh", "proxy_delay=0"))]
                group.append((ns_argv(ns[h], ["sysctl", "-q", "-w", *proxy]), None))
            groups.append(group)
        parallel(groups)
        self._wait_ready()

    @staticmethod
    def _addr(dev: str, addrs: dict[int, str], fam: int) -> str:
        return f"addr add {addrs[fam]}/{LAN_PLEN[fam]} dev {dev}" + (" nodad" if fam == 6 else "")

    def _wait_ready(self, timeout: float = 3.0) -> None:
        """Poll until every link (but lo and the address-less br0) is operationally UP
        with a real qdisc, bridge ports forward and no IPv6 address is tentative."""
        def not_ready(h: str) -> list[str]:
            links = run(["ip", "-n", self.ns[h], "-d", "-o", "link", "show"]).stdout.splitlines()
            bad = [ln.split()[1] for ln in links if not ln.split()[1].startswith(("lo:", "br0:"))
                   and (" state UP " not in ln or "qdisc noop" in ln
                        or ("bridge_slave" in ln and "bridge_slave state forwarding" not in ln))]
            if run(["ip", "-n", self.ns[h], "-6", "addr", "show", "tentative"]).stdout.strip():
                bad.append("tentative-ipv6")
            return bad

        deadline = time.monotonic() + timeout
        pending = {h: not_ready(h) for h in HOSTS}
        while any(pending.values()):  # usually already empty on the first pass
            if time.monotonic() > deadline:
                raise CommandError(["ip", "-d", "-o", "link", "show"], 1, "",
                                   f"lab links not ready after {timeout}s: {pending}")
            time.sleep(0.01)
            pending = {h: not_ready(h) for h, bad in pending.items() if bad}

    # -------------------------------------------------------------- helpers --

    def netns(self, host: str) -> str:
        """Namespace name for a host key (``"node"``) or pass-through of a namespace name."""
        return self.ns.get(host, host)

    def addr(self, host: str, family: int = 4) -> str:
        """IP of ``host`` in ``family`` (4 or 6)."""
        return self.ip[host][family]

    def exec(self, host: str, argv: Sequence[str], *, input: str | None = None,
             check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside ``host``'s namespace; raise CommandError on failure if ``check``."""
        return run(ns_argv(self.netns(host), argv), input=input, check=check, timeout=timeout)

    def nft(self, host: str, script: str) -> None:
        """Apply an ``nft -f -`` script inside ``host``'s namespace."""
        self.exec(host, ["nft", "-f", "-"], input=script)

    def sysctl(self, host: str, key: str, value: str | int) -> None:
        """Set one sysctl inside ``host``'s namespace."""
        self.exec(host, ["sysctl", "-q", "-w", f"{key}={value}"])

    def add_node_address(self, ip: str, where: Literal["lo", "lan"] = "lo", host: str = "node") -> None:
        """Assign ``ip`` (/32 or /128) to the node's loopback or LAN interface."""
        dev = "lo" if where == "lo" else NODE_LAN_IF
        fam = 6 if ":" in ip else 4
        ip_batch(self.netns(host), [f"addr add {ip}/{PLEN[fam]} dev {dev}" + (" nodad" if fam == 6 else "")])

    def del_node_address(self, ip: str, where: Literal["lo", "lan"] = "lo", host: str = "node") -> None:
        """Remove an address added by ``add_node_address``."""
        dev = "lo" if where == "lo" else NODE_LAN_IF
        fam = 6 if ":" in ip else 4
        ip_batch(self.netns(host), [f"addr del {ip}/{PLEN[fam]} dev {dev}"])

    def start_server(self, host: str, name: str | None = None, ports: Sequence[int] = SERVER_PORTS,
                     *, tcp: bool = True, udp: bool = True) -> Server:
        """Start a reply server in ``host`` (named ``name`` or the host key); stopped on close()."""
        srv = start_server(self.netns(host), name or host, ports, tcp=tcp, udp=udp)
        self.servers.append(srv)
        return srv

    def start_pod_servers(self, ports: Sequence[int] = SERVER_PORTS) -> list[Server]:
        """Start servers named pod1/pod2/pod3 on ``ports`` (TCP+UDP) concurrently."""
        srvs = start_servers([(self.ns[p], p, ports) for p in PODS])
        self.servers.extend(srvs)
        return srvs

    def tcp(self, host: str, ip: str, port: int, count: int = 1, timeout: float = 1.0,
            source_ip: str | None = None, interval: float = 0.0) -> list[Result]:
        """``tcp_probe`` from ``host``'s namespace."""
        return tcp_probe(self.netns(host), ip, port, count, timeout, source_ip, interval)

    def udp(self, host: str, ip: str, port: int, count: int = 1, timeout: float = 1.0,
            source_port: int | None = None, source_ip: str | None = None,
            interval: float = 0.0) -> list[Result]:
        """``udp_probe`` from ``host``'s namespace."""
        return udp_probe(self.netns(host), ip, port, count, timeout, source_port, source_ip, interval)

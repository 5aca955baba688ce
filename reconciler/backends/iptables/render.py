"""DesiredState -> iptables model. A plain renderer: every decision is already in the document.

Layout per IP family (iptables for ipv4, ip6tables for ipv6), making the same decisions as the nftables
renderer (the mechanics differ where iptables must, e.g. source ranges); every name starts with ``RECONCILER-`` and fits the 28-character limit:

nat table
  RECONCILER-SERVICES     hooked from PREROUTING and OUTPUT; one rule per (address, port) that is
                          DNATed, then the jump to RECONCILER-NODEPORTS for local destinations
  RECONCILER-NODEPORTS    one rule per nodePort that is DNATed
  RECONCILER-SVC-<hash>   ClusterIP traffic of one service port: masquerade non-pod sources, then
                          pick an endpoint (`-m recent` affinity, `-m statistic` cascade that DNATs
                          directly, or jumps to the endpoint's SEP chain when it has one)
  RECONCILER-EXT-<hash>   external traffic (nodePort, externalIPs, LB IPs) of one service port (ETP
                          Local: traffic from a remote endpoint pod is masqueraded: it may hairpin;
                          without local endpoints entered with -g: what it leaves goes no further)
  RECONCILER-FW-<hash>    LB IP traffic from loadBalancerSourceRanges -> EXT; the rest falls through
                          un-DNATed (entered with -g) and is dropped by RECONCILER-FIREWALL
  RECONCILER-SEP-<hash>   one endpoint of one service port, ONLY when something must happen once that
                          endpoint is chosen: hairpin masquerade (the endpoint is in hairpinEndpoints)
                          and/or the affinity `-m recent --set`; then the DNAT. Every other endpoint is
                          DNATed inline in SVC/EXT, which keeps the chain count near the number of
                          service ports (iptables-nft slows down steeply with the number of chains).
  RECONCILER-MARK-MASQ    sets the masquerade mark 0x4000
  RECONCILER-NON-POD-MASQ only with several cluster CIDRs: marks sources outside all of them
  RECONCILER-POSTROUTING  hooked from POSTROUTING: masquerades marked packets
filter table (post-DNAT; hooked for conntrack state NEW), the checks hooked as kube-proxy's
iptables mode hooks KUBE-SERVICES (ClusterIPs: FORWARD, OUTPUT) and KUBE-EXTERNAL-SERVICES
(externalIPs, LB IPs, nodePorts: INPUT, FORWARD)
  RECONCILER-FILTER       the FORWARD hook target: jumps to the four chains below
  RECONCILER-FILTER-OUTPUT  the OUTPUT hook target: FIREWALL, ENDPOINTS-CHECK, CLUSTER-IPS
  RECONCILER-FILTER-INPUT the INPUT hook target: FIREWALL, EXTERNAL-CHECK (a ClusterIP that is a
                          local address keeps its host sockets)
  RECONCILER-FIREWALL     drops LB IP traffic that was not DNATed (source outside the ranges; without
                          endpoints, what comes from outside them: the rest is rejected below)
  RECONCILER-ENDPOINTS-CHECK  REJECT / DROP for ClusterIPs without endpoints
  RECONCILER-EXTERNAL-CHECK   REJECT / DROP for externalIPs, LB IPs and (any local address) nodePorts
                          without endpoints
  RECONCILER-CLUSTER-IPS  with serviceCIDRs: REJECT unused ports of ClusterIPs, DROP unallocated IPs

Per-service rules carry ``-m comment --comment <service port id>`` (plans and service views use it).
Every rule is written exactly as ``iptables-save`` prints it, so an observed chain compares equal to
its rendered form argument for argument.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import ipaddress
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...state import (
    FAMILIES, DesiredState, Endpoint, Family, FamilyOptions, ServicePort, ServicePortFamily, TrafficPath,
    holds_loopback,
)
from .save import BUILTIN_CHAINS, Rule, format_probability

PREFIX = "RECONCILER-"
SERVICES = "RECONCILER-SERVICES"
NODEPORTS = "RECONCILER-NODEPORTS"
MARK_MASQ = "RECONCILER-MARK-MASQ"
NON_POD_MASQ = "RECONCILER-NON-POD-MASQ"
POSTROUTING = "RECONCILER-POSTROUTING"
FILTER = "RECONCILER-FILTER"
FILTER_INPUT = "RECONCILER-FILTER-INPUT"
FILTER_OUTPUT = "RECONCILER-FILTER-OUTPUT"
CLUSTER_IPS = "RECONCILER-CLUSTER-IPS"
FIREWALL = "RECONCILER-FIREWALL"
ENDPOINTS_CHECK = "RECONCILER-ENDPOINTS-CHECK"
EXTERNAL_CHECK = "RECONCILER-EXTERNAL-CHECK"
SVC_PREFIX, EXT_PREFIX, FW_PREFIX, SEP_PREFIX = (f"{PREFIX}{k}-" for k in ("SVC", "EXT", "FW", "SEP"))
SERVICE_CHAIN_PREFIXES = (SVC_PREFIX, EXT_PREFIX, FW_PREFIX, SEP_PREFIX)
MAX_CHAIN_NAME = 28
HASH_LEN = MAX_CHAIN_NAME - len(SVC_PREFIX)  # 13 base32 characters = 65 bits
MASQ_MARK = "0x4000"
LOCAL_DST = ("-m", "addrtype", "--dst-type", "LOCAL")  # a local destination address
JUMP_COMMENT = "service-reconciler"  # every jump rule we put into a built-in chain starts with this

Args = tuple[str, ...]
TABLES = ("filter", "nat")
COMMANDS: dict[str, str] = {"ipv4": "iptables", "ipv6": "ip6tables"}

# (table, built-in chain, extra match args, comment, target): inserted at the top of the built-in chain.
JUMPS: tuple[tuple[str, str, tuple[str, ...], str, str], ...] = (
    ("nat", "PREROUTING", (), "service portals", SERVICES),
    ("nat", "OUTPUT", (), "service portals", SERVICES),
    ("nat", "POSTROUTING", (), "masquerading", POSTROUTING),
    ("filter", "INPUT", ("-m", "conntrack", "--ctstate", "NEW"), "service checks", FILTER_INPUT),
    ("filter", "FORWARD", ("-m", "conntrack", "--ctstate", "NEW"), "service checks", FILTER),
    ("filter", "OUTPUT", ("-m", "conntrack", "--ctstate", "NEW"), "service checks", FILTER_OUTPUT),
)


# --------------------------------------------------------------------------- the model


@dataclass
class TableState:
    """Our part of one table: our chains (name -> rules) and our jump rules in built-in chains;
    observed, also the rules that are not ours (any other chain's, or uncommented) jumping to one of
    our chains: never touched, and what they jump to is never deleted."""

    chains: Mapping[str, tuple[Rule, ...]] = field(default_factory=dict)  # (observed: SavedChains)
    jumps: tuple[Rule, ...] = ()
    foreign: tuple[Rule, ...] = ()
    # the chains' canonical strings, when made ahead of a diff (IptablesBackend.before_diff)
    texts: dict[str, Any] | None = field(default=None, init=False, compare=False, repr=False)

    @property
    def empty(self) -> bool:
        return not self.chains and not self.jumps

    def to_dict(self) -> dict[str, Any]:
        return {
            "chains": {name: [r.spec() for r in rules] for name, rules in sorted(self.chains.items())},
            "jumps": [r.to_text(counters=False) for r in self.jumps],
        } | ({"foreignReferences": [r.to_text(counters=False) for r in self.foreign]} if self.foreign else {})


@dataclass
class IptablesModel:
    """family ('ipv4'/'ipv6') -> table ('filter'/'nat') -> our state in it."""

    families: dict[str, dict[str, TableState]] = field(default_factory=dict)
    flavour: str | None = None  # 'nft' or 'legacy' when observed

    def table(self, family: str, table: str) -> TableState:
        return self.families.get(family, {}).get(table, TableState())

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        if self.flavour:
            d["flavour"] = self.flavour
        for fam in ("ipv4", "ipv6"):
            if fam in self.families:
                d[fam] = {t: self.families[fam][t].to_dict() for t in TABLES if t in self.families[fam]}
        return d


# --------------------------------------------------------------------------- names


def chain_hash(text: str) -> str:
    """The hash part of a per-service chain name: svc_chain(sp) == SVC_PREFIX + chain_hash(sp.id)."""
    # base32 writes each 5 bytes as 8 characters on their own: the first 10 bytes give the first 16
    # (base64's b32encode is Python, and this runs for every chain of every service port)
    return base64.b32encode(hashlib.sha256(text.encode()).digest()[:10]).decode()[:HASH_LEN]


def svc_chain(sp: ServicePort) -> str:
    return SVC_PREFIX + chain_hash(sp.id)


def ext_chain(sp: ServicePort) -> str:
    return EXT_PREFIX + chain_hash(sp.id)


def fw_chain(sp: ServicePort) -> str:
    return FW_PREFIX + chain_hash(sp.id)


def sep_chain(sp: ServicePort, ep: Endpoint) -> str:
    return SEP_PREFIX + chain_hash(f"{sp.id}{ep}")


def is_ours(chain: str) -> bool:
    return chain.startswith(PREFIX)


def is_service_chain(chain: str) -> bool:
    return chain.startswith(SERVICE_CHAIN_PREFIXES)


def is_our_jump(rule: Rule) -> bool:
    """Whether a rule jumping to one of our chains carries our comment (as each of our jumps in a
    built-in chain does)."""
    c = rule.comment
    return c is not None and c.startswith(JUMP_COMMENT)


def jump_rule(chain: str, extra: tuple[str, ...], comment: str, target: str) -> Rule:
    return Rule(chain, (*extra, "-m", "comment", "--comment", f"{JUMP_COMMENT} {comment}", "-j", target))


def wanted_jumps(table: str) -> tuple[Rule, ...]:
    return tuple(jump_rule(c, extra, comment, target) for t, c, extra, comment, target in JUMPS if t == table)


def is_builtin(table: str, chain: str) -> bool:
    return chain in BUILTIN_CHAINS.get(table, ())


# --------------------------------------------------------------------------- syntax per family


class _Family:
    """Syntax that differs between iptables and ip6tables (all as iptables-save prints it)."""

    def __init__(self, family: Family):
        self.family = family
        v4 = family == "ipv4"
        self.host_len = 32 if v4 else 128
        self.af = socket.AF_INET if v4 else socket.AF_INET6
        self.loopback = "127.0.0.0/8" if v4 else "::1/128"
        self.loopback_range = "127.0.0.0-127.255.255.255" if v4 else "::1-::1"
        self.mask = "255.255.255.255" if v4 else "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"
        self.reject = ("-j", "REJECT", "--reject-with", "icmp-port-unreachable" if v4 else "icmp6-port-unreachable")

    def host(self, ip: str) -> str:
        """`ip/32` (or /128) with the address as iptables-save prints it (inet_ntop's form)."""
        return f"{socket.inet_ntop(self.af, socket.inet_pton(self.af, ip))}/{self.host_len}"

    def endpoint(self, ep: Endpoint) -> str:
        return str(ep)  # 10.0.0.1:80 / [fd00::1]:80, as --to-destination prints it


@functools.lru_cache(maxsize=1024)
def cidr(c: str) -> str:
    """A CIDR as iptables-save prints it (network address, explicit prefix length); the same few
    (cluster CIDRs, source ranges) come once per service port: remembered."""
    return str(ipaddress.ip_network(c, strict=False))


@functools.lru_cache(maxsize=64)
def _networks(cidrs: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(c, strict=False) for c in cidrs)


def in_cidrs(ip: str, cidrs: tuple[str, ...]) -> bool:
    """Whether the address is in one of the CIDRs (of its family)."""
    addr = ipaddress.ip_address(ip)
    return any(addr in net for net in _networks(cidrs))


@functools.lru_cache(maxsize=1024)
def source(c: str) -> tuple[str, ...]:
    """The match of sources in CIDR c as iptables-save prints it: `-s NET`, or nothing for a /0
    (every source; iptables-save leaves `-s 0.0.0.0/0` out, so the rule would never read back
    as written)."""
    net = cidr(c)
    return () if net.endswith("/0") else ("-s", net)


def _jumps(chain: str, *targets: str) -> tuple[Rule, ...]:
    return tuple(Rule(chain, ("-j", t)) for t in targets)


def _comment(sid: str) -> tuple[str, ...]:
    return ("-m", "comment", "--comment", sid)


def _port_match(proto: str, port: int) -> tuple[str, ...]:
    """`-p tcp` goes with the IP header fields; the `-m tcp --dport N` part comes with the matches."""
    return ("-m", proto, "--dport", str(port))


# --------------------------------------------------------------------------- render


def render(desired: DesiredState) -> IptablesModel:
    """Our chains and jumps per family (a family without service ports is omitted)."""
    return Renderer().render(desired)


class Renderer:
    """Renders with memory: the rules each service port contributes (its fragment, per family) are
    kept, and a later render builds fragments only for service ports that are not the very same
    objects as before (desired.BuildCache keeps unchanged ones identical); the rest is joining
    fragments, in C-level list and dict operations."""

    def __init__(self) -> None:
        self._key: Any = None
        self._fragments: dict[int, tuple[ServicePort, dict[str, _Builder]]] = {}

    def render(self, desired: DesiredState) -> IptablesModel:
        key = (desired.masqueradeAll, tuple(sorted(desired.families.items())))
        if key != self._key:
            self._key, self._fragments = key, {}

        def builder(family: Family) -> _Builder:
            return _Builder(_Family(family), desired.families.get(family, FamilyOptions()), desired.masqueradeAll)

        # keyed by id(): the old ports are held here, so an id found is that very port
        old, fragments = self._fragments, {}
        for sp in desired.services:
            hit = old.get(id(sp))
            if hit is None:
                frags = {}
                for family in FAMILIES:
                    blk = sp.family(family)
                    if blk is not None:
                        frag = builder(family)
                        frag.service(sp, blk)
                        frag.freeze()
                        frags[family] = frag
                hit = (sp, frags)
            fragments[id(sp)] = hit
        self._fragments = fragments
        families: dict[str, dict[str, TableState]] = {}
        for family in FAMILIES:
            parts = [frags[family] for _, frags in fragments.values() if family in frags]
            if parts:
                families[family] = builder(family).tables(parts)
        return IptablesModel(families)


class _Builder:
    def __init__(self, fam: _Family, opts: FamilyOptions, masquerade_all: bool):
        self.fam = fam
        self.opts = opts
        self.masquerade_all = masquerade_all
        self.nat: dict[str, list[Args]] = {}  # our nat chains as argument tuples
        self.services: list[Rule] = []
        self.nodeports: list[Rule] = []
        self.firewall: list[Rule] = []
        self.no_endpoints: list[Rule] = []
        self.no_external: list[Rule] = []
        self.no_endpoint_nodeports: list[Rule] = []
        self.cluster_ips: list[str] = []
        self.nat_rules: dict[str, tuple[Rule, ...]] = {}  # self.nat as Rules, once frozen

    # -- per service port ------------------------------------------------------------------

    def service(self, sp: ServicePort, blk: ServicePortFamily) -> None:
        sid, proto, f = sp.id, sp.protocol.lower(), self.fam
        self.cluster_ips.append(blk.clusterIP)
        internal, external = blk.internal, blk.external

        def addr_rule(chain: str, ip: str, *target: str, source: Args = ()) -> Rule:
            return Rule(chain, (*source, "-d", f.host(ip), "-p", proto, *_comment(sid), *_port_match(proto, sp.port),
                                *target))

        if internal.verdict == "forward":
            name = svc_chain(sp)
            rules = self._clusterip_masquerade(sid)
            rules += self._select(name, sp, blk, internal.endpoints, ())
            self.nat[name] = rules
            self.services.append(addr_rule(SERVICES, blk.clusterIP, "-j", name))
        else:
            self.no_endpoints.append(addr_rule(ENDPOINTS_CHECK, blk.clusterIP, *self._verdict(internal)))

        if external is None:
            return
        ext = self._external_chain(sp, blk, external)
        firewall = bool(blk.loadBalancerSourceRanges and blk.loadBalancerIPs and external.verdict != "reject"
                        and ext is not None)
        if firewall:
            assert ext is not None
            fw = fw_chain(sp)
            self.nat[fw] = [(*source(src), *_comment(sid), "-j", ext) for src in blk.loadBalancerSourceRanges]
        # An EXT chain that may leave traffic un-DNATed (policy Local, no local endpoint: only the
        # short-circuit) is entered with -g, where kube-proxy's iptables mode jumps: the rest goes
        # back to PREROUTING and is dropped in the filter table (EXTERNAL-CHECK), never on down
        # RECONCILER-SERVICES to another Service on the same address and port or to a NodePort on
        # it (as nftables mode, whose external chain ends the lookup).
        enter = "-g" if external.verdict == "drop" else "-j"
        for ip in blk.externalIPs:
            if ext and not (firewall and ip in blk.loadBalancerIPs):  # (also an LB IP: its source ranges
                # hold there too, as nftables mode checks them whatever else the address is)
                self.services.append(addr_rule(SERVICES, ip, enter, ext))
            if external.verdict != "forward":
                self.no_external.append(addr_rule(EXTERNAL_CHECK, ip, *self._verdict(external)))
        for ip in blk.loadBalancerIPs:
            if ext:  # (-g into FW, likewise: what it lets through un-DNATed goes back to PREROUTING and
                # RECONCILER-FIREWALL drops it, never on to a NodePort on the LB IP's port)
                self.services.append(addr_rule(SERVICES, ip, *(("-g", fw_chain(sp)) if firewall else (enter, ext))))
            if external.verdict != "forward":
                self.no_external.append(addr_rule(EXTERNAL_CHECK, ip, *self._verdict(external)))
            if firewall:
                self.firewall.append(addr_rule(FIREWALL, ip, "-j", "DROP"))
            elif blk.loadBalancerSourceRanges:  # nothing DNATed (no endpoints): the ranges' sources go
                # on to the REJECT, the rest are dropped (as kube-proxy's nftables mode; its iptables
                # mode rejects them all)
                self.firewall += [addr_rule(FIREWALL, ip, "-j", "RETURN", source=source(src))
                                  for src in blk.loadBalancerSourceRanges]
                self.firewall.append(addr_rule(FIREWALL, ip, "-j", "DROP"))
        if sp.nodePort is not None:
            if ext:
                self.nodeports.append(Rule(NODEPORTS, ("-p", proto, *_comment(sid), *_port_match(proto, sp.nodePort),
                                                       "-j", ext)))
            if external.verdict != "forward":  # on any local address but loopback (where no nodePort
                # is served: as nftables mode), as kube-proxy's, not only on --nodeport-addresses'
                self.no_endpoint_nodeports.append(Rule(EXTERNAL_CHECK, (
                    "!", "-d", self.fam.loopback, "-p", proto, *_comment(sid), *LOCAL_DST,
                    *_port_match(proto, sp.nodePort), *self._verdict(external))))

    def _verdict(self, path: TrafficPath) -> tuple[str, ...]:
        return self.fam.reject if path.verdict == "reject" else ("-j", "DROP")

    def _clusterip_masquerade(self, sid: str) -> list[Args]:
        if self.masquerade_all:
            return [(*_comment(sid), "-j", MARK_MASQ)]
        cidrs = self.opts.clusterCIDRs
        if len(cidrs) == 1:  # (a /0: every source a pod, none masqueraded, as nftables mode reads it)
            return [("!", *pods, *_comment(sid), "-j", MARK_MASQ)] if (pods := source(cidrs[0])) else []
        if cidrs:
            return [(*_comment(sid), "-j", NON_POD_MASQ)]
        return []  # no way to tell pods from others: like kube-proxy without a local detector

    def _external_chain(self, sp: ServicePort, blk: ServicePortFamily, external: TrafficPath) -> str | None:
        """The chain external traffic enters, or None when nothing is DNATed for it."""
        if external.verdict == "reject":
            return None
        sid, name = sp.id, ext_chain(sp)
        rules: list[Args] = []
        if external.policy == "Cluster":
            rules.append((*_comment(sid), "-j", MARK_MASQ))
            rules += self._select(name, sp, blk, external.endpoints, ())
        else:
            short = external.shortCircuit
            if short:
                if self.opts.clusterCIDRs:  # a pod of another node may be sent back to itself: its
                    # traffic here is masqueraded whichever endpoint it gets (rules, not a chain
                    # per endpoint; this node's own pods have theirs, see _sep). Only a source in a
                    # cluster CIDR takes that path: another endpoint (a node's, hostNetwork) is
                    # never sent back to itself here, and its node's traffic keeps its source IP.
                    rules += [("-s", self.fam.host(ep.ip), *_comment(sid), "-j", MARK_MASQ)
                              for ep in short if ep not in blk.hairpinEndpoints
                              and in_cidrs(ep.ip, self.opts.clusterCIDRs)]
                for c in self.opts.clusterCIDRs:
                    rules += self._select(name, sp, blk, short, source(c))
                local = ("-m", "addrtype", "--src-type", "LOCAL")
                rules.append((*_comment(sid), *local, "-j", MARK_MASQ))
                rules += self._select(name, sp, blk, short, local)
            if external.verdict == "forward":
                rules += self._select(name, sp, blk, external.endpoints, ())
            if not rules:
                return None
        self.nat[name] = rules
        return name

    def _select(self, chain: str, sp: ServicePort, blk: ServicePortFamily, eps: tuple[Endpoint, ...],
                match: Args) -> list[Args]:
        """Rules (argument tuples) that pick one of `eps`: sticky per client with affinity, then at random.

        `match` restricts them: IP header fields (`-s X`) go before the comment, match modules after it,
        which is the order iptables-save prints. A picked endpoint is DNATed right there, or jumped to
        through its SEP chain when it has per-endpoint work (see _sep).
        """
        sid, proto = sp.id, sp.protocol.lower()
        head = match if match[:1] in (("-s",), ("!",)) else ()
        mods = match[len(head):]
        rules: list[Args] = []
        seps = [self._sep(sp, blk, ep) for ep in eps]
        if sp.affinityTimeoutSeconds is not None:
            for sep in seps:
                assert sep is not None  # with affinity every endpoint has its SEP chain
                rules.append((*head, *_comment(sid), *mods, "-m", "recent", "--rcheck", "--seconds",
                              str(sp.affinityTimeoutSeconds), "--reap", "--name", sep, "--mask", self.fam.mask,
                              "--rsource", "-j", sep))
        n = len(eps)
        for i, (ep, sep) in enumerate(zip(eps, seps)):
            stat: tuple[str, ...] = ()
            if i < n - 1:
                stat = ("-m", "statistic", "--mode", "random", "--probability", format_probability(1.0 / (n - i)))
            if sep is not None:
                rules.append((*head, *_comment(sid), *mods, *stat, "-j", sep))
            else:
                rules.append((*head, "-p", proto, *_comment(sid), *mods, *stat, *self._dnat(proto, ep)))
        return rules

    def _dnat(self, proto: str, ep: Endpoint) -> Args:
        """`-m <proto> -j DNAT --to-destination IP:PORT` (the rule also needs `-p <proto>` in its header)."""
        return ("-m", proto, "-j", "DNAT", "--to-destination", self.fam.endpoint(ep))

    def _sep(self, sp: ServicePort, blk: ServicePortFamily, ep: Endpoint) -> str | None:
        """The endpoint's SEP chain, or None when it needs none (the cascade then DNATs inline).

        A SEP chain is kept only for work that must happen after the endpoint was chosen: hairpin
        masquerade (`-s <endpoint>` would otherwise also match when another endpoint is picked) and
        the affinity `-m recent --set`.
        """
        hairpin = ep in blk.hairpinEndpoints
        affinity = sp.affinityTimeoutSeconds is not None
        if not hairpin and not affinity:
            return None
        name = sep_chain(sp, ep)
        if name in self.nat:
            return name
        sid, proto = sp.id, sp.protocol.lower()
        rules: list[Args] = []
        if hairpin:
            rules.append(("-s", self.fam.host(ep.ip), *_comment(sid), "-j", MARK_MASQ))
        recent: tuple[str, ...] = ()
        if affinity:
            recent = ("-m", "recent", "--set", "--name", name, "--mask", self.fam.mask, "--rsource")
        rules.append(("-p", proto, *_comment(sid), *recent, *self._dnat(proto, ep)))
        self.nat[name] = rules
        return name

    # -- the shared skeleton ---------------------------------------------------------------

    def _nodeport_matches(self) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
        """(header args, match args) pairs, one rule each, that select local nodePort destinations."""
        cidrs = self.opts.nodePortCIDRs
        if cidrs is None:
            return [(("!", "-d", self.fam.loopback), LOCAL_DST)]
        # a CIDR holding loopback (0.0.0.0/1) without it: NodePorts are never served there
        not_loopback = ("-m", "iprange", "!", "--dst-range", self.fam.loopback_range)
        return [(("-d", cidr(c)), (*(not_loopback if holds_loopback(c) else ()), *LOCAL_DST)) for c in cidrs]

    def freeze(self) -> None:
        """A finished fragment: its chains as Rule tuples, made once and shared by every render."""
        self.nat_rules = {name: Rule.chain_of(name, rules) for name, rules in self.nat.items()}

    def tables(self, fragments: list[_Builder]) -> dict[str, TableState]:
        """The tables from the service ports' fragments (in service port order)."""
        nat: dict[str, tuple[Rule, ...]] = {}
        services: list[Rule] = []
        for frag in fragments:
            nat.update(frag.nat_rules)
            services += frag.services
            self.nodeports += frag.nodeports
            self.firewall += frag.firewall
            self.no_endpoints += frag.no_endpoints
            self.no_external += frag.no_external
            self.no_endpoint_nodeports += frag.no_endpoint_nodeports
            self.cluster_ips += frag.cluster_ips
        self.cluster_ips = list(dict.fromkeys(self.cluster_ips))
        for head, match in self._nodeport_matches():
            services.append(Rule(SERVICES, (*head, *match, "-j", NODEPORTS)))
        nat[SERVICES] = tuple(services)
        nat[NODEPORTS] = tuple(self.nodeports)
        nat[MARK_MASQ] = (Rule(MARK_MASQ, ("-j", "MARK", "--set-xmark", f"{MASQ_MARK}/{MASQ_MARK}")),)
        if len(self.opts.clusterCIDRs) > 1 and not self.masquerade_all:
            nat[NON_POD_MASQ] = (*(Rule(NON_POD_MASQ, (*source(c), "-j", "RETURN")) for c in self.opts.clusterCIDRs),
                                 Rule(NON_POD_MASQ, ("-j", MARK_MASQ)))
        nat[POSTROUTING] = (
            Rule(POSTROUTING, ("-m", "mark", "!", "--mark", f"{MASQ_MARK}/{MASQ_MARK}", "-j", "RETURN")),
            Rule(POSTROUTING, ("-j", "MARK", "--set-xmark", f"{MASQ_MARK}/0x0")),
            Rule(POSTROUTING, ("-j", "MASQUERADE", "--random-fully")),
        )
        cluster_ips: list[Rule] = []
        if self.opts.serviceCIDRs:
            cluster_ips += [Rule(CLUSTER_IPS, ("-d", self.fam.host(ip), *self.fam.reject)) for ip in self.cluster_ips]
            cluster_ips += [Rule(CLUSTER_IPS, ("-d", cidr(c), "-j", "DROP")) for c in self.opts.serviceCIDRs]
        filt: dict[str, tuple[Rule, ...]] = {
            FILTER: _jumps(FILTER, FIREWALL, ENDPOINTS_CHECK, EXTERNAL_CHECK, CLUSTER_IPS),
            FILTER_OUTPUT: _jumps(FILTER_OUTPUT, FIREWALL, ENDPOINTS_CHECK, CLUSTER_IPS),
            FILTER_INPUT: _jumps(FILTER_INPUT, FIREWALL, EXTERNAL_CHECK),
            FIREWALL: tuple(self.firewall),
            ENDPOINTS_CHECK: tuple(self.no_endpoints),
            EXTERNAL_CHECK: (*self.no_external, *self.no_endpoint_nodeports),
            CLUSTER_IPS: tuple(cluster_ips),
        }
        return {"filter": TableState(filt, wanted_jumps("filter")), "nat": TableState(nat, wanted_jumps("nat"))}

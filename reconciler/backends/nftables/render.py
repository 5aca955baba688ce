"""DesiredState -> nftables Ruleset. A plain renderer: every decision is already in the document.

Layout per family: `ip reconciler` (shared checks and masquerading) and 16 DNAT tables
`ip reconciler-00` … `-15` (see Renderer), built to keep the object count low:
one chain per service port (`svc-…`) choosing its endpoint with a `numgen` cascade, one more only
for external traffic that needs other handling (`ext-…`), per-endpoint chains only for session
affinity (`ep-…`); every address lookup is one map; no set or chain per endpoint otherwise.
"""

from __future__ import annotations

import bisect
import hashlib
import ipaddress
from typing import Any, Iterable

from ...state import (
    DesiredState, Endpoint, Family, FamilyOptions, ServicePort, ServicePortFamily, TrafficPath, PortChanges,
)
from .objects import FAMILIES, TABLE, BaseHook, Chain, NftSet, Ruleset, Table, nft_duration

Elements = dict[str, tuple[str | None, str | None]]
# firewall-allow's, by LB IP . protocol . port: (the sources it allows, comment): claimed per address
# as a whole (see Renderer._claim), and made one element per source when the table is built
AllowedSources = dict[str, tuple[tuple[str, ...], str | None]]

MASQ_BIT = 0x4000
MARK_MASQ = "mark-for-masquerade"
REJECT_CHAIN = "reject-chain"

# Hook priorities as numbers (nft prints dstnat=-100, srcnat=100, filter=0 by name; observe maps them back).
_BASE_CHAINS = {
    "nat-prerouting": BaseHook("nat", "prerouting", -100),
    "nat-output": BaseHook("nat", "output", -100),
    # after every shard's service IPs (the first DNAT ends the nat hooks): a NodePort never wins
    # over a service IP that is also a local address, whichever shard either is in
    "nodeports-prerouting": BaseHook("nat", "prerouting", -99),
    "nodeports-output": BaseHook("nat", "output", -99),
    "nat-postrouting": BaseHook("nat", "postrouting", 100),
    "firewall-prerouting": BaseHook("filter", "prerouting", -110),
    "firewall-output": BaseHook("filter", "output", -110),
    # REJECT/DROP of service traffic at `priority filter`, as kube-proxy (since #132456) promises
    # other components: a chain of theirs at filter, registered later, acts before these
    "filter-input": BaseHook("filter", "input", 0),
    "filter-forward": BaseHook("filter", "forward", 0),
    "filter-output": BaseHook("filter", "output", 0),
}


def service_key(sp: ServicePort) -> str:
    """`default/web/http/tcp`: the part of every object name that identifies a service port."""
    return f"{sp.namespace}/{sp.name}/{sp.portName or sp.port}/{sp.protocol.lower()}"


def svc_chain(sp: ServicePort) -> str:
    return f"svc-{service_key(sp)}"


def ext_chain(sp: ServicePort) -> str:
    return f"ext-{service_key(sp)}"


def _ep_key(sp: ServicePort, ep: Endpoint) -> str:
    return f"{service_key(sp)}/{ep.ip.replace(':', '_')}/{ep.port}"


def ep_chain(sp: ServicePort, ep: Endpoint) -> str:
    return f"ep-{_ep_key(sp, ep)}"


def affinity_set(sp: ServicePort, ep: Endpoint) -> str:
    return f"aff-{_ep_key(sp, ep)}"


class _Family:
    """Syntax that differs between `ip` and `ip6`."""

    def __init__(self, family: Family):
        self.family = family
        self.nft = FAMILIES[family]
        self.ip = "ip" if family == "ipv4" else "ip6"
        self.addr_type = "ipv4_addr" if family == "ipv4" else "ipv6_addr"
        self.loopback = "127.0.0.0/8" if family == "ipv4" else "::1"

    def endpoint(self, ep: Endpoint) -> str:
        return f"[{ep.ip}]:{ep.port}" if self.family == "ipv6" else f"{ep.ip}:{ep.port}"


def interval_set(cidrs: Iterable[str]) -> str:
    """CIDRs of one family as an inline set, as nft prints it back: the kernel holds an anonymous
    interval set as merged intervals (10.0.0.0/9 and 10.128.0.0/9 list as 10.0.0.0/8; 10.0.0.0/23
    and 10.0.2.0/24 as 10.0.0.0-10.0.2.255), so a rule written otherwise would never read back
    as written."""
    nets = sorted(ipaddress.ip_network(c, strict=False) for c in cidrs)
    spans: list[list[int]] = []
    for n in nets:
        first, last = int(n.network_address), int(n.broadcast_address)
        if spans and first <= spans[-1][1] + 1:
            spans[-1][1] = max(spans[-1][1], last)
        else:
            spans.append([first, last])
    address = ipaddress.ip_address if not nets or nets[0].version == 4 else ipaddress.IPv6Address
    out = []
    for first, last in spans:
        lo, hi = address(first), address(last)
        whole = list(ipaddress.summarize_address_range(lo, hi))  # type: ignore[arg-type]
        out.append(canonical_cidr(str(whole[0])) if len(whole) == 1 else f"{lo}-{hi}")
    return out[0] if len(out) == 1 else "{ " + ", ".join(out) + " }"


def canonical_cidr(c: str) -> str:
    """nft prints a host prefix (/32, /128) as the bare address."""
    net = ipaddress.ip_network(c, strict=False)
    return str(net.network_address) if net.prefixlen == net.max_prefixlen else str(net)


SHARDS = 16


def shard_table_name(shard: int) -> str:
    return f"{TABLE}-{shard:02d}"


def shard_of(service_port_id: str) -> int:
    """Which DNAT table a service port lives in: a stable hash of its id."""
    return int.from_bytes(hashlib.blake2b(service_port_id.encode(), digest_size=4).digest(), "big") % SHARDS


def _set(name: str, key: str, elems: Elements, value: str | None = None, flags: tuple[str, ...] = ()) -> NftSet:
    return NftSet(name, key, value, flags, None, dict(elems))


def _chains(plain: dict[str, list[str]], hooked: dict[str, list[str]]) -> dict[str, Chain]:
    out = {name: Chain(name, tuple(rules)) for name, rules in plain.items()}
    out.update({name: Chain(name, tuple(rules), _BASE_CHAINS[name]) for name, rules in hooked.items()})
    return out


def render(desired: DesiredState) -> Ruleset:
    """The tables that implement `desired` (a family with no services is omitted)."""
    return Renderer().render(desired)


_MAIN_MAPS = ("no_ep_services", "no_ep_nodeports", "firewall_ips", "firewall_allow", "hairpin", "cluster_ips")
_SHARD_MAPS = ("service_ips", "nodeports")
_MAPS = (*_MAIN_MAPS, *_SHARD_MAPS)


class Renderer:
    """Renders with memory: each service port's objects (its fragment) are kept, and the next
    render only rebuilds the fragments of service ports that are not the very same objects as
    before (desired.BuildCache keeps unchanged ones identical). Cost: O(changed service ports).

    Layout: per family, `reconciler` holds what all services share (REJECT/DROP, source ranges,
    masquerading) and SHARDS tables `reconciler-NN` hold the DNAT chains and maps, each service
    port in one shard by hash. The kernel re-validates a whole table on every change to it, so
    sharding keeps the cost of one change independent of the number of services.
    """

    def __init__(self) -> None:
        self._key: Any = None
        self._changes = PortChanges()  # against what the last render rendered
        self._fragments: dict[str, tuple[ServicePort, int, dict[str, _Builder]]] = {}
        self._main: dict[str, _Builder] = {}
        self._shards: dict[str, list[_Builder]] = {}
        # per family and map: element key -> the service port writing it, or those that do, sorted
        self._claims: dict[str, dict[str, dict[str, str | list[str]]]] = {}
        self._count: dict[str, list[int]] = {}
        self._tables: dict[str, Table] = {}  # the last render's tables, by ref
        self._dirty: set[tuple[str, int | None]] = set()  # (family, shard or None for main)

    def render(self, desired: DesiredState) -> Ruleset:
        key = (desired.masqueradeAll, tuple(sorted(desired.families.items())))
        if key != self._key:
            self.__init__()  # type: ignore[misc]
            self._key = key
            for family in ("ipv4", "ipv6"):
                fam = _Family(family)  # type: ignore[arg-type]
                opts = desired.families.get(family, FamilyOptions())  # type: ignore[call-overload]
                self._main[family] = _Builder(fam, opts, desired.masqueradeAll)
                self._shards[family] = [_Builder(fam, opts, desired.masqueradeAll) for _ in range(SHARDS)]
                self._claims[family] = {m: {} for m in _MAPS}
                self._count[family] = [0] * SHARDS
        gone, new = self._changes.update(desired)
        for sp in gone:
            self._remove(sp.id)
        for sp in new:
            self._add(sp)
        # only tables whose content changed are built again: the others stay the same objects,
        # which diff() skips without looking inside
        for family, shard in self._dirty:
            counts = self._count[family]
            if shard is None:
                table, used = self._main[family].main_table(), any(counts)
            else:
                table, used = self._shards[family][shard].shard_table(shard), counts[shard] > 0
            if used:
                self._tables[table.ref] = table
            else:
                self._tables.pop(table.ref, None)
        self._dirty.clear()
        return Ruleset(dict(sorted(self._tables.items())))

    def _add(self, sp: ServicePort) -> None:
        n = shard_of(sp.id)
        frags: dict[str, _Builder] = {}
        self._fragments[sp.id] = (sp, n, frags)
        for blk in sp.families:
            main, shard = self._main[blk.family], self._shards[blk.family][n]
            frag = _Builder(main.fam, main.opts, main.masquerade_all)
            frag.service(sp, blk)
            frags[blk.family] = frag
            shard.chains.update(frag.chains)
            shard.sets.update(frag.sets)
            claims = self._claims[blk.family]
            for m in _MAPS:
                part: Elements = getattr(frag, m)
                if not part:
                    continue
                owners, elems = claims[m], getattr(shard if m in _SHARD_MAPS else main, m)
                if owners.keys().isdisjoint(part):  # (the usual case: nobody else has these keys)
                    owners.update(dict.fromkeys(part, sp.id))
                    elems.update(part)
                else:
                    for k in part:
                        self._claim(blk.family, m, k, sp.id)
            self._count[blk.family][n] += 1
            self._dirty |= {(blk.family, n), (blk.family, None)}

    def _remove(self, sid: str) -> None:
        _, n, frags = self._fragments[sid]
        for family, frag in frags.items():
            main, shard = self._main[family], self._shards[family][n]
            for name in frag.chains:
                del shard.chains[name]
            for name in frag.sets:
                del shard.sets[name]
            claims = self._claims[family]
            for m in _MAPS:
                owners, elems = claims[m], getattr(shard if m in _SHARD_MAPS else main, m)
                for k in getattr(frag, m):
                    if type(owners[k]) is str:  # (this port's alone)
                        del owners[k]
                        del elems[k]
                    else:
                        self._unclaim(family, m, k, sid)
            self._count[family][n] -= 1
            self._dirty |= {(family, n), (family, None)}
        del self._fragments[sid]

    # An element key more than one service port writes (two Services on one externalIP or load
    # balancer IP and port, which the API server allows) holds the value of the first of them by
    # id, as iptables mode's first rule of theirs matches first: the same whatever order they came
    # and went in, so a render with memory gives what one from scratch gives. A shard map's
    # element is in that service port's shard alone (each shard's hook would DNAT otherwise).

    def _claim(self, family: str, m: str, k: str, sid: str) -> None:
        owners = self._claims[family][m]
        cur = owners.get(k)
        if cur is None:
            owners[k] = sid
            self._place(family, m, k, None, sid)
            return
        claimants = [cur] if isinstance(cur, str) else cur
        first = claimants[0]
        bisect.insort(claimants, sid)
        owners[k] = claimants
        if claimants[0] != first:
            self._place(family, m, k, first, sid)

    def _unclaim(self, family: str, m: str, k: str, sid: str) -> None:
        owners = self._claims[family][m]
        claimants = owners[k]
        assert isinstance(claimants, list)
        first = claimants[0]
        claimants.remove(sid)
        if len(claimants) == 1:
            owners[k] = claimants[0]
        if first == sid:
            self._place(family, m, k, sid, claimants[0])

    def _place(self, family: str, m: str, k: str, old: str | None, new: str) -> None:
        """Key k of map m: the element of service port `old` (if any) becomes `new`'s."""
        if m in _SHARD_MAPS:
            if old is not None:
                n = self._fragments[old][1]
                del getattr(self._shards[family][n], m)[k]
                self._dirty.add((family, n))
            _, n, frags = self._fragments[new]
            getattr(self._shards[family][n], m)[k] = getattr(frags[family], m)[k]
            self._dirty.add((family, n))
        else:
            getattr(self._main[family], m)[k] = getattr(self._fragments[new][2][family], m)[k]


class _Builder:
    def __init__(self, fam: _Family, opts: FamilyOptions, masquerade_all: bool):
        self.fam = fam
        self.opts = opts
        self.masquerade_all = masquerade_all
        self.chains: dict[str, Chain] = {}
        self.sets: dict[str, NftSet] = {}
        # element maps: key -> (value, comment)
        self.service_ips: Elements = {}
        self.nodeports: Elements = {}
        self.no_ep_services: Elements = {}
        self.no_ep_nodeports: Elements = {}
        self.firewall_ips: Elements = {}
        self.firewall_allow: AllowedSources = {}
        self.hairpin: Elements = {}
        self.cluster_ips: Elements = {}

    # -- per service port ------------------------------------------------------------------

    def service(self, sp: ServicePort, blk: ServicePortFamily) -> None:
        proto = sp.protocol.lower()
        tag = sp.id[:128]
        self.cluster_ips[blk.clusterIP] = (None, None)
        # this node's pods, and those of any node the ETP Local pod short-circuit may send back
        # to themselves (one element each: exact, as kube-proxy's per-endpoint masquerade)
        short = blk.external.shortCircuit if blk.external is not None and self.opts.clusterCIDRs else ()
        for ep in (*blk.hairpinEndpoints, *short):  # (kube-proxy's: the endpoint's protocol and port too)
            self.hairpin[f"{ep.ip} . {ep.ip} . {proto} . {ep.port}"] = (None, None)
        internal, external = blk.internal, blk.external

        svc_name = svc_chain(sp)
        if internal.verdict == "forward":
            rules = [*self._clusterip_masquerade(), *self._select(sp, internal.endpoints, "")]
            self.chains[svc_name] = Chain(svc_name, tuple(rules))
            self.service_ips[f"{blk.clusterIP} . {proto} . {sp.port}"] = (f"goto {svc_name}", tag)
        else:
            self.no_ep_services[f"{blk.clusterIP} . {proto} . {sp.port}"] = (self._verdict(internal), tag)

        if external is None:
            return
        ext_target = self._external_target(sp, blk, internal, external)
        for ip in (*blk.externalIPs, *blk.loadBalancerIPs):
            key = f"{ip} . {proto} . {sp.port}"
            if ext_target:
                self.service_ips[key] = (f"goto {ext_target}", tag)
            if external.verdict != "forward":
                self.no_ep_services[key] = (self._verdict(external), tag)
        if blk.loadBalancerSourceRanges:  # also without endpoints: a source outside them is dropped, not rejected
            sources = tuple(canonical_cidr(src) for src in blk.loadBalancerSourceRanges)
            for ip in blk.loadBalancerIPs:
                self.firewall_ips[f"{ip} . {proto} . {sp.port}"] = (None, tag)
                # (one entry per address: two Services on it allow the sources of the first of them
                # that has ranges, not both sets, which may overlap: nft refuses that; iptables mode
                # lets the first of them all decide, ranges or none)
                self.firewall_allow[f"{ip} . {proto} . {sp.port}"] = (sources, tag)
        if sp.nodePort is not None:
            key = f"{proto} . {sp.nodePort}"
            if ext_target:
                self.nodeports[key] = (f"goto {ext_target}", tag)
            if external.verdict != "forward":
                self.no_ep_nodeports[key] = (self._verdict(external), tag)

    def _verdict(self, path: TrafficPath) -> str:
        return f"goto {REJECT_CHAIN}" if path.verdict == "reject" else "drop"

    def _clusterip_masquerade(self) -> list[str]:
        if self.masquerade_all:
            return [f"jump {MARK_MASQ}"]
        if self.opts.clusterCIDRs:
            return [f"{self.fam.ip} saddr != @cluster-cidrs jump {MARK_MASQ}"]
        return []  # no way to tell pods from others: like kube-proxy without a local detector

    def _external_target(self, sp: ServicePort, blk: ServicePortFamily, internal: TrafficPath,
                         external: TrafficPath) -> str | None:
        """The chain external traffic enters, or None when nothing is DNATed for it."""
        if external.verdict == "reject":
            return None
        name = ext_chain(sp)
        rules: list[str] = []
        if external.policy == "Cluster":
            rules.append(f"jump {MARK_MASQ}")
            rules += self._select(sp, external.endpoints, "")
        else:
            short = external.shortCircuit
            if short:
                if self.opts.clusterCIDRs:
                    rules += self._select(sp, short, f"{self.fam.ip} saddr @cluster-cidrs ")
                rules.append(f"fib saddr type local jump {MARK_MASQ}")
                rules += self._select(sp, short, "fib saddr type local ")
            if external.verdict == "forward":
                rules += self._select(sp, external.endpoints, "")
            else:  # no local endpoint: dropped here, not passed on to later lookups (another shard's
                # NodePort on this local IP's port); kube-proxy's goto ends its services chain too
                rules.append("drop")
        self.chains[name] = Chain(name, tuple(rules))
        return name

    def _select(self, sp: ServicePort, eps: tuple[Endpoint, ...], match: str) -> list[str]:
        """Rules that pick one of `eps` uniformly (or sticky per client with affinity).

        A cascade: rule i fires with probability 1/(n-i), so each endpoint gets 1/n. Plain rules
        load and read back fast; inline numgen maps create one anonymous set per rule, which the
        kernel allocates in time linear in the number of sets (quadratic overall).
        """
        proto = f"meta l4proto {sp.protocol.lower()}"
        n = len(eps)
        rules = []
        if sp.affinityTimeoutSeconds is None:
            for i, ep in enumerate(eps):
                pick = f"numgen random mod {n - i} 0 " if i < n - 1 else ""
                rules.append(f"{match}{proto} {pick}dnat to {self.fam.endpoint(ep)}")
            return rules
        # the timeout goes with each entry, not with the set: a changed timeoutSeconds rewrites
        # the endpoint chains and keeps the sets, and every client stays with its endpoint (as
        # iptables' `recent` lists stay); a set's own timeout could only change by recreating it
        timeout = nft_duration(sp.affinityTimeoutSeconds)
        for ep in eps:
            chain, aff = ep_chain(sp, ep), affinity_set(sp, ep)
            self.sets[aff] = NftSet(aff, self.fam.addr_type, flags=("dynamic", "timeout"))
            self.chains[chain] = Chain(chain, (f"update @{aff} {{ {self.fam.ip} saddr timeout {timeout} }}",
                                               f"{proto} dnat to {self.fam.endpoint(ep)}"))
            rules.append(f"{match}{self.fam.ip} saddr @{aff} goto {chain}")
        for i, ep in enumerate(eps):
            pick = f"numgen random mod {n - i} 0 " if i < n - 1 else ""
            rules.append(f"{match}{pick}goto {ep_chain(sp, ep)}")
        return rules

    # -- the shared skeleton ---------------------------------------------------------------

    def main_table(self) -> Table:
        """`ip reconciler`: REJECT/DROP and source-range checks, masquerading, shared sets."""
        ip, addr = self.fam.ip, self.fam.addr_type
        svc_key = f"{addr} . inet_proto . inet_service"
        sets = {
            "no-endpoint-services": _set("no-endpoint-services", svc_key, self.no_ep_services, "verdict"),
            "no-endpoint-nodeports": _set("no-endpoint-nodeports", "inet_proto . inet_service", self.no_ep_nodeports,
                                          "verdict"),
            "firewall-ips": _set("firewall-ips", svc_key, self.firewall_ips),
            "firewall-allow": _set("firewall-allow", f"{svc_key} . {addr}",
                                   {f"{k} . {src}": (None, tag) for k, (sources, tag) in self.firewall_allow.items()
                                    for src in sources}, flags=("interval",)),
            "hairpin": _set("hairpin", f"{addr} . {addr} . inet_proto . inet_service", self.hairpin),
        }
        nodeport_match = self._nodeport_match()
        endpoints_check = [f"{ip} daddr . meta l4proto . th dport vmap @no-endpoint-services"]
        if nodeport_match is not None:
            endpoints_check.append(f"{nodeport_match}meta l4proto . th dport vmap @no-endpoint-nodeports")
        sets["cluster-ips"] = _set("cluster-ips", addr, self.cluster_ips)
        cluster_ips_check = [f"{ip} daddr @cluster-ips reject"]  # a port no service port of the IP uses
        if self.opts.serviceCIDRs:
            cluster_ips_check.append(f"{ip} daddr {interval_set(self.opts.serviceCIDRs)} drop")
        chains = _chains({
            "endpoints-check": endpoints_check,
            "cluster-ips-check": cluster_ips_check,
            "firewall-check": [f"{ip} daddr . meta l4proto . th dport @firewall-ips "
                               f"{ip} daddr . meta l4proto . th dport . {ip} saddr != @firewall-allow drop"],
            MARK_MASQ: [f"meta mark set meta mark | 0x{MASQ_BIT:08x}"],
            "masquerading": [
                f"ct status dnat {ip} saddr . {ip} daddr . meta l4proto . th dport @hairpin jump {MARK_MASQ}",
                f"meta mark & 0x{MASQ_BIT:08x} == 0x00000000 return",
                f"meta mark set meta mark ^ 0x{MASQ_BIT:08x}",
                "masquerade fully-random",
            ],
            REJECT_CHAIN: ["reject"],
        }, {
            "nat-postrouting": ["jump masquerading"],
            "firewall-prerouting": ["ct state new jump firewall-check"],
            "firewall-output": ["ct state new jump firewall-check"],
            "filter-input": ["ct state new jump endpoints-check"],
            "filter-forward": ["ct state new jump endpoints-check", "ct state new jump cluster-ips-check"],
            "filter-output": ["ct state new jump endpoints-check", "ct state new jump cluster-ips-check"],
        })
        return Table(self.fam.nft, TABLE, chains, sets)

    def shard_table(self, shard: int) -> Table:
        """`ip reconciler-NN`: DNAT for the service ports of one shard (their chains and maps)."""
        ip, addr = self.fam.ip, self.fam.addr_type
        sets = dict(self.sets)
        sets["service-ips"] = _set("service-ips", f"{addr} . inet_proto . inet_service", self.service_ips, "verdict")
        sets["service-nodeports"] = _set("service-nodeports", "inet_proto . inet_service", self.nodeports, "verdict")
        if self.opts.clusterCIDRs:
            sets["cluster-cidrs"] = _set("cluster-cidrs", addr, {canonical_cidr(c): (None, None)
                                                                for c in self.opts.clusterCIDRs}, flags=("interval",))
        plain = {"services": [f"{ip} daddr . meta l4proto . th dport vmap @service-ips"],
                 MARK_MASQ: [f"meta mark set meta mark | 0x{MASQ_BIT:08x}"]}
        hooked = {"nat-prerouting": ["jump services"], "nat-output": ["jump services"]}
        nodeport_match = self._nodeport_match()
        if nodeport_match is not None:  # (kube-proxy: after @service-ips in one chain; here shards
            # have a chain each, so their NodePorts are looked up a priority later than any service IP)
            plain["nodeports"] = [f"{nodeport_match}meta l4proto . th dport vmap @service-nodeports"]
            hooked.update({"nodeports-prerouting": ["jump nodeports"], "nodeports-output": ["jump nodeports"]})
        chains = dict(self.chains)
        chains.update(_chains(plain, hooked))
        return Table(self.fam.nft, shard_table_name(shard), chains, sets)

    def _nodeport_match(self) -> str | None:
        ip = self.fam.ip
        cidrs = self.opts.nodePortCIDRs
        if cidrs is None:
            return f"{ip} daddr != {self.fam.loopback} fib daddr type local "
        if not cidrs:
            return None
        not_loopback = f"{ip} daddr != {self.fam.loopback} " if self.opts.nodePortsHoldLoopback else ""
        return f"{not_loopback}{ip} daddr {interval_set(cidrs)} fib daddr type local "

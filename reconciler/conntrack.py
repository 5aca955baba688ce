"""Stale UDP conntrack cleanup (kube-proxy pkg/proxy/conntrack).

UDP has no connection teardown: a conntrack entry created while a service had no endpoints, or one
that DNATs to an endpoint that is gone, keeps black-holing a client that reuses its source port
until the entry times out. After each apply we delete exactly those entries.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FlowFilter:
    """Arguments selecting UDP conntrack entries: by original destination, or by reply source."""

    orig_dst: str | None = None
    orig_dport: int | None = None
    reply_src: str | None = None
    reply_sport: int | None = None

    def args(self) -> list[str]:
        out = ["-p", "udp"]
        if self.orig_dst:
            out += ["--orig-dst", self.orig_dst]
        if self.orig_dport:
            out += ["--orig-port-dst", str(self.orig_dport)]
        if self.reply_src:
            out += ["--reply-src", self.reply_src]
        if self.reply_sport:
            out += ["--reply-port-src", str(self.reply_sport)]
        return out


def _split_hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def _serving(addresses: list[str]) -> set[str]:
    """Addresses that DNAT to endpoints (not the ones marked (reject)/(drop))."""
    return {a for a in addresses if not a.endswith(")")}


def stale_udp_flows(old: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]]) -> list[FlowFilter]:
    """Filters for the entries to delete, from the service views before and after an apply."""
    out: set[FlowFilter] = set()
    for sid, view in new.items():
        if not sid.endswith("/UDP"):
            continue
        before = old.get(sid, {"addresses": [], "endpoints": []})
        gained = _serving(view["addresses"]) - _serving(before["addresses"])
        for addr in gained:  # the address starts forwarding: flush entries made while it did not
            if addr.startswith("nodePort "):
                out.add(FlowFilter(orig_dport=int(addr.split()[1].split("/")[0])))
            else:
                ip, port = _split_hostport(addr.split("/")[0])
                out.add(FlowFilter(orig_dst=ip, orig_dport=port))
    for sid, view in old.items():
        if not sid.endswith("/UDP"):
            continue
        remaining = set(new.get(sid, {}).get("endpoints", []))
        for ep in set(view["endpoints"]) - remaining:
            ip, port = _split_hostport(ep)
            out.add(FlowFilter(reply_src=ip, reply_sport=port))
    return sorted(out, key=lambda f: tuple(str(v) for v in (f.orig_dst, f.orig_dport, f.reply_src, f.reply_sport)))


def clear(filters: list[FlowFilter]) -> int:
    """Delete matching entries with the conntrack tool; returns how many filters ran."""
    if not filters:
        return 0
    binary = shutil.which("conntrack")
    if binary is None:
        log.warning("conntrack tool not found: %d stale UDP flow filter(s) not cleared", len(filters))
        return 0
    for f in filters:
        for family in ("ipv4", "ipv6"):
            if (f.orig_dst or f.reply_src or "").count(":") and family == "ipv4":
                continue
            if "." in (f.orig_dst or f.reply_src or "") and family == "ipv6":
                continue
            # exit 1 with "0 flow entries have been deleted" is normal
            subprocess.run([binary, "-D", "-f", family, *f.args()], capture_output=True, check=False)
    return len(filters)

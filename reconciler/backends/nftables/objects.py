"""nftables objects as plain typed records that write themselves as `nft -f` commands.

Rules are kept as the canonical text `nft list` prints, so a rendered rule and an observed rule
compare as strings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

TABLE = "reconciler"
FAMILIES = {"ipv4": "ip", "ipv6": "ip6"}


@dataclass(frozen=True)
class BaseHook:
    type: str  # nat | filter
    hook: str  # prerouting | input | forward | output | postrouting
    priority: int
    policy: str = "accept"

    def text(self) -> str:
        return f"type {self.type} hook {self.hook} priority {self.priority}; policy {self.policy};"


@dataclass(frozen=True)
class Chain:
    name: str
    rules: tuple[str, ...] = ()
    base: BaseHook | None = None


@dataclass(frozen=True)
class NftSet:
    """A named set (map when `value_type` is set). Dynamic sets hold runtime state: their elements
    are never compared or written."""

    name: str
    key_type: str
    value_type: str | None = None
    flags: tuple[str, ...] = ()
    timeout: int | None = None
    # key -> (value (maps only), comment); comments name the service port an element belongs to
    elements: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)

    @property
    def is_map(self) -> bool:
        return self.value_type is not None

    @property
    def dynamic(self) -> bool:
        """Filled by the packet path (`update @set`): its elements are not ours to compare."""
        return "dynamic" in self.flags or self.timeout is not None

    @property
    def kind(self) -> str:
        return "map" if self.is_map else "set"

    def spec(self) -> tuple[Any, ...]:
        """Everything but the elements: when it differs, the object must be recreated."""
        return (self.key_type, self.value_type, tuple(sorted(self.flags)), self.timeout)

    def definition(self) -> str:
        """`{ type …; flags …; }`"""
        return "{ " + self.properties() + " }"

    def properties(self) -> str:
        """`type …; flags …;`: what a definition block holds besides elements."""
        parts = [f"type {self.key_type}" + (f" : {self.value_type}" if self.value_type else "")]
        if self.flags:
            parts.append("flags " + ",".join(self.flags))
        if self.timeout is not None:
            parts.append(f"timeout {self.timeout}s")
        return "; ".join(parts) + ";"


def nft_duration(seconds: int) -> str:
    """A time as nft prints it back: 10800 -> `3h`, 90 -> `1m30s`, 86400 -> `1d` (0 -> `0s`)."""
    out = ""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size:
            out += f"{seconds // size}{unit}"
            seconds %= size
    return out or "0s"


_DURATION = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+)s)?(?:(\d+)ms)?")


def duration_seconds(text: str) -> int:
    """nft's `10m`, `3h`, `1d2h3m4s`, `10800s` -> seconds (-1, which nothing renders, when not)."""
    m = _DURATION.fullmatch(text.strip())
    if m is None or not any(m.groups()):
        return -1
    d, h, mins, secs, ms = (int(g) if g else 0 for g in m.groups())
    return d * 86400 + h * 3600 + mins * 60 + secs + ms // 1000


def element_text(key: str, value: str | None, comment: str | None) -> str:
    """`10.96.0.10 . tcp . 53 comment "kube-system/kube-dns:dns-tcp/TCP" : goto svc-…`"""
    out = key
    if comment:
        out += f' comment "{comment}"'
    if value is not None:
        out += f" : {value}"
    return out


@dataclass(frozen=True)
class Table:
    family: str  # ip | ip6
    name: str = TABLE
    chains: dict[str, Chain] = field(default_factory=dict)
    sets: dict[str, NftSet] = field(default_factory=dict)
    flags: tuple[str, ...] = ()  # as read (dormant: every hook off); we render none

    @property
    def ref(self) -> str:
        return f"{self.family} {self.name}"

    def to_dict(self) -> dict[str, Any]:
        chains = {}
        for name in sorted(self.chains):
            c = self.chains[name]
            d: dict[str, Any] = {"rules": list(c.rules)}
            if c.base:
                d["hook"] = {"type": c.base.type, "hook": c.base.hook, "priority": c.base.priority,
                             "policy": c.base.policy}
            chains[name] = d
        sets = {}
        for name in sorted(self.sets):
            s = self.sets[name]
            sd: dict[str, Any] = {"type": s.key_type}
            if s.value_type:
                sd["map"] = s.value_type
            if s.flags:
                sd["flags"] = sorted(s.flags)
            if s.timeout is not None:
                sd["timeout"] = s.timeout
            if not s.dynamic:
                sd["elements"] = [element_text(k, *s.elements[k]) for k in sorted(s.elements)]
            sets[name] = sd
        out: dict[str, Any] = {"family": self.family, "name": self.name, "chains": chains, "sets": sets}
        if self.flags:
            out["flags"] = list(self.flags)
        return out


@dataclass(frozen=True)
class Ruleset:
    """The tables this tool owns, keyed by their reference: 'ip reconciler', 'ip reconciler-07', …"""

    tables: dict[str, Table] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"tables": {k: self.tables[k].to_dict() for k in sorted(self.tables)}}

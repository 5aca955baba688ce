"""The nf_tables ruleset generation: a counter the kernel keeps per network namespace and bumps by
one on every transaction that changes anything, whoever commits it (nft, libnftables,
iptables-nft, ...). Reads never bump it, nor do failed transactions, nor ones that change nothing
(an `add` of what exists); after 2^32 - 1 it starts again at 1. Every commit is announced to
listeners as an NFT_MSG_NEWGEN message: the generation it produced, from the netlink socket
(its port id) that committed it.

So when the generation is where the kernel was last known to hold what we applied, nothing in
nf_tables has changed since: the run loop's periodic drift check need not read the kernel back
(10k services: ~7 s and ~10 s of CPU every sync period, see drift.py), nor does apply to verify
its transaction when our commits alone took the generation from where the plan's read started
(reconcile.apply). A CommitWatch around an in-process transaction tells which generation is
ours; a kernel tool's commits are the generations between the ones before and after it, when
they are exactly as many as the commits it was certain to make (follows(), the backends).
(One window stays: the kernel moves the counter as a commit starts to take effect, before it
applies some updates of existing objects (a chain's policy, a table's flags); a read that starts
in those microseconds sees the new generation without them. The run loop's hourly read and
`apply --read-back` see past it.)

Over netlink sockets of the standard library: a request costs a few tens of microseconds.
pyroute2 (a dependency of the one-shot commands) speaks it too, but importing it costs the
long-running process ~22 MiB and ~0.3 s, and a one-shot command ~0.2 s of the core it loads the
manifests on: the list of tables there (list_tables, for the other mode's leftovers) is asked
the same way.
"""

from __future__ import annotations

import errno
import itertools
import os
import socket
import struct
from collections.abc import Iterator

NETLINK_NETFILTER = 12
SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, NETLINK_DROP_MEMBERSHIP = 270, 1, 2
NFNLGRP_NFTABLES = 7  # the group nf_tables announces its changes to
NFNL_SUBSYS_NFTABLES = 10
NFT_MSG_NEWTABLE, NFT_MSG_GETTABLE, NFT_MSG_NEWGEN, NFT_MSG_GETGEN = 0, 1, 15, 16
NEWGEN = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWGEN
NEWTABLE = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWTABLE
NFTA_GEN_ID = NFTA_TABLE_NAME = 1
NLM_F_REQUEST, NLM_F_DUMP_INTR, NLM_F_DUMP = 1, 0x10, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLA_TYPE_MASK = 0x3FFF  # without the nested / byte-order flag bits

_HEADER = struct.Struct("=IHHII")  # struct nlmsghdr: len, type, flags, seq, pid
_NFGENMSG = struct.Struct("=BBH")  # struct nfgenmsg: family, version, res_id
_ATTR = struct.Struct("=HH")  # struct nlattr: len, type
_seq = itertools.count(1)


def next_generation(generation: int) -> int:
    """The generation after `generation`: the kernel's counter is 32 bits and skips 0."""
    return generation % 0xFFFFFFFF + 1


def follows(start: int | None, produced: list[int] | None) -> int | None:
    """The generation reached when the commits that produced `produced` were, in order, the very
    commits that followed `start` (nobody else's among or before them); None when not so, or
    not known (`start` or `produced` None)."""
    if start is None or produced is None:
        return None
    g = start
    for p in produced:
        if p != next_generation(g):
            return None
        g = p
    return g


def commits_between(before: int | None, after: int | None, count: int | None) -> list[int] | None:
    """The generations `count` commits made from `before`, when they lead exactly to `after`
    (a commit of anybody else's beside them would have moved it further); else None. For a kernel
    tool certain to make `count` commits, read before and after it ran: its own."""
    if before is None or after is None or not count:
        return None
    produced = [before]
    for _ in range(count):
        produced.append(next_generation(produced[-1]))
    return produced[1:] if produced[-1] == after else None


def generation(timeout: float = 1.0) -> int | None:
    """The current nf_tables ruleset generation of this thread's network namespace, or None when
    the kernel cannot be asked (no netlink, nf_tables unavailable)."""
    seq = next(_seq) & 0xFFFFFFFF
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER) as sock:
            sock.settimeout(timeout)
            sock.send(request(seq))
            return parse_reply(sock.recv(65536), seq)  # a fresh socket: the answer comes first
    except (OSError, ValueError, struct.error):
        return None


def request(seq: int) -> bytes:
    """An NFT_MSG_GETGEN request (no dump, no ack: the kernel answers with one NFT_MSG_NEWGEN)."""
    body = _NFGENMSG.pack(socket.AF_UNSPEC, 0, 0)
    return _HEADER.pack(_HEADER.size + len(body), (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETGEN,
                        NLM_F_REQUEST, seq, 0) + body


def list_tables(timeout: float = 1.0) -> set[tuple[int, str]] | None:
    """(family, name) of every nf_tables table in this thread's network namespace, the family as
    the kernel numbers it (NFPROTO_*): one dump of the tables alone. None when the kernel cannot
    be asked, or a commit meanwhile interrupted the dump."""
    seq = next(_seq) & 0xFFFFFFFF
    body = _NFGENMSG.pack(socket.AF_UNSPEC, 0, 0)  # (every family)
    found: set[tuple[int, str]] = set()
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER) as sock:
            sock.settimeout(timeout)
            sock.send(_HEADER.pack(_HEADER.size + len(body), (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETTABLE,
                                   NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body)
            for _ in range(4096):  # (a datagram holds a few hundred tables)
                if parse_tables(sock.recv(1 << 16), seq, found):
                    return found
    except (OSError, ValueError, struct.error):
        pass
    return None


def parse_tables(data: bytes, seq: int, found: set[tuple[int, str]]) -> bool:
    """Add to `found` the (family, name) of each table a datagram of dump `seq` lists; whether it
    ends the dump. OSError for a netlink error answer or an interrupted dump (its list may lack a
    table), ValueError (or struct.error) for a malformed message."""
    for kind, msg_seq, _port, start, end, flags in _messages(data):
        if msg_seq != seq:
            continue
        if flags & NLM_F_DUMP_INTR:
            raise OSError(errno.EINTR, "the dump was interrupted by a change")
        if kind == NLMSG_ERROR:
            (code,) = struct.unpack_from("=i", data, start)
            raise OSError(-code, os.strerror(-code) if code else "netlink error")
        if kind == NLMSG_DONE:
            if end - start >= 4 and (code := struct.unpack_from("=i", data, start)[0]) < 0:  # (a dump failed midway)
                raise OSError(-code, os.strerror(-code))
            return True
        if kind == NEWTABLE:
            family = data[start]  # (nfgenmsg.nfgen_family)
            found.add((family, _string_attr(data, start + _NFGENMSG.size, end, NFTA_TABLE_NAME)))
    return False


def parse_reply(data: bytes, seq: int) -> int | None:
    """The generation in a netlink datagram answering request `seq`; None when it holds no
    answer to it. OSError for a netlink error answer, ValueError (or struct.error) for a
    malformed message."""
    for kind, msg_seq, _port, start, end, _flags in _messages(data):
        if msg_seq != seq:
            continue
        if kind == NLMSG_ERROR:
            (code,) = struct.unpack_from("=i", data, start)
            raise OSError(-code, os.strerror(-code) if code else "netlink error")
        if kind == NEWGEN:
            return _gen_id(data, start, end)
        if kind == NLMSG_DONE:
            raise OSError(errno.ENODATA, "no generation in the answer")
    return None


def parse_announcements(data: bytes) -> list[tuple[int, int]]:
    """(generation, committing socket's port id) of each NFT_MSG_NEWGEN in a datagram of the
    group (the kernel puts the committer's port id in the message header)."""
    return [(_gen_id(data, start, end), port) for kind, _seq, port, start, end, _flags in _messages(data)
            if kind == NEWGEN]


def own_ports() -> set[int]:
    """The port ids of this process's nf_tables netlink sockets (libnftables' among them): a
    commit announced from one of them is this process's. Port ids, not thread ids: the kernel
    announces global ones, which a process in its own PID namespace (a pod) does not see."""
    ports = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            with socket.socket(fileno=os.dup(int(fd))) as sock:  # (a copy: the socket stays open)
                if sock.family == socket.AF_NETLINK and sock.proto == NETLINK_NETFILTER:
                    ports.add(sock.getsockname()[0])
        except (OSError, ValueError):
            continue
    return ports


class CommitWatch:
    """Hears every nf_tables commit in the network namespace it was made in, as the kernel
    announces it, while joined: join() before a transaction, and leave() tells which generation
    the transaction produced and whether anybody else committed meanwhile. (While anybody
    listens, the kernel also announces each object a commit changes: join for small transactions
    only.) One is kept for many: closing a socket that has heard announcements costs 10-20 ms.
    OSError when it cannot be made."""

    def __init__(self, buffer: int = 1 << 20) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK, NETLINK_NETFILTER)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
            self._sock.bind((0, 0))
        except OSError:
            self._sock.close()
            raise

    def join(self) -> bool:
        """Start hearing commits; False when the kernel refuses."""
        self._heard()  # whatever came after the last leave()
        try:
            self._sock.setsockopt(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, NFNLGRP_NFTABLES)
        except OSError:
            return False
        return True

    def leave(self) -> list[tuple[int, int]] | None:
        """(generation, committing socket's port id) of each commit announced since join(), in
        order; None when announcements were lost (the socket overflowed) or unreadable."""
        heard = self._heard()
        try:
            self._sock.setsockopt(SOL_NETLINK, NETLINK_DROP_MEMBERSHIP, NFNLGRP_NFTABLES)
        except OSError:
            return None
        return heard

    def close(self) -> None:
        self._sock.close()

    def _heard(self) -> list[tuple[int, int]] | None:
        seen: list[tuple[int, int]] | None = []
        while True:
            try:
                data = self._sock.recv(1 << 16)
            except BlockingIOError:
                return seen
            except OSError:  # ENOBUFS: some were dropped
                seen = None
                continue
            if seen is not None:
                try:
                    seen += parse_announcements(data)
                except (ValueError, struct.error):
                    seen = None


def _messages(data: bytes) -> Iterator[tuple[int, int, int, int, int, int]]:
    """(type, seq, port id, payload start, end, flags) of each netlink message in a datagram."""
    offset = 0
    while offset + _HEADER.size <= len(data):
        length, kind, flags, seq, port = _HEADER.unpack_from(data, offset)
        if length < _HEADER.size or offset + length > len(data):
            raise ValueError(f"malformed netlink message (length {length})")
        yield kind, seq, port, offset + _HEADER.size, offset + length, flags
        offset += (length + 3) & ~3


def _attrs(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(type, value start, value end) of each attribute between start and end (up to one too short
    to be one: padding)."""
    while start + _ATTR.size <= end:
        length, kind = _ATTR.unpack_from(data, start)
        if length < _ATTR.size:
            return
        if start + length > end:
            raise ValueError(f"malformed netlink attribute (length {length})")
        yield kind & NLA_TYPE_MASK, start + _ATTR.size, start + length
        start += (length + 3) & ~3


def _string_attr(data: bytes, start: int, end: int, wanted: int) -> str:
    """The NUL-terminated string attribute `wanted` of a payload's attributes."""
    for kind, vstart, vend in _attrs(data, start, end):
        if kind == wanted:
            return data[vstart:vend].split(b"\0", 1)[0].decode("utf-8", "replace")
    raise ValueError(f"no attribute {wanted} in the message")


def _gen_id(data: bytes, start: int, end: int) -> int:
    """NFTA_GEN_ID of an NFT_MSG_NEWGEN payload."""
    for kind, vstart, vend in _attrs(data, start + _NFGENMSG.size, end):
        if kind == NFTA_GEN_ID and vend - vstart >= 4:
            return int(struct.unpack_from(">I", data, vstart)[0])
    raise ValueError("NFT_MSG_NEWGEN without NFTA_GEN_ID")

"""The nf_tables ruleset generation: a counter the kernel keeps per network namespace and bumps by
one on every committed transaction, whoever commits it (nft, libnftables, iptables-nft, ...).
Reads never bump it, nor do failed transactions.

So when the generation is where our own last commit left it, nothing in nf_tables has changed
since: the run loop's periodic drift check need not read the kernel back (10k services: ~7 s and
~10 s of CPU every sync period, see daemon.py).

Asked with one netlink request (NFT_MSG_GETGEN) on a socket of the standard library: a few tens of
microseconds. pyroute2 (a dependency of the one-shot commands) can send it too, but importing it
costs the long-running process ~22 MiB and ~0.3 s.
"""

from __future__ import annotations

import errno
import itertools
import os
import socket
import struct

NETLINK_NETFILTER = 12
NFNL_SUBSYS_NFTABLES = 10
NFT_MSG_NEWGEN, NFT_MSG_GETGEN = 15, 16
NFTA_GEN_ID = 1
NLM_F_REQUEST = 1
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLA_TYPE_MASK = 0x3FFF  # without the nested / byte-order flag bits

_HEADER = struct.Struct("=IHHII")  # struct nlmsghdr: len, type, flags, seq, pid
_NFGENMSG = struct.Struct("=BBH")  # struct nfgenmsg: family, version, res_id
_ATTR = struct.Struct("=HH")  # struct nlattr: len, type
_seq = itertools.count(1)


def generation(timeout: float = 1.0) -> int | None:
    """The current nf_tables ruleset generation of this thread's network namespace, or None when
    the kernel cannot be asked (no netlink, nf_tables unavailable)."""
    seq = next(_seq) & 0xFFFFFFFF
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER) as sock:
            sock.settimeout(timeout)
            sock.send(request(seq))
            for _ in range(8):  # the answer is the first message; bounded in case of strays
                found = parse_reply(sock.recv(65536), seq)
                if found is not None:
                    return found
    except (OSError, ValueError):
        return None
    return None


def request(seq: int) -> bytes:
    """An NFT_MSG_GETGEN request (no dump, no ack: the kernel answers with one NFT_MSG_NEWGEN)."""
    body = _NFGENMSG.pack(socket.AF_UNSPEC, 0, 0)
    return _HEADER.pack(_HEADER.size + len(body), (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETGEN,
                        NLM_F_REQUEST, seq, 0) + body


def parse_reply(data: bytes, seq: int) -> int | None:
    """The generation in a netlink datagram answering request `seq`; None when it holds no
    answer to it. OSError for a netlink error answer, ValueError for a malformed message."""
    offset = 0
    while offset + _HEADER.size <= len(data):
        length, kind, _flags, msg_seq, _pid = _HEADER.unpack_from(data, offset)
        if length < _HEADER.size or offset + length > len(data):
            raise ValueError(f"malformed netlink message (length {length})")
        if msg_seq == seq:
            if kind == NLMSG_ERROR:
                (code,) = struct.unpack_from("=i", data, offset + _HEADER.size)
                raise OSError(-code, os.strerror(-code) if code else "netlink error")
            if kind == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWGEN:
                return _gen_id(data, offset + _HEADER.size + _NFGENMSG.size, offset + length)
            if kind == NLMSG_DONE:
                raise OSError(errno.ENODATA, "no generation in the answer")
        offset += (length + 3) & ~3
    return None


def _gen_id(data: bytes, start: int, end: int) -> int:
    while start + _ATTR.size <= end:
        length, kind = _ATTR.unpack_from(data, start)
        if length < _ATTR.size:
            break
        if kind & NLA_TYPE_MASK == NFTA_GEN_ID and length >= _ATTR.size + 4:
            return int(struct.unpack_from(">I", data, start + _ATTR.size)[0])
        start += (length + 3) & ~3
    raise ValueError("NFT_MSG_NEWGEN without NFTA_GEN_ID")

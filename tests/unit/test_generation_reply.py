"""The nf_tables generation request and the parsing of the kernel's answers (recorded from this
machine's kernel; the real round trip is tested in tests/e2e/test_generation.py)."""

from __future__ import annotations

import errno
import struct

import pytest

from reconciler.backends.generation import parse_announcements, parse_reply, parse_tables, request

# NFT_MSG_NEWGEN answering seq 7: NFTA_GEN_ID 2, NFTA_GEN_PROC_PID, NFTA_GEN_PROC_NAME "python"
NEWGEN_7 = bytes.fromhex("300000000f0a0000070000001b2a00000000000208000100000000020800020000002a1b"
                         "0b000300707974686f6e0000")
# NLMSG_ERROR -EINVAL answering seq 8 (an unknown nf_tables message type)
EINVAL_8 = bytes.fromhex("2800000002000000080000001b2a0000eaffffff14000000630a0500080000000000000000000000")


# recorded by a CommitWatch: the NEWGEN of a libnftables transaction (generation 2, from port id
# 0x89243765; thread 0x4ff5, "python"), then an `nft` process's (generation 3, port id and thread
# 0x4ff6, "nft")
ANNOUNCED = [bytes.fromhex(h) for h in (
    "300000000f0a000001000000653724890000000208000100000000020800020000004ff50b000300707974686f6e0000",
    "2c0000000f0a000001000000f64f00000000000308000100000000030800020000004ff6080003006e667400",
)]
OTHER_ANNOUNCEMENT = bytes.fromhex("1c000000000a00000100000065372489020000000800010074000000")  # NEWTABLE "t"


def test_announced_commits_name_their_generation_and_committing_socket() -> None:
    assert [parse_announcements(d) for d in ANNOUNCED] == [[(2, 0x89243765)], [(3, 0x4FF6)]]
    assert parse_announcements(OTHER_ANNOUNCEMENT) == []
    assert parse_announcements(OTHER_ANNOUNCEMENT + ANNOUNCED[0]) == [(2, 0x89243765)]


def test_request_is_a_getgen_of_the_nftables_subsystem() -> None:
    msg = request(7)
    length, kind, flags, seq, pid = struct.unpack_from("=IHHII", msg)
    assert (length, kind, flags, seq, pid) == (len(msg), 0x0A10, 1, 7, 0) and len(msg) == 20


def test_the_generation_is_read_from_the_answer() -> None:
    assert parse_reply(NEWGEN_7, 7) == 2


def test_an_answer_to_another_request_is_not_taken() -> None:
    assert parse_reply(NEWGEN_7, 8) is None


def test_a_netlink_error_is_an_oserror() -> None:
    with pytest.raises(OSError) as info:
        parse_reply(EINVAL_8, 8)
    assert info.value.errno == errno.EINVAL


def test_the_answer_found_after_a_stray_message() -> None:
    stray = bytearray(NEWGEN_7)
    struct.pack_into("=I", stray, 8, 3)  # seq 3: some earlier request's answer
    assert parse_reply(bytes(stray) + NEWGEN_7, 7) == 2


def test_a_message_cut_short_is_an_error() -> None:
    with pytest.raises(ValueError, match="length 48"):
        parse_reply(NEWGEN_7[:40], 7)


def test_an_answer_without_the_generation_is_an_error() -> None:
    with pytest.raises(ValueError, match="NFTA_GEN_ID"):
        parse_reply(NEWGEN_7[:20] + bytes(28), 7)  # the same header, zeroed attributes


# a dump of the tables answering seq 9 (inet reconciler, ip reconciler-03, ip6 filter, bridge foo),
# then its NLMSG_DONE
TABLES_9 = bytes.fromhex(
    "40000000000a02000900000034060000010000020f0001007265636f6e63696c6572000008000300000000000c00040000"
    "00000000000001080002000000000044000000000a0200090000003406000002000002120001007265636f6e63696c6572"
    "2d303300000008000300000000000c000400000000000000000208000200000000003c000000000a020009000000340600"
    "000a0000020b00010066696c746572000008000300000000000c0004000000000000000003080002000000000038000000"
    "000a020009000000340600000700000208000100666f6f0008000300000000000c0004000000000000000004080002000000"
    "0000")
DONE_9 = bytes.fromhex("1400000003000200090000003406000000000000")


def test_the_tables_are_read_from_a_dump_until_its_end() -> None:
    found: set[tuple[int, str]] = set()
    assert parse_tables(TABLES_9, 9, found) is False  # (more to come)
    assert found == {(1, "reconciler"), (2, "reconciler-03"), (10, "filter"), (7, "foo")}
    assert parse_tables(DONE_9, 9, found) is True
    assert parse_tables(TABLES_9 + DONE_9, 9, set()) is True
    other: set[tuple[int, str]] = set()
    assert parse_tables(TABLES_9, 10, other) is False and other == set()  # (another request's)


def test_an_interrupted_or_failed_dump_of_the_tables_is_an_oserror() -> None:
    interrupted = bytearray(TABLES_9)
    struct.pack_into("=H", interrupted, 6, struct.unpack_from("=H", interrupted, 6)[0] | 0x10)  # NLM_F_DUMP_INTR
    with pytest.raises(OSError) as exc:
        parse_tables(bytes(interrupted), 9, set())
    assert exc.value.errno == errno.EINTR
    with pytest.raises(OSError) as exc:
        parse_tables(EINVAL_8, 8, set())
    assert exc.value.errno == errno.EINVAL
    with pytest.raises(ValueError):
        parse_tables(TABLES_9[:-8], 9, set())  # (cut short)
    failed_done = DONE_9[:16] + struct.pack("=i", -errno.ENOBUFS)  # (an NLMSG_DONE with the dump's error)
    with pytest.raises(OSError) as exc:
        parse_tables(failed_done, 9, set())
    assert exc.value.errno == errno.ENOBUFS

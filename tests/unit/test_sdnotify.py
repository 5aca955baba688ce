"""systemd's service notifications: what a Notifier sends, over a real datagram socket (the
daemon's side: tests/unit/test_daemon.py)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Iterator

import pytest
from helpers import heard, notify_socket

from reconciler.sdnotify import STATUS_MAX, Notifier


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    """A service manager's notification socket: its path, and the socket to read."""
    path = str(tmp_path / "notify")
    with notify_socket(path) as sock:
        yield path, sock


def test_ready_once_then_the_status_when_it_changes(manager: tuple[str, socket.socket]) -> None:
    path, sock = manager
    n = Notifier({"NOTIFY_SOCKET": path})
    assert n.enabled and n.watchdog_interval is None
    n.synced("in sync: 3 service ports (nftables)")
    n.synced("in sync: 3 service ports (nftables)")  # (no change: nothing)
    n.synced("no valid input\nyet: " + "x" * 500)  # (one line, cut short)
    n.stopping()
    got = heard(sock)
    assert got[0] == "READY=1\nSTATUS=in sync: 3 service ports (nftables)"
    assert got[1] == "STATUS=" + ("no valid input yet: " + "x" * 500)[:STATUS_MAX]
    assert got[2:] == ["STOPPING=1"]


def test_a_reload_is_reloading_with_the_monotonic_time_then_ready_again(manager: tuple[str, socket.socket]) -> None:
    path, sock = manager
    clock = Clock()
    n = Notifier({"NOTIFY_SOCKET": path}, clock)
    n.reloading()  # (before the first READY=1: that one ends the start-up, nothing else to say)
    n.synced("in sync: 3 service ports (nftables)")
    clock.now = 1234.5678
    n.reloading()
    n.synced("in sync: 3 service ports (nftables)")  # (the status unchanged: READY=1 all the same)
    n.synced("in sync: 3 service ports (nftables)")
    assert heard(sock) == ["READY=1\nSTATUS=in sync: 3 service ports (nftables)",
                           "RELOADING=1\nMONOTONIC_USEC=1234567800",
                           "READY=1\nSTATUS=in sync: 3 service ports (nftables)"]


def test_watchdog_pings_at_half_its_interval_and_only_for_this_process(manager: tuple[str, socket.socket]) -> None:
    path, sock = manager
    clock = Clock()
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}, clock)
    assert n.watchdog_interval == 1.0 and n.due_in() == 0.0
    n.alive()
    clock.now += 0.6
    assert n.due_in() == pytest.approx(0.4)
    n.alive()  # (too soon)
    clock.now += 0.4
    n.alive()
    assert heard(sock) == ["WATCHDOG=1", "WATCHDOG=1"]
    other = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}, clock, pid=4242)
    assert other.watchdog_interval is None and other.due_in() == float("inf")  # (meant for another process)
    other.alive()
    assert heard(sock) == []


def test_without_a_manager_nothing_is_sent_and_a_gone_one_is_no_error(tmp_path: Path) -> None:
    quiet = Notifier({"WATCHDOG_USEC": "1000000"})
    assert not quiet.enabled and quiet.watchdog_interval is None and not quiet.send("READY=1")
    gone = Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody")})
    assert gone.send("READY=1") is False
    gone.synced("in sync")
    assert not gone.ready_sent  # (READY=1 is tried again after the next sync)


def test_an_abstract_socket_is_named_with_an_at_sign() -> None:
    name = f"reconciler-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(0.2)
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).send("READY=1")
        assert sock.recv(100) == b"READY=1"

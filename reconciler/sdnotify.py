"""systemd's service notifications (sd_notify(3)) for `reconciler run` as a Type=notify unit.

READY=1 once the first sync has ended (the kernel programmed, or why not: no valid input yet, a
failure), so that `systemctl start` returns and units ordered after this one start then; STATUS=
after each sync, what `systemctl status` shows (in sync with N service ports, the input's first
error, the failure); WATCHDOG=1 from the run loop each time round, at most every half
WatchdogSec= (a loop stuck, in a sync or anywhere, stops the pings and systemd restarts the
service); RELOADING=1 when a SIGHUP's full resync starts (`systemctl reload`), then READY=1 with
its STATUS= once it has ended, so that systemd shows the unit reloading meanwhile (and a
Type=notify-reload unit's reload waits for it); STOPPING=1 on the way out. Without $NOTIFY_SOCKET (not under systemd, Type=simple, a
container) nothing is sent. One datagram per message over the standard library's socket, as
libsystemd sends it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

STATUS_MAX = 200  # characters of a STATUS= line (systemctl status shows one line)


class Notifier:
    """The messages of one process to its service manager (nothing when there is none)."""

    def __init__(self, environ: Mapping[str, str] | None = None, clock: Callable[[], float] = time.monotonic,
                 pid: int | None = None) -> None:
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        self.address = "\0" + path[1:] if path.startswith("@") else path  # ("@": the abstract namespace)
        self.watchdog_interval: float | None = None  # seconds between pings (half WatchdogSec)
        pid = os.getpid() if pid is None else pid
        usec, owner = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
        if self.address and usec.isdigit() and int(usec) > 0 and (not owner or owner == str(pid)):
            self.watchdog_interval = int(usec) / 2e6
        self._clock = clock
        self._pinged: float | None = None
        self.ready_sent = False
        self._status: str | None = None
        self._reloading = False

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def send(self, message: str) -> bool:
        """One notification (newline-separated assignments); False when none could be sent."""
        if not self.address:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(self.address)
                sock.sendall(message.encode("utf-8", "replace"))
            return True
        except OSError as exc:  # (the manager gone or restarting: the next message tries again)
            log.debug("sd_notify %r: %s", message.split("\n", 1)[0], exc)
            return False

    def reloading(self) -> None:
        """A reload (SIGHUP's full resync) starts: RELOADING=1 with the CLOCK_MONOTONIC time, which
        systemd compares with the time it sent the signal. Before the first READY=1 nothing: that
        one ends it."""
        if self.ready_sent and self.send(f"RELOADING=1\nMONOTONIC_USEC={int(self._clock() * 1e6)}"):
            self._reloading = True

    def synced(self, status: str) -> None:
        """After a sync: its STATUS= (when it changed), with READY=1 after the first and after a
        reload's."""
        status = " ".join(status.split())[:STATUS_MAX]
        if not self.ready_sent or self._reloading:
            sent = self.send(f"READY=1\nSTATUS={status}")
            self.ready_sent = self.ready_sent or sent
            if sent:
                self._status, self._reloading = status, False
        elif status != self._status and self.send(f"STATUS={status}"):
            self._status = status

    def due_in(self) -> float:
        """Seconds until the next ping is due (infinite without a watchdog): the run loop waits no
        longer."""
        if self.watchdog_interval is None:
            return float("inf")
        if self._pinged is None:
            return 0.0
        return max(0.0, self._pinged + self.watchdog_interval - self._clock())

    def alive(self) -> None:
        """The run loop went round: WATCHDOG=1, when half the watchdog interval has passed since the
        last ping."""
        if self.watchdog_interval is None:
            return
        now = self._clock()
        if self._pinged is None or now - self._pinged >= self.watchdog_interval:
            if self.send("WATCHDOG=1"):
                self._pinged = now

    def stopping(self) -> None:
        self.send("STOPPING=1")

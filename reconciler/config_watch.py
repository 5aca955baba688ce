"""The --config file, watched: `run` exits when its content changes, as kube-proxy does.

kube-proxy reads its configuration file once and exits when the file is written ("content of
the proxy server's configuration file was updated"), for its supervisor (the kubelet, systemd)
to start it again with the new settings. A ConfigMap volume swaps a symlink and editors rename a
new file into place, so the content is what is compared, every few seconds; a file gone or
unreadable for a while is not a change (kube-proxy ignores its removal too).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)

CHECK_SECONDS = 2.0


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as fh:  # (follows symlinks: a ConfigMap's ..data swap is seen)
            return fh.read()
    except OSError:
        return None


class ConfigFileWatch:
    """Calls `on_change` once (from its own thread) when the file's content differs from what it
    held when the watch was made."""

    def __init__(self, path: str, on_change: Callable[[], None], period: float | None = None) -> None:
        self.path = path
        self._content = _read(path)
        self._on_change = on_change
        self._period = CHECK_SECONDS if period is None else period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="watch-config", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.wait(self._period):
            now = _read(self.path)
            if now is None or now == self._content:
                continue
            log.error("the configuration file %s changed: exiting, to be started again with it", self.path)
            self._on_change()
            return

"""When the run loop's periodic resync must read the kernel back to look for drift.

Reading our tables back costs what the ruleset's size costs (10k services: ~7 s, ~10 s of CPU,
every sync period). The nf_tables ruleset generation (backends/generation.py) moves with every
commit that changes anything, whoever makes it, so while it stands where the kernel was last known
to hold the model we applied, nothing has changed since and there is nothing to read. It is
trusted only as far as it is known:

* `known` is a generation at which the kernel held the applied model: one a read started at and
  found it there (a commit during the read moves the generation past it for good), or the one
  our own commits reached, when they are the very commits that followed `known` — the backend
  names the generations its commits produced (libnftables in process: the kernel's
  announcement from our socket; `nft -f` and iptables-nft's restores: the generations between
  the one before the tool ran and the one after, when they are exactly as many as the commits
  it was certain to make), so a commit of anybody else's, even one landing between two of
  ours, shows;
* anything else — commits a backend cannot name (a transaction that might change nothing, or
  one beside somebody else's commit), a transaction that changed nothing, a failed sync, no
  generation at all (legacy iptables) — leaves it unknown, and the next resync reads;
* a resync reads at least every `max_age` seconds all the same.
"""

from __future__ import annotations

import math
from typing import Any

from .backends.generation import follows
from .health import Clock

KERNEL_READ_MAX_AGE = 3600.0  # seconds


class DriftCheck:
    def __init__(self, backend: Any, clock: Clock, max_age: float = KERNEL_READ_MAX_AGE) -> None:
        self.backend = backend
        self.clock = clock
        self.max_age = max_age
        self.known: int | None = None
        self._last_read = -math.inf

    def needs_read(self) -> bool:
        """Whether a resync must read the kernel: the generation cannot vouch for it now."""
        if self.known is None or self.clock.monotonic() - self._last_read >= self.max_age:
            return True
        return self.backend.generation() != self.known

    def reading(self) -> int | None:
        """Call as a read of the kernel starts: the generation then."""
        self._last_read = self.clock.monotonic()
        return self.backend.generation()

    def found_in_sync(self, read_at: int | None) -> None:
        """The read started at generation `read_at` found the kernel holding the applied model
        (had anything committed since read_at, the generation has moved on: no match later)."""
        self.known = read_at

    def committed(self, generations: list[int] | None) -> None:
        """Our commits, unverified, produced these generations (None: not known which)."""
        self.known = follows(self.known, generations) if generations else None

    def forget(self) -> None:
        """Something failed: what the kernel holds is unknown until the next read."""
        self.known = None

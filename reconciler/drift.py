"""When the run loop's periodic resync must read the kernel back to look for drift.

Reading our tables back costs what the ruleset's size costs (10k services: ~7 s, ~10 s of CPU,
every sync period). The nf_tables ruleset generation (backends/generation.py) moves with every
commit anyone makes, so while it stands where our own last commit left it, the kernel still holds
the model we applied and there is nothing to read. The generation is trusted only as far as it
is known:

* `known` is the generation at which the kernel was last known to hold the applied model: the
  one a read started at that found it there (a commit during the read moves the generation past
  it for good), or the one our own commits reached, when the generation moved by exactly their
  number from one known before them (or a verifying read found their result);
* anything else — another writer's commit, a failed sync, a backend with no generation (legacy
  iptables) — leaves it unknown, and the next resync reads;
* a resync reads at least every `max_age` seconds all the same, so a commit of ours the kernel
  counted otherwise than we did cannot hide drift for longer than that.
"""

from __future__ import annotations

import math
from typing import Any

from .health import Clock

KERNEL_READ_MAX_AGE = 3600.0  # seconds
GENERATION_MASK = 0xFFFFFFFF  # the kernel's counter is 32 bits


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

    def committed(self, before: int | None, commits: int, verified: bool) -> None:
        """Our `commits` ran, the generation `before` them read just before; `verified`: a read
        after them found the kernel holding the model they applied."""
        after = self.backend.generation()
        alone = before is not None and after is not None and after == (before + commits) & GENERATION_MASK
        self.known = after if alone and (verified or before == self.known) else None

    def forget(self) -> None:
        """Something failed: what the kernel holds is unknown until the next read."""
        self.known = None

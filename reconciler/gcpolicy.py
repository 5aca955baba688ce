"""When CPython's cyclic garbage collector runs.

A 10k-service cluster is millions of small, acyclic, long-lived objects (parsed manifests, the
canonical document, the kernel model, read-back JSON). Reference counting frees all of them; the
cyclic collector only adds work: it re-scans them every time enough new objects are allocated,
which at that size costs more than the work itself (10k x 10: parsing 5.4 s -> 3.0 s, reading the
kernel back 6.1 s -> 3.5 s without it). So:

* one-shot commands (plan, apply, ...) run without it: they are short and build no cycles worth
  collecting;
* the run loop pauses it during a sync, collects the sync's garbage afterwards, and freezes what
  a sync that read the kernel back leaves alive (the long-lived model) so later collections skip
  it; each such sync unfreezes first (a full resync reads the kernel at least hourly, see
  drift.py), so nothing stays frozen for longer than that. A resync that did not read the kernel
  made little garbage: a full collection then would cost 0.5 s at 10k services for nothing.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


def one_shot() -> None:
    """For a short-lived command: no cyclic collection at all."""
    gc.disable()


@contextmanager
def paused() -> Iterator[None]:
    """No cyclic collection inside the block (restored afterwards)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def after_sync(full: bool) -> None:
    """Collect a sync's cyclic garbage. `full` (after a sync that read the kernel back, or
    failed): a full collection and the survivors re-frozen; otherwise only the young generations."""
    if full:
        gc.unfreeze()
        gc.collect()
        gc.freeze()
    else:
        gc.collect(1)  # the young generations: what this sync made; older cycles wait for a full one

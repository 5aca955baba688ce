"""When CPython's cyclic garbage collector runs.

A 10k-service cluster is millions of small, acyclic, long-lived objects (parsed manifests, the
canonical document, the kernel model, read-back JSON). Reference counting frees all of them; the
cyclic collector only adds work: it re-scans them every time enough new objects are allocated,
which at that size costs more than the work itself (10k x 10: parsing 5.4 s -> 3.0 s, reading the
kernel back 6.1 s -> 3.5 s without it). So:

* one-shot commands (plan, apply, ...) run without it: they are short and build no cycles worth
  collecting;
* the run loop pauses it during a sync, collects the sync's garbage afterwards, and freezes what
  a full sync leaves alive (the long-lived model) so later collections skip it; each full sync
  unfreezes first, so nothing stays frozen for longer than one sync period.
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
    """Collect a sync's cyclic garbage. After a full sync, also re-freeze the survivors: a full
    collection then (one per sync period) and cheap young ones after incremental syncs."""
    if full:
        gc.unfreeze()
        gc.collect()
        gc.freeze()
    else:
        gc.collect(1)  # the young generations: what this sync made; older cycles wait for the next full sync

"""Unit tests never touch this machine's conntrack table: each test gets a process cleanup
(conntrack.RECONCILER) over an empty table in memory."""

from __future__ import annotations

import pytest
from helpers import FakeConntrack

from reconciler import conntrack


@pytest.fixture(autouse=True)
def conntrack_in_memory(monkeypatch: pytest.MonkeyPatch) -> FakeConntrack:
    table = FakeConntrack()
    monkeypatch.setattr(conntrack, "RECONCILER", conntrack.Reconciler(table))
    return table

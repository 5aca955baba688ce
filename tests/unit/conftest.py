"""Unit tests never touch this machine's conntrack table nor its conntrack sysctls: each test gets
a process cleanup (conntrack.RECONCILER) over an empty table in memory, and `run` in-process tunes
a directory that does not exist (nf_conntrack "not loaded")."""

from __future__ import annotations

import pytest
from helpers import FakeConntrack

from reconciler import conntrack, conntrack_sysctls


@pytest.fixture(autouse=True)
def conntrack_in_memory(monkeypatch: pytest.MonkeyPatch) -> FakeConntrack:
    table = FakeConntrack()
    monkeypatch.setattr(conntrack, "RECONCILER", conntrack.Reconciler(table))
    return table


@pytest.fixture(autouse=True)
def no_host_sysctls(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    monkeypatch.setattr(conntrack_sysctls, "SYSCTL_DIR", str(tmp_path_factory.getbasetemp() / "no-netfilter"))

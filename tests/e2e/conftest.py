"""Fixtures for real-packet e2e tests in network namespaces (see lab.py)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lab import Lab, skip_reason  # noqa: E402


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    """A module-scoped Lab with servers pod1/pod2/pod3 on 8080+9090 (TCP+UDP)."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    with Lab() as the_lab:
        the_lab.start_pod_servers()
        yield the_lab

"""Shared test fixtures."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def two_cpus() -> tuple[int, int]:
    """Two CPUs this process may use, for emulating two NUMA-pinned ranks."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip(f"needs 2 allowed CPUs, this process has {allowed}")
    return allowed[0], allowed[1]

"""Spawned-process harness for the collectives tests: run a function on every rank of a group.

Workers are started with the "spawn" context (a clean interpreter per rank, as in production)
and reached through a queue; every wait has a deadline, and a rank that raises, dies or hangs
fails the test with its traceback instead of hanging it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import pytest

# Printed by every test that draws random numbers; set NUMAOV_TEST_SEED to replay another.
SEED = int(os.environ.get("NUMAOV_TEST_SEED", "20261129"))


def unique_name(prefix: str) -> str:
    """A group or job name no other test run (or engineer) on this host uses."""
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def shm_leftovers(fragment: str) -> list[str]:
    """Entries of /dev/shm whose name contains `fragment` (a group name)."""
    return sorted(name for name in os.listdir("/dev/shm") if fragment in name)


def _child(target: Callable[[int, int, Any], Any], rank: int, world: int, args: Any,
           results: Any) -> None:
    try:
        results.put((rank, "ok", target(rank, world, args)))
    except BaseException:  # the parent shows it: a rank must never fail silently
        results.put((rank, "error", traceback.format_exc()))


class RankGroup:
    """`world` spawned processes running `target(rank, world, args)`."""

    def __init__(self, world: int, target: Callable[[int, int, Any], Any], args: Any,
                 ranks: list[int] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.processes = {
            rank: ctx.Process(target=_child, args=(target, rank, world, args, self.results),
                              daemon=True)
            for rank in (ranks if ranks is not None else range(world))
        }
        for process in self.processes.values():
            process.start()

    def kill(self, rank: int) -> None:
        process = self.processes.pop(rank)
        process.kill()
        process.join(10)

    def collect(self, timeout_s: float) -> dict[int, Any]:
        """Every remaining rank's return value; fails the test on an error or the deadline."""
        deadline = time.monotonic() + timeout_s
        got: dict[int, tuple[str, Any]] = {}
        try:
            while len(got) < len(self.processes):
                remaining = deadline - time.monotonic()
                try:
                    rank, status, value = self.results.get(timeout=max(remaining, 0.01))
                except queue_module.Empty:
                    missing = sorted(set(self.processes) - set(got))
                    pytest.fail(f"ranks {missing} did not finish within {timeout_s:.0f} s")
                got[rank] = (status, value)
        finally:
            self.stop()
        errors = [f"rank {rank}:\n{value}" for rank, (status, value) in sorted(got.items())
                  if status != "ok"]
        if errors:
            pytest.fail("\n".join(errors))
        return {rank: value for rank, (_, value) in got.items()}

    def stop(self) -> None:
        for process in self.processes.values():
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(5)


def run_ranks(world: int, target: Callable[[int, int, Any], Any], args: Any,
              timeout_s: float = 240.0) -> dict[int, Any]:
    """Run `target` on `world` spawned ranks and return {rank: result}."""
    return RankGroup(world, target, args).collect(timeout_s)

"""Per-rank worker processes: binding, results by rank, failures named."""

from __future__ import annotations

import os

import pytest

from numaov import NumaovError
from numaov.runtime.placement.binding import BindingPlan
from numaov.runtime.placement.topology import read_topology
from numaov.runtime.placement.workers import WorkerContext, WorkerError, run_on_ranks

pytestmark = pytest.mark.slow  # spawned worker processes


def _report(context: WorkerContext, arg: int) -> tuple[int, int, list[int], int]:
    return context.rank, arg * 10, sorted(os.sched_getaffinity(0)), context.binding.threads


def _fail_on_rank_one(context: WorkerContext, arg: int) -> int:
    if context.rank == 1:
        raise ValueError("boom on purpose")
    return arg


WORKER_MESSAGE = "IR file '/models/x/model.xml' is corrupt; expected the file the export wrote"


def _numaov_error_on_rank_one(context: WorkerContext, arg: int) -> int:
    if context.rank == 1:
        raise NumaovError(WORKER_MESSAGE)
    return arg


def _die(context: WorkerContext, arg: int) -> int:
    os._exit(7)


def test_each_rank_runs_pinned_and_returns_in_rank_order(two_cpus) -> None:
    plan = BindingPlan.from_bind_string(f"{two_cpus[0]}|{two_cpus[1]}", read_topology())
    results = run_on_ranks(plan, _report, [1, 2], timeout_s=120)
    assert results == [(0, 10, [two_cpus[0]], 1), (1, 20, [two_cpus[1]], 1)]


def test_a_failing_rank_is_named(two_cpus) -> None:
    plan = BindingPlan.from_bind_string(f"{two_cpus[0]}|{two_cpus[1]}", read_topology())
    with pytest.raises(WorkerError, match="(?s)rank 1 failed: .*boom on purpose"):
        run_on_ranks(plan, _fail_on_rank_one, [1, 2], timeout_s=120)


def test_a_numaov_error_in_a_worker_arrives_as_its_one_line_message(two_cpus) -> None:
    plan = BindingPlan.from_bind_string(f"{two_cpus[0]}|{two_cpus[1]}", read_topology())
    with pytest.raises(WorkerError) as caught:
        run_on_ranks(plan, _numaov_error_on_rank_one, [1, 2], timeout_s=120)
    assert str(caught.value) == f"rank 1 failed: {WORKER_MESSAGE}"


def test_a_dead_worker_is_reported(two_cpus) -> None:
    plan = BindingPlan.from_bind_string(f"{two_cpus[0]}", read_topology())
    with pytest.raises(WorkerError, match=r"died without a result \(rank 0 exit code 7\)"):
        run_on_ranks(plan, _die, [0], timeout_s=120)


def test_argument_count_must_match_ranks(two_cpus) -> None:
    plan = BindingPlan.from_bind_string(f"{two_cpus[0]}", read_topology())
    with pytest.raises(WorkerError, match="2 argument sets for 1 ranks"):
        run_on_ranks(plan, _report, [1, 2])

"""The shared-memory collectives when things go wrong: every rank raises, nothing hangs, and
/dev/shm is left clean.

Mismatched ops, sizes, dtypes and roots (all_to_all among them); a rank that never arrives
(timeout) or arrives late (no error); a bad argument on one rank (an all_to_all input that does
not split evenly); a rank killed in the middle of an all_reduce or an all_to_all; a segment
left by a killed run (reclaimed) or held by a live one (refused); a full /dev/shm; ranks that
never attach. Ranks are spawned processes; all timeouts are short so the file stays fast.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest
from support.collectives_harness import RankGroup, run_ranks, shm_leftovers, unique_name

pytestmark = pytest.mark.slow  # spawned rank processes

# Long enough for a loaded 2-core machine to schedule every rank, short enough to keep the
# file fast: a timeout scenario costs about twice this.
TIMEOUT_S = 2.0


# ---------------------------------------------------------------------------------------------
# Scenarios on three ranks: each runs on a fresh group, all ranks enter it together.
# ---------------------------------------------------------------------------------------------


def _op_mismatch(comm: Any, rank: int) -> None:
    x = np.ones(1000, np.float32)
    if rank == 0:
        comm.all_reduce(x)
    else:
        comm.all_gather_into_tensor(np.empty(3000, np.float32), x)


def _size_mismatch(comm: Any, rank: int) -> None:
    comm.all_reduce(np.ones(1001 if rank == 2 else 1000, np.float32))


def _dtype_mismatch(comm: Any, rank: int) -> None:
    comm.all_reduce(np.ones(1000, np.float16 if rank == 1 else np.float32))


def _root_mismatch(comm: Any, rank: int) -> None:
    comm.broadcast(np.ones(10, np.float32), 1 if rank == 0 else 2)


def _never_arrives(comm: Any, rank: int) -> None:
    # Rank 2 skips the collective, then comes back far past the others' timeout.
    if rank == 2:
        time.sleep(2 * TIMEOUT_S)
        comm.barrier()
    else:
        comm.all_reduce(np.ones(1000, np.float32))


def _arrives_late(comm: Any, rank: int) -> None:
    # Late, but within the timeout: the others wait (spin, yield, sleep) and nobody fails.
    if rank == 1:
        time.sleep(TIMEOUT_S / 2)
    x = np.full(5000, float(rank), np.float32)
    comm.all_reduce(x)
    assert (x == 3.0).all()


def _bad_argument(comm: Any, rank: int) -> None:
    comm.all_reduce(np.ones(1000, np.int64 if rank == 1 else np.float32))


def _all_to_all_op_mismatch(comm: Any, rank: int) -> None:
    # The same buffers as a reduce_scatter_tensor's: only the op differs.
    x = np.ones(3000, np.float32)
    if rank == 0:
        comm.all_to_all(np.empty(3000, np.float32), x)
    else:
        comm.reduce_scatter_tensor(np.empty(1000, np.float32), x)


def _all_to_all_size_mismatch(comm: Any, rank: int) -> None:
    n = 3003 if rank == 2 else 3000
    comm.all_to_all(np.empty(n, np.float32), np.ones(n, np.float32))


def _all_to_all_uneven(comm: Any, rank: int) -> None:
    # Rank 1's dim 0 (4 rows) does not split over 3 ranks: refused before any data moves.
    rows = 4 if rank == 1 else 3
    comm.all_to_all(np.empty((rows, 5), np.float32), np.ones((rows, 5), np.float32))


SCENARIOS = {
    "op": _op_mismatch,
    "size": _size_mismatch,
    "dtype": _dtype_mismatch,
    "root": _root_mismatch,
    "timeout": _never_arrives,
    "late": _arrives_late,
    "argument": _bad_argument,
    "a2a-op": _all_to_all_op_mismatch,
    "a2a-size": _all_to_all_size_mismatch,
    "a2a-uneven": _all_to_all_uneven,
}


def _scenario_worker(rank: int, world: int, args: dict) -> dict[str, tuple[str, str]]:
    from numaov.distributed.communicator import CollectiveError, ShmCommunicator

    # A control group with a long timeout lines the ranks up before each scenario, whatever
    # the previous one did to them.
    control = ShmCommunicator(args["prefix"] + "-control", rank, world, job_id=args["job"],
                              timeout_s=120)
    outcomes: dict[str, tuple[str, str]] = {}
    for name, scenario in SCENARIOS.items():
        control.barrier()
        comm = ShmCommunicator(f"{args['prefix']}-{name}", rank, world, job_id=args["job"],
                               timeout_s=TIMEOUT_S)
        try:
            scenario(comm, rank)
            error = ""
        except CollectiveError as exc:
            error = str(exc)
        try:  # after a failure the communicator must refuse further calls
            comm.barrier()
            after = ""
        except CollectiveError as exc:
            after = str(exc)
        comm.close()
        outcomes[name] = (error, after)
    control.close()
    return outcomes


def test_mismatches_timeouts_and_bad_arguments_raise_on_every_rank() -> None:
    prefix = unique_name("fail")
    results = run_ranks(3, _scenario_worker, {"prefix": prefix, "job": prefix})
    errors = {name: [results[r][name][0] for r in range(3)] for name in SCENARIOS}
    afters = {name: [results[r][name][1] for r in range(3)] for name in SCENARIOS}

    # Mismatches: every rank names both sides. A rank that saw the other side first raises
    # its own mismatch; one whose peers already flagged the group says so and quotes it.
    for name, left, right in (("op", "all_reduce", "all_gather_into_tensor"),
                              ("size", "count=1000", "count=1001"),
                              ("dtype", "dtype=f32", "dtype=f16"),
                              ("root", "root=1", "root=2"),
                              ("a2a-op", "all_to_all", "reduce_scatter_tensor"),
                              ("a2a-size", "all_to_all(count=1000", "all_to_all(count=1001")):
        for rank, message in enumerate(errors[name]):
            assert "mismatch" in message and left in message and right in message, (
                name, rank, message)
            assert "seq 1" in message, (name, rank, message)
    # Timeout: ranks 0 and 1 name themselves or the flagging rank, the peer, op and seq;
    # rank 2 comes back to a failed group.
    for message in errors["timeout"][:2]:
        assert "timed out" in message and "waiting for rank 2" in message, message
        assert "all_reduce seq 1" in message, message
    assert "group failed" in errors["timeout"][2], errors["timeout"][2]
    # Late but within the timeout: no error.
    assert errors["late"] == ["", "", ""] and afters["late"] == ["", "", ""]
    # A bad argument on rank 1 stops everyone at once, not after the timeout.
    assert "dtype int64; expected float32, bfloat16 or float16" in errors["argument"][1]
    for rank in (0, 2):
        assert "group failed" in errors["argument"][rank], errors["argument"][rank]
        assert "int64" in errors["argument"][rank], errors["argument"][rank]
    # So does an uneven all_to_all split on rank 1: equal splits only.
    uneven = "input dim 0 is 4; expected a multiple of world_size 3 (equal splits only)"
    assert uneven in errors["a2a-uneven"][1], errors["a2a-uneven"][1]
    for rank in (0, 2):
        assert "group failed" in errors["a2a-uneven"][rank], errors["a2a-uneven"][rank]
        assert uneven in errors["a2a-uneven"][rank], errors["a2a-uneven"][rank]
    for name, messages in errors.items():
        assert all("\n" not in m for m in messages), (name, messages)  # one line each
    for name in SCENARIOS.keys() - {"late"}:
        for message in afters[name]:
            assert "failed earlier" in message, (name, message)
    assert shm_leftovers(prefix) == []


# ---------------------------------------------------------------------------------------------
# A rank killed in the middle of collectives.
# ---------------------------------------------------------------------------------------------


def _looping_worker(rank: int, world: int, args: dict) -> tuple[str, float]:
    """The error that stopped this rank, and when (time.monotonic(): one clock for every
    process of the machine)."""
    from numaov.distributed.communicator import CollectiveError, ShmCommunicator

    comm = ShmCommunicator(args["group"], rank, world, job_id=args["group"],
                           timeout_s=args["timeout"])
    # 16 MiB (all_to_all: 4 MiB per rank): many chunks per call, so a kill lands inside one.
    x = np.ones((world, 1 << 20) if args["op"] == "all_to_all" else 4 << 20, np.float32)
    try:
        for i in range(100_000):
            if args["op"] == "all_to_all":
                comm.all_to_all(x, x)  # in place: a copy, nothing to reset
            else:
                comm.all_reduce(x)
                x[:] = 1.0
            if i == 2:
                args["running"][rank].set()
    except CollectiveError as exc:
        return str(exc), time.monotonic()
    finally:
        comm.close()
    return "no error", time.monotonic()


@pytest.mark.parametrize("op", ["all_reduce", "all_to_all"])
def test_a_killed_rank_stops_the_others_and_leaves_nothing_in_dev_shm(op: str) -> None:
    import multiprocessing as mp

    group = unique_name(f"killed-{op}")
    ctx = mp.get_context("spawn")
    running = [ctx.Event() for _ in range(3)]
    # A generous timeout: the survivors must notice the death themselves, well before it.
    timeout_s = 60.0
    ranks = RankGroup(3, _looping_worker,
                      {"group": group, "timeout": timeout_s, "running": running, "op": op})
    for event in running:
        assert event.wait(120), "ranks did not start looping"
    time.sleep(0.2)
    killed = time.monotonic()
    ranks.kill(1)
    results = ranks.collect(60)
    stopped_s = max(results[rank][1] for rank in (0, 2)) - killed
    print(f"{op}: the survivors raised {stopped_s:.3f} s after the kill (timeout {timeout_s} s)")
    for rank in (0, 2):
        message = results[rank][0]
        assert "rank 1" in message and ("exited" in message or "failed" in message), message
        assert op in message, message
        assert "timed out" not in message and "\n" not in message, message
    # Waits check the peer's process every 20 ms; the rest is the kill itself and scheduling
    # on a loaded machine.
    assert stopped_s < 5.0 < timeout_s, stopped_s
    assert shm_leftovers(group) == []


# ---------------------------------------------------------------------------------------------
# Segments left behind, held, or impossible to create.
# ---------------------------------------------------------------------------------------------


def _lone_creator(rank: int, world: int, args: dict) -> None:
    from numaov.distributed.communicator import ShmCommunicator

    ShmCommunicator(args["group"], 0, 2, job_id=args["job"], timeout_s=120)  # waits for rank 1


def _reclaiming_worker(rank: int, world: int, args: dict) -> tuple[list[str], float]:
    import logging

    from numaov.distributed.communicator import ShmCommunicator

    notes: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: notes.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("numaov.distributed.communicator").addHandler(handler)
    comm = ShmCommunicator(args["group"], rank, world, job_id=args["job"], timeout_s=60)
    x = np.full(10, rank + 1.0, np.float32)
    comm.all_reduce(x)
    comm.close()
    return notes, float(x[0])


def _segment_path(group: str, job: str) -> str:
    from numaov.distributed.communicator import _native

    return "/dev/shm" + _native().segment_name(group, job)


def test_a_stale_segment_is_reclaimed_and_a_live_one_refused() -> None:
    from numaov.distributed.communicator import CollectiveError, ShmCommunicator

    group = unique_name("stale")
    path = _segment_path(group, group)
    # 1. A run whose rank 0 created the segment and then died before rank 1 attached.
    lone = RankGroup(2, _lone_creator, {"group": group, "job": group}, ranks=[0])
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        assert time.monotonic() < deadline, "rank 0 never created its segment"
        time.sleep(0.05)
    # 2. While that rank 0 lives, a second rank 0 of the same group and job is refused.
    with pytest.raises(CollectiveError, match=r"in use by live process \d+"):
        ShmCommunicator(group, 0, 2, job_id=group, timeout_s=TIMEOUT_S)
    pid = lone.processes[0].pid
    lone.kill(0)
    assert os.path.exists(path), "the killed creator's segment should still be there"
    # 3. The next run reclaims it and works.
    results = run_ranks(2, _reclaiming_worker, {"group": group, "job": group})
    assert results[0][1] == results[1][1] == 3.0
    assert any(f"dead process {pid}" in note for note in results[0][0]), results[0][0]
    assert shm_leftovers(group) == []


def _die_once_rank_0_created(path: str, rank: int, world_size: int, group: str | None) -> int:
    """A rank group's setup: rank 1 dies before joining, once rank 0 holds the segment."""
    if rank == 1:
        deadline = time.monotonic() + 120
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(3)
    return rank


def test_a_rank_dead_before_its_group_formed_leaves_nothing_in_dev_shm(monkeypatch) -> None:
    """The segment is unlinked once every rank attached; when one dies before that, its
    launcher unlinks it after stopping the rest (rank 0 is stopped while waiting)."""
    import functools

    from numaov.distributed.rank_group import WorkerError, run_rank_group

    group = unique_name("unformed")
    monkeypatch.setenv("NUMAOV_JOB_ID", group)
    monkeypatch.setenv("NUMAOV_COLL_TIMEOUT_S", "600")  # rank 0 would wait that long
    setup = functools.partial(_die_once_rank_0_created, _segment_path(group, group))
    started = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 exit code 3"):
        run_rank_group(2, _rank_of, [None, None], group=group, setup=setup)
    assert time.monotonic() - started < 120
    assert shm_leftovers(group) == []


def _rank_of(context: Any, arg: Any) -> int:
    return context


def test_a_full_dev_shm_fails_at_creation_with_a_clear_message(monkeypatch) -> None:
    from numaov.distributed.communicator import CollectiveError, ShmCommunicator

    group = unique_name("full")
    # 2 x 1 TiB cannot be reserved in any /dev/shm this test runs on.
    monkeypatch.setenv("NUMAOV_COLL_BUFFER_BYTES", str(1 << 40))
    with pytest.raises(CollectiveError, match=r"cannot reserve \d+ MiB in /dev/shm .*df -h"):
        ShmCommunicator(group, 0, 1, job_id=group, timeout_s=TIMEOUT_S)
    assert shm_leftovers(group) == []


def test_ranks_that_never_meet_time_out_and_leave_nothing() -> None:
    from numaov.distributed.communicator import CollectiveError, ShmCommunicator

    group = unique_name("alone")
    with pytest.raises(CollectiveError, match=r"waiting for ranks \[1, 2\] to attach"):
        ShmCommunicator(group, 0, 3, job_id=group, timeout_s=0.5)
    with pytest.raises(CollectiveError, match="waiting for rank 0 to create .*NUMAOV_JOB_ID"):
        ShmCommunicator(group, 1, 3, job_id=group, timeout_s=0.5)
    assert shm_leftovers(group) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("", 0, 2), "group is ''"),
        (("g", 2, 2), "rank 2 .* expected 0 to 1"),
        (("g", 0, 0), "world size 0 .* expected 1 to"),
        (("g", 0, 2, None, 0.0), "timeout_s is 0.0"),
    ],
)
def test_bad_constructor_arguments_are_named(args: tuple, message: str) -> None:
    from numaov.distributed.communicator import CollectiveError, ShmCommunicator

    with pytest.raises(CollectiveError, match=message):
        ShmCommunicator(*args)


def test_a_bad_timeout_variable_is_named(monkeypatch) -> None:
    from numaov.distributed.communicator import CollectiveError, ShmCommunicator

    monkeypatch.setenv("NUMAOV_COLL_TIMEOUT_S", "soon")
    with pytest.raises(CollectiveError, match="NUMAOV_COLL_TIMEOUT_S='soon'"):
        ShmCommunicator(unique_name("env"), 0, 1)


"""One spawned process per rank, joined in a shared-memory collective group.

`run_rank_group(world_size, target, per_rank_args)` spawns a process per rank;
each runs an optional `setup(rank, world_size, group)` (the runtime pins the
process to its CPUs and memory there), joins the group with a
`ShmCommunicator` registered under the group name (so the eager collective
ops and OpenVINO's extension ops find it), calls ``target(context, arg)``
and sends the result back. The parent waits with a deadline: a rank that
raises, dies or hangs ends the whole run with an error naming the rank, and
the other ranks are stopped, so a failure never leaves a group waiting; a
group segment left by ranks stopped before the group formed is unlinked then.

It lives here, beside the communicator, because both the exporter (parity of
per-rank graphs) and the runtime (inference workers) start rank groups.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue as queue_module
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from numaov import NumaovError

logger = logging.getLogger(__name__)

# Rank setup: (rank, world_size, group) -> the context object the target receives.
RankSetup = Callable[[int, int, "str | None"], Any]


class WorkerError(NumaovError):
    """A rank process raised, died or did not finish in time."""


@dataclass(frozen=True)
class RankInfo:
    """The context a target receives when no setup is given."""

    rank: int
    world_size: int
    # The collective group every rank joined (None when world_size is 1).
    group: str | None


def _rank_main(rank: int, world_size: int, group: str | None, job_id: str,
               setup: RankSetup | None, target: Callable[[Any, Any], Any], arg: Any,
               results) -> None:
    from numaov.distributed.communicator import ShmCommunicator, destroy_communicator

    joined = False
    try:
        context = (setup or RankInfo)(rank, world_size, group)
        if group is not None:
            ShmCommunicator(group, rank, world_size, job_id=job_id)  # registers itself
            joined = True
        results.put((rank, "ok", target(context, arg)))
    except NumaovError as exc:
        results.put((rank, "error", str(exc)))
    except BaseException:  # the parent shows it; a rank must never die silently
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if joined:
            destroy_communicator(group)


def run_rank_group(
    world_size: int,
    target: Callable[[Any, Any], Any],
    per_rank_args: Sequence[Any],
    *,
    group: str | None = None,
    setup: RankSetup | None = None,
    timeout_s: float = 3600.0,
) -> list[Any]:
    """Run ``target(context, per_rank_args[r])`` on every rank; return the results by rank.

    `target` and `setup` must be picklable (module-level functions or partials of them).
    With more than one rank the processes share a collective group named `group`
    (default: a fresh unique name).
    """
    if world_size < 1:
        raise WorkerError(f"world_size={world_size}; expected at least 1")
    if len(per_rank_args) != world_size:
        raise WorkerError(
            f"{len(per_rank_args)} argument sets for {world_size} ranks; expected one per rank"
        )
    if world_size > 1 and group is None:
        group = f"ranks-{uuid.uuid4().hex[:12]}"
    if world_size == 1:
        group = None
    job_id = os.environ.get("NUMAOV_JOB_ID") or f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, name=f"numaov-rank{r}", daemon=True,
                    args=(r, world_size, group, job_id, setup, target, per_rank_args[r],
                          results))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode is not None]
                # A result may race with its process's exit: blame a rank only once the
                # queue has stayed empty after it died.
                if dead and not _wait_for_result(results, 0.5):
                    codes = ", ".join(f"rank {r} exit code {procs[r].exitcode}" for r in dead)
                    raise WorkerError(f"rank process died without a result ({codes})") from None
                if time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in out]
                    raise WorkerError(
                        f"ranks {missing} did not finish within {timeout_s:.0f} s"
                    ) from None
                continue
            if status == "error":
                raise WorkerError(f"rank {rank} failed: {value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world_size else 0.5)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        if group is not None and not any(p.is_alive() for p in procs):
            reclaim_group_segments([(group, job_id)])
    return [out[r] for r in range(world_size)]


def reclaim_group_segments(groups: Sequence[tuple[str, str]]) -> None:
    """Unlink what ranks that have all exited left in /dev/shm for these (group, job id)
    pairs: a rank stopped before its group formed leaves the group's segment behind."""
    from numaov.distributed.communicator import reclaim_stale_segment

    for group, job_id in groups:
        if reclaim_stale_segment(group, job_id):
            logger.debug("unlinked the segment of group %r (job id %r) its ranks left",
                         group, job_id)


def _wait_for_result(results, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not results.empty():
            return True
        time.sleep(0.05)
    return not results.empty()

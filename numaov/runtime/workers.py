"""One worker process per rank of a binding plan.

`run_on_ranks(plan, target, per_rank_args)` spawns a process per rank; each
binds itself to its CPUs and memory, joins the shared-memory collective
group, calls ``target(context, arg)`` and sends the result back. The parent
waits with a deadline: a worker that raises, dies or hangs ends the whole
run with an error naming the rank, and the other workers are stopped, so a
failure never leaves a group waiting forever.
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
from numaov.runtime.binding import AppliedBinding, BindingPlan, apply_rank_binding

log = logging.getLogger(__name__)


class WorkerError(NumaovError):
    """A worker raised, died or did not finish in time."""


@dataclass(frozen=True)
class WorkerContext:
    """What a worker knows about itself, passed to the target."""

    rank: int
    world_size: int
    # The collective group every rank joined (None when world_size is 1).
    group: str | None
    binding: AppliedBinding

    def openvino_config(self) -> dict[str, object]:
        return self.binding.openvino_config()


def _worker_main(plan: BindingPlan, rank: int, group: str | None, job_id: str,
                 target: Callable[[WorkerContext, Any], Any], arg: Any, results) -> None:
    communicator = None
    try:
        applied = apply_rank_binding(plan, rank)
        # Matmuls in eager torch should use this rank's cores only.
        import torch

        torch.set_num_threads(applied.threads)
        if group is not None:
            from numaov.custom_ops.collectives import ShmCommunicator, register_communicator

            communicator = ShmCommunicator(group, rank, plan.world_size, job_id=job_id)
            register_communicator(communicator)
        context = WorkerContext(rank, plan.world_size, group, applied)
        results.put((rank, "ok", target(context, arg)))
    except NumaovError as exc:
        results.put((rank, "error", str(exc)))
    except BaseException:  # the parent shows it; a worker must never die silently
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if communicator is not None:
            from numaov.custom_ops.collectives import destroy_communicator

            destroy_communicator(group)


def run_on_ranks(
    plan: BindingPlan,
    target: Callable[[WorkerContext, Any], Any],
    per_rank_args: Sequence[Any],
    *,
    group: str | None = None,
    timeout_s: float = 3600.0,
) -> list[Any]:
    """Run ``target(context, per_rank_args[r])`` on every rank; return results by rank.

    `target` must be a module-level function (it is pickled into spawned
    processes). With more than one rank the workers share a collective group,
    named `group` (default: a fresh unique name).
    """
    world = plan.world_size
    if len(per_rank_args) != world:
        raise WorkerError(f"{len(per_rank_args)} argument sets for {world} ranks; expected one per rank")
    if world > 1 and group is None:
        group = f"workers-{uuid.uuid4().hex[:12]}"
    job_id = os.environ.get("NUMAOV_JOB_ID") or f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker_main, name=f"numaov-rank{r}", daemon=True,
                    args=(plan, r, group if world > 1 else None, job_id, target,
                          per_rank_args[r], results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in out and p.exitcode is not None]
                if dead:
                    # Drain a result that raced with the exit before blaming the rank.
                    time.sleep(0.2)
                    if results.empty():
                        codes = ", ".join(f"rank {r} exit code {procs[r].exitcode}" for r in dead)
                        raise WorkerError(f"worker died without a result ({codes})") from None
                if time.monotonic() > deadline:
                    missing = [r for r in range(world) if r not in out]
                    raise WorkerError(
                        f"ranks {missing} did not finish within {timeout_s:.0f} s"
                    ) from None
                continue
            if status == "error":
                raise WorkerError(f"rank {rank} failed: {value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world else 0.5)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return [out[r] for r in range(world)]

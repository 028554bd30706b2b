"""One worker process per rank of a binding plan.

`run_on_ranks(plan, target, per_rank_args)` starts a rank group
(`numaov.distributed.rank_group`) whose processes first bind themselves to
their rank's CPUs and memory, so each worker computes on its own NUMA node
with one inference thread per core, then join the shared-memory collective
group and call ``target(context, arg)`` with a `WorkerContext`.

A `NumaovError` raised in a worker (binding, loading, compiling, running) reaches the caller
as a `WorkerError` whose message is ``"rank R failed: "`` and the error's own one-line
message, so the CLI shows it as one line; the other ranks are stopped.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from numaov.distributed.rank_group import WorkerError, run_rank_group
from numaov.runtime.placement.binding import AppliedBinding, BindingPlan, apply_rank_binding

log = logging.getLogger(__name__)

__all__ = ["WorkerContext", "WorkerError", "run_on_ranks"]


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


def _bind_worker(plan: BindingPlan, rank: int, world_size: int, group: str | None) -> WorkerContext:
    applied = apply_rank_binding(plan, rank)
    # Eager torch matmuls should use this rank's cores only.
    import torch

    torch.set_num_threads(applied.threads)
    return WorkerContext(rank, world_size, group, applied)


def run_on_ranks(
    plan: BindingPlan,
    target: Callable[[WorkerContext, Any], Any],
    per_rank_args: Sequence[Any],
    *,
    group: str | None = None,
    timeout_s: float = 3600.0,
) -> list[Any]:
    """Run ``target(context, per_rank_args[r])`` on every rank of `plan`; results by rank.

    `target` must be a module-level function (it is pickled into spawned processes).
    With more than one rank the workers share a collective group named `group`
    (default: a fresh unique name).
    """
    return run_rank_group(plan.world_size, target, per_rank_args, group=group,
                          setup=functools.partial(_bind_worker, plan), timeout_s=timeout_s)

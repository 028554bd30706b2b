"""How the engine reaches its rank runners: in this process, or one worker process per rank.

Both transports take one :class:`RankStep` per rank and return one :class:`RankStepResult`
per rank, so the engine never branches on which it has:

- :class:`InProcessRanks`: a single rank's runner in the engine's process (dp=1, e.g. the
  PyTorch model in tests).
- :class:`WorkerRanks`: the binding plan's workers (``numaov.runtime.placement.workers``): each pins
  itself, binds its memory, joins the model's collective group, loads and compiles its rank's
  graph once, allocates its cache pool (checked against its node's free memory), then runs
  steps until it is closed. Each rank has its own pipe: a step is written to it and its answer
  read back directly, with no queue feeder threads in between (a step is short, and every
  thread that has to wake up for it costs time on cores the ranks compute on); a worker that
  fails ends every later step with :class:`RankWorkersError`.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from numaov import NumaovError
from numaov.manifest import LM_KIND
from numaov.runtime.lm.runner import RankRunner, RankStep, RankStepResult, open_step_model
from numaov.runtime.manifest_reader import ModelManifest, read_manifest
from numaov.runtime.placement.binding import BindingPlan

logger = logging.getLogger(__name__)

# Loading and compiling a rank's graph; a real checkpoint can take minutes.
STARTUP_TIMEOUT_S = 1800.0
# A step that has not come back in this time is stuck (a peer died mid-collective).
STEP_TIMEOUT_S = 3600.0
_POLL_S = 0.2


class RankWorkersError(NumaovError):
    """The rank workers failed, stopped or did not start."""


class RankWorkersRestarting(RankWorkersError):
    """The rank workers failed and fresh ones are starting: a request may be tried again."""


class InProcessRanks:
    """One rank runner in this process."""

    def __init__(self, runner: RankRunner) -> None:
        self._runner = runner
        self.world_size = 1
        self.load_seconds = 0.0

    def step(self, steps: list[RankStep]) -> list[RankStepResult]:
        return [self._runner.run(steps[0])]

    def failure(self) -> str | None:
        return None

    def workers(self) -> list[dict[str, Any]]:
        return [{"rank": 0, "pid": os.getpid(), "cpus": sorted(os.sched_getaffinity(0)),
                 "nodes": [], "alive": True}]

    def close(self) -> None:
        self._runner.close()


@dataclass(frozen=True)
class _RankJob:
    model_dir: str
    backend: str
    cache_tokens: int
    # The worker's end of this rank's pipe: RankStep (None to stop) in, (kind, payload) out.
    pipe: Any


def _serve_rank(context: Any, job: _RankJob) -> int:
    """Worker body: load this rank's model and pool once, then run every step sent to it."""
    manifest = read_manifest(job.model_dir, expected_kind=LM_KIND)
    start = time.perf_counter()
    model = open_step_model(manifest, job.backend, context.rank, context.openvino_config())
    cache = manifest.record.cache
    runner = RankRunner(model, cache, job.cache_tokens, context.rank)
    parent = os.getppid()
    steps = 0
    try:
        job.pipe.send(("ready", (time.perf_counter() - start, os.getpid())))
        while True:
            if not job.pipe.poll(_POLL_S * 5):
                if os.getppid() != parent:  # the engine was killed: do not linger
                    break
                continue
            try:
                item = job.pipe.recv()
            except EOFError:  # the engine closed its end
                break
            if item is None:
                break
            job.pipe.send(("step", runner.run(item)))
            steps += 1
    finally:
        runner.close()
    return steps


def _alive(pid: int) -> bool:
    """The process runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class WorkerRanks:
    """One worker process per rank of ``plan``; steps in lockstep."""

    def __init__(self, manifest: ModelManifest, backend: str, plan: BindingPlan,
                 cache_tokens: int) -> None:
        from numaov.runtime.placement.workers import run_on_ranks

        self.world_size = manifest.world_size
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(self.world_size)]
        self._pipes = [ours for ours, _ in pipes]
        self._failure: str | None = None
        self._started = False
        self._closed = False
        jobs = [_RankJob(str(manifest.directory), backend, cache_tokens, theirs)
                for _, theirs in pipes]

        def run_workers() -> None:
            try:
                run_on_ranks(plan, _serve_rank, jobs, group=manifest.collective_group,
                             timeout_s=float("inf"))
            except Exception as exc:  # noqa: BLE001 - kept for every later step to report
                self._failure = str(exc)
                if self._started:  # a failure while starting is raised to the caller instead
                    logger.error("the rank workers stopped: %s", exc)

        self._thread = threading.Thread(target=run_workers, name="numaov-lm-workers",
                                        daemon=True)
        self._thread.start()
        try:
            ready = self._collect("ready", STARTUP_TIMEOUT_S, "starting")
        except RankWorkersError:
            self.close()
            raise
        self._started = True
        self.load_seconds = max(seconds for seconds, _ in ready)
        self._pids = [pid for _, pid in ready]
        self._plan = plan

    def workers(self) -> list[dict[str, Any]]:
        """Each rank's worker: its process id, CPUs, NUMA nodes and whether it runs."""
        out = []
        for rank, pid in enumerate(self._pids):
            binding = self._plan.ranks[rank]
            out.append({"rank": rank, "pid": pid, "cpus": list(binding.cpus),
                        "nodes": list(binding.nodes), "alive": _alive(pid)})
        return out

    def failure(self) -> str | None:
        """Why the workers stopped, or None while they serve."""
        if self._failure is None and not self._closed and not self._thread.is_alive():
            return "the worker processes exited"
        return self._failure

    def step(self, steps: list[RankStep]) -> list[RankStepResult]:
        failure = self.failure()
        if failure is not None:
            raise RankWorkersError(f"the rank workers failed earlier: {failure}")
        for pipe, step in zip(self._pipes, steps, strict=True):
            try:
                pipe.send(step)
            except OSError:  # the worker died: _collect waits for failure() to say which
                pass
        return self._collect("step", STEP_TIMEOUT_S, "stepping")

    def _collect(self, kind: str, timeout_s: float, doing: str) -> list[Any]:
        """One ``kind`` reply per rank, by rank, failing when the workers stop."""
        got: dict[int, Any] = {}
        gone: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(got) < self.world_size:
            waiting = [p for r, p in enumerate(self._pipes) if r not in got and r not in gone]
            ready = mp_connection.wait(waiting, timeout=_POLL_S) if waiting else []
            if not waiting:
                time.sleep(_POLL_S)
            for pipe in ready:
                rank = self._pipes.index(pipe)
                try:
                    reply_kind, payload = pipe.recv()
                except (EOFError, OSError):  # a reset pipe is a dead worker too
                    gone.add(rank)  # the worker is gone: failure() says why below
                    continue
                if reply_kind == kind:
                    got[rank] = payload
            if ready and len(got) == self.world_size:
                break
            failure = self.failure()
            if failure is not None:
                raise RankWorkersError(f"the rank workers failed while {doing}: {failure}")
            if time.monotonic() > deadline:
                raise RankWorkersError(
                    f"the rank workers did not finish {doing} within {timeout_s:.0f} s "
                    f"(ranks done: {sorted(got)})")
        return [got[r] for r in range(self.world_size)]

    def close(self, timeout_s: float = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        for pipe in self._pipes:
            try:
                pipe.send(None)
            except OSError:  # the worker is gone already
                pass
        self._thread.join(timeout=timeout_s)

"""How one video's sampling is split over workers: guidance branches, token shares, or both.

- ``guidance``: 2 workers, one guidance branch each; their predictions are joined every step
  (``all_gather_into_tensor``).
- ``sequence``: N workers, each the whole batch (both branches) on its share of the video's
  tokens, through the transformer's ``sequence_<N>`` graph (``--sequence-parallel N`` at
  export, ``models/wan/sequence_parallel.py``): attention heads are exchanged inside the
  graph, and every worker ends each step with the whole prediction.
- ``both``: 2 x N workers, N token shares of each branch; worker ``w`` runs branch
  ``w // N`` on share ``w % N``. The shares of a branch form their own collective group (the
  graph's), all workers together the group that joins the branches.

The default is ``guidance`` for 2 workers with guidance on, ``sequence`` otherwise. Every
worker applies the same update to the same predictions, so all end with the same latents
(checked). The VAE's tiles keep their own split over the same workers.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from numaov.models.wan import SEQUENCE_GROUP, sequence_dir_name
from numaov.runtime.manifest_reader import ModelDirError, ModelManifest, read_manifest
from numaov.runtime.wan.request import SamplerInputError

SPLITS = ("guidance", "sequence", "both")


@dataclass(frozen=True)
class WorkerSplit:
    """``branches`` (1 or 2) guidance branches on their own workers x ``shares`` token
    shares of each: ``branches * shares`` workers."""

    branches: int = 1
    shares: int = 1
    # a tag that keeps this run's per-branch token groups apart from any other's
    tag: str = ""

    @property
    def workers(self) -> int:
        return self.branches * self.shares

    @property
    def name(self) -> str:
        if self.workers == 1:
            return "one worker"
        return {(2, 1): "guidance", (1, self.shares): "sequence"}.get(
            (self.branches, self.shares), "both")

    def place(self, rank: int) -> tuple[int, int]:
        """Worker ``rank``'s (branch, token share)."""
        return divmod(rank, self.shares)

    def describe(self, tokens: int | None, rank_cpus: Sequence[str] = ()) -> str:
        """Which worker runs what, for the progress lines and doctor: ``tokens`` the video's
        (None: shares by number), ``rank_cpus`` each worker's CPUs."""
        if self.workers == 1:
            return "one worker"
        share = None if tokens is None else -(-tokens // self.shares)
        parts = []
        for rank in range(self.workers):
            branch, piece = self.place(rank)
            what = []
            if self.branches == 2:
                what.append("conditional" if branch == 0 else "unconditional")
            if self.shares > 1 and share is None:
                what.append(f"token share {piece + 1} of {self.shares}")
            elif self.shares > 1:
                first, last = piece * share, min(tokens, (piece + 1) * share) - 1
                what.append(f"tokens {first}-{last}" if first <= last else "no tokens")
            where = f" (CPUs {rank_cpus[rank]})" if rank < len(rank_cpus) else ""
            parts.append(f"worker {rank}{where}: {', '.join(what)}")
        return f"{self.name} split: {'; '.join(parts)}"


def choose_split(workers: int, parallel: str | None, guided: bool) -> WorkerSplit:
    """The split for ``workers`` and ``--parallel`` (None: the default), refused with the
    numbers where it cannot run. ``guided``: some step runs both branches."""
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise SamplerInputError(f"workers={workers!r}; expected a positive integer",
                                parameter="workers")
    if parallel is not None and parallel not in SPLITS:
        raise SamplerInputError(f"parallel={parallel!r}; expected one of {', '.join(SPLITS)}",
                                parameter="parallel")
    if workers == 1:
        if parallel is not None:
            raise SamplerInputError(f"parallel={parallel} splits a video over workers; "
                                    "expected workers of at least 2", parameter="parallel")
        return WorkerSplit()
    if parallel is None:
        parallel = "guidance" if workers == 2 and guided else "sequence"
    # the job id (as the rank group's) names this run's shared memory
    tag = f"{os.environ.get('NUMAOV_JOB_ID') or os.getpid()}-{uuid.uuid4().hex[:8]}"
    if parallel != "sequence" and not guided:
        raise SamplerInputError(
            f"parallel={parallel} puts the guidance branches on their own workers, but at "
            "guidance 1 every step has one branch; expected parallel=sequence",
            parameter="parallel")
    if parallel == "guidance":
        if workers != 2:
            raise SamplerInputError(
                f"parallel=guidance with workers={workers}; expected 2 workers (one per "
                "branch), or parallel=both for more", parameter="workers")
        return WorkerSplit(2, 1, tag)
    if parallel == "both":
        if workers < 4 or workers % 2:
            raise SamplerInputError(
                f"parallel=both with workers={workers}; expected an even number of at least "
                "4 (2 branches x token shares)", parameter="workers")
        return WorkerSplit(2, workers // 2, tag)
    return WorkerSplit(1, workers, tag)


def exported_shares(manifest: ModelManifest) -> list[int]:
    """The rank counts ``manifest``'s transformer has sequence-parallel graphs for."""
    prefix = sequence_dir_name("")
    counts = []
    for path in manifest.directory.glob(f"{sequence_dir_name('*')}/manifest.json"):
        suffix = path.parent.name.removeprefix(prefix)
        if suffix.isdigit():
            counts.append(int(suffix))
    return sorted(counts)


def sequence_manifest(manifest: ModelManifest, shares: int) -> ModelManifest:
    """The graph of ``manifest``'s transformer split over ``shares`` ranks, or a one-line
    error naming the counts it has and the export option that adds one."""
    directory = manifest.directory / sequence_dir_name(shares)
    if not (directory / "manifest.json").is_file():
        have = exported_shares(manifest)
        raise SamplerInputError(
            f"the transformer in {str(manifest.directory)!r} has no graph for {shares} "
            f"sequence-parallel workers (it has: {', '.join(map(str, have)) or 'none'}); "
            f"expected an export with --sequence-parallel {shares}", parameter="workers")
    split = read_manifest(directory, expected_kind="wan")
    if split.world_size != shares or split.collective_group != SEQUENCE_GROUP:
        raise ModelDirError(
            f"{str(directory)!r} holds a graph for {split.world_size} ranks of group "
            f"{split.collective_group!r}; expected {shares} ranks of {SEQUENCE_GROUP!r} "
            "(re-export the model)")
    return split


def check_split(split: WorkerSplit, backend: str, cache: Any) -> None:
    """What a token split cannot run with."""
    if split.shares == 1:
        return
    if backend != "openvino":
        raise SamplerInputError(
            f"backend {backend} with a sequence split; expected the openvino backend (the "
            "split graph's collectives are numaov's OpenVINO ops)", parameter="backend")
    if cache is not None:
        raise SamplerInputError(
            f"cache {cache} with a sequence split: the cache runs the transformer in parts "
            "of its whole graph and keeps the whole video's residuals (first-block decides on "
            "them), which the split graph does not give; expected no cache, or "
            "parallel=guidance", parameter="cache")


def join_token_group(split: WorkerSplit, rank: int) -> Any | None:
    """With both splits, this worker's branch's token group under the graphs' group name
    (with one branch the rank group itself is that group); None when there is none to join."""
    if split.branches == 1 or split.shares == 1:
        return None
    from numaov.distributed.communicator import ShmCommunicator

    branch, share = split.place(rank)
    return ShmCommunicator(SEQUENCE_GROUP, share, split.shares,
                           job_id=token_group_job_id(split, branch))


def token_group_job_id(split: WorkerSplit, branch: int) -> str:
    """The job id of ``branch``'s token group (its segment's name is the group's and this)."""
    return f"{split.tag}-branch{branch}"


def reclaim_token_groups(split: WorkerSplit) -> None:
    """Once every worker has exited: unlink the token groups' segments a worker stopped
    before its group formed left behind (the rank group's own is reclaimed with it)."""
    if split.branches == 1 or split.shares == 1:
        return
    from numaov.distributed.rank_group import reclaim_group_segments

    reclaim_group_segments([(SEQUENCE_GROUP, token_group_job_id(split, branch))
                            for branch in range(split.branches)])

"""The model runner of one DP rank: its step graph, its cache pool, its sequences' samplers.

A rank runs what the scheduler planned for it, :class:`RankStep`: first it drops the
sequences that left (``releases``), takes the ones that join (``joins``: their cache slots,
sampling settings and seed), then runs every phase of the step in order. A phase is one
forward of the rank's graph over some of its sequences (:class:`Row`: the tokens to feed,
whether to sample the next token after them, and which tokens a structured request allows
there); every rank runs the same number of phases per step, with 0 rows where it has nothing
to do, because the collectives inside the graph need every rank at every forward. The rows of
a phase are padded to its longest row on the left; padding never enters the cache: only the
real tokens' new entries are written into the pool, at the sequence's next slots.

Backends behind one interface (:class:`StepModel`): ``openvino`` runs the rank's IR, with the
pool bound once as the graph's ``kv_cache`` input tensor over the pool's own memory (bf16
pools too, by ``numaov.arrays``); ``torch``
runs the export's model family (``numaov.models.families``) on the source checkpoint with the
same shard and the same collectives (by group name), the reference the IR is checked against.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from numaov.arrays import NUMPY_DTYPES, from_openvino, from_torch, to_openvino, to_torch
from numaov.manifest import CacheLayout
from numaov.runtime.lm.cache import check_pool_fits
from numaov.runtime.lm.sampler import new_generator, sample_token
from numaov.runtime.lm.sequence import GenerationInputError, SamplingParams
from numaov.runtime.manifest_reader import ModelManifest

BACKENDS = ("openvino", "torch")
# Pad ids are masked out of attention, so any valid id works; 0 is valid in every vocabulary.
PAD_TOKEN_ID = 0


# -- what a rank is asked to do and what it answers --------------------------------------------


@dataclass(frozen=True)
class Join:
    """A sequence arriving on the rank: its cache slots (in token order), how many of its
    first tokens' entries are already in them (a prefix another sequence fed) and its
    sampler."""

    request_id: int
    slots: np.ndarray
    params: SamplingParams
    seed: int
    keep_logits: bool = False
    cached: int = 0


@dataclass(frozen=True)
class Row:
    """One sequence in one phase: the tokens fed (prompt chunk or last output), whether the
    next token is sampled after them (the end of the prompt, or a decode) and, for a sequence
    with a structure, the mask of the tokens it allows there (``[ceil(vocab / 32)] int32``,
    :mod:`numaov.runtime.lm.grammar`)."""

    request_id: int
    tokens: tuple[int, ...]
    sample: bool
    mask: np.ndarray | None = field(default=None, compare=False, repr=False)


@dataclass
class RankStep:
    releases: list[int] = field(default_factory=list)
    joins: list[Join] = field(default_factory=list)
    phases: list[list[Row]] = field(default_factory=list)


@dataclass(frozen=True)
class Sampled:
    request_id: int
    token: int
    logprob: float | None
    logits: np.ndarray | None = None


@dataclass
class RankStepResult:
    rank: int
    sampled: list[Sampled]
    # Seconds in the graph (all phases) and in the whole step on the rank.
    forward_seconds: float
    seconds: float


# -- backends ---------------------------------------------------------------------------------


class StepModel:
    """One rank's pooled step (the family's ``step_module``): numpy in, ``(logits [B, V] f32,
    new_key_values [layers, B, T, W])`` out, the entries of the pool's dtype, valid until the
    next call."""

    name = "base"

    def bind_pool(self, pool: np.ndarray) -> None:
        """Use ``pool`` as the ``kv_cache`` input of every later step, without copies."""
        self._pool = pool

    def step(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def close(self) -> None:
        """Release the compiled model / weights."""


class OpenVINOStep(StepModel):
    name = "openvino"

    def __init__(self, manifest: ModelManifest, rank: int, config: Mapping[str, Any]) -> None:
        self._compiled = manifest.compile_rank(rank, config)
        self._request = self._compiled.create_infer_request()

    def bind_pool(self, pool: np.ndarray) -> None:
        # The graph reads the pool's memory itself; set once, kept across steps.
        self._pool_tensor = to_openvino(pool)
        self._request.set_tensor("kv_cache", self._pool_tensor)

    def step(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        self._request.infer(feeds)
        return (self._request.get_tensor("logits").data,
                from_openvino(self._request.get_tensor("new_key_values")))

    def close(self) -> None:
        self._request = None
        self._compiled = None


class TorchStep(StepModel):
    name = "torch"

    def __init__(self, manifest: ModelManifest, rank: int) -> None:
        import torch

        from numaov.models.families import family_named
        from numaov.models.layers.data_parallel import DataParallelGroup

        source = manifest.source_checkpoint_dir("openvino")
        dp = None
        if manifest.world_size > 1:
            dp = DataParallelGroup(str(manifest.collective_group), rank, manifest.world_size)
        dtype = torch.bfloat16 if manifest.precision == "bf16" else torch.float32
        self._torch = torch
        self._family = family_named(str(manifest.record.family))
        self._model = self._family.load(source, dtype, dp)

    @classmethod
    def from_model(cls, model: Any, family: Any) -> TorchStep:
        """A step over a model of ``family`` (an ``LMFamily``) already in memory (dp=1 in this
        process)."""
        import torch

        step = cls.__new__(cls)
        step._torch, step._model, step._family = torch, model, family
        return step

    def step(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        torch = self._torch
        with torch.inference_mode():
            logits, new = self._family.step_pooled(
                self._model,
                torch.from_numpy(feeds["input_ids"]), torch.from_numpy(feeds["position_ids"]),
                torch.from_numpy(feeds["attention_mask"]), to_torch(self._pool),
                torch.from_numpy(feeds["past_slots"]),
            )
        return logits.float().numpy(), from_torch(new.contiguous())  # in the pool's dtype

    def close(self) -> None:
        self._model = None


def unknown_backend(backend: str) -> GenerationInputError:
    return GenerationInputError(
        f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}", parameter="backend"
    )


def open_step_model(
    manifest: ModelManifest, backend: str, rank: int, openvino_config: Mapping[str, Any]
) -> StepModel:
    if backend == "openvino":
        return OpenVINOStep(manifest, rank, openvino_config)
    if backend == "torch":
        return TorchStep(manifest, rank)
    raise unknown_backend(backend)


# -- the runner -------------------------------------------------------------------------------


@dataclass
class _RankSequence:
    slots: np.ndarray
    params: SamplingParams
    generator: np.random.Generator
    keep_logits: bool
    cached: int = 0


class RankRunner:
    """One rank's step model, its cache pool and the state of the sequences it holds."""

    def __init__(self, model: StepModel, cache: CacheLayout, capacity_tokens: int,
                 rank: int = 0) -> None:
        self.rank = rank
        self.model = model
        self.pool_bytes = check_pool_fits(cache, capacity_tokens, rank)
        self.pool = np.zeros((cache.layers, capacity_tokens, cache.width),
                             dtype=NUMPY_DTYPES[cache.dtype])
        model.bind_pool(self.pool)
        self._sequences: dict[int, _RankSequence] = {}

    @property
    def sequences(self) -> int:
        return len(self._sequences)

    def run(self, plan: RankStep) -> RankStepResult:
        start = time.perf_counter()
        for request_id in plan.releases:
            self._sequences.pop(request_id, None)
        for join in plan.joins:
            self._sequences[join.request_id] = _RankSequence(
                join.slots, join.params, new_generator(join.seed), join.keep_logits, join.cached)
        sampled: list[Sampled] = []
        forward = 0.0
        for rows in plan.phases:
            feeds, writes = self._feeds(rows)
            begin = time.perf_counter()
            logits, new = self.model.step(feeds)
            forward += time.perf_counter() - begin
            if len(logits) != len(rows):
                # Seen when a peer rank is killed inside the step's collectives (OpenVINO
                # returned the unset outputs instead of the collective's error): name it in
                # one line rather than fail below with an index error.
                from numaov.distributed.communicator import CollectiveError

                raise CollectiveError(
                    f"rank {self.rank}'s step returned logits for {len(logits)} rows; expected "
                    f"{len(rows)} (one per row of the step; did a peer rank fail mid-step?)")
            slots, batch_rows, columns = writes
            if len(slots):
                self.pool[:, slots] = new[:, batch_rows, columns]  # only the new entries
            for i, row in enumerate(rows):
                state = self._sequences[row.request_id]
                state.cached += len(row.tokens)
                if row.sample:
                    token, logprob = sample_token(logits[i], state.params, state.generator,
                                                  row.mask)
                    kept = np.array(logits[i], dtype=np.float32) if state.keep_logits else None
                    sampled.append(Sampled(row.request_id, token, logprob, kept))
        return RankStepResult(self.rank, sampled, forward, time.perf_counter() - start)

    def _feeds(self, rows: Sequence[Row]) -> tuple[dict[str, np.ndarray], tuple]:
        """The graph inputs of one phase, and where its new entries go in the pool."""
        b = len(rows)
        t = max((len(r.tokens) for r in rows), default=1)
        states = [self._sequences[r.request_id] for r in rows]
        p = max((s.cached for s in states), default=0)
        ids = np.full((b, t), PAD_TOKEN_ID, dtype=np.int64)
        positions = np.zeros((b, t), dtype=np.int64)
        mask = np.zeros((b, p + t), dtype=np.int64)
        past = np.zeros((b, p), dtype=np.int64)
        slots, batch_rows, columns = [], [], []
        for i, (row, state) in enumerate(zip(rows, states, strict=True)):
            n, c = len(row.tokens), state.cached
            ids[i, t - n:] = row.tokens
            positions[i, t - n:] = np.arange(c, c + n)
            mask[i, :c] = 1  # the cached tokens, then right padding
            mask[i, p + t - n:] = 1  # left padding, then the new tokens
            past[i, :c] = state.slots[:c]
            slots.append(state.slots[c:c + n])
            batch_rows.append(np.full(n, i))
            columns.append(np.arange(t - n, t))
        feeds = {"input_ids": ids, "position_ids": positions, "attention_mask": mask,
                 "past_slots": past}
        if not rows:
            return feeds, (np.zeros(0, np.int64),) * 3
        return feeds, (np.concatenate(slots), np.concatenate(batch_rows), np.concatenate(columns))

    def close(self) -> None:
        self.model.close()


@dataclass
class RankGeneration:
    """What :func:`generate_on_rank` generated for this rank's prompts, in order."""

    rank: int
    tokens: list[list[int]]
    step_seconds: list[float]


def generate_on_rank(model: StepModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                     cache: CacheLayout, rank: int = 0) -> RankGeneration:
    """A fixed-length greedy generation of this rank's prompts, in lockstep with the other
    ranks doing the same (``max_new_tokens`` forwards: every prompt whole, then one token per
    forward), on a pool just large enough. For benchmarks that time single forwards; serving
    goes through :class:`numaov.runtime.lm.engine.LMEngine`."""
    need = sum(len(p) + max_new_tokens for p in prompts)
    runner = RankRunner(model, cache, max(need, 1), rank)
    params = SamplingParams(max_new_tokens, ignore_eos=True)
    joins, start = [], 0
    for i, prompt in enumerate(prompts):
        size = len(prompt) + max_new_tokens
        joins.append(Join(i, np.arange(start, start + size, dtype=np.int64), params, 0))
        start += size
    plan = RankStep(joins=joins, phases=[[Row(i, tuple(p), True) for i, p in enumerate(prompts)]])
    tokens: list[list[int]] = [[] for _ in prompts]
    seconds = []
    for _ in range(max_new_tokens):
        result = runner.run(plan)
        seconds.append(result.seconds)
        for s in result.sampled:
            tokens[s.request_id].append(s.token)
        plan = RankStep(phases=[[Row(i, (t[-1],), True) for i, t in enumerate(tokens)]])
    return RankGeneration(rank, tokens, seconds)

"""Greedy generation with an exported DeepSeek-V2, one worker process per DP rank.

``run_deepseek(model_dir, prompts, max_new_tokens)`` reads the manifest written by
``numaov export deepseek``, starts one worker per rank of the binding plan (world size = the
export's ``dp``), and returns the new tokens of every prompt in the caller's order.

- **Placement.** The binding rule (:mod:`numaov.runtime.binding`): ``NUMAOV_CPU_BIND`` (one
  CPU list per rank), else one rank per NUMA node, else the allowed CPUs split between the
  ranks; a bind string with another number of CPU lists than the model's ``dp`` is an error
  that says so (:func:`plan_for_ranks`). Each worker pins itself, binds its memory, joins the
  shared-memory group the model's collective nodes name, and compiles its rank's IR with one
  inference thread per core.
- **Sequences.** Prompt ``i`` goes to rank ``i % dp`` (round-robin, so a single prompt lands on
  rank 0 and the other ranks are idle). Each rank left-pads its own prompts into one batch and
  keeps its own KV cache; a rank with no prompts still runs every step with a batch of 0 rows,
  because the collectives inside the graph need every rank at every step. Results come back
  tagged by rank and are put back in prompt order by the same round-robin rule.
- **Steps.** Every rank runs exactly ``max_new_tokens`` steps (step 1 is the prefill of the
  whole prompt, then one token per step): there is no early stop at an end-of-sequence token,
  so the ranks agree on the step count by construction and no extra exchange is needed.
- **KV cache.** The simplest correct one: the graph returns the past with this step's entries
  appended (``present_key_values``), which becomes the next step's ``past_key_values``; the
  attention mask grows by one column per step.
- **Backends** behind one interface (:class:`StepModel`): ``openvino`` runs the rank's IR;
  ``torch`` runs ``numaov.models.deepseek`` on the source checkpoint with the same shard and
  the same collectives (by group name), the reference the IR is checked against.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from numaov import NumaovError
from numaov.runtime import binding
from numaov.runtime.binding import BIND_ENV, BindingPlan, RankCountError
from numaov.runtime.manifest_reader import ModelDirError, ModelManifest, read_manifest

logger = logging.getLogger(__name__)

BACKENDS = ("openvino", "torch")
KIND = "deepseek"
# Pad ids are masked out of attention, so any valid id works; 0 is valid in every vocabulary.
PAD_TOKEN_ID = 0
# A generation that has not finished in this time is stuck (a peer died mid-collective).
GENERATION_TIMEOUT_S = 3600.0
_CONFIG_KEYS = ("vocab_size", "num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim",
                "max_position_embeddings")

Progress = Callable[[str], None] | None


class GenerationInputError(NumaovError):
    """Prompts, token ids or generation arguments the model cannot take."""


class RankPlanError(NumaovError):
    """The binding plan does not have one rank per DP rank of the model."""


# -- prompts ----------------------------------------------------------------------------------


def parse_prompt_ids(text: str) -> list[list[int]]:
    """``"1,2,3;4,5"`` -> ``[[1, 2, 3], [4, 5]]``: prompts separated by ``;``, ids by ``,``."""
    if not isinstance(text, str) or not text.strip():
        raise GenerationInputError(
            "prompt ids are empty; expected token ids such as '1,2,3;4,5' (';' between "
            "prompts)", parameter="prompt_ids"
        )
    prompts = []
    for i, part in enumerate(text.split(";")):
        if not part.strip():
            raise GenerationInputError(
                f"prompt ids {text!r}: prompt {i} is empty; expected comma-separated token ids "
                "between the ';' separators", parameter="prompt_ids"
            )
        ids = []
        for item in part.split(","):
            item = item.strip()
            if not item.isdigit():
                raise GenerationInputError(
                    f"prompt ids {text!r}: {item!r} in prompt {i} is not a token id; expected "
                    "non-negative integers such as '1,2,3;4,5'", parameter="prompt_ids"
                )
            ids.append(int(item))
        prompts.append(ids)
    return prompts


def check_prompts(
    prompts: Sequence[Sequence[int]], config: Mapping[str, Any], max_new_tokens: int
) -> list[list[int]]:
    """The prompts as lists of ints, after checking them against the model's config."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise GenerationInputError(
            f"max_new_tokens is {max_new_tokens!r}; expected a positive integer",
            parameter="max_new_tokens",
        )
    if not prompts:
        raise GenerationInputError("no prompts given; expected at least one prompt")
    vocab = int(config["vocab_size"])
    limit = int(config["max_position_embeddings"])
    out = []
    for i, prompt in enumerate(prompts):
        ids = list(prompt)
        if not ids:
            raise GenerationInputError(f"prompt {i} is empty; expected at least one token id")
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in ids):
            raise GenerationInputError(f"prompt {i} holds non-integer token ids; expected ints")
        bad = [int(t) for t in ids if not 0 <= int(t) < vocab]
        if bad:
            raise GenerationInputError(
                f"prompt {i} holds token id(s) {bad[:8]} outside the vocabulary; expected ids in "
                f"0 .. {vocab - 1} (vocab_size {vocab})"
            )
        if len(ids) + max_new_tokens > limit:
            raise GenerationInputError(
                f"prompt {i} has {len(ids)} tokens; with {max_new_tokens} new tokens that is more "
                f"than the model's max_position_embeddings={limit}"
            )
        out.append([int(t) for t in ids])
    return out


def load_tokenizer(directory: str | Path) -> Any:
    """The Hugging Face ``tokenizers.Tokenizer`` in ``directory/tokenizer.json``."""
    path = Path(directory) / "tokenizer.json"
    if not Path(directory).is_dir():
        raise GenerationInputError(
            f"tokenizer {str(directory)!r} is not a directory; expected a directory with a "
            "Hugging Face tokenizer.json", parameter="tokenizer"
        )
    if not path.is_file():
        raise GenerationInputError(
            f"tokenizer directory {str(directory)!r} holds no tokenizer.json; expected a "
            "directory with a Hugging Face tokenizer.json", parameter="tokenizer"
        )
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a plain Exception for a malformed file
        raise GenerationInputError(
            f"cannot read {str(path)!r} as a Hugging Face tokenizer ({exc})",
            parameter="tokenizer",
        ) from exc


def encode_prompts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text (special tokens as the tokenizer's post-processor adds them)."""
    prompts = []
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text).ids
        if not ids:
            raise GenerationInputError(
                f"prompt {i} ({text!r}) encodes to no tokens; expected non-empty text"
            )
        prompts.append(list(ids))
    return prompts


# -- placement --------------------------------------------------------------------------------


def plan_for_ranks(
    world_size: int, env: Mapping[str, str] | None = None
) -> tuple[BindingPlan, str]:
    """The binding plan for a model with ``world_size`` DP ranks, by the one rule of
    :mod:`numaov.runtime.binding`, and its one-line placement."""
    try:
        plan = binding.plan_for_ranks(world_size, env)
    except RankCountError as exc:
        raise RankPlanError(
            f"a model exported for dp={world_size} runs one worker per rank: {exc}"
        ) from None
    return plan, plan.placement


# -- backends ---------------------------------------------------------------------------------


class StepModel:
    """One rank's cached step: numpy in, ``(last-token logits [B, V] f32, present f32)`` out."""

    name = "base"

    def step(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def close(self) -> None:
        """Release the compiled model / weights."""


class OpenVINOStep(StepModel):
    name = "openvino"

    def __init__(self, manifest: ModelManifest, rank: int, config: Mapping[str, Any]) -> None:
        self._compiled = manifest.compile_rank(rank, config)
        self._request = self._compiled.create_infer_request()

    def step(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        self._request.infer(feeds)
        logits = self._request.get_output_tensor(0).data
        # Copies: the request reuses its output buffers at the next step.
        return np.array(logits[:, -1], dtype=np.float32), np.array(
            self._request.get_output_tensor(1).data, dtype=np.float32
        )

    def close(self) -> None:
        self._request = None
        self._compiled = None


class TorchStep(StepModel):
    name = "torch"

    def __init__(self, manifest: ModelManifest, rank: int) -> None:
        import torch

        from numaov.models.deepseek import DataParallelGroup, DeepseekV2

        source = manifest.source_checkpoint_dir("openvino")
        dp = None
        if manifest.world_size > 1:
            dp = DataParallelGroup(str(manifest.collective_group), rank, manifest.world_size)
        dtype = torch.bfloat16 if manifest.precision == "bf16" else torch.float32
        self._torch = torch
        self._model = DeepseekV2.from_pretrained(source, dtype=dtype, dp=dp)
        self._dtype = dtype

    def step(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        torch = self._torch
        with torch.inference_mode():
            logits, present = self._model.step(
                torch.from_numpy(feeds["input_ids"]),
                torch.from_numpy(feeds["position_ids"]),
                torch.from_numpy(feeds["attention_mask"]),
                torch.from_numpy(feeds["past_key_values"]).to(self._dtype),
            )
        return logits[:, -1].float().numpy(), present.float().numpy()

    def close(self) -> None:
        self._model = None


def _unknown_backend(backend: str) -> GenerationInputError:
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
    raise _unknown_backend(backend)


# -- one rank's generation --------------------------------------------------------------------


@dataclass
class RankGeneration:
    """What one rank generated for its own prompts (in the order it was given them)."""

    rank: int
    tokens: list[list[int]]
    # [prompts, steps, vocab] f32: the logits each token was chosen from (when asked for).
    logits: np.ndarray | None
    step_seconds: list[float]
    load_seconds: float


def generate_on_rank(
    model: StepModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    layers: int,
    cache_width: int,
    keep_logits: bool = False,
    rank: int = 0,
) -> RankGeneration:
    """Greedy decoding of this rank's prompts, left-padded into one batch (possibly empty)."""
    b = len(prompts)
    longest = max((len(p) for p in prompts), default=1)
    ids = np.full((b, longest), PAD_TOKEN_ID, dtype=np.int64)
    mask = np.zeros((b, longest), dtype=np.int64)
    for i, prompt in enumerate(prompts):
        ids[i, longest - len(prompt):] = prompt
        mask[i, longest - len(prompt):] = 1
    # Left-padded rows count positions from their first real token.
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    past = np.zeros((layers, b, 0, cache_width), dtype=np.float32)
    chosen, kept, seconds = [], [], []
    for _ in range(max_new_tokens):
        start = time.perf_counter()
        logits, past = model.step({
            "input_ids": ids,
            "position_ids": np.ascontiguousarray(positions),
            "attention_mask": mask,
            "past_key_values": past,
        })
        token = logits.argmax(axis=-1).astype(np.int64)  # [B]
        chosen.append(token)
        if keep_logits:
            kept.append(logits)
        # next step: one new token per row, at the next position
        positions = mask.sum(axis=1, keepdims=True)
        ids = token[:, None]
        mask = np.concatenate([mask, np.ones((b, 1), dtype=np.int64)], axis=1)
        seconds.append(time.perf_counter() - start)
    tokens = np.stack(chosen, axis=1).tolist() if b else []
    logits_all = None
    if keep_logits:
        logits_all = np.stack(kept, axis=1) if b else np.zeros((0, max_new_tokens, 0), np.float32)
    return RankGeneration(rank, tokens, logits_all, seconds, 0.0)


@dataclass(frozen=True)
class _RankJob:
    """What a generation worker needs; plain data, so it pickles into a spawned process."""

    model_dir: str
    backend: str
    prompts: list[list[int]]
    max_new_tokens: int
    keep_logits: bool


class RankModel:
    """One rank's loaded step model and the cache sizes generation needs (a worker's state)."""

    def __init__(self, context: Any, model_dir: str, backend: str) -> None:
        manifest = read_manifest(model_dir, expected_kind=KIND)
        config = manifest.config
        self.rank = context.rank
        self.layers = int(config["num_hidden_layers"])
        self.cache_width = int(config["kv_lora_rank"]) + int(config["qk_rope_head_dim"])
        start = time.perf_counter()
        self.model = open_step_model(manifest, backend, context.rank, context.openvino_config())
        self.load_seconds = time.perf_counter() - start

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 keep_logits: bool = False) -> RankGeneration:
        result = generate_on_rank(self.model, prompts, max_new_tokens, self.layers,
                                  self.cache_width, keep_logits, self.rank)
        result.load_seconds = self.load_seconds
        return result

    def close(self) -> None:
        self.model.close()


def _generate_rank(context: Any, job: _RankJob) -> RankGeneration:
    """Worker body: load this rank's model, generate for its prompts in lockstep with the rest."""
    model = RankModel(context, job.model_dir, job.backend)
    try:
        return model.generate(job.prompts, job.max_new_tokens, job.keep_logits)
    finally:
        model.close()


# -- the run ----------------------------------------------------------------------------------


@dataclass
class GenerationResult:
    """New tokens per prompt (the caller's order) and how long it took."""

    tokens: list[list[int]]
    backend: str
    world_size: int
    placement: str
    # Slowest rank per step (the ranks run in lockstep); step 0 is the prefill, including the
    # first inference's one-time work (OpenVINO allocates and picks kernels on first use).
    step_seconds: list[float]
    # Slowest rank's model load / compile.
    load_seconds: float
    # Per prompt, [steps, vocab] f32 logits each token was chosen from (keep_logits=True).
    logits: list[np.ndarray] | None = field(default=None, repr=False)

    @classmethod
    def from_ranks(cls, results: Sequence[RankGeneration], count: int, backend: str,
                   placement: str) -> GenerationResult:
        """The ranks' generations (by rank) put back in prompt order; per step the slowest
        rank's time, since the ranks run in lockstep."""
        logits = None
        if any(r.logits is not None for r in results):
            logits = merge_rank_outputs(
                [list(r.logits) if r.logits is not None else [] for r in results], count
            )
        steps = [max(step) for step in zip(*(r.step_seconds for r in results), strict=True)]
        return cls(
            tokens=merge_rank_outputs([r.tokens for r in results], count), backend=backend,
            world_size=len(results), placement=placement, step_seconds=steps,
            load_seconds=max(r.load_seconds for r in results), logits=logits,
        )

    @property
    def prefill_seconds(self) -> float:
        return self.step_seconds[0]

    @property
    def decode_seconds(self) -> list[float]:
        return self.step_seconds[1:]

    @property
    def tokens_per_second(self) -> float:
        """All prompts' new tokens over the whole generation (prefill included)."""
        return sum(len(t) for t in self.tokens) / max(sum(self.step_seconds), 1e-12)

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Tokens per second of the decode steps alone (one token per prompt per step)."""
        if not self.decode_seconds:
            return None
        return len(self.tokens) * len(self.decode_seconds) / max(sum(self.decode_seconds), 1e-12)

    def timings(self) -> dict[str, Any]:
        decode = self.decode_seconds
        return {
            "load_s": self.load_seconds,
            "prefill_s": self.prefill_seconds,
            "decode_step_s": decode,
            "decode_step_mean_s": sum(decode) / len(decode) if decode else None,
            "tokens_per_s": self.tokens_per_second,
            "decode_tokens_per_s": self.decode_tokens_per_second,
        }

    def summary(self) -> str:
        """One line for the CLI."""
        decode = self.decode_seconds
        per_step = f", decode {1000 * sum(decode) / len(decode):.1f} ms/step" if decode else ""
        return (
            f"{len(self.tokens)} prompt(s) x {len(self.step_seconds)} new tokens on "
            f"{self.backend} with {self.world_size} rank(s): prefill "
            f"{1000 * self.prefill_seconds:.1f} ms{per_step}, {self.tokens_per_second:.1f} "
            f"tokens/s (load {self.load_seconds:.1f} s)"
        )


def split_prompts(prompts: Sequence[Sequence[int]], world_size: int) -> list[list[list[int]]]:
    """Rank r's prompts: every ``world_size``-th prompt starting at ``r``."""
    return [[list(p) for p in prompts[r::world_size]] for r in range(world_size)]


def merge_rank_outputs(per_rank: Sequence[Sequence[Any]], count: int) -> list[Any]:
    """The inverse of :func:`split_prompts`: items of every rank back in prompt order."""
    world = len(per_rank)
    merged: list[Any] = [None] * count
    for rank, items in enumerate(per_rank):
        expected = len(range(rank, count, world))
        if len(items) != expected:
            raise NumaovError(
                f"rank {rank} returned {len(items)} results for {expected} prompts; expected "
                "one per prompt it was given"
            )
        for j, item in enumerate(items):
            merged[rank + j * world] = item
    return merged


def open_lm_manifest(model_dir: str | Path, backend: str) -> ModelManifest:
    """The manifest of a ``numaov export deepseek`` directory, checked for ``backend``."""
    if backend not in BACKENDS:
        raise _unknown_backend(backend)
    manifest = read_manifest(model_dir, expected_kind=KIND)
    missing = [key for key in _CONFIG_KEYS if key not in manifest.config]
    if missing:
        raise ModelDirError(
            f"manifest config in {str(manifest.directory)!r} lacks {missing}; expected a "
            "DeepSeek-V2 config (re-export the model)"
        )
    return manifest


def resolve_plan(manifest: ModelManifest, plan: BindingPlan | None) -> tuple[BindingPlan, str]:
    """``plan`` (default :func:`plan_for_ranks`) and its description, refused unless it has
    one rank per DP rank of the model."""
    world = manifest.world_size
    if plan is None:
        plan, _ = plan_for_ranks(world)
    if plan.world_size != world:
        raise RankPlanError(
            f"the binding plan has {plan.world_size} rank(s) but the model in "
            f"{str(manifest.directory)!r} was exported for dp={world}; expected one rank per "
            f"DP rank: set {BIND_ENV} to {world} CPU lists separated by '|'"
        )
    return plan, plan.placement


def run_deepseek(
    model_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    backend: str = "openvino",
    *,
    plan: BindingPlan | None = None,
    keep_logits: bool = False,
    progress: Progress = None,
) -> GenerationResult:
    """Generate ``max_new_tokens`` tokens greedily for every prompt on one worker per rank.

    ``plan`` overrides the placement (default :func:`plan_for_ranks`, which refuses a plan
    with another number of ranks than the model's dp).
    """
    report = progress or (lambda _msg: None)
    manifest = open_lm_manifest(model_dir, backend)
    checked = check_prompts(prompts, manifest.config, max_new_tokens)
    world = manifest.world_size
    plan, placement = resolve_plan(manifest, plan)
    shares = split_prompts(checked, world)
    report(
        f"generating {max_new_tokens} tokens for {len(checked)} prompt(s) on {backend} with "
        f"{world} rank(s) ({placement}); prompts per rank: {[len(s) for s in shares]}"
    )
    jobs = [_RankJob(str(manifest.directory), backend, share, max_new_tokens, keep_logits)
            for share in shares]
    results: list[RankGeneration] = _run_jobs(plan, jobs, manifest.collective_group)
    return GenerationResult.from_ranks(results, len(checked), backend, placement)


def format_generation(
    result: GenerationResult, prompts: Sequence[Sequence[int]], tokenizer: Any = None
) -> str:
    """One line per prompt (ids, or text with a tokenizer: prompt -> new text), then the
    timing summary."""
    lines = []
    for i, (prompt, new) in enumerate(zip(prompts, result.tokens, strict=True)):
        if tokenizer is None:
            lines.append(f"[{i}] {','.join(map(str, prompt))} -> {','.join(map(str, new))}")
        else:
            lines.append(f"[{i}] {tokenizer.decode(list(prompt))!r} -> {tokenizer.decode(new)!r}")
    lines.append(result.summary())
    return "\n".join(lines)


def _run_jobs(plan: BindingPlan, jobs: list[_RankJob], group: str | None) -> list[RankGeneration]:
    from numaov.runtime.workers import run_on_ranks

    return run_on_ranks(plan, _generate_rank, jobs, group=group, timeout_s=GENERATION_TIMEOUT_S)

"""The LM engine: continuous batching over the DP ranks of an exported language model.

The one generation loop of numaov: ``numaov run lm`` (:func:`run_lm`), ``numaov serve``
(:mod:`numaov.runtime.service.lm_service`) and ``numaov bench lm`` all go through
:class:`LMEngine`, split as follows (the way openvino.genai's continuous batching is split):

- sequence state and sampling settings: :mod:`numaov.runtime.lm.sequence`;
- the scheduler (admission, least-loaded rank, decode and chunked prefill phases):
  :mod:`numaov.runtime.lm.scheduler`;
- the cache manager (the in-place token pool of every rank, capacity, free on cancel):
  :mod:`numaov.runtime.lm.cache`;
- the model runner per rank (one step of the rank's graph, writing the new cache entries,
  sampling): :mod:`numaov.runtime.lm.runner`, with the sampler in
  :mod:`numaov.runtime.lm.sampler`;
- the transports to the ranks (in process, or one pinned worker per rank):
  :mod:`numaov.runtime.lm.ranks`;
- text deltas for streaming: :mod:`numaov.runtime.lm.text`;
- structured outputs (a grammar matcher per constrained sequence, token masks):
  :mod:`numaov.runtime.lm.grammar`.

The front end talks to the engine only through :meth:`LMEngine.submit`, :meth:`~LMEngine.stream`
(or :meth:`~LMEngine.result`), :meth:`~LMEngine.cancel` and :meth:`~LMEngine.stats`. One thread
runs the loop: when some rank has work it asks the scheduler for a step, sends every rank its
part (the ranks run in lockstep: the same phases, 0 rows where idle), and applies what comes
back: each sampled token is checked against its sequence's own stop rules (end-of-sequence,
stop ids, stop strings, a complete structure, max new tokens) and advances its structure's
matcher; a finished sequence frees its cache at once and its stream ends. With no work the
loop waits on a condition, so an idle engine does not step.

Placement: the binding rule (:mod:`numaov.runtime.placement.binding`): ``NUMAOV_CPU_BIND`` (one CPU list
per rank), else one rank per NUMA node, else the allowed CPUs split between the ranks; a bind
string with another number of CPU lists than the model's ``dp`` is an error that says so.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue as queue_module
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from numaov import NumaovError
from numaov.manifest import LM_KIND, CacheLayout
from numaov.runtime.lm.cache import DEFAULT_CACHE_TOKENS, CacheManager, check_capacity
from numaov.runtime.lm.grammar import GrammarCompiler, GrammarSpec
from numaov.runtime.lm.ranks import (
    InProcessRanks,
    RankWorkersError,
    RankWorkersRestarting,
    WorkerRanks,
)
from numaov.runtime.lm.runner import (
    BACKENDS,
    OpenVINOStep,
    RankGeneration,
    RankRunner,
    RankStepResult,
    StepModel,
    TorchStep,
    generate_on_rank,
    open_step_model,
    unknown_backend,
)
from numaov.runtime.lm.scheduler import DEFAULT_MAX_RUNNING, DEFAULT_PREFILL_CHUNK, Scheduler
from numaov.runtime.lm.sequence import (
    GenerationInputError,
    SamplingParams,
    check_prompt,
    end_of_sequence_ids,
    read_generation_config,
)
from numaov.runtime.lm.sequence import (
    Sequence as SequenceState,
)
from numaov.runtime.lm.text import TextStream
from numaov.runtime.manifest_reader import ModelDirError, ModelManifest, read_manifest
from numaov.runtime.placement import binding
from numaov.runtime.placement.binding import BIND_ENV, BindingPlan, RankCountError

__all__ = [
    "BACKENDS", "Completion", "EngineHealth", "EngineStats", "GenerationInputError", "GenerationResult",
    "GrammarSpec", "LMEngine", "OpenVINOStep", "RankGeneration", "RankPlanError", "SamplingParams",
    "StepModel", "StreamEvent", "TorchStep", "generate_on_rank", "open_step_model",
    "run_lm",
]

logger = logging.getLogger(__name__)

# The Hugging Face config keys every family has and the engine reads (prompt checks).
_CONFIG_KEYS = ("vocab_size", "max_position_embeddings")
# Steps over which stats() measures each rank's tokens/s.
STATS_WINDOW_STEPS = 64
# The loop finishes the step in flight before it stops.
CLOSE_TIMEOUT_S = 600.0
_POLL_S = 0.2
# Restarting failed rank workers: the first restart is immediate, each further one within
# RESTART_RESET_S of the last waits twice as long (RESTART_BASE_S, 2x, 4x ... at most
# RESTART_MAX_S), so a model that crashes at every step does not spin; ranks that served
# RESTART_RESET_S without failing start the count again.
RESTART_BASE_S = 1.0
RESTART_MAX_S = 30.0
RESTART_RESET_S = 60.0
# An idle engine checks its workers this often, so a worker that died between requests is
# restarted (and shown in health()) without waiting for the next request.
_IDLE_CHECK_S = 1.0

Progress = Callable[[str], None] | None


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
    """The prompts as lists of ints, after checking them against the model's config: for a
    caller with no engine yet (:func:`run_lm` checks before its workers start). With an
    engine, :meth:`LMEngine.submit` is the check (``generate`` names each prompt the same)."""
    params = SamplingParams(max_new_tokens)
    _require_prompts(prompts)
    return [check_prompt(p, config, params, f"prompt {i}") for i, p in enumerate(prompts)]


def _require_prompts(prompts: Sequence[Sequence[int]]) -> None:
    if not prompts:
        raise GenerationInputError("no prompts given; expected at least one prompt",
                                   parameter="prompt")


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
    :mod:`numaov.runtime.placement.binding`, and its one-line placement."""
    try:
        plan = binding.plan_for_ranks(world_size, env)
    except RankCountError as exc:
        raise RankPlanError(
            f"a model exported for dp={world_size} runs one worker per rank: {exc}"
        ) from None
    return plan, plan.placement


def open_lm_manifest(model_dir: str | Path, backend: str) -> ModelManifest:
    """The manifest of a ``numaov export lm`` directory, checked for ``backend``."""
    if backend not in BACKENDS:
        raise unknown_backend(backend)
    manifest = read_manifest(model_dir, expected_kind=LM_KIND)
    missing = [key for key in _CONFIG_KEYS if key not in manifest.config]
    if missing:
        raise ModelDirError(
            f"manifest config in {str(manifest.directory)!r} lacks {missing}; expected a "
            "Hugging Face config with them (re-export the model)"
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



# -- the engine -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamEvent:
    """What one step added to a request: its new token (none in the last event), the text
    that token completed, the token's log-probability (when asked for), and, in the last
    event, why the request ended."""

    request_id: int
    tokens: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str | None = None
    # with finish reason "error" because the request's structure could not go on: why
    structure_error: str | None = None


@dataclass
class Completion:
    """A finished request: its new tokens (a stopping token excluded), text (with a
    tokenizer), log-probabilities (when asked for) and why it ended."""

    request_id: int
    prompt: list[int]
    tokens: list[int]
    text: str
    logprobs: list[float] | None
    finish_reason: str
    logits: np.ndarray | None = field(default=None, repr=False)
    # Prompt tokens whose entries were read from the prefix cache instead of computed.
    cached_tokens: int = 0
    # With finish reason "error" because the request's structure could not go on: why (the
    # request's own failure; without it, "error" means the rank workers failed).
    structure_error: str | None = None


@dataclass(frozen=True)
class EngineStats:
    queue_depth: int
    running: list[int]  # per rank
    cache_used_tokens: list[int]  # per rank
    cache_capacity_tokens: list[int]  # per rank
    cache_bytes: int  # each rank's pool
    tokens_per_second: list[float]  # per rank, over the last STATS_WINDOW_STEPS steps
    steps: int
    # Per rank: phases it ran with 0 rows (in lockstep with a busy rank).
    idle_phases: list[int]
    # Per rank: seconds spent running steps, since the engine started (all restarts).
    busy_seconds: list[float] = field(default_factory=list)
    # Times the rank workers were restarted after a failure.
    restarts: int = 0
    # Tokens generated since the engine started.
    generated_tokens: int = 0
    # Per rank, since the engine started: prompt tokens admitted, and of them the ones read
    # from the prefix cache; tokens in the prefix cache now.
    prompt_tokens: list[int] = field(default_factory=list)
    cached_prompt_tokens: list[int] = field(default_factory=list)
    prefix_cache_tokens: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class EngineHealth:
    """Whether the engine serves: ``state`` is "ok", "restarting" (the rank workers failed
    and fresh ones are starting; requests are refused meanwhile) or "failed" (for good: no
    restart, or the engine was closed); ``workers`` says each rank's process, CPUs and
    nodes."""

    state: str
    restarts: int
    failure: str | None
    # The last failures, oldest first: (unix time, reason).
    failures: list[tuple[float, str]]
    # Seconds until the next restart attempt while restarting (the backoff), else None.
    restart_in_s: float | None
    workers: list[dict[str, Any]]


class LMEngine:
    """Continuous batching over the ranks of ``ranks``; thread-safe.

    ``restart`` (optional) makes fresh ranks after the current ones fail: a worker that
    dies or raises fails every request in flight (finish reason "error"), the old ranks are
    closed, and ``restart(n)`` (n = 1, 2, ...: the restart's number) starts new ones, after
    a backoff when failures repeat (``RESTART_BASE_S`` ...). Without it a failure stops the
    engine for good.
    """

    def __init__(self, ranks: Any, config: Mapping[str, Any], cache: CacheLayout, *,
                 cache_tokens: int = DEFAULT_CACHE_TOKENS, tokenizer: Any = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 max_running: int = DEFAULT_MAX_RUNNING, backend: str = "openvino",
                 placement: str = "", load_seconds: float = 0.0,
                 restart: Callable[[int], Any] | None = None,
                 prefix_cache: bool = True,
                 generation_config: Mapping[str, Any] | None = None) -> None:
        self.config = config
        self.backend, self.placement, self.load_seconds = backend, placement, load_seconds
        self.world_size = ranks.world_size
        self.tokenizer = tokenizer
        self._ranks = ranks
        self.cache_bytes = cache.pool_bytes(cache_tokens)
        self._caches = [CacheManager(cache_tokens, prefix_cache) for _ in range(self.world_size)]
        self._scheduler = Scheduler(self._caches, prefill_chunk, max_running)
        self._eos = end_of_sequence_ids(config, generation_config)
        self._cond = threading.Condition()
        # Structured outputs: built at the first request with a structure (the vocabulary
        # takes about a second for 128k tokens).
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self._accept_seconds = 0.0
        self._sequences: dict[int, SequenceState] = {}
        self._texts: dict[int, TextStream] = {}
        self._events: dict[int, queue_module.Queue] = {}
        self._completions: dict[int, Completion] = {}
        self._next_id = 0
        self._closed = False
        self._failure: str | None = None
        self.step_seconds: list[float] = []
        # Per step and rank: (seconds in the graph, seconds of the whole step on the rank).
        self.rank_seconds: list[list[tuple[float, float]]] = []
        self._window: collections.deque = collections.deque(maxlen=STATS_WINDOW_STEPS)
        self._idle_phases = [0] * self.world_size
        self._busy = [0.0] * self.world_size
        self._generated = 0
        self._restart = restart
        self._restarts = 0
        self._consecutive = 0  # failures since the ranks last served RESTART_RESET_S
        self._restarting_until: float | None = None  # monotonic time of the next attempt
        self._failures: collections.deque = collections.deque(maxlen=8)
        self._healthy_since = time.monotonic()
        # request id -> (event loop, asyncio.Event) of an astream() waiting for events
        self._wakers: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}
        self._thread = threading.Thread(target=self._loop, name="numaov-lm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, model_dir: str | Path, backend: str = "openvino", *,
              plan: BindingPlan | None = None, cache_tokens: int = DEFAULT_CACHE_TOKENS,
              tokenizer: Any = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
              max_running: int = DEFAULT_MAX_RUNNING, progress: Progress = None,
              restart: bool = False, prefix_cache: bool = True) -> LMEngine:
        """An engine over one pinned worker per rank of ``model_dir``'s export; with
        ``restart``, failed workers are replaced by fresh ones (a new rank group on fresh
        shared memory) instead of stopping the engine."""
        report = progress or (lambda _msg: None)
        manifest = open_lm_manifest(model_dir, backend)
        check_capacity(cache_tokens)
        Scheduler([CacheManager(1)], prefill_chunk, max_running)  # checks both, before loading
        plan, placement = resolve_plan(manifest, plan)
        cache = manifest.record.cache
        report(f"starting {manifest.world_size} worker(s) on {backend} ({placement}); KV cache "
               f"{cache_tokens} tokens = "
               f"{cache.pool_bytes(cache_tokens) / 2**20:.1f} MiB of {cache.dtype} per rank")
        ranks = WorkerRanks(manifest, backend, plan, cache_tokens)

        def fresh_ranks(number: int) -> WorkerRanks:
            report(f"restarting the rank workers (restart {number})")
            return WorkerRanks(manifest, backend, plan, cache_tokens)

        engine = cls(ranks, manifest.config, cache, cache_tokens=cache_tokens, tokenizer=tokenizer,
                     prefill_chunk=prefill_chunk, max_running=max_running, backend=backend,
                     placement=placement, load_seconds=ranks.load_seconds,
                     restart=fresh_ranks if restart else None, prefix_cache=prefix_cache,
                     generation_config=read_generation_config(manifest.directory))
        report(f"workers ready (model loaded and compiled in {ranks.load_seconds:.1f} s)")
        return engine

    @classmethod
    def in_process(cls, model: StepModel, config: Mapping[str, Any], cache: CacheLayout, *,
                   cache_tokens: int = DEFAULT_CACHE_TOKENS, **options: Any) -> LMEngine:
        """An engine over a single rank's step model in this process (dp=1)."""
        ranks = InProcessRanks(RankRunner(model, cache, check_capacity(cache_tokens)))
        return cls(ranks, config, cache, cache_tokens=cache_tokens, backend=model.name,
                   placement="in this process", **options)

    # -- the interface ------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], params: SamplingParams, *,
               keep_logits: bool = False, name: str = "prompt") -> int:
        """Queue one request; returns its id. Bad input, or a request larger than a rank's
        whole cache, is a :class:`GenerationInputError` here, before anything runs (the one
        check of a prompt against the model; errors call it ``name``)."""
        if not isinstance(params, SamplingParams):
            raise GenerationInputError(f"params is {params!r}; expected SamplingParams",
                                       parameter="params")
        ids = check_prompt(prompt, self.config, params, name)
        if params.stop and self.tokenizer is None:
            raise GenerationInputError("stop strings need a tokenizer to read the text; "
                                       "expected stop_token_ids instead", parameter="stop")
        grammar = None
        if params.structured is not None:  # compiled here, in the caller's thread
            grammar = self.grammars(params.structured.parameter).matcher(params.structured)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        with self._cond:
            self._check_running()
            self._next_id += 1
            seq = SequenceState(self._next_id, ids, params, seed, grammar=grammar)
            self._scheduler.add(seq, keep_logits)
            self._sequences[seq.request_id] = seq
            self._texts[seq.request_id] = TextStream(self.tokenizer, params.stop)
            self._events[seq.request_id] = queue_module.Queue()
            self._cond.notify_all()
        return seq.request_id

    def grammars(self, parameter: str = "response_format") -> GrammarCompiler:
        """The engine's structured outputs: the tokenizer's vocabulary for the model's masks
        and the compiled specs (built at the first call); ``parameter`` names the request
        field in the error an engine without a tokenizer gives."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise GenerationInputError(
                        "structured output needs the model's tokenizer to map its grammar to "
                        "token ids; expected an engine started with a tokenizer",
                        parameter=parameter)
                self._grammars = GrammarCompiler(self.tokenizer, int(self.config["vocab_size"]),
                                                 self._eos)
            return self._grammars

    @property
    def grammar_seconds(self) -> float:
        """Seconds spent on structures since the engine started: token masks computed while
        scheduling, sampled tokens accepted."""
        with self._cond:
            return self._scheduler.mask_seconds + self._accept_seconds

    def stream(self, request_id: int) -> Iterator[StreamEvent]:
        """The request's events as they are produced; the last one has its finish_reason."""
        events = self._event_queue(request_id)
        while True:
            try:
                event = events.get(timeout=_POLL_S)
            except queue_module.Empty:
                continue
            yield event
            if event.finish_reason is not None:
                return

    async def astream(self, request_id: int) -> AsyncIterator[StreamEvent]:
        """:meth:`stream` for asyncio. The loop thread wakes the waiting coroutine when it
        adds an event (no thread waits per stream: a server with many streams open would
        otherwise run out of its executor's few threads)."""
        events = self._event_queue(request_id)
        wake = asyncio.Event()
        with self._cond:
            self._wakers[request_id] = (asyncio.get_running_loop(), wake)
        try:
            while True:
                try:
                    event = events.get_nowait()
                except queue_module.Empty:
                    await wake.wait()
                    wake.clear()
                    continue
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            with self._cond:
                self._wakers.pop(request_id, None)

    def result(self, request_id: int) -> Completion:
        """Wait for the request to finish; its completion (each request's once, whether or
        not it was streamed)."""
        with self._cond:
            if request_id not in self._events:
                raise self._unknown(request_id)
            while request_id not in self._completions:
                self._cond.wait()
            self._events.pop(request_id)
            return self._completions.pop(request_id)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 keep_logits: bool = False) -> list[Completion]:
        """Submit every prompt, wait for all; completions in prompt order. The prompts are
        queued under the engine's lock, so they start together in one step (a step that
        began between two submits would run the first prompts alone)."""
        _require_prompts(prompts)
        ids: list[int] = []
        with self._cond:  # reentrant: submit takes it again
            try:
                for i, prompt in enumerate(prompts):
                    ids.append(self.submit(prompt, params, keep_logits=keep_logits,
                                           name=f"prompt {i}"))
            except BaseException:
                for request_id in ids:  # a bad prompt: the ones before it do not run alone
                    self.cancel(request_id)
                raise
        return [self.result(i) for i in ids]

    def cancel(self, request_id: int) -> bool:
        """Stop the request now: its cache slots are free when this returns. False when it
        had already finished."""
        with self._cond:
            seq = self._sequences.get(request_id)
            if seq is None:
                return False
            self._finish(seq, "cancelled")
            return True

    def stats(self) -> EngineStats:
        with self._cond:
            busy, restarts, generated = list(self._busy), self._restarts, self._generated
            waiting, running = self._scheduler.counts()
            seconds = sum(w for w, _ in self._window)
            per_rank = [sum(t[r] for _, t in self._window) for r in range(self.world_size)]
            return EngineStats(
                queue_depth=waiting, running=running,
                cache_used_tokens=[c.used for c in self._caches],
                cache_capacity_tokens=[c.capacity for c in self._caches],
                cache_bytes=self.cache_bytes,
                tokens_per_second=[n / seconds if seconds else 0.0 for n in per_rank],
                steps=len(self.step_seconds), idle_phases=list(self._idle_phases),
                busy_seconds=busy, restarts=restarts, generated_tokens=generated,
                prompt_tokens=[c.prompt_tokens for c in self._caches],
                cached_prompt_tokens=[c.cached_prompt_tokens for c in self._caches],
                prefix_cache_tokens=[c.cached_tokens for c in self._caches])

    def failure(self) -> str | None:
        """Why the engine does not serve now (failed, or restarting its workers), or None."""
        with self._cond:
            return self._current_failure()

    def _current_failure(self) -> str | None:
        if self._failure is not None:
            return self._failure
        return self._ranks.failure()

    def health(self) -> EngineHealth:
        with self._cond:
            failure = self._current_failure()
            if self._restarting_until is not None:
                state = "restarting"
            elif failure is not None or self._closed:
                state = "failed"
            else:
                state = "ok"
            wait = (max(self._restarting_until - time.monotonic(), 0.0)
                    if self._restarting_until is not None else None)
            return EngineHealth(state, self._restarts, failure, list(self._failures), wait,
                                list(self._ranks.workers()))

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            for seq in list(self._sequences.values()):
                self._finish(seq, "cancelled")
            self._cond.notify_all()
        self._thread.join(timeout=CLOSE_TIMEOUT_S)
        self._ranks.close()

    def __enter__(self) -> LMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the loop -----------------------------------------------------------------------------

    def _check_running(self) -> None:
        if self._closed:
            raise RankWorkersError("the engine was closed; expected a running engine")
        if self._restarting_until is not None:
            raise RankWorkersRestarting(f"the rank workers are restarting after a failure "
                                        f"({self._failure}); expected a retry shortly")
        failure = self._current_failure()
        if failure is not None:
            raise RankWorkersError(f"the rank workers failed earlier: {failure}")

    @staticmethod
    def _unknown(request_id: int) -> GenerationInputError:
        return GenerationInputError(f"request {request_id!r} is not known (or its result was "
                                    "already taken); expected an id from submit()",
                                    parameter="request_id")

    def _event_queue(self, request_id: int) -> queue_module.Queue:
        with self._cond:
            events = self._events.get(request_id)
        if events is None:
            raise self._unknown(request_id)
        return events

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._scheduler.has_work():
                    if self._ranks.failure() is not None:
                        break  # a worker died while idle: restart it now
                    self._cond.wait(_IDLE_CHECK_S)
                if self._closed:
                    return
                idle_failure = self._ranks.failure()
                steps = None if idle_failure is not None else self._scheduler.schedule()
            if idle_failure is not None:
                if not self._recover(idle_failure):
                    return
                continue
            if steps is None:
                continue
            start = time.perf_counter()
            try:
                results = self._ranks.step(steps)
            except Exception as exc:  # noqa: BLE001 - every waiting request is told
                if not self._recover(str(exc)):
                    return
                continue
            wall = time.perf_counter() - start
            with self._cond:
                for rank, step in enumerate(steps):
                    self._idle_phases[rank] += sum(1 for rows in step.phases if not rows)
                self._apply(results, wall)

    def _recover(self, reason: str) -> bool:
        """The ranks failed: fail every request, then restart them (True) or stop (False)."""
        with self._cond:
            self._failure = reason
            self._failures.append((time.time(), reason))
            for seq in list(self._sequences.values()):
                self._finish(seq, "error")
            self._scheduler.forget_releases()  # fresh ranks know none of those sequences
            for cache in self._caches:  # nor their pools any cached prefix
                cache.clear_prefixes()
            if self._restart is None or self._closed:
                logger.error("the engine stopped: %s", reason)
                self._closed = True
                return False
            served = time.monotonic() - self._healthy_since
            self._consecutive = 1 if served >= RESTART_RESET_S else self._consecutive + 1
            logger.error("the rank workers failed (%s); restarting them", reason)
        old = self._ranks
        old.close()
        while True:
            delay = 0.0 if self._consecutive <= 1 else min(
                RESTART_BASE_S * 2 ** (self._consecutive - 2), RESTART_MAX_S)
            with self._cond:
                self._restarting_until = time.monotonic() + delay
                while not self._closed and time.monotonic() < self._restarting_until:
                    self._cond.wait(max(self._restarting_until - time.monotonic(), 0.0))
                if self._closed:
                    self._restarting_until = None
                    return False
                self._restarts += 1
                number = self._restarts
            try:
                ranks = self._restart(number)
            except Exception as exc:  # noqa: BLE001 - shown in health(), tried again
                logger.error("restart %d of the rank workers failed: %s", number, exc)
                with self._cond:
                    self._failure = f"restart {number} failed: {exc}"
                    self._failures.append((time.time(), self._failure))
                    self._consecutive += 1
                continue
            with self._cond:
                if self._closed:
                    self._restarting_until = None
                    ranks.close()
                    return False
                self._ranks = ranks
                self._failure = None
                self._restarting_until = None
                self._healthy_since = time.monotonic()
                self._cond.notify_all()
            logger.warning("the rank workers were restarted (restart %d)", number)
            return True

    def _apply(self, results: list[RankStepResult], wall: float) -> None:
        self.step_seconds.append(wall)
        self.rank_seconds.append([(r.forward_seconds, r.seconds) for r in results])
        self._window.append((wall, [len(r.sampled) for r in results]))
        for rank, r in enumerate(results):
            self._busy[rank] += r.seconds
        for result in results:
            for sampled in result.sampled:
                seq = self._sequences.get(sampled.request_id)
                if seq is None:  # cancelled while the step ran
                    continue
                token = sampled.token
                grammar = seq.grammar
                if grammar is not None and grammar.error is not None:  # no mask: never seen
                    self._finish_broken(seq)
                    continue
                # a structure allows an end-of-sequence token only once it is complete
                if token in seq.params.stop_token_ids or (token in self._eos and (
                        not seq.params.ignore_eos or grammar is not None)):
                    self._finish(seq, "stop")
                    continue
                if grammar is not None:
                    start = time.perf_counter()
                    accepted = grammar.accept(token)
                    self._accept_seconds += time.perf_counter() - start
                    if not accepted:
                        self._finish_broken(seq)
                        continue
                seq.tokens.append(token)
                self._generated += 1
                if sampled.logprob is not None:
                    seq.logprobs.append(sampled.logprob)
                if sampled.logits is not None:
                    seq.logits.append(sampled.logits)
                text = self._texts[seq.request_id]
                delta = text.add(seq.tokens)
                self._events[seq.request_id].put(StreamEvent(
                    seq.request_id, [token], delta,
                    [sampled.logprob] if sampled.logprob is not None else []))
                self._wake(seq.request_id)
                if text.stopped or (grammar is not None and grammar.done):
                    self._finish(seq, "stop")
                elif len(seq.tokens) >= seq.params.max_new_tokens:
                    self._finish(seq, "length")

    def _finish_broken(self, seq: SequenceState) -> None:
        """The structure's matcher failed (a library limit, a dead end the model's vocabulary
        cannot get out of, or a token it refused): the sequence cannot go on within its
        structure."""
        assert seq.grammar is not None
        error = structure_error(seq.grammar, len(seq.tokens))
        logger.warning("request %d: %s; it ends with finish_reason 'error'", seq.request_id,
                       error)
        self._finish(seq, "error", error)

    def _finish(self, seq: SequenceState, reason: str, broken: str | None = None) -> None:
        """End ``seq`` with ``reason``; ``broken``: why its structure cannot go on (the
        request's error)."""
        seq.finish_reason = reason
        self._scheduler.remove(seq)
        text = self._texts.pop(seq.request_id)
        delta = text.finish()
        del self._sequences[seq.request_id]
        logits = np.stack(seq.logits) if seq.logits else None
        self._completions[seq.request_id] = Completion(
            seq.request_id, seq.prompt, seq.tokens, text.text,
            seq.logprobs if seq.params.logprobs else None, reason, logits, seq.cached_prompt,
            broken)
        self._events[seq.request_id].put(StreamEvent(seq.request_id, [], delta, [], reason,
                                                     broken))
        self._wake(seq.request_id)
        self._cond.notify_all()

    def _wake(self, request_id: int) -> None:
        waker = self._wakers.get(request_id)
        if waker is not None:
            loop, event = waker
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that event loop was closed: nobody is waiting any more
                pass


def structure_error(grammar: Any, generated: int) -> str:
    """One line: where ``grammar``'s structure could not go on, and why."""
    where = "cannot start" if generated == 0 else f"cannot go on after {generated} tokens"
    return (f"{grammar.spec.describe()} {where}: {grammar.error}; expected a structure the "
            "model's vocabulary can write")


# -- one run: run lm, bench -------------------------------------------------------------------


@dataclass
class GenerationResult:
    """New tokens per prompt (the caller's order) and how long it took."""

    tokens: list[list[int]]
    backend: str
    world_size: int
    placement: str
    # Wall time of every engine step (all ranks, in lockstep); step 0 holds the prefill of
    # every prompt that fit in one chunk, including the first inference's one-time work.
    step_seconds: list[float]
    # Slowest rank's model load / compile.
    load_seconds: float
    # Per prompt, [new tokens, vocab] f32 logits each token was chosen from (keep_logits=True).
    logits: list[np.ndarray] | None = field(default=None, repr=False)
    completions: list[Completion] = field(default_factory=list, repr=False)

    @classmethod
    def from_engine(cls, engine: LMEngine, completions: list[Completion],
                    steps_before: int = 0) -> GenerationResult:
        logits = None
        if completions and all(c.logits is not None for c in completions):
            logits = [c.logits for c in completions]
        return cls(tokens=[c.tokens for c in completions], backend=engine.backend,
                   world_size=engine.world_size, placement=engine.placement,
                   step_seconds=engine.step_seconds[steps_before:],
                   load_seconds=engine.load_seconds, logits=logits, completions=completions)

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
        """Tokens per second of the steps after the first (each prompt's first token comes
        from the prefill)."""
        if not self.decode_seconds:
            return None
        decoded = sum(max(len(t) - 1, 0) for t in self.tokens)
        return decoded / max(sum(self.decode_seconds), 1e-12)

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
            f"{len(self.tokens)} prompt(s), {sum(len(t) for t in self.tokens)} new tokens in "
            f"{len(self.step_seconds)} steps on {self.backend} with {self.world_size} rank(s): "
            f"prefill {1000 * self.prefill_seconds:.1f} ms{per_step}, "
            f"{self.tokens_per_second:.1f} tokens/s (load {self.load_seconds:.1f} s)"
        )


def split_prompts(prompts: Sequence[Sequence[int]], world_size: int) -> list[list[list[int]]]:
    """Rank r's prompts under a round-robin split (for benchmarks that drive ranks directly;
    the engine places requests on the least-loaded rank instead)."""
    return [[list(p) for p in prompts[r::world_size]] for r in range(world_size)]


def run_lm(
    model_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    backend: str = "openvino",
    *,
    plan: BindingPlan | None = None,
    params: SamplingParams | None = None,
    cache_tokens: int | None = None,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    keep_logits: bool = False,
    tokenizer: Any = None,
    progress: Progress = None,
    prefix_cache: bool = True,
) -> GenerationResult:
    """Generate for every prompt on one worker per rank (the engine, started for this run).

    ``params`` sets the sampling and stop rules (default: greedy, stop at the model's
    end-of-sequence token); its ``max_new_tokens`` is ``max_new_tokens``. ``cache_tokens``
    (per rank) defaults to what the prompts need, at least ``DEFAULT_CACHE_TOKENS``. ``plan``
    overrides the placement (default :func:`plan_for_ranks`).
    """
    report = progress or (lambda _msg: None)
    manifest = open_lm_manifest(model_dir, backend)
    checked = check_prompts(prompts, manifest.config, max_new_tokens)
    if params is None:
        params = SamplingParams(max_new_tokens)
    elif params.max_new_tokens != max_new_tokens:
        params = SamplingParams(**{**params.__dict__, "max_new_tokens": max_new_tokens})
    if cache_tokens is None:
        cache_tokens = max(DEFAULT_CACHE_TOKENS, sum(len(p) + max_new_tokens for p in checked))
    report(f"generating up to {max_new_tokens} tokens for {len(checked)} prompt(s) on "
           f"{backend} with {manifest.world_size} rank(s)")
    with LMEngine.start(model_dir, backend, plan=plan, cache_tokens=cache_tokens,
                        tokenizer=tokenizer, prefill_chunk=prefill_chunk,
                        progress=progress, prefix_cache=prefix_cache) as engine:
        completions = engine.generate(checked, params, keep_logits=keep_logits)
        broken = [c for c in completions if c.finish_reason == "error"]
        if broken:  # cut short: never printed as if they had ended
            raise RankWorkersError(broken[0].structure_error or (
                "the rank workers failed while generating: "
                f"{_last_words(engine.failure() or 'no reason recorded')}"))
        return GenerationResult.from_engine(engine, completions)


def _last_words(failure: str) -> str:
    """A worker's failure in one line: a traceback's text is cut to its final line (the
    exception itself); the logs above carry the rest."""
    lines = [line.strip() for line in failure.strip().splitlines() if line.strip()]
    if len(lines) <= 1:
        return failure.strip()
    return lines[0].split("Traceback")[0] + lines[-1]


def format_generation(
    result: GenerationResult, prompts: Sequence[Sequence[int]], tokenizer: Any = None
) -> str:
    """One line per prompt (ids, or text with a tokenizer: prompt -> new text; `` [stop]``
    when it ended at a stop rule, then its log-probabilities when asked for), then the timing
    summary."""
    lines = []
    for i, (prompt, new) in enumerate(zip(prompts, result.tokens, strict=True)):
        done = result.completions[i] if result.completions else None
        stop = " [stop]" if done is not None and done.finish_reason == "stop" else ""
        if tokenizer is None:
            lines.append(f"[{i}] {','.join(map(str, prompt))} -> {','.join(map(str, new))}{stop}")
        else:
            text = done.text if done is not None else tokenizer.decode(new)
            lines.append(f"[{i}] {tokenizer.decode(list(prompt))!r} -> {text!r}{stop}")
        if done is not None and done.logprobs is not None:
            lines.append("    logprobs " + ",".join(f"{v:.4f}" for v in done.logprobs))
    lines.append(result.summary())
    return "\n".join(lines)

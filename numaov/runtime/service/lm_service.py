"""The language model a server holds: the LM engine over long-lived rank workers.

``LMService(model_dir)`` starts the engine (:class:`numaov.runtime.lm.engine.LMEngine`) on one
worker per rank of the binding plan, as ``numaov run lm`` does, but the workers stay:
each pins itself, joins the model's collective group, loads and compiles its rank's graph and
allocates its KV cache once, then serves steps until the service closes. Every request is
submitted to the engine on its own, so requests that arrive while others run join the running
batch at the next step (continuous batching) instead of waiting for them. When a worker dies,
the requests in flight fail and the engine restarts the rank group on fresh shared memory
(``restart``, on by default; see :class:`~numaov.runtime.lm.engine.LMEngine`).

The HTTP routes over it are in :mod:`numaov.runtime.service`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from numaov import NumaovError
from numaov.runtime.lm.cache import DEFAULT_CACHE_TOKENS
from numaov.runtime.lm.engine import (
    GenerationResult,
    LMEngine,
    Progress,
    SamplingParams,
)
from numaov.runtime.lm.ranks import RankWorkersError
from numaov.runtime.lm.scheduler import DEFAULT_MAX_RUNNING, DEFAULT_PREFILL_CHUNK
from numaov.runtime.placement.binding import BindingPlan

logger = logging.getLogger(__name__)


class ServiceError(NumaovError):
    """The service's workers failed, stopped or did not start, or its socket is taken."""


class LMService:
    """The engine over long-lived rank workers for one exported language model."""

    def __init__(self, model_dir: str | Path, backend: str = "openvino", *,
                 plan: BindingPlan | None = None, cache_tokens: int = DEFAULT_CACHE_TOKENS,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 max_running: int = DEFAULT_MAX_RUNNING, tokenizer: Any = None,
                 progress: Progress = None, restart: bool = True,
                 prefix_cache: bool = True) -> None:
        try:
            self.engine = LMEngine.start(model_dir, backend, plan=plan, cache_tokens=cache_tokens,
                                         tokenizer=tokenizer, prefill_chunk=prefill_chunk,
                                         max_running=max_running, progress=progress,
                                         restart=restart, prefix_cache=prefix_cache)
        except RankWorkersError as exc:
            raise ServiceError(str(exc)) from None
        self.backend = backend
        self.world_size = self.engine.world_size
        self.placement = self.engine.placement
        self.load_seconds = self.engine.load_seconds

    @property
    def config(self) -> Mapping[str, Any]:
        return self.engine.config

    def failure(self) -> str | None:
        """Why the workers do not serve now, or None while they serve."""
        return self.engine.failure()

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 params: SamplingParams | None = None) -> GenerationResult:
        """Every prompt's completion (default: greedy, ``max_new_tokens`` at most), in the
        caller's order, and the engine's step times while they ran."""
        params = params or SamplingParams(max_new_tokens)
        before = len(self.engine.step_seconds)
        try:  # the engine checks each prompt as it is submitted
            completions = self.engine.generate(prompts, params)
        except RankWorkersError as exc:
            raise ServiceError(str(exc)) from None
        broken = [c for c in completions if c.finish_reason == "error"]
        if broken:
            raise ServiceError(broken[0].structure_error or
                               f"the rank workers failed while generating: {self.failure()}")
        return GenerationResult.from_engine(self.engine, completions, before)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LMService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Sequence state and per-request sampling settings of the LM engine.

A request becomes one :class:`Sequence`: its prompt, the settings it was submitted with
(:class:`SamplingParams`, checked once at submit), the rank the scheduler gave it, how many of
its tokens are in the rank's cache, what it generated, where that is in its structure (a
grammar matcher, for a constrained request) and why it stopped. The scheduler, the cache
manager and the engine read and write it under the engine's lock; the rank workers never see
it (they get plain row descriptions, :mod:`numaov.runtime.lm.runner`).

:class:`GenerationInputError` is the one error for bad generation input, whoever finds it: a
prompt, a sampling setting, a stop rule, a structure that does not compile or a request the
cache can never hold.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from numaov import NumaovError

if TYPE_CHECKING:
    from numaov.runtime.lm.grammar import GrammarMatcher, GrammarSpec

# Why a sequence stopped (the OpenAI names): "stop" = an end-of-sequence token, a stop token
# id, a stop string or a complete structure; "length" = max_new_tokens; "cancelled" = cancel();
# "error" = the workers failed (or, never seen, a structure's matcher refused a token).
FINISH_REASONS = ("stop", "length", "cancelled", "error")


class GenerationInputError(NumaovError):
    """Prompts, token ids, sampling settings or stop rules the model or engine cannot take."""


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    ``temperature`` 0 is greedy (``top_p``, ``top_k`` and ``seed`` then change nothing);
    above 0 the logits are divided by it, cut to the ``top_k`` most likely tokens (0 = no
    cut), then to the smallest set whose probability reaches ``top_p``, and one token is drawn
    with the request's own generator, seeded by ``seed`` (a random seed when None): the same
    seed gives the same tokens whatever else is in the batch. The sequence stops at the
    model's end-of-sequence token (unless ``ignore_eos``), at any of ``stop_token_ids`` (the
    stopping token is not part of the output), when its text contains one of ``stop`` (the
    text ends before it; needs a tokenizer), or after ``max_new_tokens``. ``logprobs``: return
    the log-probability of every chosen token under the model's distribution (log-softmax of
    the raw logits, before temperature, cuts and a structure's mask). ``structured``: the
    new tokens follow this structure (:class:`numaov.runtime.lm.grammar.GrammarSpec`: JSON,
    a JSON Schema, a regex, a choice, a grammar; needs a tokenizer): only the tokens it allows
    are sampled, and the sequence stops once it is complete (also with ``ignore_eos``).
    """

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    ignore_eos: bool = False
    structured: GrammarSpec | None = None

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if not _is_int(n) or n < 1:
            raise GenerationInputError(f"max_new_tokens is {n!r}; expected a positive integer",
                                       parameter="max_new_tokens")
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t < 0:
            raise GenerationInputError(
                f"temperature is {t!r}; expected a number >= 0 (0 = greedy)",
                parameter="temperature")
        p = self.top_p
        if not _is_number(p) or not 0 < p <= 1:
            raise GenerationInputError(f"top_p is {p!r}; expected a number in (0, 1]",
                                       parameter="top_p")
        k = self.top_k
        if not _is_int(k) or k < 0:
            raise GenerationInputError(f"top_k is {k!r}; expected an integer >= 0 (0 = off)",
                                       parameter="top_k")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise GenerationInputError(
                f"seed is {self.seed!r}; expected an integer in 0 .. 2**63-1 or none",
                parameter="seed")
        if isinstance(self.stop_token_ids, (str, bytes)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise GenerationInputError(
                f"stop_token_ids is {_as_list(self.stop_token_ids)!r}; expected a list of "
                "token ids",
                parameter="stop_token_ids")
        if isinstance(self.stop, (str, bytes)) or not all(
                isinstance(s, str) and s for s in self.stop):
            raise GenerationInputError(
                f"stop is {_as_list(self.stop)!r}; expected a list of non-empty strings",
                parameter="stop")
        if self.structured is not None:
            from numaov.runtime.lm.grammar import GrammarSpec

            if not isinstance(self.structured, GrammarSpec):
                raise GenerationInputError(
                    f"structured is {self.structured!r}; expected a GrammarSpec or none",
                    parameter="response_format")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def positions_left(config: Mapping[str, Any], prompt_tokens: int) -> int:
    """How many new tokens fit after a ``prompt_tokens``-token prompt: prompt and new tokens
    together fit the model's positions (``max_position_embeddings``)."""
    return int(config["max_position_embeddings"]) - prompt_tokens


def check_prompt(prompt: Seq[int], config: Mapping[str, Any], params: SamplingParams,
                 name: str = "prompt") -> list[int]:
    """``prompt`` as a list of ints, after checking it (and its stop ids) against the model:
    the engine's check at :meth:`~numaov.runtime.lm.engine.LMEngine.submit`."""
    vocab = int(config["vocab_size"])
    limit = int(config["max_position_embeddings"])
    ids = list(prompt) if not isinstance(prompt, (str, bytes)) else None
    if ids is None or any(not _is_int(t) for t in ids):
        raise GenerationInputError(f"{name} holds non-integer token ids; expected ints",
                                   parameter="prompt")
    if not ids:
        raise GenerationInputError(f"{name} is empty; expected at least one token id",
                                   parameter="prompt")
    bad = [int(t) for t in ids if not 0 <= int(t) < vocab]
    if bad:
        raise GenerationInputError(
            f"{name} holds token id(s) {bad[:8]} outside the vocabulary; expected ids in "
            f"0 .. {vocab - 1} (vocab_size {vocab})", parameter="prompt")
    if params.max_new_tokens > positions_left(config, len(ids)):
        raise GenerationInputError(
            f"{name} has {len(ids)} tokens; with {params.max_new_tokens} new tokens that is "
            f"more than the model's max_position_embeddings={limit}", parameter="max_new_tokens")
    bad = [t for t in params.stop_token_ids if t >= vocab]
    if bad:
        raise GenerationInputError(
            f"stop_token_ids {bad} are outside the vocabulary; expected ids in 0 .. {vocab - 1}",
            parameter="stop_token_ids")
    return [int(t) for t in ids]


def end_of_sequence_ids(config: Mapping[str, Any],
                        generation_config: Mapping[str, Any] | None = None) -> frozenset[int]:
    """The model's end-of-sequence token ids: ``eos_token_id`` (one id or a list) of its
    config and of its ``generation_config.json``, which transformers' ``generate`` stops at
    (a chat model's end of turn is often there only)."""
    ids: set[int] = set()
    for source in (config, generation_config or {}):
        eos = source.get("eos_token_id")
        if eos is not None:
            ids.update(int(t) for t in (eos if isinstance(eos, list) else [eos]))
    return frozenset(ids)


def read_generation_config(directory: Path) -> dict[str, Any]:
    """``directory``'s ``generation_config.json`` (the export keeps the checkpoint's), or {}
    without one; a file that is not a JSON object is a one-line GenerationInputError."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise GenerationInputError(f"{path} cannot be read as JSON: {exc}; expected the "
                                   "checkpoint's generation_config.json") from None
    if not isinstance(value, dict):
        raise GenerationInputError(f"{path} holds {type(value).__name__}; expected a JSON "
                                   "object")
    eos = value.get("eos_token_id")
    if not all(t is None or _is_int(t) for t in (eos if isinstance(eos, list) else [eos])):
        raise GenerationInputError(f"{path} has eos_token_id {eos!r}; expected a token id or "
                                   "a list of them")
    return value


@dataclass(eq=False)
class Sequence:
    """One request in the engine: what it asked, where it runs, what it produced."""

    request_id: int
    prompt: list[int]
    params: SamplingParams
    # The seed its generator starts from (params.seed, or one drawn at submit).
    seed: int
    rank: int | None = None
    # Tokens of prompt + output whose cache entries the rank has written.
    cached: int = 0
    # Of the prompt, the tokens whose entries were found in the rank's prefix cache.
    cached_prompt: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # [V] f32 per token, only for run_lm(keep_logits=True) (backend comparisons).
    logits: list[np.ndarray] = field(default_factory=list)
    finish_reason: str | None = None
    # The rank-side state (slots, generator) was created: the rank must be told to drop it.
    joined: bool = False
    # Where its new tokens are in their structure (params.structured), else None.
    grammar: GrammarMatcher | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def in_prefill(self) -> bool:
        """The prompt's entries are not all in the cache yet."""
        return self.cached < len(self.prompt)

    @property
    def reserved_tokens(self) -> int:
        """Cache slots the sequence may fill: its prompt and every token it may generate."""
        return len(self.prompt) + self.params.max_new_tokens

    def next_input(self, chunk: int) -> list[int]:
        """The tokens to feed next: up to ``chunk`` prompt tokens, else the last output."""
        if self.in_prefill:
            return self.prompt[self.cached:self.cached + chunk]
        return [self.tokens[-1]]


def _as_list(value: Any) -> Any:
    """A tuple as the list a request wrote (messages quote what the caller gave)."""
    return list(value) if isinstance(value, tuple) else value

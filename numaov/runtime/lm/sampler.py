"""Choosing each sequence's next token from its logits, per request.

The sampler runs on the rank that holds the sequence (the logits never leave the rank), with
one generator per sequence seeded from the request's seed. A token costs exactly one draw from
that generator, so a sequence's tokens depend on its own logits and seed only, not on which
other sequences share its batch or rank. Greedy decoding (temperature 0) draws nothing.
"""

from __future__ import annotations

import numpy as np

from numaov.runtime.lm.sequence import SamplingParams


def new_generator(seed: int) -> np.random.Generator:
    """The generator of one sequence (Philox: a counter-based stream per seed)."""
    return np.random.Generator(np.random.Philox(seed))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def sample_token(logits: np.ndarray, params: SamplingParams, generator: np.random.Generator
                 ) -> tuple[int, float | None]:
    """``logits [V]`` -> (token, its log-probability when ``params.logprobs``, else None)."""
    logprob = None
    if params.greedy:
        token = int(np.argmax(logits))
    else:
        token = _draw(logits, params, generator)
    if params.logprobs:
        logprob = float(log_softmax(logits)[token])
    return token, logprob


def _draw(logits: np.ndarray, params: SamplingParams, generator: np.random.Generator) -> int:
    scaled = logits.astype(np.float64) / params.temperature
    candidates = np.arange(scaled.shape[0])
    if params.top_k and params.top_k < scaled.shape[0]:
        candidates = np.argpartition(-scaled, params.top_k - 1)[:params.top_k]
    # most likely first; ties broken by token id so the order never depends on the partition
    order = np.lexsort((candidates, -scaled[candidates]))
    candidates = candidates[order]
    values = scaled[candidates]
    probs = np.exp(values - values[0])
    probs /= probs.sum()
    if params.top_p < 1.0:
        cumulative = np.cumsum(probs)
        keep = int(np.searchsorted(cumulative, params.top_p) + 1)  # reaches top_p
        candidates, probs = candidates[:keep], probs[:keep] / cumulative[keep - 1]
    cumulative = np.cumsum(probs)
    index = int(np.searchsorted(cumulative, generator.random() * cumulative[-1], side="right"))
    return int(candidates[min(index, len(candidates) - 1)])

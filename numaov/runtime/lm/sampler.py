"""Choosing each sequence's next token from its logits, per request.

The sampler runs on the rank that holds the sequence (the logits never leave the rank), with
one generator per sequence seeded from the request's seed. A token costs exactly one draw from
that generator, so a sequence's tokens depend on its own logits and seed only, not on which
other sequences share its batch or rank. Greedy decoding (temperature 0) draws nothing.

A constrained sequence's row brings the mask of the tokens its structure allows
(:mod:`numaov.runtime.lm.grammar`: int32 words, bit ``i`` of word ``j`` = token ``32 * j + i``):
the others are out of the choice, as if their logits were -inf, before temperature and cuts;
the log-probability stays the model's own (of the raw logits).
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


# What a disallowed token's logit becomes for greedy decoding: finite (the masked logits are
# built by arithmetic, with no branch per token), below any real logit.
_FAR = np.float32(3e38)


def _mask_bits(mask: np.ndarray, vocab: int) -> np.ndarray:
    """``[vocab] uint8``, 1 where the token mask (``[ceil(vocab / 32)] int32``) allows."""
    if mask.dtype != np.int32 or mask.ndim != 1 or mask.shape[0] * 32 < vocab:
        raise ValueError(f"a token mask of {mask.dtype} {list(mask.shape)} for {vocab} logits; "
                         f"expected int32 [{(vocab + 31) // 32}]")
    return np.unpackbits(mask.view(np.uint8), count=vocab, bitorder="little")


def allowed_tokens(mask: np.ndarray, vocab: int) -> np.ndarray:
    """The ids a token mask allows, ascending."""
    return np.flatnonzero(_mask_bits(mask, vocab).view(bool))


def sample_token(logits: np.ndarray, params: SamplingParams, generator: np.random.Generator,
                 mask: np.ndarray | None = None) -> tuple[int, float | None]:
    """``logits [V]`` -> (token, its log-probability when ``params.logprobs``, else None);
    with ``mask``, only a token it allows."""
    logprob = None
    if mask is None:
        token = int(np.argmax(logits)) if params.greedy else _draw(logits, params, generator)
    elif params.greedy:
        token = _best_allowed(logits, _mask_bits(mask, logits.shape[0]))
    else:
        candidates = allowed_tokens(mask, logits.shape[0])
        if not len(candidates):
            raise ValueError("the token mask allows no token; expected at least one")
        token = _draw(logits, params, generator, candidates)
    if params.logprobs:
        logprob = float(log_softmax(logits)[token])
    return token, logprob


def _best_allowed(logits: np.ndarray, bits: np.ndarray) -> int:
    """The most likely token among those ``bits`` allows (the lowest id of equals)."""
    token = int(np.argmax(logits))
    if bits[token]:  # the model's own first choice: no need to look further
        return token
    masked = bits.astype(np.float32)  # logits where allowed, -3e38 elsewhere
    masked -= 1
    masked *= _FAR
    masked += logits
    token = int(np.argmax(masked))
    if not bits[token]:
        raise ValueError("the token mask allows no token; expected at least one")
    return token


def _draw(logits: np.ndarray, params: SamplingParams, generator: np.random.Generator,
          candidates: np.ndarray | None = None) -> int:
    scaled = logits.astype(np.float64) / params.temperature
    k = params.top_k
    if candidates is None:
        candidates = np.arange(scaled.shape[0])
        if k and k < scaled.shape[0]:
            candidates = np.argpartition(-scaled, k - 1)[:k]
    elif k and k < candidates.shape[0]:
        candidates = candidates[np.argpartition(-scaled[candidates], k - 1)[:k]]
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

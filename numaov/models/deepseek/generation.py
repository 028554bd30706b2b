"""Greedy generation over the explicit KV cache, in lockstep with the other DP ranks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from numaov import NumaovError
from numaov.models.deepseek.causal_lm import DeepseekV2, _positions_from_mask


class ModelInputError(NumaovError):
    """Token ids, prompts or generation arguments the model cannot take."""


@dataclass
class GreedyOutput:
    """``tokens[i]``: the new tokens of prompt ``i``; ``logits [B, steps, V]`` (fp32): the
    logits each token was chosen from."""

    tokens: list[list[int]]
    logits: Tensor


def generate_greedy(
    model: DeepseekV2,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    pad_token_id: int = 0,
    progress: Callable[[str], None] | None = None,
) -> GreedyOutput:
    """Greedy decoding of a batch of prompts (left-padded) with the explicit KV cache.

    Exactly ``max_new_tokens`` steps run, whatever the tokens: under DP every rank must run
    the same number of forwards (the collectives need everyone), so a rank with no prompts
    calls this with ``prompts=[]`` and takes part with empty batches.
    """
    config = model.config
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ModelInputError(f"max_new_tokens is {max_new_tokens!r}; expected a positive integer")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ModelInputError(f"prompt {i} is empty; expected at least one token id")
        bad = [t for t in prompt if not 0 <= int(t) < config.vocab_size]
        if bad:
            raise ModelInputError(
                f"prompt {i} holds token id(s) {bad[:8]} outside the vocabulary; expected ids "
                f"in 0 .. {config.vocab_size - 1}"
            )
    longest = max((len(p) for p in prompts), default=1)
    if longest + max_new_tokens > config.max_position_embeddings:
        raise ModelInputError(
            f"a prompt of {longest} tokens plus {max_new_tokens} new tokens exceeds "
            f"max_position_embeddings={config.max_position_embeddings}; expected at most "
            f"{config.max_position_embeddings} positions"
        )
    b = len(prompts)
    ids = torch.full((b, longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros((b, longest), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, longest - len(prompt):] = torch.tensor([int(t) for t in prompt])
        mask[i, longest - len(prompt):] = 1
    positions = _positions_from_mask(mask)
    past = model.empty_cache(b)
    chosen: list[Tensor] = []
    step_logits: list[Tensor] = []
    with torch.inference_mode():
        for step in range(max_new_tokens):
            logits, past = model.step(ids, positions, mask, past)
            last = logits[:, -1].float()
            token = last.argmax(dim=-1)
            chosen.append(token)
            step_logits.append(last)
            # next step: one new token per row, at the next position
            positions = mask.sum(dim=-1, keepdim=True)
            ids = token.unsqueeze(1)
            mask = torch.cat((mask, torch.ones((b, 1), dtype=mask.dtype)), dim=1)
            if progress is not None:
                progress(f"generated token {step + 1}/{max_new_tokens}")
    tokens = torch.stack(chosen, dim=1) if b else torch.zeros((0, max_new_tokens), dtype=torch.long)
    logits_all = (
        torch.stack(step_logits, dim=1) if b
        else torch.zeros((0, max_new_tokens, config.vocab_size))
    )
    return GreedyOutput(tokens=tokens.tolist(), logits=logits_all)

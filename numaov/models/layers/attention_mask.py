"""The attention mask every cached step is given, whatever the attention design (MLA in
:mod:`numaov.models.layers.mla`, GQA in :mod:`numaov.models.layers.gqa`): both take it as
``mask [B, 1, T, P+T]`` (bool, True = attend)."""

from __future__ import annotations

import torch
from torch import Tensor


def causal_attention_mask(attention_mask: Tensor, t: int) -> Tensor:
    """``attention_mask [B, S]`` (1 = real token, past and current) -> bool ``[B, 1, T, S]``.

    Query ``i`` (cache slot ``S-T+i``) sees the real tokens at slots ``<= S-T+i``, and always
    itself, so a padding query has one finite score instead of a NaN row that would leak into
    the cache of the real tokens through ``0 * NaN``.
    """
    s = attention_mask.shape[1]
    query_slot = torch.arange(t, device=attention_mask.device).unsqueeze(1) + (s - t)  # [T, 1]
    key_slot = torch.arange(s, device=attention_mask.device).unsqueeze(0)  # [1, S]
    causal = key_slot <= query_slot
    real = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, S]
    return (causal & real) | (key_slot == query_slot)

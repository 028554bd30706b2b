"""The decoder layer and the decoder stack every language-model family runs: pre-norm
attention and a pre-norm MLP / MoE block, each added to the residual, with DP attention's
exchange (:func:`numaov.models.layers.data_parallel.run_on_all_ranks`) around every MLP block.

A family hands in what is its own: its attention module (MLA, GQA), its MoE block and the
rotated dims of its rope. Parameter names are Hugging Face's (``model.embed_tokens``,
``model.layers.{i}.input_layernorm`` / ``self_attn`` / ``post_attention_layernorm`` / ``mlp``,
``model.norm``), so checkpoints load as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from numaov.models.layers.attention_mask import causal_attention_mask
from numaov.models.layers.data_parallel import (
    DataParallelGroup,
    RankRows,
    agree_rows,
    run_on_all_ranks,
)
from numaov.models.layers.mlp import GatedMLP
from numaov.models.layers.norm import RMSNorm
from numaov.models.layers.rope import RotaryEmbedding


class DecoderConfig(Protocol):
    """The config keys the decoder stack reads (every family's config has them)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None
    max_position_embeddings: int

    def is_moe_layer(self, layer: int) -> bool: ...


def multi_rank(dp: DataParallelGroup | None) -> DataParallelGroup | None:
    """``dp`` when it has more than one rank: a group of one needs no exchange."""
    return dp if dp is not None and dp.world_size > 1 else None


class DecoderLayer(nn.Module):
    """norm -> attention -> residual -> norm -> MLP / MoE (over the rows of all ranks) ->
    residual. ``attention`` is replicated (each rank runs it on its own sequences); ``mlp``
    is this rank's shard (every rank runs its part on every rank's rows)."""

    def __init__(self, hidden: int, eps: float, attention: nn.Module, mlp: nn.Module,
                 dp: DataParallelGroup | None) -> None:
        super().__init__()
        self.dp = multi_rank(dp)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = mlp

    def forward(self, hidden: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, past: Tensor,
                rows_of: RankRows | None) -> tuple[Tensor, Tensor]:
        # 1. attention
        attn, new = self.self_attn(self.input_layernorm(hidden), cos, sin, mask, past)
        hidden = hidden + attn
        # 2. MoE or dense MLP, over the rows of all ranks
        rows = self.post_attention_layernorm(hidden).reshape(-1, hidden.shape[-1])
        return hidden + run_on_all_ranks(self.mlp, rows, self.dp, rows_of).view_as(hidden), new


class DecoderStack(nn.Module):
    """Embedding, the decoder layers and the final norm: ``(input_ids, position_ids,
    attention_mask, past [layers, B, P, W]) -> (hidden [B, T, H], new [layers, B, T, W])``:
    ``new`` is this step's cache entries (what follows ``past``; each attention cuts them from
    its concatenation with the past: ``layers.gqa`` says why).

    Layer ``i`` is ``attention()`` and, when ``config.is_moe_layer(i)``, ``moe(world_size)``
    (this rank's shard of the family's MoE block), else a dense SwiGLU MLP of this rank's
    ``intermediate_size / world_size``. ``rope_dim`` is the number of dims rope rotates.
    """

    def __init__(self, config: DecoderConfig, dp: DataParallelGroup | None, *,
                 attention: Callable[[], nn.Module], moe: Callable[[int], nn.Module],
                 rope_dim: int) -> None:
        super().__init__()
        self.config = config
        self.dp = multi_rank(dp)
        world = dp.world_size if dp is not None else 1
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        # attention, then the MLP block, layer by layer: the order a seeded random
        # initialisation draws them in
        self.layers = nn.ModuleList(
            DecoderLayer(hidden, eps, attention(),
                         moe(world) if config.is_moe_layer(i)
                         else GatedMLP(hidden, config.intermediate_size // world), dp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(hidden, eps)
        self.rotary = RotaryEmbedding(rope_dim, config.rope_theta, config.rope_scaling,
                                      config.max_position_embeddings)

    def forward(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor,
                past: Tensor) -> tuple[Tensor, Tensor]:
        b, t = input_ids.shape
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary(position_ids)
        mask = causal_attention_mask(attention_mask, t)
        rows_of = agree_rows(self.dp, b * t)
        news = []
        for i, layer in enumerate(self.layers):
            hidden, new = layer(hidden, cos, sin, mask, past[i], rows_of)
            news.append(new)
        return self.norm(hidden), torch.stack(news)

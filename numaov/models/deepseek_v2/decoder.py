"""The decoder layers and the decoder stack, with the DP exchange around every MLP block."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from numaov.models.deepseek_v2.attention import DeepseekV2Attention, _attention_mask
from numaov.models.deepseek_v2.config import DeepseekV2Config
from numaov.models.deepseek_v2.moe import DeepseekV2MoE
from numaov.models.layers.data_parallel import (
    DataParallelGroup,
    RankRows,
    agree_rows,
    run_on_all_ranks,
)
from numaov.models.layers.mlp import GatedMLP
from numaov.models.layers.norm import RMSNorm
from numaov.models.layers.rope import RotaryEmbedding


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, config: DeepseekV2Config, layer: int, dp: DataParallelGroup | None) -> None:
        super().__init__()
        world = dp.world_size if dp is not None else 1
        self.dp = dp if world > 1 else None
        # 1. attention (replicated: each rank runs it on its own sequences)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DeepseekV2Attention(config)
        # 2. MoE or dense MLP (sharded: every rank runs its part on every rank's rows)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = (
            DeepseekV2MoE(config, world)
            if config.is_moe_layer(layer)
            else GatedMLP(config.hidden_size, config.intermediate_size // world)
        )

    def forward(
        self,
        hidden: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
        past: Tensor,
        rows_of: RankRows | None,
    ) -> tuple[Tensor, Tensor]:
        # 1. attention
        attn, present = self.self_attn(self.input_layernorm(hidden), cos, sin, mask, past)
        hidden = hidden + attn
        # 2. MoE or dense MLP, over the rows of all ranks
        rows = self.post_attention_layernorm(hidden).reshape(-1, hidden.shape[-1])
        return hidden + run_on_all_ranks(self.mlp, rows, self.dp, rows_of).view_as(hidden), present


class DeepseekV2Model(nn.Module):
    def __init__(self, config: DeepseekV2Config, dp: DataParallelGroup | None) -> None:
        super().__init__()
        self.config = config
        self.dp = dp if dp is not None and dp.world_size > 1 else None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV2DecoderLayer(config, i, dp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.qk_rope_head_dim, config.rope_theta,
                                      config.rope_scaling, config.max_position_embeddings)

    def forward(
        self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor, past: Tensor
    ) -> tuple[Tensor, Tensor]:
        b, t = input_ids.shape
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary(position_ids)
        mask = _attention_mask(attention_mask, t)
        rows_of = agree_rows(self.dp, b * t)
        presents = []
        for i, layer in enumerate(self.layers):
            hidden, present = layer(hidden, cos, sin, mask, past[i], rows_of)
            presents.append(present)
        return self.norm(hidden), torch.stack(presents)

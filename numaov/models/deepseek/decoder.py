"""The decoder layers and the decoder stack, with the DP exchange around every MLP block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from numaov.custom_ops import all_gather_into_tensor, reduce_scatter_tensor
from numaov.models.deepseek.attention import DeepseekV2Attention, _attention_mask
from numaov.models.deepseek.config import DeepseekV2Config
from numaov.models.deepseek.mlp import DeepseekV2MLP
from numaov.models.deepseek.moe import DeepseekV2MoE
from numaov.models.deepseek.norm import RMSNorm
from numaov.models.deepseek.rope import RotaryEmbedding
from numaov.models.deepseek.sharding import DataParallelGroup


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
            else DeepseekV2MLP(config.hidden_size, config.intermediate_size // world)
        )

    def forward(
        self,
        hidden: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
        past: Tensor,
        padded_rows: int,
    ) -> tuple[Tensor, Tensor]:
        # 1. attention
        attn, present = self.self_attn(self.input_layernorm(hidden), cos, sin, mask, past)
        hidden = hidden + attn
        # 2. MoE or dense MLP, over the rows of all ranks
        rows = self.post_attention_layernorm(hidden).reshape(-1, hidden.shape[-1])
        return hidden + self._mlp_all_ranks(rows, padded_rows).view_as(hidden), present

    def _mlp_all_ranks(self, rows: Tensor, padded_rows: int) -> Tensor:
        """``rows [n, H]`` of this rank -> the finished MLP output of the same rows."""
        if self.dp is None:
            return self.mlp(rows)
        group, world = self.dp.group, self.dp.world_size
        n = rows.shape[0]
        padded = F.pad(rows, (0, 0, 0, padded_rows - n))  # [M, H]
        everyone = all_gather_into_tensor(padded, group, world)  # [world*M, H], rank-major
        partial = self.mlp(everyone)  # this rank's shard of the sum, for every rank's rows
        mine = reduce_scatter_tensor(partial, group, world)  # [M, H]: summed, rows of this rank
        return mine[:n]


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
        self.rotary = RotaryEmbedding(config)

    def forward(
        self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor, past: Tensor
    ) -> tuple[Tensor, Tensor]:
        b, t = input_ids.shape
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary(position_ids)
        mask = _attention_mask(attention_mask, t)
        padded_rows = self._agree_padded_rows(b * t)
        presents = []
        for i, layer in enumerate(self.layers):
            hidden, present = layer(hidden, cos, sin, mask, past[i], padded_rows)
            presents.append(present)
        return self.norm(hidden), torch.stack(presents)

    def _agree_padded_rows(self, rows: int) -> int:
        """The largest row count of any rank this step (at least 1): the MAX_LEN padding.

        One tiny all-gather per forward, shared by every layer's exchange.
        """
        if self.dp is None:
            return rows
        count = torch.full((1,), rows, dtype=torch.float32)  # exact below 2**24 rows
        counts = all_gather_into_tensor(count, self.dp.group, self.dp.world_size)
        # Integer conversion on the tensor side: while exporting, .item() of an int tensor is
        # a symbolic size the graph computes at run time.
        padded = counts.max().clamp(min=1).to(torch.int64).item()
        torch._check(padded >= 1)  # a size: tells torch.export it is non-negative
        torch._check(padded >= rows)
        return padded

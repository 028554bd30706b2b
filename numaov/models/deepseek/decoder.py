"""The decoder layers and the decoder stack, with the DP exchange around every MLP block."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class RankRows:
    """This step's rows across the DP ranks: ``padded`` rows per rank in the exchange, and
    ``real [total]``: the indices of the rows that are not padding among the gathered ones."""

    padded: int
    real: Tensor


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
        rows_of: RankRows | None,
    ) -> tuple[Tensor, Tensor]:
        # 1. attention
        attn, present = self.self_attn(self.input_layernorm(hidden), cos, sin, mask, past)
        hidden = hidden + attn
        # 2. MoE or dense MLP, over the rows of all ranks
        rows = self.post_attention_layernorm(hidden).reshape(-1, hidden.shape[-1])
        return hidden + self._mlp_all_ranks(rows, rows_of).view_as(hidden), present

    def _mlp_all_ranks(self, rows: Tensor, rows_of: RankRows | None) -> Tensor:
        """``rows [n, H]`` of this rank -> the finished MLP output of the same rows."""
        if self.dp is None or rows_of is None:
            return self.mlp(rows)
        group, world = self.dp.group, self.dp.world_size
        n = rows.shape[0]
        padded = F.pad(rows, (0, 0, 0, rows_of.padded - n))  # [M, H]
        everyone = all_gather_into_tensor(padded, group, world)  # [world*M, H], rank-major
        # Only the real rows go through this rank's shard: a padding row would cost as much as
        # a real one (in the MoE's per-row gather, a copy of top-k experts' weights).
        real = everyone.index_select(0, rows_of.real)  # [total, H]
        partial = torch.zeros_like(everyone).index_copy(0, rows_of.real, self.mlp(real))
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
        rows_of = self._agree_rows(b * t)
        presents = []
        for i, layer in enumerate(self.layers):
            hidden, present = layer(hidden, cos, sin, mask, past[i], rows_of)
            presents.append(present)
        return self.norm(hidden), torch.stack(presents)

    def _agree_rows(self, rows: int) -> RankRows | None:
        """Every rank's row count this step: the padding (the largest count, at least 1: the
        MAX_LEN of the exchange) and where the real rows sit among the gathered ones.

        One tiny all-gather per forward, shared by every layer's exchange.
        """
        if self.dp is None:
            return None
        world = self.dp.world_size
        count = torch.full((1,), rows, dtype=torch.float32)  # exact below 2**24 rows
        counts = all_gather_into_tensor(count, self.dp.group, world)
        # Integer conversion on the tensor side: while exporting, .item() of an int tensor is
        # a symbolic size the graph computes at run time.
        padded = counts.max().clamp(min=1).to(torch.int64).item()
        torch._check(padded >= 1)  # a size: tells torch.export it is non-negative
        torch._check(padded >= rows)
        total = counts.sum().clamp(min=1).to(torch.int64).item()
        torch._check(total >= 1)
        torch._check(total <= world * padded)
        # gathered row r*M + i (rank r's i-th) is real when i < rank r's count
        real = (torch.arange(padded).unsqueeze(0) < counts.to(torch.int64).unsqueeze(1))
        real = real.reshape(-1).to(torch.float32)  # [world*M]
        # the real rows' indices, in any order (each row's MLP output is its own)
        return RankRows(padded, torch.topk(real, total).indices)

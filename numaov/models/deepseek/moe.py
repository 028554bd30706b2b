"""The MoE block: the fp32 router, the routed experts and the shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from numaov.models.deepseek.config import DeepseekV2Config
from numaov.models.deepseek.experts import DeepseekV2Experts
from numaov.models.deepseek.mlp import DeepseekV2MLP


class DeepseekV2Router(nn.Module):
    """Top-k expert choice per row. Kept in fp32 whatever the model dtype, as transformers and
    DeepSeek do: bf16 scores would flip near-tied experts."""

    def __init__(self, config: DeepseekV2Config) -> None:
        super().__init__()
        assert config.n_routed_experts is not None and config.num_experts_per_tok is not None
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.method = config.topk_method
        self.n_group = config.n_group or 1
        self.topk_group = config.topk_group or 1
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x [N, H]`` -> ``(expert ids [N, k] int64, weights [N, k] fp32)``."""
        scores = F.linear(x.float(), self.weight.float()).softmax(dim=-1)
        if self.method == "group_limited_greedy":
            n = scores.shape[0]
            per_group = self.num_experts // self.n_group
            group_best = scores.view(n, self.n_group, per_group).amax(dim=-1)  # [N, G]
            chosen = torch.topk(group_best, self.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_best).scatter(1, chosen, 1.0)
            expert_mask = group_mask.unsqueeze(-1).expand(n, self.n_group, per_group)
            scores = scores.masked_fill(expert_mask.reshape(n, self.num_experts) == 0, 0.0)
        weights, ids = torch.topk(scores, self.top_k, dim=-1)
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            weights = weights * self.routed_scaling_factor
        return ids, weights


class DeepseekV2MoE(nn.Module):
    """Router (replicated), routed experts and shared experts (both sharded by intermediate)."""

    def __init__(self, config: DeepseekV2Config, world_size: int) -> None:
        super().__init__()
        assert config.n_routed_experts is not None
        hidden = config.hidden_size
        self.gate = DeepseekV2Router(config)
        self.experts = DeepseekV2Experts(
            config.n_routed_experts, hidden, config.moe_intermediate_size // world_size
        )
        self.shared_experts = (
            DeepseekV2MLP(hidden, config.shared_intermediate_size // world_size)
            if config.shared_intermediate_size
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        """``x [N, H]`` -> this rank's partial sum ``[N, H]``."""
        ids, weights = self.gate(x)
        out = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

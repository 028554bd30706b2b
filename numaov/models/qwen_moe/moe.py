"""The sparse MoE block: the fp32 softmax router, the routed experts and (Qwen2-MoE) the
shared expert behind its sigmoid gate."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from numaov.models.layers.experts import RoutedExperts
from numaov.models.layers.mlp import GatedMLP
from numaov.models.layers.router import Router
from numaov.models.qwen_moe.config import QwenMoeConfig


def qwen_moe_router(config: QwenMoeConfig) -> Router:
    """Qwen-MoE's router: softmax over all experts, greedy top-k, the chosen weights
    renormalised to sum 1 when ``norm_topk_prob`` (at top-k 1 too, as transformers), never
    scaled."""
    return Router(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                  score_function="softmax", selection="greedy",
                  norm_topk_prob=config.norm_topk_prob, routed_scaling_factor=1.0)


class QwenMoeSparseBlock(nn.Module):
    """Router (replicated), routed experts and shared expert (both sharded by intermediate);
    the shared expert's gate is replicated, so each rank scales its own partial sum by it."""

    def __init__(self, config: QwenMoeConfig, world_size: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.gate = qwen_moe_router(config)
        self.experts = RoutedExperts(config.num_experts, hidden,
                                     config.moe_intermediate_size // world_size)
        if config.shared_expert_size:
            self.shared_expert: GatedMLP | None = GatedMLP(
                hidden, config.shared_expert_size // world_size)
            self.shared_expert_gate: nn.Linear | None = nn.Linear(hidden, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: Tensor) -> Tensor:
        """``x [N, H]`` -> this rank's partial sum ``[N, H]``."""
        ids, weights = self.gate(x)
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

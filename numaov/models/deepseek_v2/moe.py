"""The MoE block: the fp32 router, the routed experts and the shared experts."""

from __future__ import annotations

from torch import Tensor, nn

from numaov.models.deepseek_v2.config import DeepseekV2Config
from numaov.models.layers.experts import RoutedExperts
from numaov.models.layers.mlp import GatedMLP
from numaov.models.layers.router import Router


def deepseek_v2_router(config: DeepseekV2Config) -> Router:
    """DeepSeek-V2's router: softmax scores, greedy or group-limited (best expert per group)
    top-k, renormalised (``norm_topk_prob``) or scaled by ``routed_scaling_factor``."""
    assert config.n_routed_experts is not None and config.num_experts_per_tok is not None
    return Router(
        config.hidden_size, config.n_routed_experts, config.num_experts_per_tok,
        score_function="softmax", selection=config.topk_method,
        n_group=config.n_group or 1, topk_group=config.topk_group or 1,
        norm_topk_prob=config.norm_topk_prob,
        routed_scaling_factor=config.routed_scaling_factor,
    )


class DeepseekV2MoE(nn.Module):
    """Router (replicated), routed experts and shared experts (both sharded by intermediate)."""

    def __init__(self, config: DeepseekV2Config, world_size: int) -> None:
        super().__init__()
        assert config.n_routed_experts is not None
        hidden = config.hidden_size
        self.gate = deepseek_v2_router(config)
        self.experts = RoutedExperts(
            config.n_routed_experts, hidden, config.moe_intermediate_size // world_size
        )
        self.shared_experts = (
            GatedMLP(hidden, config.shared_intermediate_size // world_size)
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

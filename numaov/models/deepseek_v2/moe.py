"""The MoE block: DeepSeek-V2's fp32 router, the routed experts and the shared experts."""

from __future__ import annotations

from numaov.models.deepseek_v2.config import DeepseekV2Config
from numaov.models.layers.moe import SharedExpertsMoE
from numaov.models.layers.router import Router


def deepseek_v2_router(config: DeepseekV2Config) -> Router:
    """DeepSeek-V2's router: softmax scores, greedy or group-limited (best expert per group)
    top-k, scaled by ``routed_scaling_factor``. ``norm_topk_prob`` is not read, as in
    transformers' ``deepseek_v2`` (DeepSeek's own V2 code renormalised instead when it was set
    and k > 1; every published V2 checkpoint sets it False)."""
    assert config.n_routed_experts is not None and config.num_experts_per_tok is not None
    return Router(
        config.hidden_size, config.n_routed_experts, config.num_experts_per_tok,
        score_function="softmax", selection=config.topk_method,
        n_group=config.n_group or 1, topk_group=config.topk_group or 1,
        routed_scaling_factor=config.routed_scaling_factor,
    )


class DeepseekV2MoE(SharedExpertsMoE):
    """DeepSeek-V2's router, routed experts and shared experts, as one rank of
    ``world_size`` holds them."""

    def __init__(self, config: DeepseekV2Config, world_size: int) -> None:
        super().__init__(deepseek_v2_router(config), config.hidden_size,
                         config.moe_intermediate_size // world_size,
                         config.shared_intermediate_size // world_size)

"""Which of DeepSeek-V3's dims DP splits (the split itself: ``layers.sharding``): the
intermediate dim of the dense MLPs, the shared experts and every routed expert."""

from __future__ import annotations

from numaov.models.deepseek_v3.config import DeepseekV3Config
from numaov.models.layers.sharding import ShardedDim, check_dims_divide, mlp_dims


def sharded_dims(config: DeepseekV3Config) -> list[ShardedDim]:
    moe_layers = [config.is_moe_layer(i) for i in range(config.num_hidden_layers)]
    return mlp_dims(config, moe_layers, ("n_shared_experts * moe_intermediate_size",
                                         config.shared_intermediate_size, "shared experts"))


def check_dp_divides(config: DeepseekV3Config, world_size: int) -> None:
    """Raise ShardError unless ``world_size`` divides every dim the MLPs are sharded along."""
    check_dims_divide(sharded_dims(config), world_size)

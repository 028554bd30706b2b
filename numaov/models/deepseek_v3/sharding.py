"""Which of DeepSeek-V3's dims DP splits (the split itself: ``layers.sharding``): the
intermediate dim of the dense MLPs, the shared experts and every routed expert."""

from __future__ import annotations

from numaov.models.deepseek_v3.config import DeepseekV3Config
from numaov.models.layers.sharding import ShardedDim, check_dims_divide


def sharded_dims(config: DeepseekV3Config) -> list[ShardedDim]:
    dims: list[ShardedDim] = []
    if any(not config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
        dims.append(("intermediate_size", config.intermediate_size, "dense MLP layers"))
    dims.append(("moe_intermediate_size", config.moe_intermediate_size, "routed experts"))
    if config.shared_intermediate_size:
        dims.append(("n_shared_experts * moe_intermediate_size",
                     config.shared_intermediate_size, "shared experts"))
    return dims


def check_dp_divides(config: DeepseekV3Config, world_size: int) -> None:
    """Raise ShardError unless ``world_size`` divides every dim the MLPs are sharded along."""
    check_dims_divide(sharded_dims(config), world_size)

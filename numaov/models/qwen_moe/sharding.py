"""Which of Qwen-MoE's dims DP splits (the split itself: ``layers.sharding``; the DP group:
``layers.data_parallel``).

Weights are split along the intermediate dim of the dense MLPs, the shared expert and every
routed expert, not by expert (as DeepSeek-V2: every rank does ``1/dp`` of every token's work
whatever the router picks, and the graph has no data-dependent dispatch); attention, the
router and the shared expert's gate are replicated.
"""

from __future__ import annotations

from numaov.models.layers.sharding import ShardedDim, check_dims_divide, mlp_dims
from numaov.models.qwen_moe.config import QwenMoeConfig


def _sharded_dims(config: QwenMoeConfig) -> list[ShardedDim]:
    """(config key, size, what is split along it) for every dim DP shards."""
    moe_layers = [config.is_moe_layer(i) for i in range(config.num_hidden_layers)]
    return mlp_dims(config, moe_layers, ("shared_expert_intermediate_size",
                                         config.shared_expert_size, "shared expert"))


def check_dp_divides(config: QwenMoeConfig, world_size: int) -> None:
    """Raise ShardError unless ``world_size`` divides every dim the MLPs are sharded along."""
    check_dims_divide(_sharded_dims(config), world_size)

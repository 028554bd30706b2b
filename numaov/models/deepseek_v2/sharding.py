"""How DeepSeek's weights are split across DP ranks (the DP group itself: ``layers.data_parallel``).

Weights are split along the intermediate dim of the dense MLPs, the shared experts and every
routed expert, not by expert (the package docstring says why), and ``lm_head`` by vocabulary
rows (``layers.sharding``); the router and the rest outside the MLP blocks are replicated.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from torch import Tensor

from numaov.models.deepseek_v2.config import DeepseekV2Config
from numaov.models.layers.data_parallel import ShardError
from numaov.models.layers.sharding import check_dims_divide, mlp_dims
from numaov.models.layers.sharding import shard_tensor as shard_tensor


def _sharded_dims(config: DeepseekV2Config) -> list[tuple[str, int, str]]:
    """(config key, size, what is split along it) for every dim DP shards."""
    moe_layers = [config.is_moe_layer(i) for i in range(config.num_hidden_layers)]
    return mlp_dims(config, moe_layers, ("n_shared_experts * moe_intermediate_size",
                                         config.shared_intermediate_size, "shared experts"))


def check_dp_divides(config: DeepseekV2Config, world_size: int) -> None:
    """Raise ShardError unless ``world_size`` divides every dim the MLPs are sharded along."""
    check_dims_divide(_sharded_dims(config), world_size)


def shard_state_dict(
    state_dict: Mapping[str, Tensor], config: DeepseekV2Config, rank: int, world_size: int,
    presharded: Collection[str] = (),
) -> dict[str, Tensor]:
    """Rank ``rank``'s weights out of a full (model-layout) state dict (:func:`shard_tensor`
    per tensor): intermediate-dim slices of the dense MLPs, shared experts and routed experts;
    everything else is shared by reference. Tensors named in ``presharded`` already hold this
    rank's slice and pass through.
    """
    check_dp_divides(config, world_size)
    if not 0 <= rank < world_size:
        raise ShardError(f"rank {rank} is outside 0 .. {world_size - 1}")
    return {
        name: tensor if name in presharded else shard_tensor(name, tensor, rank, world_size)
        for name, tensor in state_dict.items()
    }

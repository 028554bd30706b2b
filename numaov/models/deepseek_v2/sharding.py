"""How DeepSeek's weights are split across DP ranks (the DP group itself: ``layers.data_parallel``).

Weights are split along the intermediate dim of the dense MLPs, the shared experts and every
routed expert, not by expert (the package docstring says why); the router and everything
outside the MLP blocks are replicated.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping

from torch import Tensor

from numaov.models.deepseek_v2.config import DeepseekV2Config
from numaov.models.layers.data_parallel import ShardError


def _sharded_dims(config: DeepseekV2Config) -> list[tuple[str, int, str]]:
    """(config key, size, what is split along it) for every dim DP shards."""
    dims = []
    if any(not config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
        dims.append(("intermediate_size", config.intermediate_size, "dense MLP layers"))
    if config.n_routed_experts is not None:
        dims.append(("moe_intermediate_size", config.moe_intermediate_size, "routed experts"))
        if config.shared_intermediate_size:
            dims.append(("n_shared_experts * moe_intermediate_size",
                         config.shared_intermediate_size, "shared experts"))
    return dims


def check_dp_divides(config: DeepseekV2Config, world_size: int) -> None:
    """Raise ShardError unless ``world_size`` divides every dim the MLPs are sharded along."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ShardError(f"dp is {world_size!r}; expected a positive integer",
                         parameter="dp")
    dims = _sharded_dims(config)
    bad = [(key, size, role) for key, size, role in dims if size % world_size]
    if bad:
        common = math.gcd(*(size for _, size, _ in dims))
        valid = [d for d in range(1, common + 1) if common % d == 0]
        listed = ", ".join(f"{key}={size} ({role})" for key, size, role in bad)
        raise ShardError(
            f"dp={world_size} does not divide {listed}: the MLP and expert weights are split "
            f"along these dims; expected a dp that divides all of them "
            f"(possible: {', '.join(map(str, valid[:16]))}{' ...' if len(valid) > 16 else ''})",
            parameter="dp",
        )


# Which tensors are split and along which dim (all others are replicated). gate_up_proj
# stacks [gate; up] along dim 1, so each half is split separately (see shard_state_dict).
_SHARD_RULES: tuple[tuple[re.Pattern[str], int], ...] = (
    (re.compile(r"\.mlp\.(shared_experts\.)?(gate_proj|up_proj)\.weight$"), 0),
    (re.compile(r"\.mlp\.(shared_experts\.)?down_proj\.weight$"), 1),
    (re.compile(r"\.mlp\.experts\.down_proj$"), 2),
)
_GATE_UP = re.compile(r"\.mlp\.experts\.gate_up_proj$")


def shard_tensor(name: str, tensor: Tensor, rank: int, world_size: int) -> Tensor:
    """Rank ``rank``'s slice of the model-layout tensor ``name`` (a copy, so the full one can
    be freed), or ``tensor`` itself when it is replicated."""
    if _GATE_UP.search(name):
        e, two_i, h = tensor.shape
        halves = tensor.view(e, 2, two_i // 2, h)
        step = two_i // 2 // world_size
        return halves[:, :, rank * step:(rank + 1) * step].reshape(e, 2 * step, h).clone()
    for pattern, dim in _SHARD_RULES:
        if pattern.search(name):
            step = tensor.shape[dim] // world_size
            return tensor.narrow(dim, rank * step, step).clone()
    return tensor


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

"""How the MLP blocks' weights are split across DP ranks, for every family whose MLP tensors
have Hugging Face's names (``mlp.gate_proj`` / ``up_proj`` / ``down_proj``; the shared experts
``mlp.shared_experts.*`` of DeepSeek or the one ``mlp.shared_expert.*`` of Qwen2-MoE; the
expert stacks ``mlp.experts.gate_up_proj`` / ``down_proj``).

Weights are split along the intermediate dim of the dense MLPs, the shared experts and every
routed expert, not by expert: every rank then does ``1/dp`` of every token's work whatever the
router picks, and the shapes stay data-independent. ``lm_head`` is split by vocabulary rows
(:func:`head_rows`: zero rows pad a vocabulary ``dp`` does not divide, so it needs no check).
The router, Qwen2-MoE's ``mlp.shared_expert_gate``, attention, the norms and the embedding are
replicated. A family says which MLP dims its layers split (:func:`check_dims_divide`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from numaov.models.layers.data_parallel import ShardError

#: (config key, size, what is split along it)
ShardedDim = tuple[str, int, str]


def mlp_dims(config: Any, moe_layers: Sequence[bool],
             shared: ShardedDim | None = None) -> list[ShardedDim]:
    """The dims DP splits in a decoder of dense MLP layers (``intermediate_size``) and MoE
    layers (``moe_intermediate_size``, and the shared experts' ``shared`` dim when they have
    one), given which layers are MoE layers."""
    dims: list[ShardedDim] = []
    if not all(moe_layers):
        dims.append(("intermediate_size", config.intermediate_size, "dense MLP layers"))
    if any(moe_layers):
        dims.append(("moe_intermediate_size", config.moe_intermediate_size, "routed experts"))
        if shared is not None and shared[1]:
            dims.append(shared)
    return dims


def check_dims_divide(dims: Sequence[ShardedDim], world_size: int) -> None:
    """Raise ShardError unless ``world_size`` divides every one of ``dims``."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ShardError(f"dp is {world_size!r}; expected a positive integer",
                         parameter="dp")
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


# Which tensors are split and along which dim (all others are replicated, the shared expert's
# gate ``mlp.shared_expert_gate.weight`` too). ``shared_experts?``: DeepSeek's plural, Qwen's
# singular. gate_up_proj stacks [gate; up] along dim 1, so each half is split separately (see
# shard_tensor).
_SHARD_RULES: tuple[tuple[re.Pattern[str], int], ...] = (
    (re.compile(r"\.mlp\.(shared_experts?\.)?(gate_proj|up_proj)\.weight$"), 0),
    (re.compile(r"\.mlp\.(shared_experts?\.)?down_proj\.weight$"), 1),
    (re.compile(r"\.mlp\.experts\.down_proj$"), 2),
)
_GATE_UP = re.compile(r"\.mlp\.experts\.gate_up_proj$")
HEAD = "lm_head.weight"


def head_rows(vocab_size: int, world_size: int) -> int:
    """The vocabulary rows of ``lm_head`` each of ``world_size`` ranks holds: the vocabulary
    split evenly, rounded up (the last rank's slice ends in zero rows, whose logits are cut)."""
    return -(-vocab_size // world_size)


def head_slice(vocab_size: int, rank: int, world_size: int) -> slice:
    """The rows of the whole head that are rank ``rank``'s (fewer than :func:`head_rows` for
    the last rank of a vocabulary ``world_size`` does not divide)."""
    rows = head_rows(vocab_size, world_size)
    return slice(min(rank * rows, vocab_size), min((rank + 1) * rows, vocab_size))


def padded_head(mine: Tensor, vocab_size: int, world_size: int) -> Tensor:
    """A rank's rows of the head (:func:`head_slice`) padded with zero rows to
    :func:`head_rows`."""
    missing = head_rows(vocab_size, world_size) - len(mine)
    return torch.cat((mine, mine.new_zeros(missing, *mine.shape[1:])))


def shard_tensor(name: str, tensor: Tensor, rank: int, world_size: int) -> Tensor:
    """Rank ``rank``'s slice of the model-layout tensor ``name`` (a copy, so the full one can
    be freed), or ``tensor`` itself when it is replicated."""
    if name == HEAD:
        vocab = tensor.shape[0]
        return padded_head(tensor[head_slice(vocab, rank, world_size)], vocab, world_size)
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

"""Checkpoints with one tensor per routed expert, to and from expert stacks.

On disk, DeepSeek's checkpoints and those transformers' ``save_pretrained`` writes
(Qwen-MoE) keep one tensor per expert (``model.layers.{l}.mlp.experts.{e}.gate_proj.weight``
...); the models hold the experts as stacks (``mlp.experts.gate_up_proj [E, 2I, H]``, gate
rows first, and ``mlp.experts.down_proj [E, H, I]``), as transformers does in memory, because
a stack can be indexed by the router's choice inside one graph. Both layouts are read; a family hands in its model's tensor shapes,
which layers are MoE layers and its sizes, and gets the model-layout state dict, checked.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping
from typing import Protocol

import torch
from torch import Tensor

from numaov.models.checkpoint import check_state_dict
from numaov.models.layers.sharding import HEAD, head_slice, padded_head, shard_tensor

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

STACK = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
PER_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.")


class TensorSource(Protocol):
    """What is read from a checkpoint: ``checkpoint.SafetensorsCheckpoint`` or a view of it
    (``checkpoint.BlockFp8Checkpoint``)."""

    def shapes(self) -> dict[str, tuple[int, ...]]: ...

    def read(self, name: str, rows: slice | None = None) -> Tensor: ...

    def __getitem__(self, name: str) -> Tensor: ...

    def __contains__(self, name: object) -> bool: ...


def checkpoint_shapes(model_shapes: Mapping[str, tuple[int, ...]], per_expert: bool,
                      tie_word_embeddings: bool) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a full checkpoint of a model whose (unsharded) state dict
    has ``model_shapes``, in the per-expert or the stacked layout."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in model_shapes.items():
        match = STACK.match(name)
        if match is None or not per_expert:
            shapes[name] = tuple(shape)
            continue
        prefix, kind = match.groups()
        e, rows, cols = shape
        for i in range(e):
            if kind == "gate_up_proj":
                shapes[f"{prefix}.{i}.gate_proj.weight"] = (rows // 2, cols)
                shapes[f"{prefix}.{i}.up_proj.weight"] = (rows // 2, cols)
            else:
                shapes[f"{prefix}.{i}.down_proj.weight"] = (rows, cols)
    if tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def checkpoint_to_stacked(
    checkpoint: TensorSource, model_shapes: Mapping[str, tuple[int, ...]], *,
    moe_layers: Iterable[int], num_experts: int, moe_intermediate_size: int,
    tie_word_embeddings: bool, what: str, shard: tuple[int, int] | None = None,
    ignore: Collection[str] = (), read_experts: bool = True,
) -> dict[str, Tensor]:
    """A full checkpoint's tensors (per-expert layout, or the stacked one) in the model's
    layout, after checking every name and shape against ``model_shapes``; with
    ``shard=(rank, world_size)``, only that rank's slices (as :func:`shard_tensor`; the caller
    has checked that ``world_size`` divides the sharded dims). Tensors named in ``ignore`` are
    neither checked nor read; with ``read_experts`` False the routed experts are checked but
    not read (a model whose experts live in an expert store).

    Tensors are read one at a time and converted as they are read, so the result is the only
    copy of the weights: a per-expert tensor's rows are read straight into its place in the
    expert stack (a rank reads only its own rows, as it does of the head), and a tensor to
    shard is sliced and let go before the next is read.

    Raises CheckpointError naming the missing, unexpected and mis-shaped tensors.
    """
    shapes = {name: shape for name, shape in checkpoint.shapes().items() if name not in ignore}
    per_expert = not any(STACK.match(name) for name in shapes)
    if tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # tied: the embedding is the head
    expected = checkpoint_shapes(model_shapes, per_expert, tie_word_embeddings)
    # A module of width zero (transformers' shared experts at n_shared_experts 0) is saved as
    # empty tensors; the model leaves it out, and an empty tensor holds no weights to lose.
    shapes = {name: shape for name, shape in shapes.items()
              if name in expected or math.prod(shape) != 0}
    check_state_dict(expected, shapes, what)
    rank, world = shard if shard is not None else (0, 1)
    state: dict[str, Tensor] = {}
    if per_expert and read_experts:
        for layer in moe_layers:
            state.update(read_expert_stacks(checkpoint, f"model.layers.{layer}.mlp.experts",
                                            num_experts, moe_intermediate_size, rank, world))
    for name in shapes:
        if name in state or PER_EXPERT.match(name) or (not read_experts and STACK.match(name)):
            continue
        if name == HEAD and world > 1:  # only this rank's vocabulary rows are read
            vocab = shapes[name][0]
            state[name] = padded_head(checkpoint.read(name, head_slice(vocab, rank, world)),
                                      vocab, world)
            continue
        tensor = checkpoint[name]
        state[name] = shard_tensor(name, tensor, rank, world) if world > 1 else tensor
        del tensor  # the full tensor goes before the next one is read
    if tie_word_embeddings:  # the table itself, or this rank's vocabulary slice of it
        embedding = state["model.embed_tokens.weight"]
        state[HEAD] = shard_tensor(HEAD, embedding, rank, world) if world > 1 else embedding
    return state


def read_expert_stacks(
    checkpoint: TensorSource, prefix: str, experts: int, intermediate: int, rank: int,
    world: int,
) -> dict[str, Tensor]:
    """One MoE layer's per-expert tensors (``prefix.{e}.*``) as this rank's ``gate_up_proj
    [E, 2I, H]`` and ``down_proj [E, H, I]`` stacks, each expert's rows read into place."""
    gate_up = down = None
    for e in range(experts):
        expert_gate_up, expert_down = read_expert(checkpoint, prefix, e, intermediate, rank,
                                                  world)
        if gate_up is None:
            gate_up = torch.empty(experts, *expert_gate_up.shape, dtype=expert_gate_up.dtype)
            down = torch.empty(experts, *expert_down.shape, dtype=expert_down.dtype)
        gate_up[e] = expert_gate_up
        down[e] = expert_down
    assert gate_up is not None and down is not None  # an MoE layer has experts
    return {f"{prefix}.gate_up_proj": gate_up, f"{prefix}.down_proj": down}


def read_expert(checkpoint: TensorSource, prefix: str, expert: int, intermediate: int,
                rank: int, world: int) -> tuple[Tensor, Tensor]:
    """Expert ``expert`` of the MoE layer ``prefix`` (``model.layers.{l}.mlp.experts``) as
    rank ``rank``'s ``gate_up [2I/world, H]`` (its gate rows, then its up rows) and ``down
    [H, I/world]``, read from either checkpoint layout (one tensor per expert, or the stacks);
    only the rank's rows of gate and up are read."""
    step = intermediate // world
    rows = slice(rank * step, (rank + 1) * step)
    if f"{prefix}.gate_up_proj" in checkpoint:
        stack = checkpoint.read(f"{prefix}.gate_up_proj", slice(expert, expert + 1))[0]
        gate_up = torch.cat([stack[:intermediate][rows], stack[intermediate:][rows]])
        down = checkpoint.read(f"{prefix}.down_proj", slice(expert, expert + 1))[0]
        return gate_up, down[:, rows].contiguous()
    gate = checkpoint.read(f"{prefix}.{expert}.gate_proj.weight", rows)
    up = checkpoint.read(f"{prefix}.{expert}.up_proj.weight", rows)
    # down_proj [H, I] is split along its columns: read whole, one expert at a time
    down = checkpoint[f"{prefix}.{expert}.down_proj.weight"][:, rows].contiguous()
    return torch.cat([gate, up]), down


def split_expert(gate_up: Tensor, down: Tensor, intermediate: int, rank: int, world: int
                 ) -> tuple[Tensor, Tensor]:
    """Rank ``rank``'s share of a whole expert (``gate_up [2I, H]``: gate rows then up rows;
    ``down [H, I]``), as :func:`read_expert` reads it for that rank."""
    step = intermediate // world
    rows = slice(rank * step, (rank + 1) * step)
    return (torch.cat([gate_up[:intermediate][rows], gate_up[intermediate:][rows]]),
            down[:, rows].contiguous())


def stacked_to_per_expert(state_dict: Mapping[str, Tensor],
                          tie_word_embeddings: bool) -> dict[str, Tensor]:
    """The inverse of :func:`checkpoint_to_stacked`: the per-expert layout (what DeepSeek
    publishes and transformers' ``save_pretrained`` writes), contiguous tensors ready for
    safetensors."""
    out: dict[str, Tensor] = {}
    for name, tensor in state_dict.items():
        match = STACK.match(name)
        if match is None:
            out[name] = tensor.contiguous()
            continue
        prefix, kind = match.groups()
        if kind == "gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = gate[e].contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = up[e].contiguous()
        else:
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e].contiguous()
    if tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out

"""DeepSeek's checkpoint layout (one tensor per expert) to and from the model's (expert stacks,
see the package docstring), checked against the config; the file names of a checkpoint."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import Tensor

from numaov.models.checkpoint import SafetensorsCheckpoint, check_state_dict
from numaov.models.deepseek_v2.config import DeepseekV2Config
from numaov.models.deepseek_v2.sharding import check_dp_divides, shard_tensor

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

_STACK = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def _checkpoint_shapes(config: DeepseekV2Config, per_expert: bool) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a full checkpoint, per-expert or stacked layout."""
    # The model is the one source of its tensor names; it is imported here because its
    # from_pretrained / save_pretrained convert through this module.
    from numaov.models.deepseek_v2.causal_lm import DeepseekV2

    with torch.device("meta"):
        model = DeepseekV2(config)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in model.state_dict().items():
        match = _STACK.match(name)
        if match is None or not per_expert:
            shapes[name] = tuple(tensor.shape)
            continue
        prefix, kind = match.groups()
        e, rows, cols = tensor.shape
        for i in range(e):
            if kind == "gate_up_proj":
                shapes[f"{prefix}.{i}.gate_proj.weight"] = (rows // 2, cols)
                shapes[f"{prefix}.{i}.up_proj.weight"] = (rows // 2, cols)
            else:
                shapes[f"{prefix}.{i}.down_proj.weight"] = (rows, cols)
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def checkpoint_to_model_state_dict(
    checkpoint: SafetensorsCheckpoint, config: DeepseekV2Config, what: str = "checkpoint",
    shard: tuple[int, int] | None = None,
) -> dict[str, Tensor]:
    """A full checkpoint's tensors (per-expert DeepSeek layout, or transformers' stacked one)
    in the model's layout, after checking every name and shape against ``config``; with
    ``shard=(rank, world_size)``, only that rank's slices (as :func:`shard_tensor`).

    Tensors are read one at a time and converted as they are read, so the result is the only
    copy of the weights: a per-expert tensor's rows are read straight into its place in the
    expert stack (a rank reads only its own rows), and a tensor to shard is sliced and let go
    before the next is read.

    Raises CheckpointError naming the missing, unexpected and mis-shaped tensors.
    """
    shapes = checkpoint.shapes()
    per_expert = not any(_STACK.match(name) for name in shapes)
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # tied: the embedding is the head
    check_state_dict(_checkpoint_shapes(config, per_expert), shapes, what)
    rank, world = shard if shard is not None else (0, 1)
    check_dp_divides(config, world)
    state: dict[str, Tensor] = {}
    if per_expert:
        for layer in range(config.num_hidden_layers):
            if config.is_moe_layer(layer):
                state.update(_read_expert_stacks(checkpoint, config, layer, rank, world))
    for name in shapes:
        if name in state or _PER_EXPERT.match(name):
            continue
        tensor = checkpoint[name]
        state[name] = shard_tensor(name, tensor, rank, world) if world > 1 else tensor
        del tensor  # the full tensor goes before the next one is read
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


_PER_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.")


def _read_expert_stacks(
    checkpoint: SafetensorsCheckpoint, config: DeepseekV2Config, layer: int, rank: int,
    world: int,
) -> dict[str, Tensor]:
    """One MoE layer's per-expert tensors as this rank's ``gate_up_proj [E, 2I, H]`` and
    ``down_proj [E, H, I]`` stacks, each expert's rows read into place from the file."""
    prefix = f"model.layers.{layer}.mlp.experts"
    experts = int(config.n_routed_experts or 0)
    step = int(config.moe_intermediate_size) // world
    rows = slice(rank * step, (rank + 1) * step)
    gate_up = down = None
    for e in range(experts):
        gate = checkpoint.read(f"{prefix}.{e}.gate_proj.weight", rows)
        if gate_up is None:
            gate_up = torch.empty(experts, 2 * step, gate.shape[1], dtype=gate.dtype)
        gate_up[e, :step] = gate
        gate_up[e, step:] = checkpoint.read(f"{prefix}.{e}.up_proj.weight", rows)
        # down_proj [H, I] is split along its columns: read whole, one expert at a time
        part = checkpoint[f"{prefix}.{e}.down_proj.weight"][:, rows]
        if down is None:
            down = torch.empty(experts, part.shape[0], step, dtype=part.dtype)
        down[e] = part
    assert gate_up is not None and down is not None  # an MoE layer has experts
    return {f"{prefix}.gate_up_proj": gate_up, f"{prefix}.down_proj": down}


def model_to_checkpoint_state_dict(
    state_dict: Mapping[str, Tensor], config: DeepseekV2Config
) -> dict[str, Tensor]:
    """The inverse of :func:`checkpoint_to_model_state_dict`: DeepSeek's per-expert layout
    (what transformers' ``save_pretrained`` writes), contiguous tensors ready for safetensors."""
    out: dict[str, Tensor] = {}
    for name, tensor in state_dict.items():
        match = _STACK.match(name)
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
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out

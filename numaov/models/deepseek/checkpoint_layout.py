"""DeepSeek's checkpoint layout (one tensor per expert) to and from the model's (expert stacks,
see the package docstring), checked against the config; the file names of a checkpoint."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import Tensor

from numaov.models.checkpoint import check_state_dict
from numaov.models.deepseek.config import DeepseekV2Config
from numaov.models.deepseek.sharding import check_dp_divides, shard_state_dict

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

_STACK = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def _checkpoint_shapes(config: DeepseekV2Config, per_expert: bool) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a full checkpoint, per-expert or stacked layout."""
    # The model is the one source of its tensor names; it is imported here because its
    # from_pretrained / save_pretrained convert through this module.
    from numaov.models.deepseek.causal_lm import DeepseekV2

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
    state_dict: Mapping[str, Tensor], config: DeepseekV2Config, what: str = "checkpoint",
    shard: tuple[int, int] | None = None,
) -> dict[str, Tensor]:
    """A full checkpoint's tensors (per-expert DeepSeek layout, or transformers' stacked one)
    in the model's layout, after checking every name and shape against ``config``; with
    ``shard=(rank, world_size)``, only that rank's slices (as :func:`shard_state_dict`).

    Sharding here rather than after matters for memory: the per-expert tensors are stacked
    from slices of the (memory-mapped) checkpoint, so only the rank's share of the experts is
    ever copied, not every expert of every layer.

    Raises CheckpointError naming the missing, unexpected and mis-shaped tensors.
    """
    per_expert = not any(_STACK.match(name) for name in state_dict)
    state = dict(state_dict)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: the embedding is the head
    check_state_dict(_checkpoint_shapes(config, per_expert), state, what)
    if shard is not None:
        check_dp_divides(config, shard[1])
    presharded = []
    if per_expert:
        rows = slice(None)
        if shard is not None:
            step = int(config.moe_intermediate_size) // shard[1]
            rows = slice(shard[0] * step, (shard[0] + 1) * step)
        for layer in range(config.num_hidden_layers):
            if not config.is_moe_layer(layer):
                continue
            prefix = f"model.layers.{layer}.mlp.experts"
            experts = range(config.n_routed_experts or 0)
            gate = [state.pop(f"{prefix}.{e}.gate_proj.weight")[rows] for e in experts]
            up = [state.pop(f"{prefix}.{e}.up_proj.weight")[rows] for e in experts]
            down = [state.pop(f"{prefix}.{e}.down_proj.weight")[:, rows] for e in experts]
            state[f"{prefix}.gate_up_proj"] = torch.cat((torch.stack(gate), torch.stack(up)), 1)
            state[f"{prefix}.down_proj"] = torch.stack(down)
            presharded += [f"{prefix}.gate_up_proj", f"{prefix}.down_proj"]
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    if shard is not None:
        state = shard_state_dict(state, config, shard[0], shard[1],
                                 presharded if shard[1] > 1 else ())
    return state


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

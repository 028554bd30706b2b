"""Qwen-MoE's checkpoint layout (one tensor per expert, what transformers' ``save_pretrained``
writes) to and from the model's (expert stacks ``gate_up_proj [E, 2I, H]``, ``down_proj
[E, H, I]``), checked against the config; the file names of a checkpoint. The conversion
itself is the shared :mod:`numaov.models.layers.expert_layout`."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from numaov.models.checkpoint import SafetensorsCheckpoint
from numaov.models.layers.expert_layout import WEIGHTS_INDEX_NAME as WEIGHTS_INDEX_NAME
from numaov.models.layers.expert_layout import WEIGHTS_NAME as WEIGHTS_NAME
from numaov.models.layers.expert_layout import stacked_to_per_expert
from numaov.models.qwen_moe.config import QwenMoeConfig


def checkpoint_to_model_state_dict(
    checkpoint: SafetensorsCheckpoint, config: QwenMoeConfig, what: str = "checkpoint",
    shard: tuple[int, int] | None = None, read_experts: bool = True,
) -> dict[str, Tensor]:
    """A full checkpoint's tensors (per-expert layout, or transformers' stacked one) in the
    model's layout, after checking every name and shape against ``config``; with
    ``shard=(rank, world_size)``, only that rank's slices (``layers.sharding.shard_tensor``).

    Raises CheckpointError naming the missing, unexpected and mis-shaped tensors.
    """
    # The model is the one source of its tensor names; imported here because its
    # from_pretrained converts through this module.
    from numaov.models.qwen_moe.causal_lm import QwenMoe

    return QwenMoe.stacked_state(checkpoint, config, what, shard,
                                 num_experts=config.num_experts, read_experts=read_experts)


def model_to_checkpoint_state_dict(
    state_dict: Mapping[str, Tensor], config: QwenMoeConfig
) -> dict[str, Tensor]:
    """The inverse of :func:`checkpoint_to_model_state_dict`: the per-expert layout (what
    transformers' ``save_pretrained`` writes), contiguous tensors ready for safetensors."""
    return stacked_to_per_expert(state_dict, config.tie_word_embeddings)

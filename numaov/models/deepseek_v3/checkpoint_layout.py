"""A DeepSeek-V3 checkpoint as the model's state dict: the shared per-expert <-> stack
conversion (:mod:`numaov.models.layers.expert_layout`), plus what V3 checkpoints add: the
multi-token-prediction layers (skipped), the router's ``e_score_correction_bias`` (required)
and released FP8 weights (dequantized block by block as they are read)."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

import torch
from torch import Tensor

from numaov.models.checkpoint import BlockFp8Checkpoint, CheckpointError, SafetensorsCheckpoint
from numaov.models.deepseek_v3.config import DeepseekV3Config
from numaov.models.deepseek_v3.sharding import check_dp_divides
from numaov.models.layers.expert_layout import (
    TensorSource,
    stacked_to_per_expert,
)

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def multi_token_prediction_names(names: list[str], config: DeepseekV3Config) -> list[str]:
    """The tensors of the multi-token-prediction layers (``model.layers.{L}..`` to
    ``model.layers.{L + num_nextn_predict_layers - 1}..``, ``L = num_hidden_layers``): a
    training aid (and a draft model for speculative decoding) numaov does not run."""
    first = config.num_hidden_layers
    last = first + config.num_nextn_predict_layers
    return [n for n in names if (m := _LAYER.match(n)) and first <= int(m.group(1)) < last]


def checkpoint_to_model_state_dict(
    checkpoint: SafetensorsCheckpoint, config: DeepseekV3Config, dtype: torch.dtype,
    what: str = "checkpoint", shard: tuple[int, int] | None = None,
    read_experts: bool = True,
) -> dict[str, Tensor]:
    """The checkpoint's tensors in the model's layout (this rank's slices with ``shard``):
    FP8 weights dequantized to ``dtype`` as they are read (``config.fp8``), the
    multi-token-prediction layers skipped with a log line. Raises CheckpointError naming a
    missing ``e_score_correction_bias``, and every missing, unexpected and mis-shaped tensor."""
    world = shard[1] if shard is not None else 1
    check_dp_divides(config, world)
    source: TensorSource = checkpoint
    if config.fp8 is not None:
        source = BlockFp8Checkpoint(checkpoint, config.fp8.block, dtype, what)
        logger.info("%s: %d float8 weights dequantized to %s in %dx%d blocks as they are read",
                    what, len(source.quantized), str(dtype).removeprefix("torch."),
                    *config.fp8.block)
    names = list(source.shapes())
    skipped = multi_token_prediction_names(names, config)
    if skipped:
        logger.info("%s: %d multi-token-prediction tensors (layers %d..%d) skipped: numaov runs "
                    "the main model only", what, len(skipped), config.num_hidden_layers,
                    config.num_hidden_layers + config.num_nextn_predict_layers - 1)
    moe_layers = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
    for layer in moe_layers:
        bias = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
        if bias not in names:
            raise CheckpointError(
                f"{what}: tensor {bias!r} is missing; DeepSeek-V3's noaux_tc routing chooses "
                f"experts by the scores plus this per-expert bias (expected shape "
                f"[{config.n_routed_experts}])")
    # The model is the one source of its tensor names; imported here because its
    # from_pretrained converts through this module.
    from numaov.models.deepseek_v3.causal_lm import DeepseekV3

    return DeepseekV3.stacked_state(source, config, what, shard,
                                    num_experts=config.n_routed_experts, ignore=set(skipped),
                                    read_experts=read_experts)


def model_to_checkpoint_state_dict(
    state_dict: Mapping[str, Tensor], config: DeepseekV3Config
) -> dict[str, Tensor]:
    """DeepSeek's per-expert layout of the model's state dict (plain weights)."""
    return stacked_to_per_expert(state_dict, config.tie_word_embeddings)

"""The causal LM: the shared :class:`numaov.models.layers.causal_lm.CausalLM` (load, save, the
cached step and the pooled step the exporter traces) with Qwen-MoE's config, checkpoint layout
and decoder."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from numaov.models.checkpoint import SafetensorsCheckpoint
from numaov.models.layers.causal_lm import CausalLM, CausalLMStep
from numaov.models.qwen_moe.checkpoint_layout import (
    checkpoint_to_model_state_dict,
    model_to_checkpoint_state_dict,
)
from numaov.models.qwen_moe.config import QwenMoeConfig, QwenMoeConfigError
from numaov.models.qwen_moe.decoder import qwen_moe_decoder
from numaov.models.qwen_moe.sharding import check_dp_divides


class QwenMoe(CausalLM):
    """Qwen3-MoE / Qwen2-MoE causal LM with Hugging Face parameter names; ``from_pretrained``
    reads a ``qwen3_moe`` / ``qwen2_moe`` checkpoint directory (per-expert or stacked
    experts)."""

    title = "Qwen-MoE"
    config_class = QwenMoeConfig
    config_error = QwenMoeConfigError
    # transformers 5 writes ``dtype`` (older versions ``torch_dtype``): the newer key first
    dtype_keys = ("dtype", "torch_dtype")
    dtype_parameter = "dtype"
    build_decoder = staticmethod(qwen_moe_decoder)
    check_dp_divides = staticmethod(check_dp_divides)
    checkpoint_tensors = staticmethod(model_to_checkpoint_state_dict)

    @staticmethod
    def checkpoint_state(checkpoint: SafetensorsCheckpoint, config: Any, dtype: torch.dtype,
                         what: str, shard: tuple[int, int] | None,
                         read_experts: bool = True) -> dict[str, Tensor]:
        return checkpoint_to_model_state_dict(checkpoint, config, what, shard, read_experts)


class QwenMoeStep(CausalLMStep):
    """:meth:`QwenMoe.step_pooled` as a module's forward: what the exporter traces."""

"""The causal LM: the shared :class:`numaov.models.layers.causal_lm.CausalLM` (load, save, the
cached step and the pooled step the exporter traces) with DeepSeek-V2's config, checkpoint
layout and decoder (MLA, the MoE block)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from numaov.models.checkpoint import SafetensorsCheckpoint
from numaov.models.deepseek_v2.attention import DeepseekV2Attention
from numaov.models.deepseek_v2.checkpoint_layout import (
    checkpoint_to_model_state_dict,
    model_to_checkpoint_state_dict,
)
from numaov.models.deepseek_v2.config import DeepseekConfigError, DeepseekV2Config
from numaov.models.deepseek_v2.moe import DeepseekV2MoE
from numaov.models.deepseek_v2.sharding import check_dp_divides
from numaov.models.layers.causal_lm import CausalLM, CausalLMStep
from numaov.models.layers.data_parallel import DataParallelGroup
from numaov.models.layers.decoder import DecoderStack


class DeepseekV2(CausalLM):
    """DeepSeek-V2 causal LM with Hugging Face parameter names (``DeepseekV2ForCausalLM``);
    ``from_pretrained`` reads a ``deepseek_v2`` checkpoint directory, ``save_pretrained``
    writes DeepSeek's per-expert layout."""

    title = "DeepSeek-V2"
    config_class = DeepseekV2Config
    config_error = DeepseekConfigError
    check_dp_divides = staticmethod(check_dp_divides)
    checkpoint_tensors = staticmethod(model_to_checkpoint_state_dict)

    @staticmethod
    def build_decoder(config: DeepseekV2Config, dp: DataParallelGroup | None) -> DecoderStack:
        return DecoderStack(config, dp, attention=lambda: DeepseekV2Attention(config),
                            moe=lambda world: DeepseekV2MoE(config, world),
                            rope_dim=config.qk_rope_head_dim)

    @staticmethod
    def checkpoint_state(checkpoint: SafetensorsCheckpoint, config: Any, dtype: torch.dtype,
                         what: str, shard: tuple[int, int] | None,
                         read_experts: bool = True) -> dict[str, Tensor]:
        return checkpoint_to_model_state_dict(checkpoint, config, what, shard, read_experts)


class DeepseekV2Step(CausalLMStep):
    """:meth:`DeepseekV2.step_pooled` as a module's forward: what the exporter traces."""


"""The DeepSeek-V3 causal LM: the shared :class:`numaov.models.layers.causal_lm.CausalLM`
(load, save, the cached step and the pooled step the exporter traces) with DeepSeek-V3's
config, checkpoint layout (FP8 weights, the skipped multi-token-prediction layers) and
decoder."""

from __future__ import annotations

from typing import Any

from numaov.models.deepseek_v3.checkpoint_layout import (
    checkpoint_to_model_state_dict,
    model_to_checkpoint_state_dict,
)
from numaov.models.deepseek_v3.config import DeepseekV3Config, DeepseekV3ConfigError
from numaov.models.deepseek_v3.model import deepseek_v3_decoder
from numaov.models.deepseek_v3.sharding import check_dp_divides
from numaov.models.layers.causal_lm import CausalLM, CausalLMStep


class DeepseekV3(CausalLM):
    """DeepSeek-V3 (and Kimi-K2) causal LM with Hugging Face parameter names;
    ``from_pretrained`` reads a ``deepseek_v3`` / ``kimi_k2`` checkpoint directory (plain or
    block-FP8 weights), ``save_pretrained`` writes DeepSeek's per-expert layout, plain."""

    title = "DeepSeek-V3"
    config_class = DeepseekV3Config
    config_error = DeepseekV3ConfigError
    build_decoder = staticmethod(deepseek_v3_decoder)
    check_dp_divides = staticmethod(check_dp_divides)
    checkpoint_state = staticmethod(checkpoint_to_model_state_dict)
    checkpoint_tensors = staticmethod(model_to_checkpoint_state_dict)

    def checkpoint_config(self) -> dict[str, Any]:
        config = super().checkpoint_config()
        config.pop("quantization_config", None)  # saved weights are plain
        return config


class DeepseekV3Step(CausalLMStep):
    """:meth:`DeepseekV3.step_pooled` as a module's forward: what the exporter traces."""


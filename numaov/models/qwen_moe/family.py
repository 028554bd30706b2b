"""Qwen-MoE as the rest of numaov sees it (:class:`numaov.models.families.LMFamily`)."""

from __future__ import annotations

from typing import Any

from numaov.models.families import CacheLayout, CausalLMFamily, ExpertShape


class QwenMoeFamily(CausalLMFamily):
    name = "qwen_moe"
    title = "Qwen-MoE"
    model_types = ("qwen3_moe", "qwen2_moe")
    tool_call_parser = "hermes"
    model_class = "numaov.models.qwen_moe.causal_lm:QwenMoe"
    step_class = "numaov.models.qwen_moe.causal_lm:QwenMoeStep"

    def cache_layout(self, config: Any) -> CacheLayout:
        # GQA: per token the rotated keys and the values of the KV heads, head-major
        width = config.num_key_value_heads * config.kv_head_dim
        return CacheLayout("gqa", config.num_hidden_layers, (("key", width), ("value", width)))

    def expert_shape(self, config: Any, dp: int) -> ExpertShape | None:
        if not any(config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
            return None
        return ExpertShape(config.num_experts, config.hidden_size,
                           config.moe_intermediate_size // dp)


FAMILY = QwenMoeFamily()

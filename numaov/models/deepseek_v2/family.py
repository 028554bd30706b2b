"""DeepSeek-V2 as the rest of numaov sees it (:class:`numaov.models.families.LMFamily`)."""

from __future__ import annotations

from typing import Any

from numaov.models.families import CacheLayout, CausalLMFamily, ExpertShape


class DeepseekV2Family(CausalLMFamily):
    name = "deepseek_v2"
    title = "DeepSeek-V2"
    model_types = ("deepseek_v2",)
    model_class = "numaov.models.deepseek_v2.causal_lm:DeepseekV2"
    step_class = "numaov.models.deepseek_v2.causal_lm:DeepseekV2Step"

    def cache_layout(self, config: Any) -> CacheLayout:
        # MLA: per token the normalised latent and the rotated rope key (shared by all heads)
        return CacheLayout("mla", config.num_hidden_layers,
                           (("latent", config.kv_lora_rank), ("rope_key", config.qk_rope_head_dim)))

    def expert_shape(self, config: Any, dp: int) -> ExpertShape | None:
        if config.n_routed_experts is None:
            return None
        return ExpertShape(config.n_routed_experts, config.hidden_size,
                           config.moe_intermediate_size // dp)


FAMILY = DeepseekV2Family()

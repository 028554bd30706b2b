"""DeepSeek-V3 (and Kimi-K2) as the rest of numaov sees it
(:class:`numaov.models.families.LMFamily`)."""

from __future__ import annotations

from typing import Any

from numaov.models.families import CacheLayout, CausalLMFamily, ExpertShape


class DeepseekV3Family(CausalLMFamily):
    name = "deepseek_v3"
    title = "DeepSeek-V3"
    model_types = ("deepseek_v3", "kimi_k2")
    tool_call_parser = "deepseek_v3"
    model_class = "numaov.models.deepseek_v3.causal_lm:DeepseekV3"
    step_class = "numaov.models.deepseek_v3.causal_lm:DeepseekV3Step"

    def cache_layout(self, config: Any) -> CacheLayout:
        # MLA, as DeepSeek-V2: per token the normalised latent and the rotated rope key
        return CacheLayout("mla", config.num_hidden_layers,
                           (("latent", config.kv_lora_rank), ("rope_key", config.qk_rope_head_dim)))

    def expert_shape(self, config: Any, dp: int) -> ExpertShape | None:
        return ExpertShape(config.n_routed_experts, config.hidden_size,
                           config.moe_intermediate_size // dp)

    def kept_aside(self, config: Any, names: list[str]) -> dict[str, list[str]]:
        from numaov.models.deepseek_v3.checkpoint_layout import multi_token_prediction_names

        mtp = multi_token_prediction_names(names, config)
        return {"multi_token_prediction": mtp} if mtp else {}


FAMILY = DeepseekV3Family()

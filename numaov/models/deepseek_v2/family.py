"""DeepSeek-V2 as the rest of numaov sees it (:class:`numaov.models.families.LMFamily`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from numaov.models.families import CacheLayout, ExpertShape, LMFamily


class DeepseekV2Family(LMFamily):
    name = "deepseek_v2"
    title = "DeepSeek-V2"
    model_types = ("deepseek_v2",)

    def read_config(self, checkpoint_dir: str | Path) -> Any:
        from numaov.models.deepseek_v2.config import DeepseekV2Config

        return DeepseekV2Config.from_pretrained(checkpoint_dir)

    def config_from_dict(self, values: Mapping[str, Any]) -> Any:
        from numaov.models.deepseek_v2.config import DeepseekV2Config

        return DeepseekV2Config.from_dict(values)

    def config_dict(self, config: Any) -> dict[str, Any]:
        return config.to_dict()

    def check_dp(self, config: Any, dp: int) -> None:
        from numaov.models.deepseek_v2.sharding import check_dp_divides

        check_dp_divides(config, dp)

    def cache_layout(self, config: Any) -> CacheLayout:
        # MLA: per token the normalised latent and the rotated rope key (shared by all heads)
        return CacheLayout("mla", config.num_hidden_layers,
                           (("latent", config.kv_lora_rank), ("rope_key", config.qk_rope_head_dim)))

    def expert_shape(self, config: Any, dp: int) -> ExpertShape | None:
        if config.n_routed_experts is None:
            return None
        return ExpertShape(config.n_routed_experts, config.hidden_size,
                           config.moe_intermediate_size // dp)

    def load(self, checkpoint_dir: str | Path, dtype: Any, dp: Any = None) -> Any:
        from numaov.models.deepseek_v2 import DeepseekV2

        return DeepseekV2.from_pretrained(checkpoint_dir, dtype=dtype, dp=dp)

    def step_module(self, model: Any) -> Any:
        from numaov.models.deepseek_v2 import DeepseekV2Step

        return DeepseekV2Step(model)

    def step_pooled(self, model: Any, *inputs: Any) -> Any:
        return model.step_pooled(*inputs)


FAMILY = DeepseekV2Family()

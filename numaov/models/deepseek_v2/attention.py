"""Multi-head latent attention (MLA) with DeepSeek-V2's config: the shared
:mod:`numaov.models.layers.mla`."""

from __future__ import annotations

from numaov.models.deepseek_v2.config import DeepseekV2Config
from numaov.models.layers.mla import LATENT_NORM_EPS as LATENT_NORM_EPS
from numaov.models.layers.mla import MultiHeadLatentAttention
from numaov.models.layers.rope import yarn_softmax_factor


class DeepseekV2Attention(MultiHeadLatentAttention):
    """MLA as DeepSeek-V2 configures it (interleaved rope; yarn sharpens the softmax)."""

    def __init__(self, config: DeepseekV2Config) -> None:
        super().__init__(
            config.hidden_size, config.num_attention_heads, q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank, nope_dim=config.qk_nope_head_dim,
            rope_dim=config.qk_rope_head_dim, v_dim=config.v_head_dim,
            attention_bias=config.attention_bias,
            # 1/sqrt(qk_head_dim), sharpened under yarn by the factor the rope tables are
            # scaled by
            softmax_scale=config.qk_head_dim ** -0.5 * yarn_softmax_factor(config.rope_scaling),
            interleaved_rope=True,
        )

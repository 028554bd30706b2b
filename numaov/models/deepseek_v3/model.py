"""DeepSeek-V3's blocks: the MoE block (sigmoid router with the score correction bias, routed
and shared experts: the shared ``layers.moe.SharedExpertsMoE``) and its MLA; the decoder layer
and stack around them are the shared ``layers.decoder``."""

from __future__ import annotations

from numaov.models.deepseek_v3.config import DeepseekV3Config
from numaov.models.layers.data_parallel import DataParallelGroup
from numaov.models.layers.decoder import DecoderStack
from numaov.models.layers.mla import MultiHeadLatentAttention
from numaov.models.layers.moe import SharedExpertsMoE
from numaov.models.layers.rope import yarn_softmax_factor
from numaov.models.layers.router import Router


def deepseek_v3_router(config: DeepseekV3Config) -> Router:
    """DeepSeek-V3's router: sigmoid scores; the choice on the scores plus
    ``e_score_correction_bias``, in the ``topk_group`` groups whose two best corrected scores
    sum highest (``noaux_tc``); the weights are the uncorrected scores, renormalised when
    ``norm_topk_prob``, then always times ``routed_scaling_factor``."""
    return Router(
        config.hidden_size, config.n_routed_experts, config.num_experts_per_tok,
        score_function="sigmoid", selection="noaux_tc",
        n_group=config.n_group, topk_group=config.topk_group,
        norm_topk_prob=config.norm_topk_prob,
        routed_scaling_factor=config.routed_scaling_factor,
        correction_bias=True,
    )


def deepseek_v3_moe(config: DeepseekV3Config, world_size: int) -> SharedExpertsMoE:
    """The router, routed experts and shared experts, as one rank of ``world_size`` holds
    them."""
    return SharedExpertsMoE(deepseek_v3_router(config), config.hidden_size,
                            config.moe_intermediate_size // world_size,
                            config.shared_intermediate_size // world_size)


def deepseek_v3_attention(config: DeepseekV3Config) -> MultiHeadLatentAttention:
    """MLA with q LoRA (when ``q_lora_rank``); ``rope_interleave`` picks the rope layout; yarn
    sharpens the softmax by ``mscale(factor, mscale_all_dim) ** 2``."""
    return MultiHeadLatentAttention(
        config.hidden_size, config.num_attention_heads, q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank, nope_dim=config.qk_nope_head_dim,
        rope_dim=config.qk_rope_head_dim, v_dim=config.v_head_dim,
        attention_bias=config.attention_bias,
        softmax_scale=config.qk_head_dim ** -0.5 * yarn_softmax_factor(config.rope_scaling),
        interleaved_rope=config.rope_interleave,
    )


def deepseek_v3_decoder(config: DeepseekV3Config, dp: DataParallelGroup | None) -> DecoderStack:
    """The decoder stack: MLA and, from ``first_k_dense_replace`` on, the MoE block."""
    return DecoderStack(config, dp, attention=lambda: deepseek_v3_attention(config),
                        moe=lambda world: deepseek_v3_moe(config, world),
                        rope_dim=config.qk_rope_head_dim)

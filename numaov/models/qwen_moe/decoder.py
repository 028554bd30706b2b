"""Qwen-MoE's decoder: the shared ``layers.decoder`` stack with GQA and the sparse MoE block."""

from __future__ import annotations

from numaov.models.layers.data_parallel import DataParallelGroup
from numaov.models.layers.decoder import DecoderStack
from numaov.models.layers.gqa import GroupedQueryAttention
from numaov.models.qwen_moe.config import QwenMoeConfig
from numaov.models.qwen_moe.moe import QwenMoeSparseBlock


def qwen_moe_attention(config: QwenMoeConfig) -> GroupedQueryAttention:
    """GQA with Qwen3's per-head q/k RMSNorm or Qwen2's q/k/v bias."""
    return GroupedQueryAttention(
        config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
        config.kv_head_dim, qkv_bias=config.has_qkv_bias, o_bias=config.has_o_bias,
        qk_norm_eps=config.rms_norm_eps if config.qk_norm else None,
    )


def qwen_moe_decoder(config: QwenMoeConfig, dp: DataParallelGroup | None) -> DecoderStack:
    """The decoder stack: GQA and, on the sparse layers, the MoE block; rope on whole heads."""
    return DecoderStack(config, dp, attention=lambda: qwen_moe_attention(config),
                        moe=lambda world: QwenMoeSparseBlock(config, world),
                        rope_dim=config.kv_head_dim)

"""A tiny DeepSeek-V2 MoE with seeded random weights, saved in the Hugging Face layout.

It has the real model's structure (MLA with a low-rank query, yarn rope, one dense layer
then MoE layers with shared experts and group-limited routing) at a size that runs, exports
and converts in seconds, so the demo and the tests exercise loading, DP attention, export and
generation without a download. Its sizes divide by 2 and 4, so it shards for dp = 1, 2 and 4.
The weights are untrained: generated tokens are deterministic noise, good for parity and
speed, not for text.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from numaov.models.deepseek_v2 import DeepseekV2, DeepseekV2Config
from numaov.models.layers.router import Router

TINY_DEEPSEEK_CONFIG = DeepseekV2Config(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    n_shared_experts=2,
    num_experts_per_tok=2,
    topk_method="group_limited_greedy",
    n_group=4,
    topk_group=2,
    routed_scaling_factor=1.5,
    norm_topk_prob=False,
    first_k_dense_replace=1,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    # DeepSeek-V2's own yarn settings, with a short original context so positions past
    # it are exercised by short prompts.
    rope_scaling={
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)


def init_tiny_weights(model: DeepseekV2, generator: torch.Generator) -> None:
    """Fill every parameter from ``generator`` with scales that keep activations O(1).

    Variance-preserving projections (std 1/sqrt(fan_in)) and a sharp router make top-1
    logits and expert choices well separated, so parity checks between runs that differ only
    by rounding pick the same tokens; norm weights are perturbed from 1 so a checkpoint that
    swapped or dropped one is caught.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith("embed_tokens.weight"):
                param.copy_(torch.randn(param.shape, generator=generator))
            else:
                fan_in = param.shape[-1]
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(fan_in))
        for module in model.modules():
            if isinstance(module, Router):
                module.weight.mul_(4.0)


def build_tiny_deepseek(directory: str | Path, seed: int = 0) -> Path:
    """Build the tiny DeepSeek-V2 from ``seed`` and save it to ``directory``; return the path.

    Same seed, same weights (on the same torch version); the caller's RNG state is untouched.
    """
    model = DeepseekV2.empty(TINY_DEEPSEEK_CONFIG)
    init_tiny_weights(model, torch.Generator().manual_seed(seed))
    return model.save_pretrained(directory)

"""Tiny Qwen3-MoE / Qwen2-MoE checkpoints written by transformers' own ``save_pretrained``.

One tiny config (hidden 64, 4 heads / 2 KV heads of head_dim 16, 3 layers of which layer 1 is
dense through ``mlp_only_layers``, 8 experts top-2, expert intermediate 32) with overrides
per test. transformers initialises weights with std 0.02, which leaves the logits near zero
and the greedy choice a near tie; the weights are redrawn at a scale (``1/sqrt(fan_in)``,
norms around 1, a sharper router) where the top-1 / top-2 logit gaps are large, so greedy
tokens are a meaningful comparison. The generator is seeded and the seed printed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

TINY: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "mlp_only_layers": [1],
    "norm_topk_prob": True,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}
# Qwen2-MoE only: its shared expert (and, by default in transformers, q/k/v biases).
QWEN2_EXTRA: dict[str, Any] = {"shared_expert_intermediate_size": 48}
KINDS = ("qwen3_moe", "qwen2_moe")


def hf_model(kind: str, seed: int, **overrides: Any) -> Any:
    """transformers' ``Qwen3MoeForCausalLM`` / ``Qwen2MoeForCausalLM`` of the tiny config with
    seeded weights at a useful scale (module docstring)."""
    import torch
    import transformers

    values = {**TINY, **(QWEN2_EXTRA if kind == "qwen2_moe" else {}), **overrides}
    if kind == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**values))
    else:
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**values))
    print(f"tiny {kind} seed: {seed}")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                value = 1 + 0.1 * torch.randn(param.shape, generator=generator)
            elif name.endswith("mlp.gate.weight"):  # the router: clear expert choices
                value = torch.randn(param.shape, generator=generator)
            elif name.endswith("bias"):
                value = 0.1 * torch.randn(param.shape, generator=generator)
            else:
                fan_in = param.shape[-1]
                value = torch.randn(param.shape, generator=generator) / math.sqrt(fan_in)
            param.copy_(value)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def save_checkpoint(directory: Path, kind: str, seed: int, **overrides: Any) -> tuple[Any, Path]:
    """The transformers model of :func:`hf_model` and the directory its ``save_pretrained``
    wrote (f32 safetensors, per-expert tensors, transformers 5's config keys)."""
    model = hf_model(kind, seed, **overrides)
    model.save_pretrained(directory)
    return model, directory


def hf_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy generation, one prompt at a time (no padding), with its own
    cache: the reference the numaov engine's tokens are compared with."""
    import torch

    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            generated = model.generate(ids, attention_mask=torch.ones_like(ids),
                                       max_new_tokens=max_new_tokens,
                                       min_new_tokens=max_new_tokens, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)
        out.append(generated[0, len(prompt):].tolist())
    return out

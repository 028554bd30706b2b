"""Tiny DeepSeek-V3 checkpoints for the family's tests: written by transformers'
``save_pretrained`` (f32), a released-style FP8 copy of one, and greedy references.

The tiny config: hidden 64, 3 layers of which the first is dense, 16 routed experts in 4
groups, top-4 of the best 2 groups, 1 shared expert, q LoRA, yarn rope with mscale /
mscale_all_dim. transformers initialises ``e_score_correction_bias`` to zeros; the harness
draws it at random (the scale of the sigmoid scores) so the bias takes part in the choice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SEED = 11
TINY: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_attention_heads": 4,
    "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 16, "n_shared_experts": 1,
    "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                        "original_max_position_embeddings": 64, "beta_fast": 32,
                        "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.7},
}
PROMPTS = [[5, 17, 99, 3, 250, 8, 41], [30, 2, 200], [77, 12, 19, 101, 33]]


def hf_model(seed: int = SEED, **overrides: Any) -> Any:
    """transformers' DeepseekV3ForCausalLM on the tiny config (f32, eval), weights drawn from
    ``seed``, with a random ``e_score_correction_bias``."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(**{**TINY, **overrides})
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(torch.randn_like(tensor) * 0.05)
    return model


def save_hf_checkpoint(directory: Path, seed: int = SEED, **overrides: Any) -> tuple[Any, Path]:
    """(transformers model, the directory its ``save_pretrained`` wrote)."""
    model = hf_model(seed, **overrides)
    print(f"tiny DeepSeek-V3 seed: {seed} overrides: {overrides}")
    model.save_pretrained(directory)
    return model, directory


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def write_tensors(directory: Path, tensors: dict[str, torch.Tensor],
                  config_changes: dict[str, Any] | None = None) -> Path:
    """Replace the checkpoint's weights by ``tensors`` (one file) and update its config."""
    from safetensors.torch import save_file

    for path in directory.glob("model*.safetensors*"):
        path.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
    if config_changes:
        config = json.loads((directory / "config.json").read_text())
        config.update(config_changes)
        (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def shard_checkpoint(directory: Path, count: int) -> None:
    """Rewrite the checkpoint (in place) as ``count`` shards
    ``model-0000i-of-0000n.safetensors`` with its ``model.safetensors.index.json``, tensors
    in name order, as the releases are sharded."""
    from safetensors.torch import save_file

    tensors = read_tensors(directory)
    names = sorted(tensors)
    per = -(-len(names) // count)
    weight_map = {}
    for path in directory.glob("model*.safetensors*"):
        path.unlink()
    for i in range(count):
        shard = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i * per:(i + 1) * per]}
        save_file(part, str(directory / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
         "weight_map": weight_map}, indent=2))


def add_multi_token_prediction_layer(directory: Path) -> dict[str, torch.Tensor]:
    """Append DeepSeek's multi-token-prediction layer to the checkpoint (in place, as released:
    layer ``num_hidden_layers``, a copy of the last decoder layer's tensors, float8 ones with
    their scales, plus its own projection, norms and head) and set
    ``num_nextn_predict_layers`` 1; returns the tensors added."""
    tensors = read_tensors(directory)
    layers = json.loads((directory / "config.json").read_text())["num_hidden_layers"]
    last, mtp_prefix = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    mtp = {n.replace(last, mtp_prefix): t.clone() for n, t in tensors.items()
           if n.startswith(last)}
    hidden, vocab = tensors["model.norm.weight"].shape[0], tensors["lm_head.weight"].shape[0]
    generator = torch.Generator().manual_seed(SEED)
    mtp.update({f"{mtp_prefix}eh_proj.weight": torch.randn(hidden, 2 * hidden,
                                                           generator=generator),
                f"{mtp_prefix}enorm.weight": torch.ones(hidden),
                f"{mtp_prefix}hnorm.weight": torch.ones(hidden),
                f"{mtp_prefix}shared_head.norm.weight": torch.ones(hidden),
                f"{mtp_prefix}shared_head.head.weight": torch.randn(vocab, hidden,
                                                                    generator=generator)})
    write_tensors(directory, {**tensors, **mtp}, {"num_nextn_predict_layers": 1})
    return mtp


def is_quantized_weight(name: str, tensor: torch.Tensor) -> bool:
    """What DeepSeek's FP8 release quantizes: the 2-D linear weights of the decoder layers
    (attention projections, MLPs, experts), not the embeddings, head, norms or router."""
    return (name.startswith("model.layers.") and name.endswith(".weight") and tensor.dim() == 2
            and "layernorm" not in name and not name.endswith("mlp.gate.weight"))


def quantize_block_fp8(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor,
                                                                       torch.Tensor]:
    """``weight [N, K]`` -> (float8_e4m3fn weight, f32 ``scale_inv [ceil(N/b), ceil(K/b)]``):
    per block, the scale that maps its largest magnitude to e4m3's largest (448), as
    DeepSeek's and transformers' quantizers do; partial edge blocks have their own scale."""
    n, k = weight.shape
    rows, cols = -(-n // block), -(-k // block)
    scale_inv = torch.empty(rows, cols, dtype=torch.float32)
    quantized = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            part = weight[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            s = part.abs().amax().clamp(min=1e-12) / 448.0
            scale_inv[i, j] = s
            quantized[i * block:(i + 1) * block, j * block:(j + 1) * block] = (
                (part / s).clamp(-448, 448).to(torch.float8_e4m3fn))
    return quantized, scale_inv


def to_fp8_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    """Rewrite a plain checkpoint as a released FP8 one (in place); returns the dequantized
    weights by transformers' own convention (``finegrained_fp8._dequantize_fp8_weight``), the
    reference the family's reading must match."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    tensors = read_tensors(directory)
    out: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if is_quantized_weight(name, tensor):
            q, s = quantize_block_fp8(tensor)
            out[name], out[name[:-len("weight")] + "weight_scale_inv"] = q, s
            dequantized[name] = _dequantize_fp8_weight(q, s, [128, 128], torch.float32)
        else:
            out[name] = tensor
            dequantized[name] = tensor.float()
    write_tensors(directory, out, {"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128]}, "torch_dtype": "bfloat16"})
    return dequantized


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt (its own cache)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()

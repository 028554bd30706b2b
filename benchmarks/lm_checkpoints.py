"""The seeded checkpoints ``benchmarks/lm_engine.py`` benchmarks, one per ``--family``.

- ``deepseek_v2``: moe.py's DeepSeek-V2 shape with the LM issue's sizes (hidden 1024, 4 layers:
  one dense, three MoE with 16 routed + 2 shared experts of 512, top-6, kv_lora_rank 256,
  q_lora_rank 384, vocab 16384; 537 MB in f32), numaov's own ``DeepseekV2`` with
  ``init_tiny_weights``.
- ``deepseek_v3``: DeepSeek-V3's shape cut to 1.51 GB in bf16 (754 M parameters): hidden
  2048; MLA as V3 (q_lora_rank 1536, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim
  128, v_head_dim 128) with 16 heads (DeepSeek-V2-Lite's count at this width); 4 layers, the
  first dense (intermediate 4608: 9x the expert's, as V3's 18432 / 2048); 64 routed experts
  of 512 in 8 groups, top-8 of the best 4 groups, 1 shared expert; sigmoid scores with a
  seeded non-zero ``e_score_correction_bias``; ``routed_scaling_factor`` 2.5; V3's yarn rope
  (factor 40 over 4,096 positions); vocab cut to 12,288. transformers'
  ``DeepseekV3ForCausalLM``.
- ``qwen_moe``: Qwen3-30B-A3B's shape cut to 1.51 GB in bf16 (757 M parameters): hidden 2048,
  32 heads / 4 KV heads of head_dim 128, 128 experts of 768, top-8, ``norm_topk_prob``,
  rope theta 1e6; one layer (one layer's experts alone are 1.2 GB) and vocab cut to 32,768.
  transformers' ``Qwen3MoeForCausalLM``.

The transformers models get weights redrawn from a seeded generator at a scale where the
logits are not a near tie (``1 / sqrt(fan_in)`` for matrices and the router, norms around 1,
as ``tests/support/qwen_moe_harness.py`` does; transformers' std-0.02 init leaves the logits
near zero), the routed experts' output scaled down (``ROUTED_DOWN_SCALE``: a rounding-flipped
router choice then moves a row within bf16's tolerance), are cast to bf16 and written by
``save_pretrained``. Each checkpoint is cached under
``benchmarks/out/lm_engine/checkpoints/<family>-<hash of its config, seed and init>``;
:func:`released_fp8` writes a DeepSeek-V3 one again in DeepSeek's released FP8 layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SEED = 0
ROOT = Path(__file__).resolve().parent / "out" / "lm_engine" / "checkpoints"
FAMILIES = ("deepseek_v2", "deepseek_v3", "qwen_moe")
# bumped when the weight drawing below changes (part of the cache key)
INIT_VERSION = 2

DEEPSEEK_V3: dict[str, Any] = {
    "vocab_size": 12288, "hidden_size": 2048, "intermediate_size": 4608,
    "moe_intermediate_size": 512, "num_hidden_layers": 4, "first_k_dense_replace": 1,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "n_routed_experts": 64, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8,
    "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                        "original_max_position_embeddings": 4096, "beta_fast": 32,
                        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}
QWEN_MOE: dict[str, Any] = {
    "vocab_size": 32768, "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 1, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "bos_token_id": 0, "eos_token_id": 1,
}
# e_score_correction_bias: about the spread of the sigmoid scores, so it moves the choice
BIAS_STD = 0.1
# The routed experts' down projections at this fraction of 1 / sqrt(fan_in). At full scale a
# near-tied router choice that bf16's rounding flips (64-128 experts, top-8, at every MoE
# layer) moves a row by O(1): PyTorch's own bf16 logits differed from its f32 ones by 0.26 of
# their scale (DeepSeek-V3 shape; 0.075 Qwen), over numaov's bf16 export tolerance (0.1), so
# the export would refuse the checkpoint. At 0.1: 0.028 / 0.011, the choices unchanged.
# The bytes and the work per token are the same.
ROUTED_DOWN_SCALE = 0.1


def _log(message: str) -> None:
    import sys

    print(f"[lm_checkpoints] {message}", file=sys.stderr, flush=True)


def vocab_size(family: str) -> int:
    if family == "deepseek_v2":
        return deepseek_v2_config().vocab_size
    return {"deepseek_v3": DEEPSEEK_V3, "qwen_moe": QWEN_MOE}[family]["vocab_size"]


def deepseek_v2_config() -> Any:
    from moe import BENCH_CONFIG  # benchmarks/moe.py, beside this file

    # moe.py's DeepSeek-V2 shape with the checkpoint sizes: 4 layers, 16 routed
    # experts of 512, positions for the 4,096-token contexts; 537 MB in f32.
    return dataclasses.replace(
        BENCH_CONFIG, moe_intermediate_size=512, num_hidden_layers=4, n_routed_experts=16,
        max_position_embeddings=8192, eos_token_id=1)


def build(family: str, **overrides: Any) -> Path:
    """The family's checkpoint directory (built on the first call, then reused); ``overrides``
    change config keys (e.g. fewer layers) and give another cached checkpoint."""
    if family == "deepseek_v2":
        if overrides:
            raise ValueError("deepseek_v2's checkpoint takes no overrides")
        return _deepseek_v2()
    values = {**{"deepseek_v3": DEEPSEEK_V3, "qwen_moe": QWEN_MOE}[family], **overrides}
    key = hashlib.sha256(json.dumps([values, SEED, INIT_VERSION, BIAS_STD, ROUTED_DOWN_SCALE],
                                    sort_keys=True).encode()).hexdigest()[:10]
    directory = ROOT / f"{family}-{key}"
    if (directory / "config.json").is_file():
        return directory
    model = {"deepseek_v3": _deepseek_v3_model, "qwen_moe": _qwen_moe_model}[family](values)
    count = sum(p.numel() for p in model.parameters())
    _log(f"{family}: {count / 1e6:.0f} M parameters = {2 * count / 1e9:.2f} GB in bf16; "
         f"writing {directory}")
    model.to(torch.bfloat16).save_pretrained(directory)
    return directory


def released_fp8(directory: Path) -> Path:
    """A copy of a DeepSeek-V3 checkpoint ``directory`` in DeepSeek's released FP8 layout
    (beside it, ``<name>-fp8``, built once): every 2-D weight of the decoder layers (attention
    projections, MLPs, shared and routed experts; not the embeddings, head, norms or router)
    as float8_e4m3fn with a ``weight_scale_inv`` per 128 x 128 block
    (``moe_ops.quantize_block_fp8``), the config's ``quantization_config`` as V3's. What a V3
    / R1 user exports; numaov keeps its experts and attention projections as released."""
    from safetensors.torch import load_file, save_file

    from numaov.custom_ops.moe_ops import FP8_BLOCK, quantize_block_fp8

    out = directory.parent / f"{directory.name}-fp8"
    if (out / "config.json").is_file():
        return out
    _log(f"deepseek_v3: writing the released FP8 layout of {directory.name} to {out}")
    out.mkdir(parents=True, exist_ok=True)
    scales = {}  # the scales' names -> their file, for a sharded checkpoint's index
    for path in sorted(directory.glob("*.safetensors")):
        tensors = {}
        for name, tensor in load_file(str(path)).items():
            if (name.startswith("model.layers.") and name.endswith(".weight")
                    and tensor.dim() == 2 and not name.endswith("mlp.gate.weight")):
                tensors[name], tensors[f"{name}_scale_inv"] = quantize_block_fp8(tensor)
                scales[f"{name}_scale_inv"] = path.name
            else:
                tensors[name] = tensor
        save_file(tensors, str(out / path.name), metadata={"format": "pt"})
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        mapping = json.loads(index.read_text())
        mapping["weight_map"].update(scales)
        (out / index.name).write_text(json.dumps(mapping, indent=2))
    for path in directory.iterdir():
        if path.suffix != ".safetensors" and path.name not in ("config.json", index.name):
            (out / path.name).write_bytes(path.read_bytes())
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(FP8_BLOCK)}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _deepseek_v2() -> Path:
    from numaov.models.builtin.deepseek_tiny import init_tiny_weights
    from numaov.models.deepseek_v2 import DeepseekV2

    directory = ROOT.parent / "checkpoint"  # where the V2 runs before --family kept it
    if (directory / "config.json").is_file():
        return directory
    _log("deepseek_v2: building the 537 MB checkpoint")
    model = DeepseekV2.empty(deepseek_v2_config())
    init_tiny_weights(model, torch.Generator().manual_seed(SEED))
    model.save_pretrained(directory)
    return directory


def _redraw(model: torch.nn.Module, router_scale: Callable[[int], float]) -> None:
    """Every parameter drawn again from the seeded generator (module docstring);
    ``router_scale(fan_in)`` is the std of the router's weights."""
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                value = 1 + 0.1 * torch.randn(param.shape, generator=generator)
            elif name.endswith("mlp.gate.weight"):
                value = torch.randn(param.shape, generator=generator) * router_scale(
                    param.shape[-1])
            elif name.endswith("bias"):
                value = BIAS_STD * torch.randn(param.shape, generator=generator)
            else:
                value = torch.randn(param.shape, generator=generator) / math.sqrt(
                    param.shape[-1])
            if name.endswith("mlp.experts.down_proj"):  # [experts, hidden, intermediate]
                value = value * ROUTED_DOWN_SCALE
            param.copy_(value)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(BIAS_STD * torch.randn(buffer.shape, generator=generator))


def _deepseek_v3_model(values: dict[str, Any]) -> torch.nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(SEED)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**values)).eval()
    # sigmoid scores: router logits of std 1 spread them over (0.27, 0.73)
    _redraw(model, lambda fan_in: 1 / math.sqrt(fan_in))
    return model


def _qwen_moe_model(values: dict[str, Any]) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(SEED)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**values)).eval()
    # softmax over 128 experts: router logits of std 2, a clear but not one-hot top-8
    _redraw(model, lambda fan_in: 2 / math.sqrt(fan_in))
    return model

"""DeepSeek-V2 model: parity with transformers, checkpoint loading, KV cache, MoE faces."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.deepseek_harness import greedy_reference
from transformers import DeepseekV2Config as HFConfig
from transformers import DeepseekV2ForCausalLM

from numaov.custom_ops import moe_experts
from numaov.models.builtin.deepseek_tiny import TINY_DEEPSEEK_CONFIG, build_tiny_deepseek
from numaov.models.checkpoint import CheckpointError
from numaov.models.deepseek_v2 import (
    DeepseekConfigError,
    DeepseekV2,
    DeepseekV2Config,
    DeepseekV2Step,
)
from numaov.models.layers.experts import RoutedExperts

SEED = 1234
PROMPTS = [[3, 14, 15, 92, 65, 35, 89], [27, 18], [28, 18, 28, 45, 90]]
MAX_NEW_TOKENS = 5
# fp32 on both sides. The models differ in operation order only (transformers' complex-number
# rope vs the rotary op, SDPA vs its attention, the expert loop), so logits agree to float32
# rounding accumulated over 2-3 layers: ~1e-6 on logits of magnitude ~1-10. 1e-4 is well
# above that and well below the top-1 / top-2 logit gaps greedy decoding depends on.
ATOL = 1e-4
RTOL = 1e-4

# Two transformers configs that together cover the architecture's switches.
HF_CONFIGS: dict[str, dict[str, Any]] = {
    # plain rope, query without low rank, greedy routing, tied embeddings, all layers MoE, no
    # shared experts (n_shared_experts 0: transformers saves them as empty tensors)
    "lite": dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=12, n_routed_experts=6, n_shared_experts=0, num_experts_per_tok=2,
        topk_method="greedy", routed_scaling_factor=1.0, first_k_dense_replace=0,
        tie_word_embeddings=True, max_position_embeddings=128,
    ),
    # yarn rope, low-rank query, group-limited routing, a dense first layer, 2 shared experts
    "full": dict(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3,
        topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=2.5, first_k_dense_replace=1, max_position_embeddings=128,
        rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                      "mscale_all_dim": 0.707},
    ),
}


def _init_like_tiny(model: torch.nn.Module, seed: int) -> None:
    """Weights with O(1) activations and a sharp router (as the builtin tiny model), so the
    greedy choices are not decided by rounding-level logit gaps."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif "embed_tokens" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                scale = 4.0 if name.endswith("mlp.gate.weight") else 1.0
                param.copy_(scale * torch.randn(param.shape, generator=gen)
                            / math.sqrt(param.shape[-1]))


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def hf_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(transformers model, saved directory); "full" is saved sharded."""
    name = request.param
    print(f"transformers DeepseekV2 {name!r} seed: {SEED}")
    torch.manual_seed(SEED)
    hf = DeepseekV2ForCausalLM(HFConfig(**HF_CONFIGS[name])).eval()
    _init_like_tiny(hf, SEED)
    directory = tmp_path_factory.mktemp(f"hf_{name}")
    hf.save_pretrained(directory, max_shard_size="40KB" if name == "full" else "1GB")
    sharded = (directory / "model.safetensors.index.json").is_file()
    assert sharded == (name == "full"), "the fixture should exercise both layouts"
    return hf, directory


def test_logits_and_greedy_tokens_match_transformers(hf_checkpoint) -> None:
    hf, directory = hf_checkpoint
    model = DeepseekV2.from_pretrained(directory)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(model(ids), expected, atol=ATOL, rtol=RTOL)

    # batched and left-padded here, one prompt at a time in transformers
    tokens, logits = greedy_reference(model, PROMPTS, MAX_NEW_TOKENS)
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                output_logits=True, return_dict_in_generate=True, pad_token_id=0,
            )
        assert tokens[i] == out.sequences[0, len(prompt):].tolist(), f"prompt {i}"
        torch.testing.assert_close(
            logits[i], torch.cat(out.logits).float(), atol=ATOL, rtol=RTOL
        )


def test_pooled_step_with_chunked_prefill_equals_full_recompute() -> None:
    """The exported step over a token pool: the prompt read in two chunks, then one token per
    step, the new entries written at scattered slots of the pool; the last logits of every
    step equal a forward of the whole sequence with no cache."""
    model = DeepseekV2.empty(TINY_DEEPSEEK_CONFIG)
    from numaov.models.builtin.deepseek_tiny import init_tiny_weights

    init_tiny_weights(model, torch.Generator().manual_seed(SEED))
    step = DeepseekV2Step(model)
    c = TINY_DEEPSEEK_CONFIG
    pool = torch.randn(c.num_hidden_layers, 64, c.kv_cache_dim)  # garbage in unused slots
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(SEED))[:20]
    sequence = list(PROMPTS[0])
    chunks = [sequence[:3], sequence[3:]]
    cached = 0
    for _ in range(MAX_NEW_TOKENS):
        chunk = chunks.pop(0) if chunks else sequence[-1:]
        n = len(chunk)
        with torch.no_grad():
            logits, new = step(
                torch.tensor([chunk]), torch.arange(cached, cached + n)[None],
                torch.ones(1, cached + n, dtype=torch.long), pool, slots[None, :cached])
            full = model(torch.tensor([sequence[:cached + n]]))[:, -1]
        torch.testing.assert_close(logits, full, atol=ATOL, rtol=RTOL)
        assert new.shape == (c.num_hidden_layers, 1, n, c.kv_cache_dim)
        pool[:, slots[cached:cached + n]] = new[:, 0]
        cached += n
        if not chunks and cached == len(sequence):
            sequence.append(int(logits.argmax()))


def test_bf16_load_keeps_the_router_in_fp32(tmp_path: Path) -> None:
    directory = build_tiny_deepseek(tmp_path / "tiny", seed=SEED)
    model = DeepseekV2.from_pretrained(directory, dtype=torch.bfloat16)
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.bfloat16
    ref = DeepseekV2.from_pretrained(directory)
    ids = torch.tensor([PROMPTS[0]])
    # bf16 keeps 8 mantissa bits: over 3 layers logits of magnitude ~5 drift by ~0.05.
    torch.testing.assert_close(model(ids).float(), ref(ids), atol=0.25, rtol=0.05)


def test_experts_are_the_moe_op_eagerly_and_under_export() -> None:
    """The module is numaov::moe_experts on its stacks; torch.export captures that one op
    (no torch.cond, no per-row weight gather), with the row count still dynamic."""
    gen = torch.Generator().manual_seed(SEED)
    experts = RoutedExperts(num_experts=8, hidden=16, intermediate=12)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(8, 24, 16, generator=gen) / 4)
        experts.down_proj.copy_(torch.randn(8, 16, 12, generator=gen) / 4)
    x = torch.randn(5, 16, generator=gen)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(5)])
    weights = torch.rand(5, 2, generator=gen)
    with torch.no_grad():
        got = experts(x, ids, weights)
        assert torch.equal(got, moe_experts(x, ids, weights, experts.gate_up_proj,
                                            experts.down_proj))
    rows = torch.export.Dim("rows")
    program = torch.export.export(experts, (x, ids, weights),
                                  dynamic_shapes=({0: rows}, {0: rows}, {0: rows}))
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert targets == ["numaov.moe_experts.default"], targets
    torch.testing.assert_close(program.module()(x, ids, weights), got)


# ---------------------------------------------------------------------------------------------
# Checkpoints that do not fit
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    return build_tiny_deepseek(tmp_path / "tiny", seed=SEED)


def test_missing_and_misshaped_tensors_are_named(tiny_dir: Path) -> None:
    weights = tiny_dir / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    tensors["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(3, 3)
    tensors["model.layers.9.mlp.gate.weight"] = torch.zeros(1)
    save_file(tensors, str(weights))
    with pytest.raises(CheckpointError) as info:
        DeepseekV2.from_pretrained(tiny_dir)
    message = str(info.value)
    assert "1 missing tensor: model.layers.2.mlp.experts.5.up_proj.weight" in message
    assert "1 unexpected tensor: model.layers.9.mlp.gate.weight" in message
    assert "model.layers.0.self_attn.o_proj.weight (expected [64, 64], found [3, 3])" in message


def test_config_that_does_not_match_the_weights(tiny_dir: Path) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())
    config["n_routed_experts"] = 16
    (tiny_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as info:
        DeepseekV2.from_pretrained(tiny_dir)
    # 8 absent experts x 3 tensors x 2 MoE layers, and the router sized for 16 experts
    assert "48 missing tensors: model.layers.1.mlp.experts.10.down_proj.weight" in str(info.value)
    assert "model.layers.1.mlp.gate.weight (expected [16, 64], found [8, 64])" in str(info.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": None}, "missing required key"),
        ({"model_type": "llama"}, "expected 'deepseek_v2'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
        ({"topk_method": "noaux_tc"}, "topk_method is 'noaux_tc'"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok is 9"),
        ({"n_group": 3}, "n_group dividing n_routed_experts"),
        ({"qk_rope_head_dim": 7}, "expected an even number"),
    ],
)
def test_bad_config_is_a_clear_error(tiny_dir: Path, change: dict[str, Any], message: str) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())
    config.update(change)
    (tiny_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(DeepseekConfigError, match=message):
        DeepseekV2.from_pretrained(tiny_dir)


def test_missing_directory_and_weights(tmp_path: Path, tiny_dir: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        DeepseekV2.from_pretrained(tmp_path / "nowhere")
    (tiny_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        DeepseekV2.from_pretrained(tiny_dir)


def test_stacked_expert_layout_and_auto_dtype_load(tiny_dir: Path, tmp_path: Path) -> None:
    """transformers' in-memory layout (experts.gate_up_proj / experts.down_proj stacks) loads
    as well as DeepSeek's per-expert files."""
    model = DeepseekV2.from_pretrained(tiny_dir)
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    config = json.loads((tiny_dir / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (stacked / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(stacked / "model.safetensors"))
    again = DeepseekV2.from_pretrained(stacked, dtype="auto")
    assert again.lm_head.weight.dtype == torch.bfloat16
    again = DeepseekV2.from_pretrained(stacked)
    ids = torch.tensor([PROMPTS[0]])
    assert torch.equal(again(ids), model(ids))  # same weights, same code: bit-identical


def test_config_round_trips_through_config_json(tiny_dir: Path) -> None:
    assert DeepseekV2Config.from_pretrained(tiny_dir) == TINY_DEEPSEEK_CONFIG
    # and transformers reads what numaov writes
    hf = DeepseekV2ForCausalLM.from_pretrained(tiny_dir).eval()
    ours = DeepseekV2.from_pretrained(tiny_dir)
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_dp1_step_exports_with_dynamic_shapes_and_runs_in_openvino(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """torch.onnx.export(dynamo=True) of the cached step, one graph for every batch size,
    new-token count and cache length, run by OpenVINO with numaov's MoeExperts op at row
    counts from 3 to 40; ONNX Runtime, which has no kernel for the numaov.moe node, refuses
    the graph clearly."""
    from numaov.custom_ops import (
        OnnxRuntimeUnsupportedError,
        check_onnxruntime_can_run,
        compile_ir,
        onnx_translation_table,
    )
    from numaov.exporter.openvino_convert import convert_to_ir

    model = DeepseekV2.from_pretrained(tiny_dir)
    step = DeepseekV2Step(model).eval()
    layers, width = TINY_DEEPSEEK_CONFIG.num_hidden_layers, TINY_DEEPSEEK_CONFIG.kv_cache_dim

    def inputs(b: int, t: int, p: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(b * 100 + t * 10 + p)
        mask = torch.ones(b, p + t, dtype=torch.long)
        mask[0, 0] = 0 if p + t > 1 else 1  # a left-padded first row
        pool = b * p + 3
        return {
            "input_ids": torch.randint(0, TINY_DEEPSEEK_CONFIG.vocab_size, (b, t), generator=gen),
            "position_ids": (torch.arange(p, p + t) - 1).clamp(min=0).expand(b, t).contiguous(),
            "attention_mask": mask,
            "kv_cache": torch.randn(layers, pool, width, generator=gen),
            "past_slots": torch.randperm(pool, generator=gen)[: b * p].reshape(b, p),
        }

    batch = torch.export.Dim("batch", min=1, max=64)
    seq = torch.export.Dim("seq", min=1, max=256)
    past = torch.export.Dim("past", min=0, max=256)
    total = torch.export.Dim("total", min=1, max=512)
    pool = torch.export.Dim("pool", min=1, max=4096)
    example = inputs(2, 3, 4)
    path = tmp_path / "step.onnx"
    torch.onnx.export(
        step, tuple(example.values()), str(path), dynamo=True,
        input_names=list(example), output_names=["logits", "new_key_values"],
        dynamic_shapes={"input_ids": {0: batch, 1: seq}, "position_ids": {0: batch, 1: seq},
                        "attention_mask": {0: batch, 1: total}, "kv_cache": {1: pool},
                        "past_slots": {0: batch, 1: past}},
        custom_translation_table=onnx_translation_table("decomposed"),
    )
    with pytest.raises(OnnxRuntimeUnsupportedError, match=r"numaov\.moe nodes \(MoeExperts x"):
        check_onnxruntime_can_run(path)
    run = compile_ir(convert_to_ir(path, tmp_path / "step.xml"), "f32").runner()
    # (batch, new tokens, cached tokens): prefill with an empty cache, decode, mixed
    for b, t, p in ((1, 5, 0), (3, 1, 7), (1, 40, 0), (2, 2, 3)):
        feed = inputs(b, t, p)
        with torch.no_grad():
            logits, new = step(*feed.values())
        got = run({k: v.numpy() for k, v in feed.items()})
        # float32 graph vs float32 eager; same tolerance and reason as the transformers parity
        torch.testing.assert_close(torch.from_numpy(got[0]), logits, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(torch.from_numpy(got[1]), new, atol=ATOL, rtol=RTOL)

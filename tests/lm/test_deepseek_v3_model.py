"""DeepSeek-V3 family: parity with transformers' DeepseekV3ForCausalLM on checkpoints its
``save_pretrained`` wrote, the router's correction bias, released FP8 checkpoints,
multi-token-prediction tensors, and the one-line refusals."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from support.deepseek_harness import greedy_reference
from support.deepseek_v3_harness import (
    PROMPTS,
    SEED,
    add_multi_token_prediction_layer,
    hf_greedy,
    hf_model,
    read_tensors,
    save_hf_checkpoint,
    to_fp8_checkpoint,
    write_tensors,
)

from numaov import NumaovError
from numaov.models.checkpoint import CheckpointError
from numaov.models.deepseek_v3 import DeepseekV3, DeepseekV3Config
from numaov.models.families import family_for_checkpoint
from numaov.models.layers.data_parallel import ShardError

# f32 on both sides. The models differ in operation order only: numaov runs MLA absorbed
# (kv_b_proj folded into the query and the output instead of expanding keys/values), rope
# through its op on interleaved pairs, and the experts through the MoE op's grouped loop;
# measured max |diff| ~2e-7 on logits of magnitude ~0.5-1. 1e-4 is far above float32
# reordering and far below the top-1 / top-2 gaps greedy decoding depends on.
ATOL = 1e-4
RTOL = 1e-4
NEW_TOKENS = 5

# Each case: transformers config overrides for the checkpoint, and those of the reference
# model when it differs (None: the same).
CASES: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {
    "groups_of_4_top4": ({}, None),
    "top1_no_q_lora_halves_rope": (
        {"num_experts_per_tok": 1, "topk_group": 1, "q_lora_rank": None,
         "rope_interleave": False, "rope_parameters": {"rope_type": "default",
                                                       "rope_theta": 10000.0}}, None),
    # Groups of 1 expert: DeepSeek's and transformers' code take the 2 best scores of a group
    # and fail on a group of 1. numaov's group merit is then that expert's corrected score,
    # so keeping the best topk_group >= top_k groups and taking the top-k inside them is
    # plain top-k on the corrected scores: the same choice as transformers with one group
    # of all 16 experts, the reference here.
    "groups_of_1_top1": ({"n_group": 16, "topk_group": 4, "num_experts_per_tok": 1},
                         {"n_group": 1, "topk_group": 1, "num_experts_per_tok": 1}),
    "groups_of_1_top3": ({"n_group": 16, "topk_group": 3, "num_experts_per_tok": 3},
                         {"n_group": 1, "topk_group": 1, "num_experts_per_tok": 3}),
    # transformers does not read moe_layer_freq (DeepSeek's own code made layers with
    # i % freq != 0 dense): its checkpoint has experts in every layer from
    # first_k_dense_replace on, and so does numaov's model.
    "moe_layer_freq_not_read": ({"moe_layer_freq": 2}, None),
    # transformers keeps a shared-experts MLP of width 0 and saves its empty tensors
    "no_shared_experts": ({"n_shared_experts": 0}, None),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    return save_hf_checkpoint(tmp_path_factory.mktemp("v3") / "tiny")


def _copy(directory: Path, target: Path) -> Path:
    target.mkdir(parents=True)
    for path in directory.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    return target


# One case in the fast lane; the others (up to ~8 s each here) with the slow tests.
@pytest.mark.parametrize("case", [
    pytest.param(c, marks=() if c == "groups_of_4_top4" else pytest.mark.slow)
    for c in sorted(CASES)])
def test_logits_and_greedy_tokens_match_transformers(case: str, tmp_path: Path) -> None:
    overrides, reference_overrides = CASES[case]
    hf, directory = save_hf_checkpoint(tmp_path / "ckpt", SEED, **overrides)
    if reference_overrides is not None:
        reference = hf_model(SEED, **{**overrides, **reference_overrides})
        reference.load_state_dict(hf.state_dict())
        hf = reference
    model = DeepseekV3.from_pretrained(directory)
    assert family_for_checkpoint(directory).name == "deepseek_v3"
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = hf(ids).logits
            got = model(ids)
        print(f"{case}: max |logits diff| {float((got - expected).abs().max()):.2e}")
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    # numaov: batched, left-padded, every token a full recompute; transformers: its cache
    tokens, _ = greedy_reference(model, PROMPTS, NEW_TOKENS)
    assert tokens == [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


def test_the_correction_bias_changes_the_choice_as_in_transformers(tiny) -> None:
    hf, directory = copy.deepcopy(tiny[0]), tiny[1]  # the bias is changed below
    model = DeepseekV3.from_pretrained(directory)
    ours, theirs = model.model.layers[1].mlp.gate, hf.model.layers[1].mlp.gate
    assert ours.weight.dtype == torch.float32 and ours.e_score_correction_bias.dtype == torch.float32
    torch.manual_seed(SEED)
    x = torch.randn(32, 64)

    def choices() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, weights = ours(x)
        _, hf_weights, hf_ids = theirs(x)
        order, hf_order = ids.sort(-1), hf_ids.sort(-1)
        assert torch.equal(order.values, hf_order.values)
        torch.testing.assert_close(weights.gather(1, order.indices),
                                   hf_weights.gather(1, hf_order.indices), atol=1e-6, rtol=1e-6)
        return order.values, weights, hf_weights

    before, _, _ = choices()
    # a bias well above the sigmoid scores' spread on experts 12..15 (group 3): they win
    with torch.no_grad():
        for router in (ours, theirs):
            router.e_score_correction_bias[12:] += 1.0
    after, weights, _ = choices()
    assert not torch.equal(before, after)
    assert bool((after >= 12).all()) and not bool((before >= 12).all())
    # the weights are the uncorrected scores: renormalised to 1, times the scaling factor
    torch.testing.assert_close(weights.sum(-1), torch.full((32,), 2.5), atol=1e-5, rtol=0)


def test_released_fp8_checkpoint_matches_its_dequantized_weights(tmp_path: Path,
                                                                 caplog) -> None:
    # wide enough for several 128x128 blocks with partial edges: the dense MLP is
    # [200, 136] / [136, 200], every expert [200, 136] / [136, 200], q_b_proj [4*40, 136]
    wide = {"hidden_size": 136, "intermediate_size": 200, "moe_intermediate_size": 200,
            "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2,
            "q_lora_rank": 136, "kv_lora_rank": 136, "qk_nope_head_dim": 32}
    _, directory = save_hf_checkpoint(tmp_path / "fp8", SEED, **wide)
    dequantized = to_fp8_checkpoint(directory)
    files = read_tensors(directory)
    assert files["model.layers.0.mlp.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert files["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (2, 2)
    assert files["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"].shape == (2, 2)
    with caplog.at_level(logging.INFO):
        model = DeepseekV3.from_pretrained(directory)
    assert any("float8 weights dequantized" in r.getMessage() for r in caplog.records)
    # every weight is transformers' dequantization of it, bit for bit (f32: w.float() * s)
    state = model.state_dict()
    assert torch.equal(state["model.layers.0.mlp.gate_proj.weight"],
                       dequantized["model.layers.0.mlp.gate_proj.weight"])
    stack = state["model.layers.2.mlp.experts.gate_up_proj"]
    for e in range(8):
        assert torch.equal(stack[e, :200], dequantized[f"model.layers.2.mlp.experts.{e}.gate_proj.weight"])
        assert torch.equal(stack[e, 200:], dequantized[f"model.layers.2.mlp.experts.{e}.up_proj.weight"])
        assert torch.equal(state["model.layers.2.mlp.experts.down_proj"][e],
                           dequantized[f"model.layers.2.mlp.experts.{e}.down_proj.weight"])
    # and the model is transformers' on the dequantized weights
    reference_dir = write_tensors(_copy(directory, tmp_path / "dequantized"), dequantized)
    config = json.loads((reference_dir / "config.json").read_text())
    del config["quantization_config"]
    (reference_dir / "config.json").write_text(json.dumps(config))
    from transformers import DeepseekV3ForCausalLM

    hf = DeepseekV3ForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=ATOL, rtol=RTOL)
    # a DP rank dequantizes only its own rows (partial blocks included)
    from numaov.models.layers.data_parallel import DataParallelGroup

    rank1 = DeepseekV3.from_pretrained(directory, dp=DataParallelGroup("unused", 1, 2))
    assert torch.equal(rank1.state_dict()["model.layers.2.mlp.experts.down_proj"][5],
                       dequantized["model.layers.2.mlp.experts.5.down_proj.weight"][:, 100:])
    # "auto" is the release's bfloat16; the router stays f32
    auto = DeepseekV3.from_pretrained(directory, dtype="auto")
    assert auto.lm_head.weight.dtype == torch.bfloat16
    assert auto.model.layers[1].mlp.gate.weight.dtype == torch.float32


def test_fp8_scales_that_do_not_fit_are_named(tmp_path: Path) -> None:
    _, directory = save_hf_checkpoint(tmp_path / "fp8", SEED)
    to_fp8_checkpoint(directory)
    tensors = read_tensors(directory)
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    missing = dict(tensors)
    del missing[name]
    write_tensors(directory, missing)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.self_attn\.o_proj\.weight' "
                                              r"has no .*weight_scale_inv"):
        DeepseekV3.from_pretrained(directory)
    write_tensors(directory, {**tensors, name: torch.ones(2, 2)})
    with pytest.raises(CheckpointError, match=r"has shape \[2, 2\]; expected \[1, 1\]"):
        DeepseekV3.from_pretrained(directory)


def test_multi_token_prediction_tensors_are_skipped(tiny, tmp_path: Path, caplog) -> None:
    hf, directory = tiny
    directory = _copy(directory, tmp_path / "mtp")
    add_multi_token_prediction_layer(directory)
    with caplog.at_level(logging.INFO):
        model = DeepseekV3.from_pretrained(directory)
    assert any("multi-token-prediction tensors (layers 3..3) skipped" in r.getMessage()
               for r in caplog.records)
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(("change", "message"), [
    ({"n_routed_experts": 10}, "n_routed_experts=10 is not a multiple of n_group=4"),
    ({"topk_group": 5}, "topk_group=5 is more than n_group=4"),
    ({"index_topk": 2048, "index_n_heads": 64},
     "index_topk=2048, index_n_heads=64 ask for DeepSeek-V3.2's sparse attention"),
    ({"model_type": "deepseek_v32"}, "'deepseek_v32' (DeepSeek-V3.2) is not supported"),
    ({"model_type": "deepseek_v4"}, "'deepseek_v4' (DeepSeek-V4) is not supported"),
    ({"scoring_func": "softmax"}, "scoring_func is 'softmax'; expected 'sigmoid'"),
    ({"quantization_config": {"quant_method": "awq"}}, "quant_method is 'awq'; expected 'fp8'"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}},
     "weight_block_size is [128]; expected two positive"),
])
def test_bad_configs_are_one_line_errors(tiny, tmp_path: Path, change: dict[str, Any],
                                         message: str) -> None:
    directory = _copy(tiny[1], tmp_path / "bad")
    config = json.loads((directory / "config.json").read_text())
    config.update(change)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(NumaovError) as info:
        DeepseekV3.from_pretrained(directory)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_missing_correction_bias_is_named(tiny, tmp_path: Path) -> None:
    directory = _copy(tiny[1], tmp_path / "nobias")
    tensors = read_tensors(directory)
    del tensors["model.layers.2.mlp.gate.e_score_correction_bias"]
    write_tensors(directory, tensors)
    with pytest.raises(CheckpointError) as info:
        DeepseekV3.from_pretrained(directory)
    assert "tensor 'model.layers.2.mlp.gate.e_score_correction_bias' is missing" in str(info.value)
    assert "\n" not in str(info.value)


def test_kimi_k2_model_type_config_round_trip_and_dp_check(tiny, tmp_path: Path) -> None:
    hf, directory = tiny
    directory = _copy(directory, tmp_path / "kimi")
    config = json.loads((directory / "config.json").read_text())
    config["model_type"] = "kimi_k2"
    (directory / "config.json").write_text(json.dumps(config))
    family = family_for_checkpoint(directory)
    assert family.name == "deepseek_v3"
    ours = family.read_config(directory)
    assert ours.model_type == "kimi_k2" and ours.rope_scaling["mscale_all_dim"] == 0.7
    assert family.config_from_dict(family.config_dict(ours)) == ours
    assert family.cache_layout(ours).kind == "mla"
    with pytest.raises(ShardError, match=r"dp=3 does not divide moe_intermediate_size=32 \(routed experts\)"):
        family.check_dp(ours, 3)
    model = family.load(directory, torch.float32)
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=ATOL, rtol=RTOL)
    assert isinstance(ours, DeepseekV3Config)

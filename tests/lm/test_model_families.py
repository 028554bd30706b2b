"""The seam between numaov and its model families: the registry by ``model_type``, the cache
layout the manifest records, and the shared layers checked against transformers' own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from numaov.cli import main
from numaov.manifest import CacheLayout, ModelDirError
from numaov.models.builtin import TINY_MOE_DIR
from numaov.models.families import (
    FAMILIES,
    FamilyError,
    family_for_checkpoint,
    family_named,
    supported_model_types,
)
from numaov.models.layers.rope import RopeConfigError, RotaryEmbedding
from numaov.models.layers.router import Router


def _checkpoint(tmp_path: Path, config: object) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_registry_picks_the_family_by_model_type() -> None:
    family = family_for_checkpoint(TINY_MOE_DIR)
    assert family.name == "deepseek_v2" and family is family_named("deepseek_v2")
    assert "deepseek_v2" in supported_model_types()
    for name in FAMILIES:  # every registered family describes itself under its own name
        assert family_named(name).name == name and family_named(name).model_types


def test_an_unknown_model_type_is_one_line_listing_the_supported(tmp_path: Path) -> None:
    with pytest.raises(FamilyError, match=r"model_type 'llama' is not supported; expected one "
                       r"of \[.*'deepseek_v2'"):
        family_for_checkpoint(_checkpoint(tmp_path / "a", {"model_type": "llama"}))
    with pytest.raises(FamilyError, match="is not a directory"):
        family_for_checkpoint(tmp_path / "missing")
    with pytest.raises(FamilyError, match="holds a JSON list"):
        family_for_checkpoint(_checkpoint(tmp_path / "b", [1]))
    with pytest.raises(FamilyError, match="'mamba' is not one numaov serves"):
        family_named("mamba")


def test_export_lm_refuses_an_unknown_model_type_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = _checkpoint(tmp_path / "ckpt", {"model_type": "mistral"})
    for command in ("lm", "deepseek"):  # `export deepseek` is the alias of `export lm`
        code = main(["export", command, "--checkpoint", str(checkpoint), "--out",
                     str(tmp_path / "out"), "--quiet"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 1 and len(err) == 1, err
        assert "model_type 'mistral' is not supported" in err[0] and "deepseek_v2" in err[0]
        assert not (tmp_path / "out").exists()


def test_the_cache_layout_round_trips_and_is_checked() -> None:
    family = family_named("deepseek_v2")
    config = family.read_config(TINY_MOE_DIR)
    layout = family.cache_layout(config)
    assert layout.kind == "mla" and layout.layers == config.num_hidden_layers
    assert layout.width == config.kv_lora_rank + config.qk_rope_head_dim
    assert CacheLayout.from_dict(json.loads(json.dumps(layout.to_dict())), "here") == layout
    broken = {**layout.to_dict(), "width": layout.width + 1}
    with pytest.raises(ModelDirError, match="inconsistent; re-export"):
        CacheLayout.from_dict(broken, "here")
    with pytest.raises(ModelDirError, match="malformed"):
        CacheLayout.from_dict({"kind": "gqa"}, "here")
    # the pool's element type: f32 unless the export says otherwise (exports before the field)
    assert layout.dtype == "f32" and layout.pool_bytes(10) == 10 * layout.layers * layout.width * 4
    older = {k: v for k, v in layout.to_dict().items() if k != "dtype"}
    assert CacheLayout.from_dict(older, "here") == layout
    bf16 = CacheLayout.from_dict({**layout.to_dict(), "dtype": "bf16"}, "here")
    assert bf16.pool_bytes(10) == layout.pool_bytes(10) // 2
    with pytest.raises(ModelDirError, match="inconsistent; re-export"):
        CacheLayout.from_dict({**layout.to_dict(), "dtype": "f16"}, "here")


# -- shared layers against transformers' ---------------------------------------------------------


@pytest.mark.parametrize("norm_topk_prob,top_k", [(True, 4), (False, 4), (True, 1)])
def test_sigmoid_group_router_equals_transformers_deepseek_v3(norm_topk_prob: bool,
                                                               top_k: int) -> None:
    """DeepSeek-V3's routing (sigmoid, the correction bias for the choice only, groups ranked by
    their two best experts) against transformers' ``DeepseekV3TopkRouter``: the same experts and
    weights. The bias is large enough to change the choice, so a bias applied to the weights or
    ignored would fail."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(0)
    experts, groups, hidden = 16, 4, 32
    config = DeepseekV3Config(hidden_size=hidden, n_routed_experts=experts, n_group=groups,
                              topk_group=2, num_experts_per_tok=top_k,
                              norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5)
    reference = DeepseekV3TopkRouter(config)
    ours = Router(hidden, experts, top_k, score_function="sigmoid", selection="noaux_tc",
                  n_group=groups, topk_group=2, norm_topk_prob=norm_topk_prob,
                  routed_scaling_factor=2.5, correction_bias=True)
    with torch.no_grad():
        reference.weight.normal_()
        reference.e_score_correction_bias.copy_(torch.randn(experts) * 0.3)
        ours.weight.copy_(reference.weight)
        ours.e_score_correction_bias.copy_(reference.e_score_correction_bias)
        x = torch.randn(64, hidden)
        _, ref_weights, ref_ids = reference(x)
        ids, weights = ours(x)
        unbiased = Router(hidden, experts, top_k, score_function="sigmoid",
                          selection="noaux_tc", n_group=groups, topk_group=2,
                          norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5)
        unbiased.weight.copy_(reference.weight)
        unbiased_ids, _ = unbiased(x)
    order, ref_order = ids.sort(dim=-1), ref_ids.sort(dim=-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices),
                               ref_weights.gather(1, ref_order.indices), rtol=1e-6, atol=1e-7)
    assert not torch.equal(unbiased_ids.sort(dim=-1).values, order.values)


@pytest.mark.parametrize("topk_method,norm_topk_prob",
                         [("greedy", True), ("group_limited_greedy", True),
                          ("group_limited_greedy", False)])
def test_deepseek_v2_router_and_layers_follow_transformers(topk_method: str,
                                                          norm_topk_prob: bool) -> None:
    """DeepSeek-V2's router against transformers' ``DeepseekV2TopkRouter`` (softmax, greedy or
    best-expert group-limited top-k, times ``routed_scaling_factor``): the same experts and
    weights, ``norm_topk_prob`` not read as there; and its MoE layers where transformers puts
    them, ``moe_layer_freq`` not read either."""
    from transformers import DeepseekV2Config as HFDeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    from numaov.models.deepseek_v2 import DeepseekV2Config
    from numaov.models.deepseek_v2.moe import deepseek_v2_router

    torch.manual_seed(0)
    values = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=5,
                  num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
                  q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                  moe_intermediate_size=16, n_routed_experts=16, n_shared_experts=1,
                  num_experts_per_tok=4, topk_method=topk_method, n_group=4, topk_group=2,
                  norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5,
                  first_k_dense_replace=1, moe_layer_freq=2)
    reference = DeepseekV2TopkRouter(HFDeepseekV2Config(**values))
    config = DeepseekV2Config.from_dict({**values, "model_type": "deepseek_v2"})
    ours = deepseek_v2_router(config)
    with torch.no_grad():
        reference.weight.normal_()
        ours.weight.copy_(reference.weight)
        x = torch.randn(64, 32)
        _, ref_weights, ref_ids = reference(x)
        ids, weights = ours(x)
    order, ref_order = ids.sort(dim=-1), ref_ids.sort(dim=-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices),
                               ref_weights.gather(1, ref_order.indices), rtol=1e-6, atol=1e-7)
    assert [config.is_moe_layer(i) for i in range(5)] == [False, True, True, True, True]


def _transformers_inv_freq(rope_parameters: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4,
                         max_position_embeddings=32768, rope_parameters=rope_parameters)
    return ROPE_INIT_FUNCTIONS[rope_parameters["rope_type"]](config, "cpu")


@pytest.mark.parametrize("parameters", [
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
     "original_max_position_embeddings": 32768},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
], ids=["llama3", "yarn", "linear"])
def test_rope_scaling_equals_transformers(parameters: dict) -> None:
    """The rope kinds the families' configs ship, against transformers' own tables: the inverse
    frequencies and yarn's attention factor, f32 (same formula, rounding only)."""
    head_dim = 64
    inv_freq, attention_factor = _transformers_inv_freq(parameters, head_dim)
    scaling = {k: v for k, v in parameters.items() if k != "rope_theta"}
    rope = RotaryEmbedding(head_dim, parameters["rope_theta"], scaling, 32768)
    torch.testing.assert_close(rope.inv_freq, inv_freq.float(), rtol=1e-6, atol=0.0)
    assert rope.attention_factor == pytest.approx(attention_factor, rel=1e-6)
    cos, sin = rope(torch.arange(6).view(1, 6))
    assert cos.shape == (6, head_dim // 2) and sin.shape == (6, head_dim // 2)


def test_an_unknown_rope_kind_is_refused() -> None:
    with pytest.raises(RopeConfigError, match="rope_scaling type 'dynamic' is not supported"):
        RotaryEmbedding(64, 10000.0, {"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(RopeConfigError, match="'llama3' has no 'low_freq_factor'"):
        RotaryEmbedding(64, 10000.0, {"rope_type": "llama3", "factor": 2.0})


@pytest.mark.slow  # seven checkpoint loads per head
@pytest.mark.parametrize("tied", [True, False])
def test_a_rank_holds_its_vocabulary_rows_of_the_head(tmp_path: Path, tied: bool) -> None:
    """Under DP each rank holds ceil(vocab / dp) rows of lm_head, the last slice padded with
    zero rows (their logits are cut): an untied head's rows read alone from the checkpoint, a
    tied head's a copy of the rank's rows of the table, which stays whole and is the head
    itself at dp=1."""
    from support.qwen_moe_harness import save_checkpoint

    from numaov.models.layers.data_parallel import DataParallelGroup
    from numaov.models.qwen_moe import QwenMoe

    _, checkpoint = save_checkpoint(tmp_path / "tied", "qwen3_moe", 3, tie_word_embeddings=tied,
                                    vocab_size=253)
    whole = QwenMoe.from_pretrained(checkpoint)
    table, head = whole.model.embed_tokens.weight, whole.lm_head.weight
    assert (head is table) == tied and whole.head_is_embedding == tied
    for world in (2, 4):
        rows = -(-253 // world)
        slices = []
        for rank in range(world):
            model = QwenMoe.from_pretrained(checkpoint,
                                            dp=DataParallelGroup("unused", rank, world))
            assert not model.head_is_embedding and model.lm_head.weight.shape == (rows, 64)
            assert torch.equal(model.model.embed_tokens.weight, table)
            slices.append(model.lm_head.weight)
        rebuilt = torch.cat(slices)
        assert torch.equal(rebuilt[:253], head) and not rebuilt[253:].any(), world

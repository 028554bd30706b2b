"""The Qwen-MoE family's PyTorch model against transformers' ``Qwen3MoeForCausalLM`` and
``Qwen2MoeForCausalLM`` on checkpoints their own ``save_pretrained`` wrote, its pooled step,
its config checks and what it tells the registry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.qwen_moe_harness import KINDS, hf_model, save_checkpoint

from numaov.models.families import family_for_checkpoint
from numaov.models.layers.data_parallel import ShardError
from numaov.models.qwen_moe import QwenMoe, QwenMoeConfig, QwenMoeConfigError

SEED = 11
# f32 on both sides and the same math up to the order of the sums: numaov's MoE op loops
# over experts in its own grouping, rope and RMSNorm run as numaov's fallback ops (fp32
# inside), GQA attends through a broadcast matmul instead of repeated K/V. Measured
# differences are f32 rounding, 2e-6 .. 7e-6 on logits of magnitude ~3-4 (seed 11); 1e-4 leaves
# a wide margin and stays far below the top-1 / top-2 gaps the greedy tokens depend on.
LOGITS_ATOL = 1e-4
PROMPT_LEN, NEW_TOKENS = 9, 8

VARIANTS = {
    "base": {},
    "kv_heads_1": {"num_key_value_heads": 1},
    "kv_heads_eq_heads": {"num_key_value_heads": 4},
    "tied_embeddings": {"tie_word_embeddings": True},
    "top_k_1": {"num_experts_per_tok": 1},
    "top_k_1_unnormalised": {"num_experts_per_tok": 1, "norm_topk_prob": False},
    "sparse_step_2": {"decoder_sparse_step": 2, "mlp_only_layers": []},
    # as Qwen3's model cards extend the context (rope_scaling yarn, factor 4); positions past
    # the original length are reached by the 9 + 8 tokens with original 8
    "yarn": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 8}},
}


def _ours_greedy(model: QwenMoe, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens through the model's cached step (prefill, then one token at a time)."""
    ids = torch.tensor([prompt])
    cache = model.empty_cache(1)
    tokens: list[int] = []
    total = 0
    with torch.no_grad():
        for _ in range(steps):
            t = ids.shape[1]
            positions = torch.arange(total, total + t).unsqueeze(0)
            mask = torch.ones(1, total + t, dtype=torch.long)
            logits, cache = model.step(ids, positions, mask, cache)
            total += t
            tokens.append(int(logits[0, -1].argmax()))
            ids = torch.tensor([[tokens[-1]]])
    return tokens


# The base variant runs in the fast lane; the others (each a transformers model and ours built
# and compared, ~2 s each) with the slow tests.
@pytest.mark.parametrize("variant", [
    pytest.param(v, marks=() if v == "base" else pytest.mark.slow) for v in sorted(VARIANTS)])
@pytest.mark.parametrize("kind", KINDS)
def test_matches_transformers(tmp_path: Path, kind: str, variant: str) -> None:
    reference, checkpoint = save_checkpoint(tmp_path / "ckpt", kind, SEED, **VARIANTS[variant])
    model = QwenMoe.from_pretrained(checkpoint)
    generator = torch.Generator().manual_seed(SEED)
    ids = torch.randint(2, 256, (3, PROMPT_LEN), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        got = model(ids, mask)
    real = mask.bool()
    diff = (expected - got)[real].abs().max().item()
    print(f"{kind} {variant}: max |logits diff| {diff:.2e} (scale "
          f"{expected[real].abs().max().item():.2f})")
    torch.testing.assert_close(got[real], expected[real], atol=LOGITS_ATOL, rtol=0)

    prompt = ids[0].tolist()
    with torch.no_grad():
        hf_tokens = reference.generate(ids[:1], attention_mask=torch.ones_like(ids[:1]),
                                       max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                       do_sample=False, pad_token_id=0)[0, PROMPT_LEN:].tolist()
    assert _ours_greedy(model, prompt, NEW_TOKENS) == hf_tokens
    if variant == "tied_embeddings":
        assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("kind", KINDS)
def test_pooled_step_reads_slots_and_returns_new_entries(tmp_path: Path, kind: str) -> None:
    """step_pooled over a shuffled pool equals the explicit-cache step it mirrors."""
    _, checkpoint = save_checkpoint(tmp_path / "ckpt", kind, SEED)
    model = QwenMoe.from_pretrained(checkpoint)
    generator = torch.Generator().manual_seed(SEED)
    b, p, t = 2, 5, 3
    ids = torch.randint(2, 256, (b, p + t), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        _, past = model.step(ids[:, :p], positions[:, :p], mask[:, :p], model.empty_cache(b))
        expected, present = model.step(ids[:, p:], positions[:, p:], mask, past)
        layers, width = past.shape[0], past.shape[-1]
        assert width == 2 * 2 * 16  # K and V of 2 KV heads of head_dim 16
        pool = torch.randn(layers, b * p + 4, width, generator=generator)
        slots = torch.randperm(b * p + 4, generator=generator)[: b * p].view(b, p)
        pool[:, slots.reshape(-1)] = past.reshape(layers, b * p, width)
        logits, new = model.step_pooled(ids[:, p:], positions[:, p:], mask, pool, slots)
    torch.testing.assert_close(logits, expected[:, -1], atol=1e-5, rtol=0)
    torch.testing.assert_close(new, present[:, :, p:], atol=1e-5, rtol=0)


def _config_json(tmp_path: Path, kind: str, **changes: object) -> Path:
    model = hf_model(kind, SEED)
    values = model.config.to_dict()
    values.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(values))
    return tmp_path


@pytest.mark.parametrize("kind", KINDS)
def test_sliding_window_is_refused(tmp_path: Path, kind: str) -> None:
    directory = _config_json(tmp_path, kind, use_sliding_window=True, sliding_window=64)
    with pytest.raises(QwenMoeConfigError, match="use_sliding_window is true"):
        family_for_checkpoint(directory).read_config(directory)


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    values = hf_model("qwen3_moe", SEED).config.to_dict()
    with pytest.raises(QwenMoeConfigError, match="missing required key.*num_key_value_heads"):
        QwenMoeConfig.from_dict({k: v for k, v in values.items()
                                 if k != "num_key_value_heads"})
    with pytest.raises(QwenMoeConfigError, match="num_key_value_heads is 3; expected a divisor"):
        QwenMoeConfig.from_dict({**values, "num_key_value_heads": 3})
    with pytest.raises(QwenMoeConfigError, match="hidden_act is 'gelu'"):
        QwenMoeConfig.from_dict({**values, "hidden_act": "gelu"})
    with pytest.raises(QwenMoeConfigError, match="rope"):
        QwenMoeConfig.from_dict({**values, "rope_parameters": {"rope_type": "longrope",
                                                               "rope_theta": 1e4}})


@pytest.mark.parametrize("kind", KINDS)
def test_family_describes_itself(tmp_path: Path, kind: str) -> None:
    directory = _config_json(tmp_path, kind)
    family = family_for_checkpoint(directory)
    assert family.name == "qwen_moe" and kind in family.model_types
    config = family.read_config(directory)
    layout = family.cache_layout(config)
    assert (layout.kind, layout.layers, layout.parts) == ("gqa", 3, (("key", 32), ("value", 32)))
    assert family.expert_shape(config, 2).intermediate == 16
    # the manifest's form reads back to the same config
    assert family.config_from_dict(json.loads(json.dumps(family.config_dict(config)))) == config
    family.check_dp(config, 2)
    shared = ", shared_expert_intermediate_size=48" if kind == "qwen2_moe" else ""
    with pytest.raises(ShardError, match=r"dp=5 does not divide intermediate_size=96 \(dense "
                       r"MLP layers\), moe_intermediate_size=32 \(routed experts\)" + shared):
        family.check_dp(config, 5)

"""Which projections an LM export runs on numaov's DenseLinear op (``exporter.dense_projections``):
the rules that turn bf16 and int8 ones on, the layers they replace, and the model they give."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.qwen_moe_harness import save_checkpoint

from numaov.custom_ops.moe_ops import dequantize_experts, quantize_experts
from numaov.exporter import dense_projections
from numaov.exporter.dense_projections import (
    bf16_projections,
    bf16_projections_here,
    int8_projections,
    int8_projections_here,
)
from numaov.models.layers.kernel_linear import KernelLinear
from numaov.models.qwen_moe.causal_lm import QwenMoe

SEED = 11


@pytest.mark.parametrize(("kernel", "expected"), [
    ("avx512_bf16", True), ("amx", False), ("avx2", False), (None, False)])
def test_bf16_projections_only_where_the_kernel_runs_bf16_on_avx512_bf16(
        monkeypatch: pytest.MonkeyPatch, kernel: str | None, expected: bool) -> None:
    """On AVX512-BF16 without AMX the kernel reads a projection of a few rows faster than
    OpenVINO's FullyConnected; with AMX oneDNN's tiles keep a prefill's, and AVX2 was not
    measured. Only an export computed in bf16 whose other weights are stored bf16 (--weights
    bf16, or fp8 experts with a bf16 rest; not NNCF's, not f32 inference) moves them."""
    monkeypatch.setattr(dense_projections, "bf16_kernel", lambda: {"kernel": kernel})
    assert bf16_projections_here("bf16", "bf16") is expected
    assert not bf16_projections_here("f32", "bf16")
    assert not bf16_projections_here("bf16", "f32")


@pytest.mark.parametrize("tied", [False, True])
def test_every_projection_moves_and_a_tied_head_stays(tmp_path: Path, tied: bool) -> None:
    """Each attention and MLP projection and the head becomes a KernelLinear of its weight in
    bf16 (biases kept: Qwen2-MoE's q / k / v); a head tied to the embedding stays, so the
    table is held once. The model then computes what bf16 projections compute: its logits
    within bf16's rounding of the f32 model's (the same greedy tokens on this prompt)."""
    _, checkpoint = save_checkpoint(tmp_path / "ckpt", "qwen2_moe", SEED,
                                    tie_word_embeddings=tied)
    model = QwenMoe.from_pretrained(checkpoint)
    ids = torch.randint(2, 256, (2, 9), generator=torch.Generator().manual_seed(SEED))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = model(ids, mask)
    layers = model.config.num_hidden_layers
    dense_layers = len(model.config.mlp_only_layers)  # each has gate, up and down
    shared = layers - dense_layers  # a sparse layer's shared expert: gate, up and down
    moved = bf16_projections(model)
    assert moved == 4 * layers + 3 * dense_layers + 3 * shared + (0 if tied else 1)
    assert isinstance(model.lm_head, KernelLinear) is not tied
    attention = model.model.layers[0].self_attn
    assert isinstance(attention.q_proj, KernelLinear) and attention.q_proj.bias is not None
    assert attention.q_proj.weight.dtype == torch.bfloat16
    with torch.no_grad():
        got = model(ids, mask)
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() < 0.05 * scale
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize(("kernel", "expected"), [("vnni", True), ("f32", False), (None, False)])
def test_int8_projections_only_where_the_kernel_runs_int8_on_vnni(
        monkeypatch: pytest.MonkeyPatch, kernel: str | None, expected: bool) -> None:
    """An int8 export computed in bf16 moves its projections where the kernel multiplies int8
    weights against quantized activations (AVX512-VNNI); widened to f32 they are slower than
    OpenVINO's int8 FullyConnected from two rows. f32 inference and int4 stay on NNCF's."""
    monkeypatch.setattr(dense_projections, "int8_kernel", lambda: {"kernel": kernel})
    assert int8_projections_here("bf16", "int8") is expected
    assert not int8_projections_here("f32", "int8")
    assert not int8_projections_here("bf16", "int4")
    assert not int8_projections_here("bf16", "bf16")


def test_int8_projections_hold_each_row_symmetric_to_half_a_step(tmp_path: Path) -> None:
    """Each projection (and the untied head) becomes a KernelLinear of int8 rows with one scale
    each, ``max|w| / 127`` (NNCF's INT8_SYM): every weight within half its row's step of the
    original, the biases kept. The model computes what the f32 model holding the weights they
    stand for (dequantized) computes: the eager op widens them exactly (f32 sums, 1e-5)."""
    _, checkpoint = save_checkpoint(tmp_path / "ckpt", "qwen2_moe", SEED)
    model = QwenMoe.from_pretrained(checkpoint)
    attention = model.model.layers[0].self_attn
    original = attention.q_proj.weight.detach().clone()
    ids = torch.randint(2, 256, (2, 9), generator=torch.Generator().manual_seed(SEED))
    mask = torch.ones_like(ids)
    rounded = QwenMoe.from_pretrained(checkpoint)  # each projection's weight as int8 stands for
    for _, _, _, linear in dense_projections._projections(rounded):
        stored, scale = quantize_experts(linear.weight.detach()[None], "int8")
        linear.weight.data = dequantize_experts(stored, scale)[0]
    with torch.no_grad():
        expected = rounded(ids, mask)
    moved = int8_projections(model)
    layers = model.config.num_hidden_layers
    dense_layers = len(model.config.mlp_only_layers)
    assert moved == 4 * layers + 3 * dense_layers + 3 * (layers - dense_layers) + 1
    q_proj = attention.q_proj
    assert isinstance(q_proj, KernelLinear) and q_proj.bias is not None
    assert q_proj.weight.dtype == torch.int8 and q_proj.scale.shape == (original.shape[0], 1)
    assert torch.equal(q_proj.scale[:, 0], original.abs().amax(1) / 127)
    error = (dequantize_experts(q_proj.weight[None], q_proj.scale[None])[0] - original).abs()
    assert bool((error <= q_proj.scale / 2 * (1 + 1e-5)).all())
    with torch.no_grad():
        got = model(ids, mask)
    assert (got - expected).abs().max().item() < 1e-5 * expected.abs().max().item()

"""numaov::moe_experts: the eager op against a float64 reference, the OpenVINO op against the
eager op, and the errors of both faces.

Tolerances (max |got - expected| / max |expected|):
- f32 against float64: 1e-5. f32 sums of at most a few hundred products per output round
  each term by ~6e-8 relative; 1e-5 leaves two orders of margin while a wrong expert, slot
  or weight is off by O(1).
- bf16 weights against float64: 3e-2. The activations, the weights and the intermediate
  silu(gate) * up are each rounded to bf16 (2^-9 relative each, ~4e-3 after the sums),
  measured 5e-3 .. 1e-2 here.
- OpenVINO f32 against eager f32: 1e-5 (same math, another summation order).
- OpenVINO bf16 against eager bf16: 2e-2 (the eager op also rounds gate and up to bf16
  before silu, the kernel rounds only silu(gate) * up: one bf16 rounding apart).
- int8 / int4 (weight-only): the op on stored weights against float64 on the weights they
  stand for (dequantized) is an f32 comparison, 1e-5; OpenVINO against eager, 1e-5 too (both
  widen the same integers with the same scales). What quantizing costs is a property of the
  weights, not of the op: each value is within half a step (its group's scale / 2) of the
  original, checked exactly; on these random stacks the layer output moves by ~1e-2 (int8)
  and ~2e-1 (int4) of its scale, which the export's per-format tolerances bound.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from numaov.custom_ops import (
    MoeOpError,
    OnnxRuntimeUnsupportedError,
    check_onnxruntime_can_run,
    compile_ir,
    moe_experts,
)
from numaov.custom_ops.moe_ops import (
    dequantize_experts,
    kernel_unavailable_reason,
    quantize_experts,
    write_moe_onnx,
)
from numaov.exporter.openvino_convert import convert_to_ir
from numaov.models.deepseek_v2 import DeepseekV2Config
from numaov.models.deepseek_v2.moe import deepseek_v2_router

F32_TOL = 1e-5
BF16_TOL = 3e-2
OV_BF16_TOL = 2e-2

BF16_MISSING = kernel_unavailable_reason("bf16")
needs_bf16 = pytest.mark.skipif(bool(BF16_MISSING), reason=f"no AVX512-BF16: {BF16_MISSING}")
F32_MISSING = kernel_unavailable_reason("f32")
needs_avx512 = pytest.mark.skipif(bool(F32_MISSING), reason=f"no AVX-512: {F32_MISSING}")


def _problem(rows: int, experts: int, top_k: int, hidden: int = 48, inter: int = 20,
             seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g)
    scores = torch.rand(rows, experts, generator=g)
    weights, ids = torch.topk(scores, top_k, dim=-1)  # distinct experts per row, as a router
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    return x, ids, weights, gate_up, down


def _reference(x, ids, weights, gate_up, down) -> torch.Tensor:
    """float64, one (row, slot) pair at a time: the definition, not the grouped algorithm."""
    x, gate_up, down = x.double(), gate_up.double(), down.double()
    inter = down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for n in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            gate, up = gate_up[e, :inter] @ x[n], gate_up[e, inter:] @ x[n]
            out[n] += weights[n, j].double() * (down[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def _rel(got: torch.Tensor | np.ndarray, expected: torch.Tensor | np.ndarray) -> float:
    got, expected = torch.as_tensor(got).double(), torch.as_tensor(expected).double()
    if expected.numel() == 0:
        return 0.0
    return float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------
# eager op against float64
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [0, 1, 7, 64, 1000])
def test_eager_matches_float64_at_every_row_count(rows: int) -> None:
    x, ids, weights, gate_up, down = _problem(rows, experts=8, top_k=2)
    got = moe_experts(x, ids, weights, gate_up, down)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert _rel(got, _reference(x, ids, weights, gate_up, down)) < F32_TOL


def test_eager_gradients_match_float64() -> None:
    """Training the built-in MoE backpropagates through the op: the gradients of x, the router
    weights and both stacks equal float64's."""
    x, ids, weights, gate_up, down = _problem(7, experts=4, top_k=2)
    leaves = [t.requires_grad_() for t in (x, weights, gate_up, down)]
    moe_experts(x, ids, weights, gate_up, down).square().sum().backward()
    got = [t.grad for t in leaves]
    reference = [t.detach().double().requires_grad_() for t in leaves]
    _reference(reference[0], ids, *reference[1:]).square().sum().backward()
    for name, g, r in zip(("x", "weights", "gate_up", "down"), got, reference, strict=True):
        assert _rel(g, r.grad) < F32_TOL, name


@pytest.mark.parametrize("top_k", [1, 2, 6, 8])
def test_eager_matches_float64_at_every_top_k(top_k: int) -> None:
    x, ids, weights, gate_up, down = _problem(9, experts=16, top_k=top_k, seed=top_k)
    assert _rel(moe_experts(x, ids, weights, gate_up, down),
                _reference(x, ids, weights, gate_up, down)) < F32_TOL


def test_experts_without_rows_and_all_rows_to_one_expert() -> None:
    x, _, weights, gate_up, down = _problem(33, experts=12, top_k=1)
    one = torch.full((33, 1), 5)  # every row to expert 5; the other eleven get nothing
    got = moe_experts(x, one, weights, gate_up, down)
    assert _rel(got, _reference(x, one, weights, gate_up, down)) < F32_TOL
    # changing an expert that got no rows changes nothing
    other = gate_up.clone()
    other[0] += 1.0
    assert torch.equal(moe_experts(x, one, weights, other, down), got)


def test_group_limited_routing() -> None:
    config = DeepseekV2Config(
        vocab_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, moe_intermediate_size=12, norm_topk_prob=False,
        routed_scaling_factor=1.5,
    )
    router = deepseek_v2_router(config)
    torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(3))
    x, _, _, gate_up, down = _problem(40, experts=16, top_k=4, hidden=32, inter=12, seed=4)
    with torch.no_grad():
        ids, weights = router(x)
    groups = (ids // 4).tolist()
    assert all(len(set(g)) <= 2 for g in groups)  # each row's experts come from 2 groups
    assert _rel(moe_experts(x, ids, weights, gate_up, down),
                _reference(x, ids, weights, gate_up, down)) < F32_TOL


def test_bf16_weights_and_activations() -> None:
    x, ids, weights, gate_up, down = _problem(64, experts=8, top_k=2)
    reference = _reference(x, ids, weights, gate_up, down)
    weights_bf16 = moe_experts(x, ids, weights, gate_up.bfloat16(), down.bfloat16())
    assert weights_bf16.dtype == torch.float32
    assert _rel(weights_bf16, reference) < BF16_TOL
    all_bf16 = moe_experts(x.bfloat16(), ids, weights, gate_up.bfloat16(), down.bfloat16())
    assert all_bf16.dtype == torch.bfloat16
    assert _rel(all_bf16, reference) < BF16_TOL


@pytest.mark.parametrize(("weight_format", "group_size"),
                         [("int8", None), ("int8", 16), ("int4", 32), ("int4", None)])
def test_quantized_weights_are_within_half_a_step_and_the_op_runs_them(
        weight_format: str, group_size: int | None) -> None:
    x, ids, weights, gate_up, down = _problem(70, experts=8, top_k=2, hidden=64, inter=32)
    stored = [quantize_experts(w, weight_format, group_size) for w in (gate_up, down)]
    for (q, scale), original in zip(stored, (gate_up, down), strict=True):
        assert q.dtype == (torch.int8 if weight_format == "int8" else torch.uint8)
        k = original.shape[2]
        assert q.shape[2] == (k if weight_format == "int8" else k // 2)
        step = scale.repeat_interleave(k // scale.shape[2], dim=2)
        error = (dequantize_experts(q, scale) - original).abs()
        assert bool((error <= step / 2 * (1 + 1e-5)).all())
    (qg, sg), (qd, sd) = stored
    got = moe_experts(x, ids, weights, qg, qd, sg, sd)
    exact = _reference(x, ids, weights, dequantize_experts(qg, sg), dequantize_experts(qd, sd))
    assert _rel(got, exact) < F32_TOL


# ---------------------------------------------------------------------------------------------
# errors of the eager face
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "parameter", "message"),
    [
        (lambda t: {**t, "x": t["x"][:, :-1]}, "gate_up", r"do not fit; expected x \[N, H\]"),
        (lambda t: {**t, "x": t["x"].unsqueeze(0)}, "x", "expected 2 dimensions"),
        (lambda t: {**t, "x": t["x"].half()}, "x", "x dtype is torch.float16"),
        (lambda t: {**t, "ids": t["ids"].float()}, "ids", "ids dtype is torch.float32"),
        (lambda t: {**t, "ids": t["ids"][:-1], "weights": t["weights"][:-1]}, "ids",
         "x has 5 rows but ids has 4"),
        (lambda t: {**t, "weights": t["weights"][:, :1]}, "weights", "differ; expected both"),
        (lambda t: {**t, "weights": t["weights"].double()}, "weights", "torch.float64"),
        (lambda t: {**t, "down": t["down"].bfloat16()}, "gate_up", "expected both"),
        (lambda t: {**t, "down": t["down"][:, :, :-1]}, "gate_up", "do not fit"),
        (lambda t: {**t, "ids": t["ids"] + 6}, "ids", r"expert id \d+ at row \d+, slot \d+; "
         r"expected 0 .. 7 \(gate_up holds 8 experts\)"),
        (lambda t: {**t, "ids": t["ids"] - 9}, "ids", "expert id -"),
    ],
)
def test_eager_refuses_bad_inputs(change, parameter: str, message: str) -> None:
    x, ids, weights, gate_up, down = _problem(5, experts=8, top_k=2)
    tensors = change({"x": x, "ids": ids, "weights": weights, "gate_up": gate_up, "down": down})
    with pytest.raises(MoeOpError, match=message) as info:
        moe_experts(**tensors)
    assert info.value.parameter == parameter


def test_quantized_formats_refuse_missing_or_misfit_scales() -> None:
    x, ids, weights, gate_up, down = _problem(3, experts=4, top_k=2, hidden=64, inter=16)
    (qg, sg), (qd, sd) = (quantize_experts(w, "int8") for w in (gate_up, down))
    with pytest.raises(MoeOpError, match="expected both scales exactly for int8 / int4"):
        moe_experts(x, ids, weights, qg, qd)
    with pytest.raises(MoeOpError, match=r"down_scale is torch.float32 \[4, 32, 1\]; expected"):
        moe_experts(x, ids, weights, qg, qd, sg, sg)
    with pytest.raises(MoeOpError, match="has 3 groups over rows of 64 values"):
        moe_experts(x, ids, weights, qg, qd, sg.expand(4, 32, 3).contiguous(), sd)
    with pytest.raises(MoeOpError, match="int4 group_size 48 for rows of 64 values; expected a "
                       "multiple of 32 dividing 64"):
        quantize_experts(gate_up, "int4", group_size=48)
    with pytest.raises(MoeOpError, match="weight format 'int2'"):
        quantize_experts(gate_up, "int2")


# ---------------------------------------------------------------------------------------------
# the OpenVINO op
# ---------------------------------------------------------------------------------------------


def _compiled(tmp_path: Path, gate_up, down, top_k: int, precision: str, scales=None):
    onnx_path = write_moe_onnx(tmp_path / "moe.onnx", gate_up, down, top_k, scales)
    xml = convert_to_ir(onnx_path, tmp_path / f"moe_{precision}.xml", precision)
    return compile_ir(xml, precision)


def _feeds(x, ids, weights) -> dict[str, np.ndarray]:
    return {"x": x.numpy(), "ids": ids.numpy(), "weights": weights.numpy()}


@needs_avx512
def test_openvino_op_equals_eager_op_f32(tmp_path: Path) -> None:
    _, _, _, gate_up, down = _problem(1, experts=16, top_k=6, hidden=72, inter=36)
    run = _compiled(tmp_path, gate_up, down, 6, "f32").runner()
    for rows in (0, 1, 7, 64, 1000):
        x, ids, weights, _, _ = _problem(rows, experts=16, top_k=6, hidden=72, inter=36,
                                         seed=rows)
        (got,) = run(_feeds(x, ids, weights))
        assert got.shape == (rows, 72)
        assert _rel(got, moe_experts(x, ids, weights, gate_up, down)) < F32_TOL, rows
    x, _, weights, _, _ = _problem(50, experts=16, top_k=6, hidden=72, inter=36, seed=9)
    one = torch.full((50, 6), 3)  # all rows' slots to one expert
    (got,) = run(_feeds(x, one, weights))
    assert _rel(got, moe_experts(x, one, weights, gate_up, down)) < F32_TOL


@needs_bf16
def test_openvino_op_equals_eager_op_bf16_and_keeps_bf16_weights(tmp_path: Path) -> None:
    _, _, _, gate_up, down = _problem(1, experts=8, top_k=2, hidden=96, inter=40)
    compiled = _compiled(tmp_path, gate_up, down, 2, "bf16")
    # extension ops run as "Reference" layers, named after the node (here its output, y)
    (op,) = [n for n in compiled.model.get_runtime_model().get_ordered_ops()
             if n.get_rt_info()["layerType"].astype(str) == "Reference"
             and n.get_rt_info()["originalLayersNames"].astype(str) == "y"]
    # the expert stacks reach the kernel as bf16 (no Convert folded back to f32)
    assert [op.get_input_element_type(i).get_type_name() for i in (3, 4)] == ["bf16", "bf16"]
    run = compiled.runner()
    for rows in (1, 7, 130):
        x, ids, weights, _, _ = _problem(rows, experts=8, top_k=2, hidden=96, inter=40, seed=rows)
        (got,) = run(_feeds(x, ids, weights))
        eager = moe_experts(x, ids, weights, gate_up.bfloat16(), down.bfloat16())
        assert _rel(got, eager) < OV_BF16_TOL, rows
        assert _rel(got, _reference(x, ids, weights, gate_up, down)) < BF16_TOL, rows


@needs_avx512
@pytest.mark.parametrize(("weight_format", "group_size"), [("int8", None), ("int4", 32)])
def test_openvino_op_equals_eager_op_int8_int4(tmp_path: Path, weight_format: str,
                                               group_size: int | None) -> None:
    _, _, _, gate_up, down = _problem(1, experts=8, top_k=6, hidden=96, inter=64)
    (qg, sg), (qd, sd) = (quantize_experts(w, weight_format, group_size) for w in (gate_up, down))
    run = _compiled(tmp_path, qg, qd, 6, "f32", (sg, sd)).runner()
    for rows in (0, 1, 7, 64, 1000):
        x, ids, weights, _, _ = _problem(rows, experts=8, top_k=6, hidden=96, inter=64, seed=rows)
        (got,) = run(_feeds(x, ids, weights))
        assert _rel(got, moe_experts(x, ids, weights, qg, qd, sg, sd)) < F32_TOL, rows


@needs_avx512
def test_openvino_op_refuses_bad_inputs_with_a_clear_error(tmp_path: Path) -> None:
    _, _, _, gate_up, down = _problem(1, experts=8, top_k=2)
    run = _compiled(tmp_path, gate_up, down, 2, "f32").runner()
    x, ids, weights, _, _ = _problem(4, experts=8, top_k=2)
    bad = ids.clone()
    bad[2, 1] = 8
    with pytest.raises(RuntimeError, match=r"expert id 8 at row 2, slot 1; expected 0 .. 7"):
        run(_feeds(x, bad, weights))
    # found by the plugin's run-time shape inference, which runs the op's own checks
    with pytest.raises(RuntimeError, match=r"x \[4,48\] and expert ids \[3,2\] differ in rows"):
        run({"x": x.numpy(), "ids": ids[:3].numpy(), "weights": weights[:3].numpy()})
    # the op still runs after refusing
    (got,) = run(_feeds(x, ids, weights))
    assert _rel(got, moe_experts(x, ids, weights, gate_up, down)) < F32_TOL


def test_onnxruntime_refuses_the_moe_domain(tmp_path: Path) -> None:
    _, _, _, gate_up, down = _problem(1, experts=4, top_k=2)
    path = write_moe_onnx(tmp_path / "moe.onnx", gate_up, down, 2)
    with pytest.raises(OnnxRuntimeUnsupportedError,
                       match=r"ONNX Runtime cannot run numaov\.moe nodes \(MoeExperts\)"):
        check_onnxruntime_can_run(path)

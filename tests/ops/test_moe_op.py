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
- int8 / int4 weights against int8 activations (AVX512-VNNI; a bf16 model's, or any under
  NUMAOV_MOE_VNNI=always): against float64 on the dequantized weights and on the rows as
  quantized (x, and each pair's silu(gate) * up), 5e-3: the int32 sums of a group are exact,
  but the kernel's f32 silu(gate) * up and the reference's float64 one can put a value on
  neighbouring steps (a step is 1/127 of its group's largest value), measured up to 1.3e-3.
  Against the unquantized rows, 3e-2: each activation moves by up to half a step, twice per
  expert (x, then silu(gate) * up); measured 1.3e-2 .. 1.8e-2 on these random stacks.
- fp8 (E4M3FN, weight-only like int8): the same two 1e-5 comparisons. Quantizing moves each
  value by at most half an E4M3 step: 2^-4 of the value, or half the subnormal step (2^-10 of
  the block's scale) near 0. The kernel's widening of every byte is checked exactly.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from support.moe_kernel import (
    bf16_tiles_missing,
    needs_kernel,
    quantized_activations,
    relative_error,
    vnni_missing,
)

from numaov.custom_ops import (
    MoeOpError,
    OnnxRuntimeUnsupportedError,
    check_onnxruntime_can_run,
    compile_ir,
    moe_experts,
)
from numaov.custom_ops.moe_ops import (
    bf16_kernel,
    dequantize_experts,
    fp8_row_scales,
    kernel_isa,
    quantize_experts,
    write_moe_onnx,
)
from numaov.exporter.openvino_convert import convert_to_ir
from numaov.models.deepseek_v2 import DeepseekV2Config
from numaov.models.deepseek_v2.moe import deepseek_v2_router

F32_TOL = 1e-5
BF16_TOL = 3e-2
OV_BF16_TOL = 2e-2


def _problem(rows: int, experts: int, top_k: int, hidden: int = 48, inter: int = 20,
             seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g)
    scores = torch.rand(rows, experts, generator=g)
    weights, ids = torch.topk(scores, top_k, dim=-1)  # distinct experts per row, as a router
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    return x, ids, weights, gate_up, down


def _reference(x, ids, weights, gate_up, down, seen=None) -> torch.Tensor:
    """float64, one (row, slot) pair at a time: the definition, not the grouped algorithm.
    ``seen``: what the kernel makes of activation rows ``[N, K]`` (x, and each pair's silu(gate)
    * up) before multiplying them (None: nothing)."""
    seen = seen or (lambda rows: rows.double())
    x, gate_up, down = seen(x), gate_up.double(), down.double()
    inter = down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for n in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            gate, up = gate_up[e, :inter] @ x[n], gate_up[e, inter:] @ x[n]
            h = seen((torch.nn.functional.silu(gate) * up)[None])[0]
            out[n] += weights[n, j].double() * (down[e] @ h)
    return out


# ---------------------------------------------------------------------------------------------
# eager op against float64
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [0, 1, 7, 64, 1000])
def test_eager_matches_float64_at_every_row_count(rows: int) -> None:
    x, ids, weights, gate_up, down = _problem(rows, experts=8, top_k=2)
    got = moe_experts(x, ids, weights, gate_up, down)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert relative_error(got, _reference(x, ids, weights, gate_up, down)) < F32_TOL


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
        assert relative_error(g, r.grad) < F32_TOL, name


@pytest.mark.parametrize("top_k", [1, 2, 6, 8])
def test_eager_matches_float64_at_every_top_k(top_k: int) -> None:
    x, ids, weights, gate_up, down = _problem(9, experts=16, top_k=top_k, seed=top_k)
    assert relative_error(moe_experts(x, ids, weights, gate_up, down),
                _reference(x, ids, weights, gate_up, down)) < F32_TOL


def test_experts_without_rows_and_all_rows_to_one_expert() -> None:
    x, _, weights, gate_up, down = _problem(33, experts=12, top_k=1)
    one = torch.full((33, 1), 5)  # every row to expert 5; the other eleven get nothing
    got = moe_experts(x, one, weights, gate_up, down)
    assert relative_error(got, _reference(x, one, weights, gate_up, down)) < F32_TOL
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
    assert relative_error(moe_experts(x, ids, weights, gate_up, down),
                _reference(x, ids, weights, gate_up, down)) < F32_TOL


def test_bf16_weights_and_activations() -> None:
    x, ids, weights, gate_up, down = _problem(64, experts=8, top_k=2)
    reference = _reference(x, ids, weights, gate_up, down)
    weights_bf16 = moe_experts(x, ids, weights, gate_up.bfloat16(), down.bfloat16())
    assert weights_bf16.dtype == torch.float32
    assert relative_error(weights_bf16, reference) < BF16_TOL
    all_bf16 = moe_experts(x.bfloat16(), ids, weights, gate_up.bfloat16(), down.bfloat16())
    assert all_bf16.dtype == torch.bfloat16
    assert relative_error(all_bf16, reference) < BF16_TOL


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
    assert relative_error(got, exact) < F32_TOL


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


def _compiled(tmp_path: Path, gate_up, down, top_k: int, precision: str, scales=None,
              properties=None):
    onnx_path = write_moe_onnx(tmp_path / "moe.onnx", gate_up, down, top_k, scales)
    xml = convert_to_ir(onnx_path, tmp_path / f"moe_{precision}.xml", precision)
    return compile_ir(xml, precision, properties)


def _feeds(x, ids, weights) -> dict[str, np.ndarray]:
    return {"x": x.numpy(), "ids": ids.numpy(), "weights": weights.numpy()}


@needs_kernel
def test_openvino_op_equals_eager_op_f32(tmp_path: Path) -> None:
    _, _, _, gate_up, down = _problem(1, experts=16, top_k=6, hidden=72, inter=36)
    run = _compiled(tmp_path, gate_up, down, 6, "f32").runner()
    for rows in (0, 1, 7, 64, 1000):
        x, ids, weights, _, _ = _problem(rows, experts=16, top_k=6, hidden=72, inter=36,
                                         seed=rows)
        (got,) = run(_feeds(x, ids, weights))
        assert got.shape == (rows, 72)
        assert relative_error(got, moe_experts(x, ids, weights, gate_up, down)) < F32_TOL, rows
    x, _, weights, _, _ = _problem(50, experts=16, top_k=6, hidden=72, inter=36, seed=9)
    one = torch.full((50, 6), 3)  # all rows' slots to one expert
    (got,) = run(_feeds(x, one, weights))
    assert relative_error(got, moe_experts(x, one, weights, gate_up, down)) < F32_TOL


@needs_kernel
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
        assert relative_error(got, eager) < OV_BF16_TOL, rows
        assert relative_error(got, _reference(x, ids, weights, gate_up, down)) < BF16_TOL, rows


@needs_kernel
# A tile takes a row's weights a 64-byte line at a time (int8 / fp8: 64 values,
# int4: 128) and the rest in single steps; a one-row tile scales each group's sum:
# 96 and 64 values are one line and a rest (int8) or single steps only (int4),
# 288 and 160 lines and a rest for both (int4 in groups of 32), 512 and 256 int4
# lines in groups of 128 (four and two lines a group).
@pytest.mark.parametrize(("weight_format", "group_size", "hidden", "inter"),
                         [("int8", None, 96, 64), ("int8", 16, 96, 64), ("int4", 32, 96, 64),
                          ("int8", None, 288, 160), ("int4", None, 288, 160),
                          ("int4", None, 512, 256)])
def test_openvino_op_equals_eager_op_int8_int4(tmp_path: Path, weight_format: str,
                                               group_size: int | None, hidden: int,
                                               inter: int) -> None:
    _, _, _, gate_up, down = _problem(1, experts=8, top_k=6, hidden=hidden, inter=inter)
    (qg, sg), (qd, sd) = (quantize_experts(w, weight_format, group_size) for w in (gate_up, down))
    run = _compiled(tmp_path, qg, qd, 6, "f32", (sg, sd)).runner()
    for rows in (0, 1, 7, 64, 1000):
        x, ids, weights, _, _ = _problem(rows, experts=8, top_k=6, hidden=hidden, inter=inter,
                                         seed=rows)
        (got,) = run(_feeds(x, ids, weights))
        assert relative_error(got, moe_experts(x, ids, weights, qg, qd, sg, sd)) < F32_TOL, rows


# 96 / 64 values: one 64-value group and a rest; 256 / 128 in weight scale groups of 64 (the
# activations' groups) and, int4, of 128 (its default here); rows per call from one (decode)
# to 300 (across threads; experts of 16 rows and more as outer products)
@pytest.mark.skipif(bool(vnni_missing()), reason=f"no VNNI int8 products: {vnni_missing()}")
@pytest.mark.parametrize(("weight_format", "group_size", "hidden", "inter"), [
    ("int8", None, 96, 64), ("int8", 64, 256, 128), ("int4", None, 256, 128),
    ("int4", 64, 256, 128)])
def test_int8_and_int4_experts_against_quantized_activations(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, weight_format: str,
        group_size: int | None, hidden: int, inter: int) -> None:
    """int8 / int4 experts in a bf16 model (and in an f32 one under NUMAOV_MOE_VNNI=always)
    multiply quantized activations; an f32 model under auto keeps f32 ones, bit for bit what
    off gives. In the bf16 model (bf16-valued x and routing weights) the result is the f32
    model's under always, rounded to bf16 once."""
    monkeypatch.delenv("NUMAOV_MOE_ISA", raising=False)
    _, _, _, gate_up, down = _problem(1, experts=8, top_k=6, hidden=hidden, inter=inter)
    (qg, sg), (qd, sd) = (quantize_experts(w, weight_format, group_size) for w in (gate_up, down))
    dequantized = [dequantize_experts(q, s) for q, s in ((qg, sg), (qd, sd))]
    for name in ("f32", "bf16"):
        (tmp_path / name).mkdir()
    f32 = _compiled(tmp_path / "f32", qg, qd, 6, "f32", (sg, sd)).runner()
    bf16 = _compiled(tmp_path / "bf16", qg, qd, 6, "bf16", (sg, sd)).runner()
    for rows in (1, 3, 7, 64, 300):
        x, ids, weights, _, _ = _problem(rows, experts=8, top_k=6, hidden=hidden, inter=inter,
                                         seed=rows)
        x, weights = x.bfloat16().float(), weights.bfloat16().float()
        feeds = _feeds(x, ids, weights)
        monkeypatch.setenv("NUMAOV_MOE_VNNI", "off")
        (exact,) = f32(feeds)
        monkeypatch.setenv("NUMAOV_MOE_VNNI", "auto")
        (f32_auto,) = f32(feeds)
        (got,) = bf16(feeds)
        monkeypatch.setenv("NUMAOV_MOE_VNNI", "always")
        (quantized,) = f32(feeds)
        assert np.array_equal(f32_auto, exact), rows
        assert np.array_equal(got, torch.from_numpy(quantized).bfloat16().float().numpy()), rows
        as_quantized = _reference(x, ids, weights, *dequantized, seen=quantized_activations)
        assert relative_error(quantized, as_quantized) < 5e-3, rows
        assert relative_error(quantized, _reference(x, ids, weights, *dequantized)) < 3e-2, rows
        assert relative_error(exact, _reference(x, ids, weights, *dequantized)) < F32_TOL, rows


@needs_kernel
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
    assert relative_error(got, moe_experts(x, ids, weights, gate_up, down)) < F32_TOL


def test_onnxruntime_refuses_the_moe_domain(tmp_path: Path) -> None:
    _, _, _, gate_up, down = _problem(1, experts=4, top_k=2)
    path = write_moe_onnx(tmp_path / "moe.onnx", gate_up, down, 2)
    with pytest.raises(OnnxRuntimeUnsupportedError,
                       match=r"ONNX Runtime cannot run numaov\.moe nodes \(MoeExperts\)"):
        check_onnxruntime_can_run(path)


# ---------------------------------------------------------------------------------------------
# fp8 (float8_e4m3fn with DeepSeek-V3's 128 x 128 block scales)
# ---------------------------------------------------------------------------------------------


def _fp8_problem(rows: int, hidden: int, inter: int, seed: int = 0, experts: int = 8,
                 top_k: int = 2):
    x, ids, weights, gate_up, down = _problem(rows, experts=experts, top_k=top_k, hidden=hidden,
                                              inter=inter, seed=seed)
    (qg, sg), (qd, sd) = (quantize_experts(w, "fp8") for w in (gate_up, down))
    return x, ids, weights, gate_up, down, qg, qd, sg, sd


@pytest.mark.parametrize(("hidden", "inter", "groups"),
                         [(48, 20, (1, 1)), (256, 160, (2, 5)), (384, 128, (3, 1))])
def test_fp8_eager_matches_float64_on_the_weights_it_stands_for(hidden: int, inter: int,
                                                                 groups: tuple[int, int]) -> None:
    x, ids, weights, _, _, qg, qd, sg, sd = _fp8_problem(37, hidden, inter)
    assert qg.dtype == qd.dtype == torch.float8_e4m3fn
    assert (sg.shape[2], sd.shape[2]) == groups  # 128-column blocks as per-row groups
    got = moe_experts(x, ids, weights, qg, qd, sg, sd)
    exact = _reference(x, ids, weights, dequantize_experts(qg, sg), dequantize_experts(qd, sd))
    assert relative_error(got, exact) < F32_TOL
    bf16_x = moe_experts(x.bfloat16(), ids, weights, qg, qd, sg, sd)
    assert bf16_x.dtype == torch.bfloat16 and relative_error(bf16_x, exact) < BF16_TOL


@pytest.mark.parametrize(("rows", "k"), [(40, 48), (300, 200), (256, 384)])
def test_fp8_quantize_round_trip_is_within_half_an_e4m3_step(rows: int, k: int) -> None:
    g = torch.Generator().manual_seed(rows)
    stack = torch.randn(3, rows, k, generator=g) * torch.logspace(-6, 1, k)  # subnormals too
    if k % 128 and k > 128:
        with pytest.raises(MoeOpError, match=r"groups of 8 values; expected .* or use --weights "
                           "bf16"):
            quantize_experts(stack, "fp8")
        return
    q, scales = quantize_experts(stack, "fp8")
    assert scales.shape[:2] == (3, rows)
    per_value = scales.repeat_interleave(k // scales.shape[2], dim=2)
    error = (dequantize_experts(q, scales) - stack).abs()
    bound = 2.0**-4 * stack.abs() + 2.0**-10 * per_value
    assert bool((error <= bound * (1 + 1e-5)).all())
    # the largest value of each block lands on 448 exactly
    assert float(q.float().abs().max()) == 448.0
    # the block scales, as DeepSeek-V3 writes them: max |w| of each 128 x 128 block / 448
    block = stack[0, :128, :128] if k >= 128 else stack[0, :128, :]
    assert float(scales[0, 0, 0]) == pytest.approx(float(block.abs().max()) / 448, rel=1e-6)


def _block_lookup(block_scale_inv: torch.Tensor, row_start: int, rows: int, col_start: int,
                  cols: int) -> torch.Tensor:
    """The scale of every value of the slice, straight from its 128 x 128 block."""
    r = (torch.arange(rows) + row_start) // 128
    c = (torch.arange(cols) + col_start) // 128
    return block_scale_inv[r][:, c]


@pytest.mark.parametrize(("n", "k", "row_start", "rows", "col_start", "cols", "groups"), [
    (7168, 2048, 0, 7168, 0, 2048, 16),          # whole down of a V3 expert (H x I)
    (4096, 7168, 1024, 1024, 0, 7168, 56),       # gate_up rows of rank 1 of 4 (I = 1024)
    (7168, 2048, 0, 7168, 512, 512, 4),          # down columns of rank 1 of 4
    (7168, 2048, 0, 7168, 256, 256, 2),          # down columns of rank 1 of 8
    (7168, 2048, 0, 7168, 1920, 128, 1),         # one whole block of columns
    (7168, 2048, 0, 7168, 1056, 64, 1),          # inside one block
    (4096, 1408, 0, 4096, 704, 704, 11),         # V2-Lite down, 2 ranks: groups of 64
    (300, 200, 5, 280, 16, 160, 10),             # partial blocks, groups of 16
    (300, 200, 0, 300, 100, 100, 1),             # crosses 128 in groups of 4: refused
])
def test_fp8_row_scales_of_sharded_slices_match_a_block_lookup(
        n: int, k: int, row_start: int, rows: int, col_start: int, cols: int,
        groups: int) -> None:
    g = torch.Generator().manual_seed(n + k + col_start)
    blocks = torch.rand(-(-n // 128), -(-k // 128), generator=g) + 0.1
    if col_start % 128 + cols > 128 and math.gcd(128, col_start, cols) < 16:
        with pytest.raises(MoeOpError, match="or use --weights bf16"):
            fp8_row_scales(blocks, row_start, rows, col_start, cols)
        return
    scales = fp8_row_scales(blocks, row_start, rows, col_start, cols)
    assert scales.dtype == torch.float32 and scales.shape == (rows, groups)
    per_value = scales.repeat_interleave(cols // groups, dim=1)
    assert torch.equal(per_value, _block_lookup(blocks, row_start, rows, col_start, cols))


def test_fp8_row_scales_refuses_small_groups_and_slices_outside() -> None:
    blocks = torch.ones(4, 4)
    with pytest.raises(MoeOpError, match=r"columns 8 \.\. 248 cut 128-column scale blocks into "
                       r"groups of 8 values; expected .* or use --weights bf16"):
        fp8_row_scales(blocks, 0, 10, 8, 240)
    with pytest.raises(MoeOpError, match="expected a slice inside the weight"):
        fp8_row_scales(blocks, 500, 100, 0, 128)


def test_fp8_stacks_need_scales() -> None:
    x, ids, weights, _, _, qg, qd, sg, sd = _fp8_problem(3, 64, 32)
    with pytest.raises(MoeOpError, match="expected both scales exactly for int8 / int4 / fp8"):
        moe_experts(x, ids, weights, qg, qd)
    with pytest.raises(MoeOpError, match="has 3 groups over rows of 64 values"):
        moe_experts(x, ids, weights, qg, qd, sg.expand(-1, -1, 3).contiguous(), sd)


@needs_kernel
@pytest.mark.parametrize(("hidden", "inter"), [(48, 20), (256, 160)])
def test_openvino_op_equals_eager_op_fp8(tmp_path: Path, hidden: int, inter: int) -> None:
    _, _, _, _, _, qg, qd, sg, sd = _fp8_problem(1, hidden, inter, experts=8, top_k=6)
    compiled = _compiled(tmp_path, qg, qd, 6, "f32", (sg, sd))
    (op,) = [n for n in compiled.model.get_runtime_model().get_ordered_ops()
             if n.get_rt_info()["layerType"].astype(str) == "Reference"]
    # the stacks reach the kernel as fp8 bytes (no Convert to f32 in between)
    assert [op.get_input_element_type(i).get_type_name() for i in (3, 4)] == ["f8e4m3"] * 2
    run = compiled.runner()
    for rows in (0, 1, 7, 64, 300):
        x, ids, weights, *_ = _fp8_problem(rows, hidden, inter, seed=rows, experts=8, top_k=6)
        (got,) = run(_feeds(x, ids, weights))
        assert got.shape == (rows, hidden)
        assert relative_error(got, moe_experts(x, ids, weights, qg, qd, sg, sd)) < F32_TOL, rows


@needs_kernel
@pytest.mark.parametrize("flush_denormals", [False, True])
def test_openvino_fp8_widening_is_exact_for_every_code(tmp_path: Path,
                                                       flush_denormals: bool) -> None:
    """Every E4M3FN byte but the NaNs, in every lane of a 16-value step: down row 16 + c holds
    code c in lane c % 16 (zeros elsewhere), and rows 0 .. 15 hold 1.0 in lane i, so out[i] is
    the activation a[i] and out[16 + c] must be a[c % 16] * value(c) rounded once, where
    value(c) is torch's float8_e4m3fn -> float conversion: subnormals, -0, negatives and 448
    included. Also with OpenVINO's threads flushing denormals (DAZ / FTZ): E4M3's subnormals
    are widened through subnormal IEEE halves, which DAZ must not flush."""
    codes = torch.arange(256)
    nan = (codes & 0x7F) == 0x7F
    hidden, inter = 16 + 256, 16
    down = torch.zeros(1, hidden, inter, dtype=torch.uint8)
    down[0, torch.arange(16), torch.arange(16)] = 0x38  # 1.0
    down[0, 16 + codes, codes % 16] = torch.where(nan, 0, codes).to(torch.uint8)
    down = down.view(torch.float8_e4m3fn)
    g = torch.Generator().manual_seed(5)
    gate_up, _ = quantize_experts(torch.randn(1, 2 * inter, hidden, generator=g), "fp8")
    ones = (torch.ones(1, 2 * inter, 1), torch.ones(1, hidden, 1))
    run = _compiled(tmp_path, gate_up, down, 1, "f32", ones,
                    {"CPU_DENORMALS_OPTIMIZATION": flush_denormals}).runner()
    x = torch.randn(1, hidden, generator=g)
    (got,) = run(_feeds(x, torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)))
    act = got[0, :16]
    assert bool((act != 0).all())
    values = torch.where(nan, 0, codes).to(torch.uint8).view(torch.float8_e4m3fn).float()
    expected = act[(codes % 16).numpy()] * values.numpy()  # float32 products, rounded once
    assert np.array_equal(got[0, 16:], expected)
    assert values.abs().max() == 448 and values[1] == 2.0**-9 and values[0x80 + 7] == -7 * 2.0**-9


@pytest.mark.skipif(bool(bf16_tiles_missing()), reason=f"no bf16 tiles: {bf16_tiles_missing()}")
@pytest.mark.parametrize(("hidden", "inter"), [(48, 20), (256, 160)])
def test_fp8_experts_in_a_bf16_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hidden: int,
                                     inter: int) -> None:
    """A model compiled at bf16 gives the op bf16 activations (compile_ir; at f32 the same IR
    keeps f32 ones). Below the kernel's fp8_tile_min_rows
    rows per expert fp8 experts run exactly as in an f32 model, the sum rounded to bf16 once;
    from there on the bf16 tiles on the weights dequantized to bf16 (each w * scale rounded
    once, as PyTorch dequantizes FP8 weights for a bf16 model): bit for bit what bf16 experts
    holding those dequantized weights give. Top-1 routing, every expert the same rows."""
    monkeypatch.delenv("NUMAOV_MOE_ISA", raising=False)  # AVX2 has no bf16 tiles
    experts = 4
    _, _, _, _, _, qg, qd, sg, sd = _fp8_problem(1, hidden, inter, experts=experts, top_k=1)
    for name in ("fp8_bf16", "fp8_f32", "bf16"):
        (tmp_path / name).mkdir()
    fp8_bf16 = _compiled(tmp_path / "fp8_bf16", qg, qd, 1, "bf16", (sg, sd))
    (op,) = [n for n in fp8_bf16.model.get_runtime_model().get_ordered_ops()
             if n.get_rt_info()["layerType"].astype(str) == "Reference"]
    assert [op.get_input_element_type(i).get_type_name() for i in (0, 3, 4)] == [
        "bf16", "f8e4m3", "f8e4m3"]
    f32_hint = compile_ir(tmp_path / "fp8_bf16" / "moe_bf16.xml", "bf16",
                          {"INFERENCE_PRECISION_HINT": "f32"})
    (op,) = [n for n in f32_hint.model.get_runtime_model().get_ordered_ops()
             if n.get_rt_info()["layerType"].astype(str) == "Reference"]
    assert op.get_input_element_type(0).get_type_name() == "f32"
    fp8_f32 = _compiled(tmp_path / "fp8_f32", qg, qd, 1, "f32", (sg, sd)).runner()
    dequantized = [dequantize_experts(q, s) for q, s in ((qg, sg), (qd, sd))]
    bf16 = _compiled(tmp_path / "bf16", *dequantized, 1, "bf16").runner()
    run = fp8_bf16.runner()
    tile_rows = bf16_kernel()["fp8_tile_min_rows"]
    for per_expert in (1, tile_rows - 1, tile_rows, 75):
        rows = experts * per_expert
        x, _, weights, *_ = _fp8_problem(rows, hidden, inter, seed=rows, experts=experts, top_k=1)
        x = x.bfloat16().float()  # a bf16 model's activations
        ids = (torch.arange(rows) % experts).reshape(rows, 1)
        (got,) = run(_feeds(x, ids, weights))
        if per_expert < tile_rows:
            (exact,) = fp8_f32(_feeds(x, ids, weights))
            assert np.array_equal(got, torch.from_numpy(exact).bfloat16().float().numpy()), rows
        else:
            (tiles,) = bf16(_feeds(x, ids, weights))
            assert np.array_equal(got, tiles), rows
        if per_expert == 1 and bf16_kernel()["kernel"] != "amx":
            # decode runs no tiles: NUMAOV_MOE_AMX=always without AMX is no error for it
            monkeypatch.setenv("NUMAOV_MOE_AMX", "always")
            (again,) = run(_feeds(x, ids, weights))
            monkeypatch.delenv("NUMAOV_MOE_AMX")
            assert np.array_equal(again, got)
        reference = _reference(x, ids, weights, *dequantized)
        assert relative_error(got, reference) < BF16_TOL, rows


# ---------------------------------------------------------------------------------------------
# the AVX2 kernel (CPUs without AVX-512; NUMAOV_MOE_ISA=avx2 forces it)
# ---------------------------------------------------------------------------------------------


def _avx2_missing() -> str:
    import os

    before = os.environ.get("NUMAOV_MOE_ISA")
    os.environ["NUMAOV_MOE_ISA"] = "avx2"
    try:
        kernel_isa("f32")
        return ""
    except MoeOpError as exc:
        return str(exc)
    finally:
        if before is None:
            del os.environ["NUMAOV_MOE_ISA"]
        else:
            os.environ["NUMAOV_MOE_ISA"] = before


# Sizes with tails: hidden 100 (12 whole 8-value steps of gate / up and a tail of 4),
# intermediate 37 (down: 4 steps and a lone value); int4 rows are whole 32-value blocks in
# groups of 32; fp8 at 256 / 160 has 2 and 5 scale groups per row.
@pytest.mark.skipif(bool(_avx2_missing()), reason=f"no AVX2 kernel: {_avx2_missing()}")
@pytest.mark.parametrize(("weight_format", "hidden", "inter"), [
    ("f32", 100, 37), ("bf16", 100, 37), ("int8", 100, 37), ("int4", 96, 64),
    ("fp8", 100, 37), ("fp8", 256, 160)])
def test_avx2_kernel_matches_float64_and_the_avx512_kernel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, weight_format: str, hidden: int,
        inter: int) -> None:
    """The AVX2 kernel against the float64 reference on the weights the stacks stand for (f32
    and the weight-only formats: 1e-5; bf16: BF16_TOL) at decode, a few rows and prefill, and
    against the AVX-512 kernel where the CPU has it, which sums the same products in another
    order (1e-5; bf16: 2e-3, silu(gate) * up may round to bf16 the other way, as for AMX)."""
    experts, top_k = 8, 2
    _, _, _, gate_up, down = _problem(1, experts=experts, top_k=top_k, hidden=hidden,
                                      inter=inter)
    scales = None
    stacks = (gate_up, down)
    if weight_format in ("int8", "int4", "fp8"):
        group = 32 if weight_format == "int4" else None
        (qg, sg), (qd, sd) = (quantize_experts(w, weight_format, group) for w in (gate_up, down))
        stacks, scales = (qg, qd), (sg, sd)
        gate_up, down = dequantize_experts(qg, sg), dequantize_experts(qd, sd)
    precision = "bf16" if weight_format == "bf16" else "f32"
    run = _compiled(tmp_path, *stacks, top_k, precision, scales).runner()
    monkeypatch.setenv("NUMAOV_MOE_ISA", "avx2")
    assert kernel_isa(weight_format) == "avx2"
    has_avx512 = True
    try:
        monkeypatch.setenv("NUMAOV_MOE_ISA", "avx512")
        kernel_isa(weight_format)
    except MoeOpError:
        has_avx512 = False
    for rows in (1, 3, 64, 300):
        x, ids, weights, *_ = _problem(rows, experts=experts, top_k=top_k, hidden=hidden,
                                       inter=inter, seed=rows)
        monkeypatch.setenv("NUMAOV_MOE_ISA", "avx2")
        (got,) = run(_feeds(x, ids, weights))
        reference = _reference(x, ids, weights, gate_up, down)
        assert relative_error(got, reference) < (BF16_TOL if precision == "bf16" else F32_TOL), rows
        if has_avx512:
            monkeypatch.setenv("NUMAOV_MOE_ISA", "avx512")
            (other,) = run(_feeds(x, ids, weights))
            assert relative_error(got, other) < (2e-3 if precision == "bf16" else F32_TOL), rows


def test_a_bad_or_missing_isa_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NUMAOV_MOE_ISA", "sse")
    with pytest.raises(MoeOpError, match=r"NUMAOV_MOE_ISA='sse'; expected auto, avx512 or avx2"):
        kernel_isa("f32")
    with pytest.raises(MoeOpError, match=r"NUMAOV_MOE_ISA='sse'"):
        bf16_kernel()


# Rows per expert of top-1 routing: every tile height (1 to kTileRows = 4) alone and after
# whole tiles (5 = 4 + 1, 6 = 4 + 2, 7 = 4 + 3, 9 = 2 x 4 + 1), batched decode's counts.
FEW_ROWS = (1, 2, 3, 4, 5, 6, 7, 9)


@needs_kernel
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize(("weight_format", "group"),
                         [("int8", None), ("int8", 32), ("int4", 32), ("int4", 64), ("fp8", None)])
def test_scaled_formats_at_each_tile_height(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            isa: str, weight_format: str,
                                            group: int | None) -> None:
    """Tiles of one to four rows sum a scale group's products in different ways (one row:
    unscaled sums scaled at the group's end; more: int4 looks its weights up already scaled,
    the byte formats scale each widened vector; AVX2 tiles take two rows at most): each
    expert's rows against float64 on the weights the stacks stand for (1e-5). hidden 256 and
    intermediate 128 give every format several scale groups per row (fp8: two 128-value
    blocks)."""
    monkeypatch.setenv("NUMAOV_MOE_ISA", isa)
    try:
        kernel_isa(weight_format)
    except MoeOpError as exc:
        pytest.skip(str(exc))
    experts, hidden, inter = len(FEW_ROWS), 256, 128
    _, _, _, gate_up, down = _problem(1, experts=experts, top_k=1, hidden=hidden, inter=inter)
    (qg, sg), (qd, sd) = (quantize_experts(w, weight_format, group) for w in (gate_up, down))
    run = _compiled(tmp_path, qg, qd, 1, "f32", (sg, sd)).runner()
    g = torch.Generator().manual_seed(3)
    rows = sum(FEW_ROWS)
    ids = torch.repeat_interleave(torch.arange(experts), torch.tensor(FEW_ROWS))
    ids = ids[torch.randperm(rows, generator=g)].reshape(rows, 1)
    x = torch.randn(rows, hidden, generator=g)
    weights = torch.rand(rows, 1, generator=g)
    (got,) = run(_feeds(x, ids, weights))
    reference = _reference(x, ids, weights, dequantize_experts(qg, sg), dequantize_experts(qd, sd))
    for expert, count in enumerate(FEW_ROWS):
        mine = (ids[:, 0] == expert).numpy()
        assert relative_error(got[mine], reference[mine]) < F32_TOL, count

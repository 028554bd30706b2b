"""numaov::dense_linear, a linear layer on the MoE experts' kernel (what keeps a released FP8
checkpoint's attention projections one byte per weight): the eager op against float64 on the
weights the stored ones stand for, the OpenVINO op against the eager op, and both faces'
errors.

Tolerances (max |got - expected| / max |expected|), as for the experts (test_moe_op.py):
f32 and weight-only formats (int8, int4, fp8: widened exactly, f32 activations) 1e-5 against
float64 on the dequantized weight (f32 sums in another order); bf16 weights, and fp8 in a bf16
model from the bf16 tiles' row count, 3e-2 against float64 (activations and weights rounded
to bf16, 2^-9 relative each); bf16-valued activations and weights, 1e-2 (only the output is
rounded to bf16). Below that row count a bf16 model's fp8 linear is the f32
model's result rounded to bf16 once: compared bit for bit. int8 weights against quantized activations
(and int4 ones; AVX512-VNNI; test_moe_op.py's rule): 1e-5 against float64 on the activations as quantized
(exact int32 sums per group, scaled in f32), 3e-2 against the unquantized ones.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support.moe_kernel import (
    ACT_GROUP,
    bf16_tiles_missing,
    needs_kernel,
    quantized_activations,
    relative_error,
    vnni_missing,
)

from numaov.custom_ops import MoeOpError, compile_ir
from numaov.custom_ops.moe_ops import (
    bf16_kernel,
    dense_linear,
    dequantize_experts,
    int8_kernel,
    quantize_experts,
    write_dense_linear_onnx,
)
from numaov.exporter.openvino_convert import convert_to_ir

F32_TOL = 1e-5
BF16_TOL = 3e-2
BF16_OUTPUT_TOL = 1e-2


def _weight(outs: int, k: int, weight_format: str, seed: int = 0, group_size: int | None = None):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(1, outs, k, generator=g) / k**0.5
    stored, scale = quantize_experts(w, weight_format, group_size)
    return stored[0], None if scale is None else scale[0]


def _standing_for(stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return dequantize_experts(stored[None], None if scale is None else scale[None])[0].double()


@pytest.mark.parametrize("weight_format", ["f32", "bf16", "int8", "int4", "fp8"])
def test_eager_matches_float64_on_the_weight_it_stands_for(weight_format: str) -> None:
    stored, scale = _weight(72, 256, weight_format)
    x = torch.randn(2, 5, 256)  # any leading dims
    got = dense_linear(x, stored, scale)
    assert got.shape == (2, 5, 72) and got.dtype == torch.float32
    xr = x.bfloat16().double() if weight_format == "bf16" else x.double()
    tolerance = BF16_TOL if weight_format == "bf16" else F32_TOL
    assert relative_error(got, xr @ _standing_for(stored, scale).T) < tolerance


def _compiled(tmp_path: Path, stored, scale, precision: str):
    onnx_path = write_dense_linear_onnx(tmp_path / "linear.onnx", stored, scale)
    xml = convert_to_ir(onnx_path, tmp_path / f"linear_{precision}.xml", precision)
    return compile_ir(xml, precision)


# 160 and 1,152 values per row: whole 64-byte lines and a rest, one and nine fp8 scale groups
# (128 columns each); 131 outputs: column blocks, a partial last tile and a partial last
# 128-row scale block
@needs_kernel
@pytest.mark.parametrize(("weight_format", "k"), [
    ("f32", 160), ("int8", 160), ("int4", 160), ("fp8", 160), ("fp8", 1152)])
def test_openvino_op_equals_eager_op(tmp_path: Path, weight_format: str, k: int) -> None:
    stored, scale = _weight(131, k, weight_format)
    run = _compiled(tmp_path, stored, scale, "f32").runner()
    for rows in (0, 1, 2, 3, 5, 9, 64, 300):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        (got,) = run({"x": x.numpy()})
        assert got.shape == (rows, 131)
        assert relative_error(got, dense_linear(x, stored, scale)) < F32_TOL, rows


@pytest.mark.skipif(bool(bf16_tiles_missing()), reason=f"no bf16 tiles: {bf16_tiles_missing()}")
def test_fp8_in_a_bf16_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled at bf16 the op gets bf16 activations and keeps the weight fp8 (the CPU plugin
    does not widen it); below the bf16 tiles' row count the result is the exact one rounded
    once, from there on the tiles' on the weight dequantized to bf16."""
    monkeypatch.delenv("NUMAOV_MOE_ISA", raising=False)
    stored, scale = _weight(96, 384, "fp8")
    (tmp_path / "bf16").mkdir()
    compiled = _compiled(tmp_path / "bf16", stored, scale, "bf16")
    (op,) = [n for n in compiled.model.get_runtime_model().get_ordered_ops()
             if n.get_rt_info()["layerType"].astype(str) == "Reference"]
    assert [op.get_input_element_type(i).get_type_name() for i in (0, 1)] == ["bf16", "f8e4m3"]
    run = compiled.runner()
    exact = _compiled(tmp_path, stored, scale, "f32").runner()
    tile_rows = bf16_kernel()["fp8_tile_min_rows"]
    for rows in (1, tile_rows - 1, tile_rows, 200):
        x = torch.randn(rows, 384, generator=torch.Generator().manual_seed(rows)).bfloat16().float()
        (got,) = run({"x": x.numpy()})
        if rows < tile_rows:
            (want,) = exact({"x": x.numpy()})
            assert np.array_equal(got, torch.from_numpy(want).bfloat16().float().numpy()), rows
        assert relative_error(got, x.double() @ _standing_for(stored, scale).T) < BF16_TOL, rows


# Outer products from 16 rows where AMX is not used (dot-product tiles below): rows on both
# sides, one and two 16-row blocks and a partial one; 37 outputs (a partial weight block of 16
# rows, and of 8 within it); K of 97 values (an odd pair at the end) and 256
@pytest.mark.skipif(bool(bf16_tiles_missing()), reason=f"no bf16 tiles: {bf16_tiles_missing()}")
@pytest.mark.parametrize("k", [97, 256])
def test_bf16_weights_on_either_side_of_the_outer_products(tmp_path: Path, k: int) -> None:
    stored, _ = _weight(37, k, "bf16")
    run = _compiled(tmp_path, stored, None, "bf16").runner()
    for rows in (1, 15, 16, 17, 32, 33, 100):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16().float()
        (got,) = run({"x": x.numpy()})
        # bf16-valued operands: exact products, f32 sums, one rounding of the output to bf16
        # (2^-9 of a value, measured 2e-3 .. 3.5e-3 of the largest)
        assert relative_error(got, x.double() @ stored.double().T) < BF16_OUTPUT_TOL, rows


# int8 / int4 weights against quantized activations: 160 values (two 64-value groups, the
# second short), 131 (a last quad of 3 values: read through a zero-padded word), 256 in one scale group per row and in weight groups of 64 (int4: 128, its
# default, and 64), 192 (int4 in three groups of 64); rows 1 to 5 (every micro-tile height,
# then a second tile), 16 (one outer-product block), 64 and 300 (across threads); 131 outputs
# (a partial last tile)
@pytest.mark.skipif(bool(vnni_missing()), reason=f"no VNNI int8 products: {vnni_missing()}")
@pytest.mark.parametrize(("weight_format", "k", "group_size"), [
    ("int8", 160, None), ("int8", 131, None), ("int8", 256, None), ("int8", 256, 64), ("int4", 256, None),
    ("int4", 256, 64), ("int4", 192, None)])
def test_int8_and_int4_weights_against_quantized_activations(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, weight_format: str, k: int,
        group_size: int | None) -> None:
    """A bf16 model runs int8 / int4 weights against activations quantized per row in groups
    of 64 (the weight stays as stored: the CPU plugin does not widen it); with bf16-valued
    activations its result is the f32 model's under NUMAOV_MOE_VNNI=always rounded once. An
    f32 model under auto keeps f32 activations, bit for bit what off gives."""
    monkeypatch.delenv("NUMAOV_MOE_ISA", raising=False)
    assert int8_kernel()["act_group"] == ACT_GROUP
    stored, scale = _weight(131, k, weight_format, group_size=group_size)
    (tmp_path / "bf16").mkdir()
    compiled = _compiled(tmp_path / "bf16", stored, scale, "bf16")
    (op,) = [n for n in compiled.model.get_runtime_model().get_ordered_ops()
             if n.get_rt_info()["layerType"].astype(str) == "Reference"]
    assert [op.get_input_element_type(i).get_type_name() for i in (0, 1)] == [
        "bf16", "i8" if weight_format == "int8" else "u8"]
    bf16, f32 = compiled.runner(), _compiled(tmp_path, stored, scale, "f32").runner()
    weight = _standing_for(stored, scale)
    for rows in (1, 2, 3, 4, 5, 16, 64, 300):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16().float()
        monkeypatch.setenv("NUMAOV_MOE_VNNI", "off")
        (exact,) = f32({"x": x.numpy()})
        monkeypatch.setenv("NUMAOV_MOE_VNNI", "auto")
        (f32_auto,) = f32({"x": x.numpy()})
        (got,) = bf16({"x": x.numpy()})
        monkeypatch.setenv("NUMAOV_MOE_VNNI", "always")
        (quantized,) = f32({"x": x.numpy()})
        assert np.array_equal(f32_auto, exact), rows
        assert np.array_equal(got, torch.from_numpy(quantized).bfloat16().float().numpy()), rows
        assert relative_error(quantized, quantized_activations(x) @ weight.T) < F32_TOL, rows
        assert relative_error(quantized, x.double() @ weight.T) < 3e-2, rows


@pytest.mark.skipif(bool(vnni_missing()), reason=f"no VNNI int8 products: {vnni_missing()}")
@pytest.mark.parametrize(("weight_format", "group_size"), [("int8", 16), ("int4", 32)])
def test_weight_groups_finer_than_the_activations_keep_f32_activations(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, weight_format: str,
        group_size: int) -> None:
    """Weight scale groups of 16 (int8) or 32 (int4) values do not hold whole 64-value
    activation groups: such a weight runs on f32 activations even under
    NUMAOV_MOE_VNNI=always."""
    stored, scale = _weight(40, 128, weight_format, group_size=group_size)
    run = _compiled(tmp_path, stored, scale, "f32").runner()
    x = torch.randn(3, 128)
    monkeypatch.setenv("NUMAOV_MOE_VNNI", "always")
    (got,) = run({"x": x.numpy()})
    monkeypatch.setenv("NUMAOV_MOE_VNNI", "off")
    (exact,) = run({"x": x.numpy()})
    assert np.array_equal(got, exact)
    assert relative_error(got, x.double() @ _standing_for(stored, scale).T) < F32_TOL


@needs_kernel
def test_a_bad_vnni_setting_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stored, scale = _weight(8, 64, "int8")
    run = _compiled(tmp_path, stored, scale, "f32").runner()
    monkeypatch.setenv("NUMAOV_MOE_VNNI", "sometimes")
    with pytest.raises(MoeOpError, match="NUMAOV_MOE_VNNI='sometimes'; expected auto, off or "
                       "always") as caught:
        int8_kernel()
    assert caught.value.parameter == "NUMAOV_MOE_VNNI"
    with pytest.raises(Exception, match="NUMAOV_MOE_VNNI='sometimes'") as caught:
        run({"x": np.zeros((2, 64), np.float32)})
    assert "Traceback" not in str(caught.value)


def test_eager_refuses_bad_inputs() -> None:
    stored, scale = _weight(8, 64, "fp8")
    with pytest.raises(MoeOpError, match=r"x \[3, 32\] and weight \[8, 64\] differ in input size"):
        dense_linear(torch.randn(3, 32), stored, scale)
    with pytest.raises(MoeOpError, match="expected a scale exactly for int8 / int4 / fp8"):
        dense_linear(torch.randn(3, 64), stored, None)
    with pytest.raises(MoeOpError, match=r"scale is torch.float32 \[4, 1\]; expected "
                       r"torch.float32 \[8, groups\]"):
        dense_linear(torch.randn(3, 64), stored, scale[:4])
    with pytest.raises(MoeOpError, match="x is torch.int64"):
        dense_linear(torch.ones(3, 64, dtype=torch.long), stored, scale)


@needs_kernel
def test_openvino_op_refuses_a_misfit_input_in_one_line(tmp_path: Path) -> None:
    stored, scale = _weight(8, 64, "int8")
    run = _compiled(tmp_path, stored, scale, "f32").runner()
    with pytest.raises(Exception, match=r"x \[2,\s?32\]|64") as caught:
        run({"x": np.zeros((2, 32), np.float32)})
    assert "Traceback" not in str(caught.value)

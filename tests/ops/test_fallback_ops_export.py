"""ONNX and OpenVINO faces of the fallback ops.

Each op is exported alone (``torch.onnx.export(dynamo=True)`` with the numaov translation table
and dynamic dims), once per module, then run in ONNX Runtime and OpenVINO at shapes other than
the export shapes (hypothesis draws them) and compared with the eager op. A layer-type
inventory of OpenVINO's compiled model proves the fusions (RMS, MVN, RoPE) and that per-frame
modulation rows are broadcast, not materialised, so a fusion regression fails here.

OpenVINO is compiled with ``INFERENCE_PRECISION_HINT=f32`` in the accuracy tests: this machine
has AVX512-BF16 (and reports AMX), where OpenVINO's default performance mode runs in bf16 and
an fp32 comparison would measure bf16 rounding instead of the lowering.

Tolerances (graph vs eager op, both computing in fp32, so only arithmetic order differs):
- fp32: rtol 1e-5 / atol 1e-5. Fused kernels (RMS, MVN, RoPE) sum and take roots in another
  order than PyTorch; over C <= 64 channels with O(1) values that is a few fp32 ulps.
- bf16 / fp16 activations (cast inside the module, so the op sees them), ONNX Runtime: it
  computes the fp32 subgraph exactly as written and rounds once, like the eager op, so the two
  agree or differ by one ulp where the fp32 values straddle a rounding boundary: rtol 2**-7
  (bf16, one ulp = 2**-8 relative) and 2**-10 (fp16, one ulp = 2**-11 relative), atol the same
  (values near zero). (Measured: bit-identical.)
- bf16 / fp16 activations, OpenVINO: its CPU plugin runs the region between a low-precision
  Convert pair in that precision (even with an f32 hint), so intermediates such as
  ``1 + scale``, the normalised value before the affine, or the rotary products are rounded
  too; a few such roundings compound to a few ulps of the largest output. Bound: atol of
  4 ulps at the output's largest magnitude, ``4 * eps(dtype) * max|expected|`` (measured up
  to 2 ulps).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort
import openvino as ov
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from numaov.custom_ops import (
    FallbackOpError,
    compile_ir,
    fuse_scale_shift,
    norm_infer,
    onnx_opset_version,
    onnx_translation_table,
    rotary_embedding,
    rows_copy,
    scale_residual_norm_scale_shift,
)

SEED = 20261129
TOL = {  # (rtol, atol) per activation dtype; reasons in the module docstring
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2**-7, 2**-7),
    torch.float16: (2**-10, 2**-10),
}
C = 64  # channels
HEADS, HEAD_DIM = 4, 16
FEW = settings(max_examples=6, deadline=None)
Dim = torch.export.Dim


def setup_module() -> None:
    print(f"seed {SEED}")


# ---------------------------------------------------------------------------------------------
# Export / run helpers
# ---------------------------------------------------------------------------------------------


class Exported:
    """One module exported to ONNX, with ONNX Runtime and OpenVINO sessions on it."""

    def __init__(self, module: torch.nn.Module, args: tuple, dynamic_shapes: tuple, path: Path,
                 lowering: str = "decomposed") -> None:
        self.module = module
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module, args, dynamo=True, dynamic_shapes=dynamic_shapes,
                custom_translation_table=onnx_translation_table(lowering),
                opset_version=onnx_opset_version(lowering), verbose=False,
            )
        program.save(str(path))
        self.path = path
        self.names = [i.name for i in ort.InferenceSession(str(path)).get_inputs()]
        self._ort: ort.InferenceSession | None = None
        self._ov: dict[str, ov.CompiledModel] = {}

    def ort(self, *inputs: torch.Tensor) -> list[np.ndarray]:
        if self._ort is None:
            self._ort = ort.InferenceSession(str(self.path))
        return self._ort.run(None, dict(zip(self.names, (t.numpy() for t in inputs), strict=True)))

    def compiled(self, precision: str = "f32") -> ov.CompiledModel:
        """Compiled as the product compiles (``compile_ir``), at ``precision``."""
        if precision not in self._ov:
            self._ov[precision] = compile_ir(self.path, precision).model
        return self._ov[precision]

    def openvino(self, *inputs: torch.Tensor) -> list[np.ndarray]:
        result = self.compiled()([t.numpy() for t in inputs])
        return [result[i] for i in range(len(result))]

    def eager(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        with torch.no_grad():
            out = self.module(*inputs)
        return list(out) if isinstance(out, tuple) else [out]

    def check(self, *inputs: torch.Tensor, dtype: torch.dtype = torch.float32,
              runtimes: Sequence[str] = ("ort", "openvino")) -> None:
        """Both runtimes agree with the eager op within the dtype's tolerance."""
        expected = self.eager(*inputs)
        for runtime in runtimes:
            actual = self.ort(*inputs) if runtime == "ort" else self.openvino(*inputs)
            assert len(actual) == len(expected)
            for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
                assert a.shape == tuple(e.shape), (runtime, i, a.shape, e.shape)
                rtol, atol = TOL[dtype]
                if runtime == "openvino" and dtype != torch.float32 and e.numel():
                    rtol, atol = 0.0, 4 * torch.finfo(dtype).eps * float(e.abs().max())
                np.testing.assert_allclose(a, e.numpy(), rtol=rtol, atol=atol,
                                           err_msg=f"{runtime} output {i}")


def layers(compiled: ov.CompiledModel) -> list[tuple[str, list[ov.PartialShape]]]:
    """Executed layer types with their input shapes (rt_info["layerType"] of the runtime model)."""
    return [
        (node.get_rt_info()["layerType"].astype(str), [i.get_partial_shape() for i in node.inputs()])
        for node in compiled.get_runtime_model().get_ordered_ops()
    ]


def layer_counts(compiled: ov.CompiledModel) -> Counter:
    ignore = {"Input", "Output", "Const"}
    return Counter(kind for kind, _ in layers(compiled) if kind not in ignore)


def _cast(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t.to(dtype)


def randn(*shape: int, gen: torch.Generator, scale: float = 1.0, offset: float = 0.0):
    return torch.randn(shape, generator=gen) * scale + offset


# ---------------------------------------------------------------------------------------------
# Modules: each exports one op (several calls of it, to cover its shape variants in one export)
# ---------------------------------------------------------------------------------------------


class Modulation(torch.nn.Module):
    """fuse_scale_shift over every scale/shift shape; activations cast to ``dtype`` inside."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x, frame, token, bc, one_one_c, channel, scalar):
        x = x.to(self.dtype)
        outs = (
            fuse_scale_shift(x, frame, bc),  # per-frame scale, [B, C] shift
            fuse_scale_shift(x, token, frame, 0.0),  # [B, L, C] scale, per-frame shift
            fuse_scale_shift(x, one_one_c, channel),  # [1, 1, C] and [C]
            fuse_scale_shift(x, scalar, token.to(self.dtype)),  # scalar, same-dtype [B, L, C]
        )
        return tuple(o.float() for o in outs)


def modulation_inputs(b: int, frames: int, per_frame: int, gen: torch.Generator):
    seq = frames * per_frame
    return (
        randn(b, seq, C, gen=gen), randn(b, frames, 1, C, gen=gen, scale=0.5),
        randn(b, seq, C, gen=gen, scale=0.5), randn(b, C, gen=gen, scale=0.5),
        randn(1, 1, C, gen=gen, scale=0.5), randn(C, gen=gen), randn(gen=gen),
    )


def modulation_dims() -> tuple:
    b, seq, f = Dim("B"), Dim("L"), Dim("F")
    return ({0: b, 1: seq}, {0: b, 1: f}, {0: b, 1: seq}, {0: b}, None, None, None)


class Norms(torch.nn.Module):
    """norm_infer: RMS with weight, RMS without, LayerNorm without affine, LayerNorm affine."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(SEED)
        self.weight = torch.nn.Parameter(randn(C, gen=gen, offset=1.0))
        self.bias = torch.nn.Parameter(randn(C, gen=gen))
        self.dtype = dtype

    def forward(self, x):
        x = x.to(self.dtype)
        outs = (
            norm_infer(x, self.weight, None, 1e-6, True),
            norm_infer(x, None, None, 1e-6, True),
            norm_infer(x, None, None, 1e-6, False),
            norm_infer(x, self.weight, self.bias, 1e-5, False),
        )
        return tuple(o.float() for o in outs)


class Rotary(torch.nn.Module):
    """rotary_embedding: both forms, [B, T, H, D] and [T, H, D], D/2- and D-column tables."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x, x3, cos, sin):
        x, x3 = x.to(self.dtype), x3.to(self.dtype)
        outs = (
            rotary_embedding(x, cos, sin, True),
            rotary_embedding(x, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1), False),
            rotary_embedding(x3, cos, sin, False),
            rotary_embedding(x3, cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1), True),
        )
        return tuple(o.float() for o in outs)


def rotary_inputs(b: int, seq: int, gen: torch.Generator):
    angle = torch.rand(seq, HEAD_DIM // 2, generator=gen) * 6.3
    return (randn(b, seq, HEADS, HEAD_DIM, gen=gen), randn(seq, HEADS, HEAD_DIM, gen=gen),
            angle.cos(), angle.sin())


def rotary_dims() -> tuple:
    b, t = Dim("B"), Dim("T")
    return ({0: b, 1: t}, {0: t}, {0: t}, {0: t})


class ResidualNormModulation(torch.nn.Module):
    """scale_residual_norm_scale_shift: Wan's LayerNorm form with per-frame gate/scale, and
    an RMS affine form without gate."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(SEED + 1)
        self.weight = torch.nn.Parameter(randn(C, gen=gen, offset=1.0))
        self.bias = torch.nn.Parameter(randn(C, gen=gen))
        self.dtype = dtype

    def forward(self, residual, x, gate, scale, shift):
        residual, x = residual.to(self.dtype), x.to(self.dtype)
        a, r1 = scale_residual_norm_scale_shift(residual, x, gate, None, None, 1e-6, False,
                                                scale, shift)
        b, r2 = scale_residual_norm_scale_shift(r1, x, None, self.weight, self.bias, 1e-6, True,
                                                shift, scale, 0.0)
        return a.float(), r1.float(), b.float(), r2.float()


def residual_inputs(b: int, frames: int, per_frame: int, gen: torch.Generator):
    seq = frames * per_frame
    return (randn(b, seq, C, gen=gen), randn(b, seq, C, gen=gen),
            randn(b, frames, 1, C, gen=gen, scale=0.5), randn(b, frames, 1, C, gen=gen, scale=0.5),
            randn(b, C, gen=gen, scale=0.5))


def residual_dims() -> tuple:
    b, seq, f = Dim("B"), Dim("L"), Dim("F")
    return ({0: b, 1: seq}, {0: b, 1: seq}, {0: b, 1: f}, {0: b, 1: f}, {0: b})


class RowCopies(torch.nn.Module):
    """rows_copy both directions (on copies of dst: an ONNX graph cannot mutate its input)."""

    def forward(self, dst, src):
        gathered, scattered = dst.clone(), dst.clone()
        rows_copy(gathered, src, 2, 3, False)
        rows_copy(scattered, src, 1, 5, True)
        return gathered, scattered


# ---------------------------------------------------------------------------------------------
# Exports, shared by the tests of a module (each costs a few seconds)
# ---------------------------------------------------------------------------------------------

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> Callable[[str], Exported]:
    cache: dict[str, Exported] = {}
    folder = tmp_path_factory.mktemp("fallback_onnx")
    gen = torch.Generator().manual_seed(SEED)

    def get(key: str) -> Exported:
        if key not in cache:
            kind, dtype_name, lowering = (key.split("-") + ["decomposed"])[:3]
            dtype = DTYPES[dtype_name]
            path = folder / f"{key}.onnx"
            if kind == "modulation":  # exported at F=5, L=1280 (the shapes)
                cache[key] = Exported(Modulation(dtype), modulation_inputs(2, 5, 256, gen),
                                      modulation_dims(), path, lowering)
            elif kind == "norms":
                cache[key] = Exported(Norms(dtype), (randn(2, 9, C, gen=gen),),
                                      ({0: Dim("B"), 1: Dim("L")},), path, lowering)
            elif kind == "rotary":
                cache[key] = Exported(Rotary(dtype), rotary_inputs(2, 9, gen), rotary_dims(),
                                      path, lowering)
            elif kind == "residual":
                cache[key] = Exported(ResidualNormModulation(dtype),
                                      residual_inputs(2, 5, 4, gen), residual_dims(), path,
                                      lowering)
            elif kind == "rows":
                cache[key] = Exported(RowCopies(), (randn(6, 8, gen=gen), randn(5, 8, gen=gen)),
                                      ({0: Dim("D")}, {0: Dim("S")}), path, lowering)
        return cache[key]

    return get


# ---------------------------------------------------------------------------------------------
# Accuracy at shapes other than the export shapes
# ---------------------------------------------------------------------------------------------


def test_per_frame_modulation_exported_at_f5_runs_at_f13(exports):
    """Exported at F=5, L=1280; L/F comes from run-time shapes, so F=13, L=3120 is right."""
    gen = torch.Generator().manual_seed(SEED)
    exports("modulation-f32").check(*modulation_inputs(1, 13, 240, gen))


@pytest.mark.parametrize("kind", ["modulation", "residual"])
@FEW
@given(b=st.integers(1, 3), frames=st.integers(1, 7), per_frame=st.integers(1, 9),
       seed=st.integers(0, 2**31 - 1))
def test_per_frame_ops_dynamic_shapes(exports, kind, b, frames, per_frame, seed):
    """fuse_scale_shift and scale_residual_norm_scale_shift at drawn B, F and L/F."""
    build = {"modulation": modulation_inputs, "residual": residual_inputs}[kind]
    gen = torch.Generator().manual_seed(seed)
    exports(f"{kind}-f32").check(*build(b, frames, per_frame, gen))


@pytest.mark.parametrize("dtype_name", ["bf16", "f16"])
def test_modulation_low_precision_activations(exports, dtype_name):
    gen = torch.Generator().manual_seed(SEED)
    exports(f"modulation-{dtype_name}").check(*modulation_inputs(2, 3, 7, gen),
                                              dtype=DTYPES[dtype_name])


@pytest.mark.parametrize("kind", ["norms", "rotary"])
@pytest.mark.parametrize("lowering", ["decomposed", "opset23"])
@FEW
@given(b=st.integers(1, 3), seq=st.integers(1, 33), seed=st.integers(0, 2**31 - 1))
def test_token_ops_dynamic_shapes(exports, kind, lowering, b, seq, seed):
    """norm_infer and rotary_embedding, both lowerings, at drawn B and L (T)."""
    gen = torch.Generator().manual_seed(seed)
    inputs = ((randn(b, seq, C, gen=gen, scale=3.0, offset=1.0),) if kind == "norms"
              else rotary_inputs(b, seq, gen))
    exports(f"{kind}-f32-{lowering}").check(*inputs)


@pytest.mark.parametrize("kind", ["norms", "rotary", "residual"])
def test_bf16_activations(exports, kind):
    """bf16 activations, fp32 parameters/tables: decomposed lowering (ORT has no bf16 kernels
    for the opset-23 ops)."""
    gen = torch.Generator().manual_seed(SEED)
    inputs = {
        "norms": (randn(3, 11, C, gen=gen, scale=3.0, offset=1.0),),
        "rotary": rotary_inputs(3, 11, gen),
        "residual": residual_inputs(3, 3, 5, gen),
    }[kind]
    exports(f"{kind}-bf16").check(*inputs, dtype=torch.bfloat16)


@FEW
@given(dst_rows=st.integers(1, 9), src_rows=st.integers(1, 9))
def test_rows_copy_clamps_at_run_time(exports, dst_rows, src_rows):
    """The graph was exported with offset/n fixed; the clamping follows run-time row counts."""
    gen = torch.Generator().manual_seed(SEED + dst_rows * 10 + src_rows)
    exported = exports("rows-f32")
    exported.check(randn(dst_rows, 8, gen=gen), randn(src_rows, 8, gen=gen))


# ---------------------------------------------------------------------------------------------
# OpenVINO layer inventory: the fusions this module's lowering exists for
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lowering", ["decomposed", "opset23"])
def test_openvino_fuses_norms(exports, lowering):
    counts = layer_counts(exports(f"norms-f32-{lowering}").compiled())
    # Two RMSNorms -> RMS; two LayerNorms -> MVN; the affine LayerNorm keeps one Eltwise for
    # its weight/bias because its result is a model output (inside a model it folds into MVN).
    assert counts["RMS"] == 2 and counts["MVN"] == 2, counts
    assert not {"Reduce", "Power", "Sqrt"} & set(counts), counts
    assert counts["Eltwise"] <= 1, counts


def test_openvino_fuses_rotary(exports):
    compiled = exports("rotary-f32").compiled()
    counts = layer_counts(compiled)
    # Four rotary calls -> four RoPE nodes. The two interleaved ones each keep two Transposes
    # (de-interleave / re-interleave around RoPE, see fallback_onnx's docstring).
    assert counts["RoPE"] == 4, counts
    assert counts["Transpose"] == 4, counts
    # Nothing of the rotation runs outside the fused node: no Eltwise/Split touches an
    # activation (rank >= 4); the only Eltwise left prepare the small [T, D] cos/sin tables.
    on_activations = [(kind, shapes) for kind, shapes in layers(compiled)
                      if kind in ("Eltwise", "Split") and any(s.rank.get_length() >= 4
                                                              for s in shapes)]
    assert not on_activations, on_activations


def test_openvino_rotary_opset23_becomes_rope(exports):
    counts = layer_counts(exports("rotary-f32-opset23").compiled())
    assert counts["RoPE"] == 4, counts


def test_openvino_per_frame_modulation_is_broadcast_not_materialised(exports):
    # A fresh compilation: the runtime model of one that has run reports the last inference's
    # static shapes (the drawn shapes above include one token per frame, which reads as [.., 1, C]).
    compiled = compile_ir(exports("modulation-f32").path, "f32").model
    inventory = layers(compiled)
    kinds = {kind for kind, _ in inventory}
    # Nothing expands the per-frame rows to [B, L, C].
    assert not {"Broadcast", "Tile"} & kinds, sorted(kinds)
    # An Eltwise consumes the rows as [?, ?, 1, C] next to x's frame view [?, ?, ?, C].
    def is_frame_rows(shape: ov.PartialShape) -> bool:
        return shape.rank.get_length() == 4 and shape[2] == 1 and shape[3] == C

    frame_eltwise = [shapes for kind, shapes in inventory
                     if kind == "Eltwise" and any(is_frame_rows(s) for s in shapes)]
    assert frame_eltwise, inventory
    assert all(any(s.rank.get_length() == 4 and s[2] != 1 for s in shapes)
               for shapes in frame_eltwise), frame_eltwise
    # scale + shift + (1 + scale) fold into one Eltwise per call: four calls, four Eltwise.
    assert layer_counts(compiled)["Eltwise"] == 4, layer_counts(compiled)


def test_openvino_residual_norm_modulation_fuses(exports):
    compiled = exports("residual-f32").compiled()
    counts = layer_counts(compiled)
    assert counts["MVN"] == 1 and counts["RMS"] == 1, counts
    assert not {"Broadcast", "Tile", "Reduce"} & set(counts), counts


@pytest.mark.parametrize("kind", ["norms", "rotary"])
def test_openvino_fusions_hold_in_bf16_inference(exports, kind):
    """The default hint on this machine is bf16; the fusions must not depend on fp32."""
    counts = layer_counts(exports(f"{kind}-f32").compiled("bf16"))
    if kind == "norms":
        assert counts["RMS"] == 2 and counts["MVN"] == 2, counts
    else:
        assert counts["RoPE"] == 4, counts


# ---------------------------------------------------------------------------------------------
# Errors at export time
# ---------------------------------------------------------------------------------------------


def _error_chain(exc: BaseException) -> list[BaseException]:
    chain = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def _export_error(module: torch.nn.Module, args: tuple, dynamic_shapes: tuple | None,
                  tmp_path: Path) -> FallbackOpError:
    with pytest.raises(Exception) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Exported(module, args, dynamic_shapes, tmp_path / "bad.onnx")
    found = [e for e in _error_chain(info.value) if isinstance(e, FallbackOpError)]
    assert found, f"no FallbackOpError in {_error_chain(info.value)!r}"
    return found[0]


class _PerFrame(torch.nn.Module):
    def forward(self, x, scale):
        return fuse_scale_shift(x, scale, scale)


def test_export_rejects_l_not_divisible_by_f(tmp_path):
    gen = torch.Generator().manual_seed(SEED)
    error = _export_error(_PerFrame(), (randn(1, 21, C, gen=gen), randn(1, 5, 1, C, gen=gen)),
                          ({1: Dim("L")}, {1: Dim("F")}), tmp_path)
    assert "multiple of F" in str(error)


class _Rotary(torch.nn.Module):
    def forward(self, x, cos, sin):
        return rotary_embedding(x, cos, sin, True)


def test_export_rejects_odd_head_dim(tmp_path):
    gen = torch.Generator().manual_seed(SEED)
    error = _export_error(_Rotary(), (randn(5, 2, 7, gen=gen), randn(5, 3, gen=gen),
                                      randn(5, 3, gen=gen)), None, tmp_path)
    assert "odd" in str(error)


def test_export_rejects_dynamic_head_dim(tmp_path):
    """RoPE fusion and the lowering need a static head dim; a dynamic one is refused clearly."""
    gen = torch.Generator().manual_seed(SEED)
    half = Dim("half")
    error = _export_error(_Rotary(), (randn(5, 3, 8, gen=gen), randn(5, 4, gen=gen),
                                      randn(5, 4, gen=gen)),
                          ({2: 2 * half}, {1: half}, {1: half}), tmp_path)
    assert "static" in str(error)


def test_unknown_lowering_is_refused():
    with pytest.raises(FallbackOpError, match="decomposed"):
        onnx_translation_table("fused")

"""Fallback ops, ONNX face: each ``numaov::`` op written as standard ONNX ops.

The functions here are onnxscript *trace-only* functions: ``torch.onnx.export(dynamo=True,
custom_translation_table=...)`` calls them with ``onnx_ir`` values whose rank, static sizes and
dtype are known at export time, so Python decides the graph shape (which views, which casts) and
only sizes that are dynamic in the export stay symbolic (``Shape`` ops). In particular the
per-frame modulation takes ``F`` from the modulation tensor and ``L/F`` from ``x`` at run time:
a graph exported at ``F=5, L=1280`` is right at ``F=13, L=3120``.

Two lowerings (``onnx_translation_table(lowering)``):

- ``"decomposed"`` (default, opset 20, torch's default): standard ops only; runs in ONNX Runtime
  and OpenVINO.
- ``"opset23"``: RMSNorm becomes ONNX ``RMSNormalization``; rotary becomes ``RotaryEmbedding``
  (the 3-D ``[B, T, H*D]`` form with ``num_heads``, position ids ``0..T-1``). Export with
  ``opset_version=onnx_opset_version("opset23")``. ONNX Runtime has no bf16 kernels for these.

What OpenVINO 2026.4's CPU plugin makes of them (checked with ``get_runtime_model()`` layer types,
``tests/ops/test_fallback_ops_export.py`` asserts it):

- RMSNorm ``x * 1/sqrt(mean(x^2) + eps) * gamma`` fuses to ``RMS`` when ``gamma`` is a constant
  (an initializer, as in a real model); without a weight we multiply by a constant of ones so
  the fusion still applies (the weight-free form is not matched). opset-23
  ``RMSNormalization`` also becomes ``RMS``.
- LayerNorm is written as ONNX ``LayerNormalization`` (opset 17, in both lowerings); the ONNX
  frontend turns it into ``MVN``; a weight/bias becomes one ``Eltwise`` after it (or a fused
  post-op of the MVN when a later node consumes it).
- Rotary, half-split (NeoX) on ``x = [B, T, H, D]`` with ``cos/sin`` broadcast as
  ``[1, T, 1, D]`` (``x*cos + concat(-x2, x1)*sin``, the negation written as ``Mul(-1)``) fuses
  to one ``RoPE`` node, in this ``[B, T, H, D]`` layout as well as in ``[B, H, T, D]``.
- Rotary, interleaved (GPT-J): none of OpenVINO's interleaved patterns is reachable from ONNX
  on CPU. The Flux pattern (``reshape [..., D/2, 2] / split / concat(-x1, x0)``, in
  ``[B, H, T, D]`` or ``[B, T, H, D]``) is not fused by the CPU plugin: it runs as ``Eltwise``
  chains on size-2 dims, about 10x slower than ``RoPE`` (see benchmarks/RESULTS.md). The
  GPT-J pattern (the CPU kernel is ``[B, T, H, D]``, Wan's layout) needs a ``VariadicSplit``
  of one ``[sin | cos]`` table with lengths ``[D/2, -1]``, which an ONNX ``Split`` cannot
  express (its lengths are explicit), so it never matches. Viewing each pair as a head of
  size 2 does fuse, but the kernel then loops over 2-element rows, which is slow. So the
  interleaved form is lowered as *de-interleave -> half-split rotary -> re-interleave*: two
  ``Transpose`` of ``[..., D/2, 2]`` views around one fused ``RoPE``, the fastest of the three
  forms (figures in benchmarks/RESULTS.md). opset-23 ``RotaryEmbedding`` is read by the ONNX
  frontend as a similar de-interleave + ``RoPE``, with two more
  ``[B, T, H, D] <-> [B, H, T, D]`` transposes. (Folding the pair permutation into the q/k
  projection weights would remove the transposes; that is the model's business, not this
  op's.)
- Modulation with per-frame rows: ``x`` is reshaped to ``[B, F, L/F, C]`` and multiplied/added
  with ``[b, F, 1, C]`` rows by broadcasting, so no ``Broadcast``/``Tile`` materialises
  ``[B, L, C]`` copies of the rows; the ``Mul``/``Add`` pair runs as one ``Eltwise``.

Casts: every op computes in fp32 (``Cast`` in, ``Cast`` back), as the eager face does; for
fp32 inputs no ``Cast`` is written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from onnxscript import ir, opset18, opset23

from numaov.custom_ops.fallback_ops import FallbackOpError
from numaov.manifest import LOWERINGS

__all__ = ["LOWERINGS", "ONNX_OPSETS", "fallback_translation_table", "onnx_opset_version"]

# The opset each lowering is exported at: the exporter and the fusion tests both read it, so
# the tests check the graphs the product writes. 20 is torch.onnx's default; opset 23 is the
# first with RMSNormalization and RotaryEmbedding.
ONNX_OPSETS = {"decomposed": 20, "opset23": 23}
_INT64_MAX = 2**63 - 1

op = opset18  # every op below except RMSNormalization/RotaryEmbedding is the same in 18 and 20


def onnx_opset_version(lowering: str = "decomposed") -> int:
    """The ``opset_version`` to pass to ``torch.onnx.export`` for a lowering."""
    _check_lowering(lowering)
    return ONNX_OPSETS[lowering]


def _check_lowering(lowering: str) -> None:
    if lowering not in LOWERINGS:
        raise FallbackOpError(
            f"unknown ONNX lowering {lowering!r}; expected one of {', '.join(LOWERINGS)}"
        )


# ---------------------------------------------------------------------------------------------
# Helpers on traced values. Shapes/dtypes are read at export time; sizes that are symbolic in
# the export are read with Shape ops at run time.
# ---------------------------------------------------------------------------------------------


def _rank(v: ir.Value) -> int:
    if v.shape is None:
        raise FallbackOpError(f"ONNX export: value {v.name!r} has no known rank")
    return len(v.shape)


def _static(v: ir.Value, axis: int) -> int | None:
    dim = v.shape[axis] if v.shape is not None else None
    return dim if isinstance(dim, int) else None


def _ints(values: list[int]) -> ir.Value:
    return op.Constant(value_ints=values)


def _to_f32(v: ir.Value) -> ir.Value:
    return v if v.dtype == ir.DataType.FLOAT else op.Cast(v, to=ir.DataType.FLOAT)


def _cast_like(v: ir.Value, like: ir.Value) -> ir.Value:
    return v if like.dtype == ir.DataType.FLOAT else op.Cast(v, to=like.dtype)


def _frames_of(*ts: ir.Value | None) -> ir.Value | None:
    """``F`` (a 1-element int64 tensor) from the first per-frame ``[b, F, 1, C]`` tensor."""
    for t in ts:
        if t is not None and _rank(t) == 4:
            return op.Shape(t, start=1, end=2)
    return None


def _frame_major(t: ir.Value, frames: ir.Value) -> ir.Value:
    """``[b, L, C] -> [b, F, L/F, C]``; ``L/F`` comes from the run-time shape."""
    return op.Reshape(t, op.Concat(_ints([0]), frames, _ints([-1]), op.Shape(t, start=2), axis=0))


def _modulation_view(t: ir.Value, frames: ir.Value | None) -> ir.Value:
    """A scale/shift/gate tensor shaped to broadcast against ``x`` (or its frame view)."""
    rank, rows = _rank(t), (_static(t, 1) if _rank(t) >= 2 else None)
    t = _to_f32(t)  # shapes are read before the cast: a Cast output may carry no shape
    if rank <= 1:
        return t
    if frames is None:
        return op.Unsqueeze(t, _ints([1])) if rank == 2 else t  # [b, C] acts as [b, 1, C]
    if rank == 2:
        return op.Unsqueeze(t, _ints([1, 2]))  # [b, C] -> [b, 1, 1, C]
    if rank == 3:
        if rows == 1:
            return op.Unsqueeze(t, _ints([1]))  # [b, 1, C] -> [b, 1, 1, C]
        return _frame_major(t, frames)  # [b, L, C] -> [b, F, L/F, C]
    return t  # [b, F, 1, C]


def _modulate_f32(
    x32: ir.Value, x_like: ir.Value, scale: ir.Value, shift: ir.Value, scale_constant: float
) -> ir.Value:
    """``x * (scale_constant + scale) + shift`` in fp32 for ``x = [B, L, C]``.

    With a per-frame operand ``x`` is viewed as ``[B, F, L/F, C]`` (a free reshape) so the
    ``[b, F, 1, C]`` rows broadcast; they are never expanded to ``[B, L, C]``.
    """
    frames = _frames_of(scale, shift)
    xv = x32 if frames is None else _frame_major(x32, frames)
    factor = _modulation_view(scale, frames)
    if scale_constant != 0.0:
        factor = op.Add(factor, op.Constant(value_float=float(scale_constant)))
    y = op.Add(op.Mul(xv, factor), _modulation_view(shift, frames))
    return y if frames is None else op.Reshape(y, op.Shape(x_like))


def _ones_like_channels(x: ir.Value, x32: ir.Value) -> ir.Value:
    """A ``[C]`` fp32 vector of ones: a constant when ``C`` is static (so it folds and fuses)."""
    c = _static(x, -1)
    if c is not None:
        return op.Constant(value_floats=[1.0] * c)
    return op.Expand(op.Constant(value_floats=[1.0]), op.Shape(x32, start=-1))


def _norm_f32(
    x32: ir.Value,
    x_like: ir.Value,
    weight: ir.Value | None,
    bias: ir.Value | None,
    eps: float,
    is_rms_norm: bool,
    lowering: str,
) -> ir.Value:
    """Norm over the last dim of an fp32 tensor, in the form OpenVINO fuses (module docstring)."""
    gamma = _ones_like_channels(x_like, x32) if weight is None else _to_f32(weight)
    if not is_rms_norm:
        # LayerNormalization has three outputs (Y, mean, inverse std); only Y is used.
        b = None if bias is None else _to_f32(bias)
        return op.LayerNormalization(x32, gamma, b, axis=-1, epsilon=eps, stash_type=1)[0]
    if lowering == "opset23":
        y = opset23.RMSNormalization(x32, gamma, axis=-1, epsilon=eps, stash_type=1)
    else:
        mean_sq = op.ReduceMean(op.Pow(x32, op.Constant(value_float=2.0)), _ints([-1]))
        denom = op.Sqrt(op.Add(mean_sq, op.Constant(value_float=float(eps))))
        y = op.Mul(op.Mul(x32, op.Div(op.Constant(value_float=1.0), denom)), gamma)
    return y if bias is None else op.Add(y, _to_f32(bias))


# ---------------------------------------------------------------------------------------------
# Rotary embedding
# ---------------------------------------------------------------------------------------------


def _half_table(table: ir.Value, head_dim: int, interleaved: bool) -> ir.Value:
    """The ``[T, D/2]`` fp32 table from a ``[T, D/2]`` or ``[T, D]`` one (see eager face)."""
    columns = _static(table, -1)
    table = _to_f32(table)
    if columns == head_dim:
        half = head_dim // 2
        if interleaved:  # c0 c0 c1 c1 ... -> even columns
            return op.Slice(table, _ints([0]), _ints([head_dim]), _ints([1]), _ints([2]))
        return op.Slice(table, _ints([0]), _ints([half]), _ints([1]))  # c.. c.. -> first half
    return table


def _rotate_half_split(x4: ir.Value, cos: ir.Value, sin: ir.Value, head_dim: int) -> ir.Value:
    """NeoX rotary on fp32 ``x4 = [B, T, H, D]``, tables ``[T, D/2]``: the RoPE-fusing form."""
    half = head_dim // 2
    # [T, D/2] -> [T, D] (c c) -> [1, T, 1, D], broadcast over batch and heads
    cos4 = op.Unsqueeze(op.Concat(cos, cos, axis=-1), _ints([0, 2]))
    sin4 = op.Unsqueeze(op.Concat(sin, sin, axis=-1), _ints([0, 2]))
    x1 = op.Slice(x4, _ints([0]), _ints([half]), _ints([3]))
    x2 = op.Slice(x4, _ints([half]), _ints([_INT64_MAX]), _ints([3]))
    # Mul(-1), not Neg: the fusion pattern matches a multiply by -1.
    rotated = op.Concat(op.Mul(x2, op.Constant(value_float=-1.0)), x1, axis=-1)
    return op.Add(op.Mul(x4, cos4), op.Mul(rotated, sin4))


def _swap_pairs(x4: ir.Value, head_dim: int, split: bool) -> ir.Value:
    """Permute the last dim between interleaved (x0 y0 x1 y1 ..) and split (x0 x1 .. y0 y1 ..)."""
    shape5 = [0, 0, 0, head_dim // 2, 2] if split else [0, 0, 0, 2, head_dim // 2]
    x5 = op.Transpose(op.Reshape(x4, _ints(shape5)), perm=[0, 1, 2, 4, 3])
    return op.Reshape(x5, _ints([0, 0, 0, head_dim]))


def _rotary_opset23(
    x4: ir.Value, cos: ir.Value, sin: ir.Value, interleaved: bool, heads: int, head_dim: int
) -> ir.Value:
    """ONNX ``RotaryEmbedding`` on ``[B, T, H*D]`` with positions ``0..T-1`` into the tables."""
    x3 = op.Reshape(x4, _ints([0, 0, heads * head_dim]))
    seq = op.Shape(x4, start=1, end=2)
    positions = op.Range(
        op.Constant(value_int=0), op.Squeeze(seq, _ints([0])), op.Constant(value_int=1)
    )
    batch_seq = op.Concat(op.Shape(x4, start=0, end=1), seq, axis=0)
    position_ids = op.Expand(op.Unsqueeze(positions, _ints([0])), batch_seq)
    y3 = opset23.RotaryEmbedding(
        x3, cos, sin, position_ids, interleaved=int(interleaved), num_heads=heads
    )
    return op.Reshape(y3, op.Shape(x4))


def _rotary(
    x: ir.Value, cos: ir.Value, sin: ir.Value, interleaved: bool, lowering: str
) -> ir.Value:
    rank = _rank(x)
    if rank not in (3, 4):
        raise FallbackOpError(f"rotary_embedding export: x must be rank 3 or 4, got rank {rank}")
    head_dim, heads = _static(x, -1), _static(x, -2)
    if head_dim is None or (heads is None and lowering == "opset23"):
        raise FallbackOpError(
            "rotary_embedding export: the head dim (and, for opset23, the head count) of x "
            f"must be static, got x shape {x.shape}; export them as fixed sizes (the fused "
            "RoPE needs them), only B and T may be dynamic"
        )
    x4 = _to_f32(x) if rank == 4 else op.Unsqueeze(_to_f32(x), _ints([0]))  # [T,H,D]->[1,T,H,D]
    cos_h = _half_table(cos, head_dim, interleaved)
    sin_h = _half_table(sin, head_dim, interleaved)
    if lowering == "opset23":
        y4 = _rotary_opset23(x4, cos_h, sin_h, interleaved, heads, head_dim)
    elif interleaved:
        split = _swap_pairs(x4, head_dim, split=True)
        y4 = _swap_pairs(_rotate_half_split(split, cos_h, sin_h, head_dim), head_dim, split=False)
    else:
        y4 = _rotate_half_split(x4, cos_h, sin_h, head_dim)
    y = y4 if rank == 4 else op.Squeeze(y4, _ints([0]))
    return _cast_like(y, x)


# ---------------------------------------------------------------------------------------------
# Row copy (functional form: the exported graph returns the updated dst)
# ---------------------------------------------------------------------------------------------


def _rows(v: ir.Value, start: ir.Value | list[int], end: ir.Value | list[int]) -> ir.Value:
    start_v = _ints(start) if isinstance(start, list) else start
    end_v = _ints(end) if isinstance(end, list) else end
    return op.Slice(v, start_v, end_v, _ints([0]))


def _rows_copy(dst: ir.Value, src: ir.Value, offset: int, n: int, offset_src: bool) -> ir.Value:
    """``dst`` with ``n`` rows of ``src`` copied in, clamped like the eager op.

    Slice clamps out-of-range starts/ends, which gives the clamping for free; the only explicit
    arithmetic keeps an end from going negative (a negative Slice end counts from the back).
    """
    dst_rows = op.Shape(dst, start=0, end=1)
    if offset_src:  # dst[0:k] = src[offset:offset+k]
        moved = _rows(_rows(src, [offset], [offset + n]), [0], dst_rows)
        count = op.Shape(moved, start=0, end=1)
        return op.Concat(moved, _rows(dst, count, [_INT64_MAX]), axis=0)
    room = op.Max(op.Sub(dst_rows, _ints([offset])), _ints([0]))  # dst[offset:offset+k] = src[0:k]
    moved = _rows(_rows(src, [0], [n]), [0], room)
    count = op.Shape(moved, start=0, end=1)
    tail_start = op.Add(_ints([offset]), count)
    return op.Concat(_rows(dst, [0], [offset]), moved, _rows(dst, tail_start, [_INT64_MAX]), axis=0)


# ---------------------------------------------------------------------------------------------
# The translation table
# ---------------------------------------------------------------------------------------------


def fallback_translation_table(lowering: str = "decomposed") -> dict[Any, Callable[..., Any]]:
    """``{torch op overload: onnxscript trace-only function}`` for the fallback ops."""
    _check_lowering(lowering)

    def fuse_scale_shift(x, scale, shift, scale_constant: float = 1.0):
        return _cast_like(_modulate_f32(_to_f32(x), x, scale, shift, scale_constant), x)

    def rotary_embedding(x, cos, sin, interleaved: bool):
        return _rotary(x, cos, sin, interleaved, lowering)

    def norm_infer(x, weight, bias, eps: float, is_rms_norm: bool):
        y = _norm_f32(_to_f32(x), x, weight, bias, eps, is_rms_norm, lowering)
        return _cast_like(y, x)

    def scale_residual_norm_scale_shift(
        residual, x, gate, weight, bias, eps: float, is_rms_norm: bool, scale, shift,
        scale_constant: float = 1.0,
    ):
        if gate is None:
            r32 = op.Add(_to_f32(residual), _to_f32(x))
        else:  # residual + gate * x == x * (0 + gate) + residual
            r32 = _modulate_f32(_to_f32(x), x, gate, residual, 0.0)
        new_residual = _cast_like(r32, residual)
        # The norm sees the residual rounded to its dtype, like the eager face.
        if residual.dtype != ir.DataType.FLOAT:
            r32 = op.Cast(new_residual, to=ir.DataType.FLOAT)
        normed = _norm_f32(r32, residual, weight, bias, eps, is_rms_norm, lowering)
        out = _modulate_f32(normed, residual, scale, shift, scale_constant)
        return _cast_like(out, residual), new_residual

    def rows_copied(dst, src, offset: int, n: int, offset_src: bool):
        return _rows_copy(dst, src, offset, n, offset_src)

    numaov = torch.ops.numaov
    return {
        numaov.fuse_scale_shift.default: fuse_scale_shift,
        numaov.rotary_embedding.default: rotary_embedding,
        numaov.norm_infer.default: norm_infer,
        numaov.scale_residual_norm_scale_shift.default: scale_residual_norm_scale_shift,
        # rows_copy mutates dst; under export it dispatches to its functional twin rows_copied.
        numaov.rows_copied.default: rows_copied,
    }

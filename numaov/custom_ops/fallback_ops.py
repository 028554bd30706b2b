"""Fallback ops, eager face: the CPU replacements for the GPU kernels of diffusion transformers.

Each op is a ``torch.library`` custom op in the ``numaov`` namespace with its fake (shape-only)
kernel right below it, so ``torch.export`` sees one opaque node per op and the ONNX lowering in
``fallback_onnx.py`` decides how it is written. Model code calls the plain functions at the
bottom of this module; they validate their arguments *before* dispatch, so a bad shape or dtype
is one clear :class:`FallbackOpError` both in eager mode and while exporting (during export the
checks see the example inputs' sizes, read without adding shape guards).

Numerics (docs/architecture.md, "Ops and their three faces"): activations are fp32, bf16 or
fp16; auxiliary tensors (scale, shift, gate, cos/sin, norm weight/bias) are either the
activation's dtype or fp32 (fp32 modulation with bf16 activations is the usual DiT mix). Every
op computes in fp32 and rounds once to the activation dtype, as the reference kernels do.

Modulation shapes, for ``x`` of shape ``[B, L, C]`` (``b`` is ``B`` or 1):
``[]`` (scalar), ``[C]``, ``[b, C]`` (acts as ``[b, 1, C]``), ``[b, 1, C]``, ``[b, L, C]`` and the
per-frame ``[b, F, 1, C]``, where frame ``f``'s row applies to tokens ``f*L/F .. (f+1)*L/F - 1``
(tokens are frame-major), so ``L`` must be a multiple of ``F``. Per-frame rows are applied by
viewing ``x`` as ``[B, F, L/F, C]`` and broadcasting ``[b, F, 1, C]``: the rows are never
expanded to ``[B, L, C]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from numaov import NumaovError

__all__ = [
    "FallbackOpError",
    "fuse_scale_shift",
    "norm_infer",
    "rotary_embedding",
    "rows_copy",
    "scale_residual_norm_scale_shift",
]

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class FallbackOpError(NumaovError):
    """A fallback op was called with a shape, rank or dtype it cannot honour."""


# ---------------------------------------------------------------------------------------------
# Argument checks. They run in the public wrappers, before dispatch, on real tensors in eager
# mode and on fake tensors with symbolic sizes during export.
# ---------------------------------------------------------------------------------------------


def _size(value: int | torch.SymInt) -> int | None:
    """The concrete value of a size, or None when it is unknown.

    During export a dynamic size is a SymInt whose hint is the example input's size; reading the
    hint (instead of comparing the SymInt) checks the example without adding a shape guard, which
    would otherwise specialise the dimension the caller declared dynamic.
    """
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        return int(hint) if hint is not None else None
    return int(value)


def _shape(t: Tensor) -> tuple[int | None, ...]:
    return tuple(_size(s) for s in t.shape)


def _fmt(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("?" if s is None else str(s) for s in shape) + "]"


def _eq(a: int | None, b: int | None) -> bool:
    """Sizes agree, or one is unknown (an unbacked size cannot be checked before run time)."""
    return a is None or b is None or a == b


def _check_activation(op: str, name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise FallbackOpError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in ACTIVATION_DTYPES:
        raise FallbackOpError(
            f"{op}: {name} has dtype {t.dtype}; expected float32, bfloat16 or float16"
        )


def _check_aux_dtype(op: str, name: str, t: Tensor, activation: torch.dtype) -> None:
    """Auxiliary tensors are the activation dtype or fp32; any other mix is refused.

    fp32 is always exact to widen from, and the activation dtype is the caller's own choice;
    a third dtype (say fp16 scales with bf16 activations, or float64) would be silently rounded
    differently by eager PyTorch, ONNX Runtime and OpenVINO, so it is an error instead.
    """
    if not isinstance(t, Tensor):
        raise FallbackOpError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (activation, torch.float32):
        raise FallbackOpError(
            f"{op}: {name} has dtype {t.dtype} but the activation is {activation}; "
            f"expected {activation} or torch.float32"
        )


def _modulation_frames(op: str, name: str, t: Tensor, x_shape: tuple[int | None, ...]) -> int:
    """Check a scale/shift/gate shape against ``x = [B, L, C]``; return its frame count.

    The frame count is 0 for the non-per-frame shapes and ``F`` for ``[b, F, 1, C]``.
    """
    b, seq, c = x_shape
    shape = _shape(t)
    expected = (
        f"expected one of [], [C], [B, C], [B, 1, C], [1, 1, C], [B, L, C] or per-frame "
        f"[B, F, 1, C] with L divisible by F (x is [B, L, C] = {_fmt(x_shape)})"
    )
    ok = False
    frames = 0
    if t.dim() == 0:
        ok = True
    elif t.dim() == 1:
        ok = _eq(shape[0], c)
    elif t.dim() == 2:
        ok = shape[0] in (1, None) or _eq(shape[0], b)
        ok = ok and _eq(shape[1], c)
    elif t.dim() == 3:
        ok = (shape[0] in (1, None) or _eq(shape[0], b)) and _eq(shape[2], c)
        ok = ok and (shape[1] in (1, None) or _eq(shape[1], seq))
    elif t.dim() == 4:
        ok = (shape[0] in (1, None) or _eq(shape[0], b)) and shape[2] == 1 and _eq(shape[3], c)
        f = shape[1]
        if ok and f is not None and seq is not None:
            if f == 0 or seq % f != 0:
                raise FallbackOpError(
                    f"{op}: per-frame {name} has F={f} frames but x has L={seq} tokens; "
                    "L must be a multiple of F (frame f covers tokens f*L/F .. (f+1)*L/F - 1)"
                )
        frames = f if f is not None else -1
    if not ok:
        if t.dim() >= 1 and shape[-1] is not None and c is not None and shape[-1] != c:
            raise FallbackOpError(
                f"{op}: {name} has {shape[-1]} channels (shape {_fmt(shape)}) but x has "
                f"C={c}; {expected}"
            )
        raise FallbackOpError(f"{op}: {name} has shape {_fmt(shape)}; {expected}")
    return frames


def _check_modulation(
    op: str, x: Tensor, named: Sequence[tuple[str, Tensor | None]]
) -> None:
    """Validate ``x = [B, L, C]`` and its modulation tensors; per-frame ones must agree on F."""
    _check_activation(op, "x", x)
    if x.dim() != 3:
        raise FallbackOpError(
            f"{op}: x must be [B, L, C] (rank 3), got rank {x.dim()} shape {_fmt(_shape(x))}"
        )
    x_shape = _shape(x)
    frames: dict[str, int] = {}
    for name, t in named:
        if t is None:
            continue
        _check_aux_dtype(op, name, t, x.dtype)
        f = _modulation_frames(op, name, t, x_shape)
        if f:
            frames[name] = f
    if len({f for f in frames.values() if f > 0}) > 1:
        listed = ", ".join(f"{n} F={f}" for n, f in frames.items())
        raise FallbackOpError(
            f"{op}: per-frame tensors disagree on the frame count ({listed}); expected one F"
        )


def _check_norm(
    op: str, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> None:
    _check_activation(op, "x", x)
    if x.dim() < 1:
        raise FallbackOpError(f"{op}: x must have at least one dimension to normalise over")
    c = _size(x.shape[-1])
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        _check_aux_dtype(op, name, t, x.dtype)
        if t.dim() != 1 or not _eq(_size(t.shape[0]), c):
            raise FallbackOpError(
                f"{op}: {name} has shape {_fmt(_shape(t))} but x has C={c} channels in its "
                f"last dim; expected {name} of shape [{c}] or None"
            )
    if not isinstance(eps, (float, int)) or eps < 0:
        raise FallbackOpError(f"{op}: eps must be a non-negative float, got {eps!r}")


# ---------------------------------------------------------------------------------------------
# Kernels (pure PyTorch). The helpers below are shared by the eager kernels only.
# ---------------------------------------------------------------------------------------------


def _frame_count(*ts: Tensor | None) -> int:
    for t in ts:
        if t is not None and t.dim() == 4:
            return int(t.shape[1])
    return 0


def _as_frames(t: Tensor, batch: int, seq: int, frames: int) -> Tensor:
    """View a modulation tensor for ``x`` viewed as ``[B, F, L/F, C]`` (no copy of any row)."""
    if t.dim() <= 1:
        return t
    c = t.shape[-1]
    if t.dim() == 2:  # [b, C] -> [b, 1, 1, C]
        return t.reshape(t.shape[0], 1, 1, c)
    if t.dim() == 3:
        if t.shape[1] == 1 and seq != 1:  # [b, 1, C] -> [b, 1, 1, C]
            return t.reshape(t.shape[0], 1, 1, c)
        return t.reshape(t.shape[0], frames, seq // frames, c)  # [b, L, C] -> [b, F, L/F, C]
    return t  # already [b, F, 1, C]


def _as_tokens(t: Tensor) -> Tensor:
    """View a non-per-frame modulation tensor for ``x = [B, L, C]``: ``[b, C]`` acts as ``[b, 1, C]``."""
    return t.unsqueeze(1) if t.dim() == 2 else t


def _views(x: Tensor, *ts: Tensor | None) -> tuple[Tensor, list[Tensor | None]]:
    """Shape ``x`` and its modulation tensors so they broadcast without expanding any row."""
    frames = _frame_count(*ts)
    if frames:
        batch, seq, c = x.shape
        xv = x.reshape(batch, frames, seq // frames, c)
        return xv, [None if t is None else _as_frames(t, batch, seq, frames) for t in ts]
    return x, [None if t is None else _as_tokens(t) for t in ts]


_SCRATCH_ELEMENTS = 1 << 16  # fp32 scratch of 256 KiB per block: stays in L2


def _modulate_into(out: Tensor, y: Tensor, scale: Tensor, shift: Tensor, c: float) -> None:
    """``out = y * (c + scale) + shift`` computed in fp32, rounded once into ``out``'s dtype.

    ``out`` and ``y`` have one shape; ``scale``/``shift`` broadcast against it and are either
    constant along dim -2 (size 1) or as long as ``y`` there.
    """
    factor = scale.float() + c  # small: at most [b, L, C], usually [b, F, 1, C]
    shift = shift.float()
    if y.dtype == torch.float32 and out.dtype == torch.float32:
        torch.addcmul(shift, y, factor, out=out)
        return
    # Low-precision tensors: PyTorch's mixed-dtype elementwise path (bf16 and fp32 operands in
    # one kernel) is far slower than its same-dtype kernels (benchmarks/RESULTS.md), so blocks
    # of rows are widened into an fp32 scratch buffer that stays in cache, computed there, and
    # rounded into ``out``.
    rows = y.shape[-2] if y.dim() >= 2 else 1
    if y.dim() < 2 or rows == 0 or y.numel() == 0:
        out.copy_(torch.addcmul(shift, y.float(), factor))
        return
    per_row = max(1, y.numel() // rows)
    step = max(1, _SCRATCH_ELEMENTS // per_row)
    for start in range(0, rows, step):
        count = min(step, rows - start)
        block = y.narrow(-2, start, count).float()
        block.mul_(_rows_of(factor, rows, start, count)).add_(_rows_of(shift, rows, start, count))
        out.narrow(-2, start, count).copy_(block)


def _rows_of(t: Tensor, rows: int, start: int, count: int) -> Tensor:
    """The part of a broadcast operand that meets rows ``start .. start+count`` of dim -2."""
    if t.dim() >= 2 and t.shape[-2] == rows and rows != 1:
        return t.narrow(-2, start, count)
    return t


@torch.library.custom_op("numaov::fuse_scale_shift", mutates_args=())
def _fuse_scale_shift_op(x: Tensor, scale: Tensor, shift: Tensor, scale_constant: float) -> Tensor:
    xv, (scale_v, shift_v) = _views(x, scale, shift)
    out = torch.empty(xv.shape, dtype=x.dtype, device=x.device)
    _modulate_into(out, xv, scale_v, shift_v, scale_constant)
    return out.reshape(x.shape)


@_fuse_scale_shift_op.register_fake
def _(x: Tensor, scale: Tensor, shift: Tensor, scale_constant: float) -> Tensor:
    return x.new_empty(x.shape)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    half = x.shape[-1] // 2
    if cos.shape[-1] != half:
        # D columns: interleaved tables repeat each frequency twice (c0 c0 c1 c1 ..), half-split
        # tables are concatenated twice (c0 c1 .. c0 c1 ..); either way these are the D/2 values.
        cos, sin = (cos[:, 0::2], sin[:, 0::2]) if interleaved else (cos[:, :half], sin[:, :half])
    cos = cos.float().unsqueeze(-2)  # [T, 1, D/2], broadcast over heads (and batch)
    sin = sin.float().unsqueeze(-2)
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf[..., :half], xf[..., half:]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if interleaved:
        out = torch.stack((o1, o2), dim=-1).flatten(-2)
    else:
        out = torch.cat((o1, o2), dim=-1)
    return out.to(x.dtype)


@torch.library.custom_op("numaov::rotary_embedding", mutates_args=())
def _rotary_embedding_op(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    return _rotate(x, cos, sin, interleaved)


@_rotary_embedding_op.register_fake
def _(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    return x.new_empty(x.shape)


def _normalise_fp32(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, is_rms_norm: bool
) -> Tensor:
    """The fp32 normalised (and affine-transformed) tensor; statistics are always fp32."""
    c = x.shape[-1]
    xf = x.float()
    w = None if weight is None else weight.float()
    if is_rms_norm:
        y = torch.nn.functional.rms_norm(xf, (c,), w, eps)
        return y if bias is None else y.add_(bias.float())
    b = None if bias is None else bias.float()
    return torch.nn.functional.layer_norm(xf, (c,), w, b, eps)


@torch.library.custom_op("numaov::norm_infer", mutates_args=())
def _norm_infer_op(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, is_rms_norm: bool
) -> Tensor:
    return _normalise_fp32(x, weight, bias, eps, is_rms_norm).to(x.dtype)


@_norm_infer_op.register_fake
def _(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, is_rms_norm: bool
) -> Tensor:
    return x.new_empty(x.shape)


# Backward of the two ops the built-in models are trained through (the DeepSeek-V2 MoE in
# models/builtin): the gradient of the same PyTorch arithmetic as the forward, recomputed from
# the saved inputs, so a model trains on the very ops it exports with. Tables (cos, sin), eps
# and flags take no gradient.


def _grads_of(fn, inputs: tuple[Tensor | None, ...], wanted: list[bool],
              grad: Tensor) -> tuple[Tensor | None, ...]:
    """``d fn(*inputs) / d inputs`` against ``grad`` for the ``wanted`` inputs, None for the
    others."""
    leaves = [t.detach().requires_grad_(w) if t is not None else None
              for t, w in zip(inputs, wanted, strict=True)]
    with torch.enable_grad():
        out = fn(*leaves)
        found = torch.autograd.grad(out, [t for t, w in zip(leaves, wanted, strict=True) if w],
                                    grad, allow_unused=True)
    it = iter(found)
    return tuple(next(it) if w else None for w in wanted)


def _rotary_setup(ctx, inputs, output) -> None:
    x, cos, sin, interleaved = inputs
    ctx.save_for_backward(x, cos, sin)
    ctx.interleaved = interleaved


def _rotary_backward(ctx, grad: Tensor):
    x, cos, sin = ctx.saved_tensors
    (gx,) = _grads_of(lambda t: _rotate(t, cos, sin, ctx.interleaved), (x,),
                      [ctx.needs_input_grad[0]], grad)
    return gx, None, None, None


def _norm_setup(ctx, inputs, output) -> None:
    x, weight, bias, eps, is_rms_norm = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.eps, ctx.is_rms_norm = eps, is_rms_norm


def _norm_backward(ctx, grad: Tensor):
    gx, gw, gb = _grads_of(
        lambda x, w, b: _normalise_fp32(x, w, b, ctx.eps, ctx.is_rms_norm).to(x.dtype),
        tuple(ctx.saved_tensors), list(ctx.needs_input_grad[:3]), grad)
    return gx, gw, gb, None, None


_rotary_embedding_op.register_autograd(_rotary_backward, setup_context=_rotary_setup)
_norm_infer_op.register_autograd(_norm_backward, setup_context=_norm_setup)


@torch.library.custom_op("numaov::scale_residual_norm_scale_shift", mutates_args=())
def _scale_residual_norm_scale_shift_op(
    residual: Tensor,
    x: Tensor,
    gate: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    is_rms_norm: bool,
    scale: Tensor,
    shift: Tensor,
    scale_constant: float,
) -> tuple[Tensor, Tensor]:
    # 1. residual with gate, rounded to the residual dtype: that is the tensor the next block sees
    xv, (gate_v,) = _views(x, gate)
    rv = residual.reshape(xv.shape)
    new_residual = torch.empty(xv.shape, dtype=residual.dtype, device=residual.device)
    if gate_v is None:
        torch.add(rv, xv, out=new_residual)  # one dtype: PyTorch adds in fp32, rounds once
    else:  # residual + gate * x == x * (0 + gate) + residual
        _modulate_into(new_residual, xv, gate_v, rv, 0.0)
    new_residual = new_residual.reshape(residual.shape)
    # 2. norm in fp32, 3. modulation in fp32, one rounding at the end
    y = _normalise_fp32(new_residual, weight, bias, eps, is_rms_norm)
    yv, (scale_v, shift_v) = _views(y, scale, shift)
    out = torch.empty(yv.shape, dtype=residual.dtype, device=residual.device)
    _modulate_into(out, yv, scale_v, shift_v, scale_constant)
    return out.reshape(residual.shape), new_residual


@_scale_residual_norm_scale_shift_op.register_fake
def _(
    residual: Tensor,
    x: Tensor,
    gate: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    is_rms_norm: bool,
    scale: Tensor,
    shift: Tensor,
    scale_constant: float,
) -> tuple[Tensor, Tensor]:
    return residual.new_empty(residual.shape), residual.new_empty(residual.shape)


@torch.library.custom_op("numaov::rows_copy", mutates_args=("dst",))
def _rows_copy_op(dst: Tensor, src: Tensor, offset: int, n: int, offset_src: bool) -> None:
    count = _rows_count(dst.shape[0], src.shape[0], offset, n, offset_src)
    if count <= 0:
        return
    if offset_src:
        dst[:count].copy_(src[offset : offset + count])
    else:
        dst[offset : offset + count].copy_(src[:count])


@_rows_copy_op.register_fake
def _(dst: Tensor, src: Tensor, offset: int, n: int, offset_src: bool) -> None:
    return None


@torch.library.custom_op("numaov::rows_copied", mutates_args=())
def _rows_copied_op(dst: Tensor, src: Tensor, offset: int, n: int, offset_src: bool) -> Tensor:
    out = dst.clone()
    _rows_copy_op(out, src, offset, n, offset_src)
    return out


@_rows_copied_op.register_fake
def _(dst: Tensor, src: Tensor, offset: int, n: int, offset_src: bool) -> Tensor:
    return dst.new_empty(dst.shape)


def _rows_count(dst_rows: int, src_rows: int, offset: int, n: int, offset_src: bool) -> int:
    """Rows actually copied: ``n`` clamped to what both tensors hold past the offset."""
    if offset_src:
        return max(0, min(n, src_rows - offset, dst_rows))
    return max(0, min(n, src_rows, dst_rows - offset))


# ---------------------------------------------------------------------------------------------
# Public functions: validate, then dispatch to the custom op (eager kernel or export node).
# ---------------------------------------------------------------------------------------------


def fuse_scale_shift(
    x: Tensor, scale: Tensor, shift: Tensor, scale_constant: float = 1.0
) -> Tensor:
    """``x * (scale_constant + scale) + shift`` for ``x = [B, L, C]``.

    ``scale`` and ``shift`` each take any modulation shape of the module docstring, per-frame
    ``[B, F, 1, C]`` included, and may differ from each other. Returns ``x``'s shape and dtype.
    """
    _check_modulation("fuse_scale_shift", x, (("scale", scale), ("shift", shift)))
    return _fuse_scale_shift_op(x, scale, shift, float(scale_constant))


def rotary_embedding(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """Rotary position embedding of ``x = [T, H, D]`` or ``[B, T, H, D]``.

    ``cos``/``sin`` are ``[T, D/2]`` (or ``[T, D]``: repeated-pair tables for the interleaved
    form use every second column, concatenated tables for the half-split form use the first
    half), broadcast over heads. ``interleaved=True`` rotates adjacent pairs (GPT-J),
    ``False`` rotates ``x[i]`` with ``x[i + D/2]`` (NeoX). Computed in fp32, cast back.
    """
    op = "rotary_embedding"
    _check_activation(op, "x", x)
    if x.dim() not in (3, 4):
        raise FallbackOpError(
            f"{op}: x must be [T, H, D] or [B, T, H, D], got rank {x.dim()} "
            f"shape {_fmt(_shape(x))}"
        )
    x_shape = _shape(x)
    t, d = x_shape[-3], x_shape[-1]
    if d is not None and d % 2 != 0:
        raise FallbackOpError(f"{op}: head dim D={d} is odd; rotary pairs need an even D")
    for name, table in (("cos", cos), ("sin", sin)):
        _check_aux_dtype(op, name, table, x.dtype)
        shape = _shape(table)
        cols_ok = d is None or shape[-1] is None or shape[-1] in (d // 2, d)
        if table.dim() != 2 or not _eq(shape[0], t) or not cols_ok:
            raise FallbackOpError(
                f"{op}: {name} has shape {_fmt(shape)}; expected [T, D/2] or [T, D] with "
                f"T={t}, D={d} from x of shape {_fmt(x_shape)}"
            )
    if cos.dim() == 2 and not all(_eq(a, b) for a, b in zip(_shape(cos), _shape(sin), strict=True)):
        raise FallbackOpError(
            f"{op}: cos {_fmt(_shape(cos))} and sin {_fmt(_shape(sin))} differ in shape; "
            "expected the same shape"
        )
    return _rotary_embedding_op(x, cos, sin, bool(interleaved))


def norm_infer(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    is_rms_norm: bool,
) -> Tensor:
    """LayerNorm (``is_rms_norm=False``) or RMSNorm over the last dim, fp32 statistics.

    ``weight`` and ``bias`` are ``[C]`` or None each (an RMSNorm bias is added after scaling).
    The result has ``x``'s dtype.
    """
    _check_norm("norm_infer", x, weight, bias, eps)
    return _norm_infer_op(x, weight, bias, float(eps), bool(is_rms_norm))


def scale_residual_norm_scale_shift(
    residual: Tensor,
    x: Tensor,
    gate: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    is_rms_norm: bool,
    scale: Tensor,
    shift: Tensor,
    scale_constant: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """``r = residual + gate * x``; return ``(norm(r) * (scale_constant + scale) + shift, r)``.

    ``residual`` and ``x`` are ``[B, L, C]`` of one dtype; ``gate`` (None means 1), ``scale``
    and ``shift`` take any modulation shape, per-frame included. ``r`` is rounded to the
    residual dtype (it is what the next block adds to); norm and modulation then run in fp32
    with one rounding at the end.
    """
    op = "scale_residual_norm_scale_shift"
    _check_modulation(op, residual, (("gate", gate), ("scale", scale), ("shift", shift)))
    _check_activation(op, "x", x)
    if x.dtype != residual.dtype or x.dim() != 3 or not all(
        _eq(a, b) for a, b in zip(_shape(x), _shape(residual), strict=True)
    ):
        raise FallbackOpError(
            f"{op}: x is {_fmt(_shape(x))} {x.dtype} but residual is "
            f"{_fmt(_shape(residual))} {residual.dtype}; expected the same shape and dtype"
        )
    _check_norm(op, residual, weight, bias, eps)
    return _scale_residual_norm_scale_shift_op(
        residual, x, gate, weight, bias, float(eps), bool(is_rms_norm), scale, shift,
        float(scale_constant),
    )


def rows_copy(dst: Tensor, src: Tensor, offset: int, n: int, offset_src: bool) -> None:
    """Copy ``n`` rows along dim 0 into ``dst`` in place (the DP gather/scatter row copy).

    ``offset_src=True`` copies ``src[offset:offset+n]`` to ``dst[0:n]`` (scatter), otherwise
    ``src[0:n]`` to ``dst[offset:offset+n]`` (gather). The count is clamped to the rows both
    tensors hold; an offset past the end copies nothing.
    """
    op = "rows_copy"
    for name, t in (("dst", dst), ("src", src)):
        if not isinstance(t, Tensor) or t.dim() < 1:
            raise FallbackOpError(f"{op}: {name} must be a tensor with a row dimension (rank >= 1)")
    if dst.dtype != src.dtype:
        raise FallbackOpError(
            f"{op}: dst is {dst.dtype} but src is {src.dtype}; expected the same dtype "
            "(a row copy does not convert)"
        )
    if dst.dim() != src.dim() or not all(
        _eq(a, b) for a, b in zip(_shape(dst)[1:], _shape(src)[1:], strict=True)
    ):
        raise FallbackOpError(
            f"{op}: rows of dst {_fmt(_shape(dst))} and src {_fmt(_shape(src))} differ; "
            "expected the same shape past dim 0"
        )
    if offset < 0 or n < 0:
        raise FallbackOpError(f"{op}: offset={offset} and n={n} must be non-negative")
    if torch.compiler.is_exporting():
        # An exported graph is functional and the ONNX exporter cannot translate a mutating
        # custom op (it sees it wrapped in auto_functionalized), so the export writes the
        # functional twin and lets torch.export turn the copy_ into a new value of dst.
        dst.copy_(_rows_copied_op(dst, src, int(offset), int(n), bool(offset_src)))
        return
    _rows_copy_op(dst, src, int(offset), int(n), bool(offset_src))

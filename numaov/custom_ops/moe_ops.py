"""The routed experts of a MoE layer as one op, ``numaov::moe_experts``, with its three faces.

``moe_experts(x, ids, weights, gate_up, down)`` computes, for every row ``n`` of ``x [N, H]``::

    out[n] = sum_j weights[n, j] * down[e] @ (silu(gate[e] @ x[n]) * (up[e] @ x[n])),  e = ids[n, j]

with the experts as weight stacks ``gate_up [E, 2I, H]`` (gate rows first, then up) and
``down [E, H, I]``. ``ids`` and ``weights`` are ``[N, k]`` (the router's top-k).

- **eager**: the ``torch.library`` op below, a grouped loop: the (row, slot) pairs sorted by
  expert, one pair of matmuls per expert that got rows, over just those rows; every hit
  expert's weights are read once, in place. Its fake kernel is right below it. The op has
  no backward: when its inputs need gradients (training) the public function runs the same
  loop outside the op, and autograd differentiates it.
- **ONNX**: node ``numaov.moe::MoeExperts`` with the five tensors as inputs (the weights are
  initializers, so an export's weight format is the IR constants' format). Written by
  :func:`moe_translation_table` for a captured program (what ``numaov.exporter`` does) and
  by ``torch.onnx.ops.symbolic`` when ``torch.onnx.export`` traces the public function.
  ONNX Runtime has no kernel for it: ``check_onnxruntime_can_run`` refuses such a graph.
- **OpenVINO**: the extension op ``MoeExperts`` (``csrc/ops/moe_op.cpp``, kernel in
  ``csrc/kernels/moe_kernels.cpp``): f32 weights with AVX-512 FMA, bf16 weights with AVX512-BF16 dot
  products, int8 / int4 / fp8 weights widened and scaled as they are read (int8 and int4 in a
  bf16 model: int8 products on AVX512-VNNI against activations quantized per row,
  ``int8_kernel``); cost proportional to the routed rows.

Weight formats (``WEIGHT_FORMATS``; :func:`quantize_experts` writes them, the layout is drawn
in ``csrc/kernels/moe_kernels.hpp``): ``f32`` and ``bf16`` stacks as they are; ``int8``: int8 stacks
plus f32 scales ``[E, rows, groups]`` (symmetric, ``q = round(w / scale)``, one group per
output channel by default); ``int4``: uint8 stacks holding two values per byte (the last dim
halved) plus f32 scales per group of 32 / 64 / 128 values; ``fp8``: ``torch.float8_e4m3fn``
stacks plus f32 scales ``[E, rows, groups]`` as for int8, from DeepSeek-V3's 128 x 128 block
scales (:func:`quantize_experts`, and :func:`fp8_row_scales` for a released FP8 checkpoint's
blocks, sharded or not). The scales are two more inputs of the op (and of the ONNX node), so an
IR carries them as constants.

``dense_linear(x, weight, scale)`` is the same kernel as a plain linear layer, ``weight . x``
over the last dim, for a weight ``[M, K]`` in one of these formats (node
``numaov.moe::DenseLinear``, extension op ``DenseLinear``): what keeps a released FP8
checkpoint's attention and MLP projections one byte per weight with ``--fp8-dense``, which
OpenVINO's CPU plugin would widen to bf16 at compile time, and a bf16 export's projections on
AVX512-BF16 without AMX (``models.layers.kernel_linear``).

Numerics: sums over a row's slots are fp32 and the result is rounded once to ``x``'s dtype.
With bf16 weights the activations are rounded to bf16 before each projection (what a bf16
``F.linear`` does); int8 / int4 / fp8 weights are weight-only (the activations stay f32).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from numaov import NumaovError
from numaov.manifest import WEIGHT_FORMATS

__all__ = [
    "MOE_DOMAIN",
    "WEIGHT_FORMATS",
    "MoeOpError",
    "dequantize_experts",
    "fp8_row_scales",
    "quantize_block_fp8",
    "quantize_experts",
    "bf16_kernel",
    "int8_kernel",
    "kernel_isa",
    "kernel_unavailable_reason",
    "dense_linear",
    "moe_experts",
    "moe_translation_table",
    "write_dense_linear_onnx",
    "write_moe_onnx",
    "write_store_moe_onnx",
]

#: The ONNX domain of the MoeExperts node; the C++ extension maps the same string.
MOE_DOMAIN = "numaov.moe"
MOE_DOMAIN_VERSION = 1

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.uint8, torch.float8_e4m3fn)
#: Stacks that come with f32 scales: int8, packed int4, fp8.
SCALED_DTYPES = (torch.int8, torch.uint8, torch.float8_e4m3fn)
#: DeepSeek-V3's FP8 block (rows x columns of a weight [N, K]) and E4M3's largest value.
FP8_BLOCK = (128, 128)
FP8_MAX = 448.0
ID_DTYPES = (torch.int64, torch.int32)
#: int4 group sizes tried largest first (a group must divide the row; the kernel reads 32
#: values per step).
INT4_GROUP_SIZES = (128, 64, 32)


class MoeOpError(NumaovError):
    """moe_experts was called with tensors of the wrong shape, dtype or expert ids."""


# ---------------------------------------------------------------------------------------------
# Argument checks, run before dispatch so eager calls and export tracing fail the same way.
# ---------------------------------------------------------------------------------------------


def _known(size: Any) -> int | None:
    """A size's concrete value, or None for a dynamic (symbolic) one, without adding a guard."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return int(hint) if hint is not None else None
    return int(size)


def _check_args(x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor,
                gate_up_scale: Tensor | None, down_scale: Tensor | None) -> None:
    def fail(message: str, parameter: str) -> None:
        raise MoeOpError(f"moe_experts: {message}", parameter=parameter)

    expected = {"x": 2, "ids": 2, "weights": 2, "gate_up": 3, "down": 3}
    tensors = {"x": x, "ids": ids, "weights": weights, "gate_up": gate_up, "down": down}
    if gate_up_scale is not None or down_scale is not None:
        tensors.update(gate_up_scale=gate_up_scale, down_scale=down_scale)
        expected.update(gate_up_scale=3, down_scale=3)
    for name, tensor in tensors.items():
        if not isinstance(tensor, Tensor):
            fail(f"{name} is {type(tensor).__name__}; expected a tensor", name)
        if tensor.dim() != expected[name]:
            fail(f"{name} has shape {list(tensor.shape)}; expected {expected[name]} dimensions",
                 name)
        if tensor.device.type != "cpu":
            fail(f"{name} is on {tensor.device}; expected a CPU tensor", name)
    if x.dtype not in ACTIVATION_DTYPES:
        fail(f"x dtype is {x.dtype}; expected torch.float32 or torch.bfloat16", "x")
    if ids.dtype not in ID_DTYPES:
        fail(f"ids dtype is {ids.dtype}; expected torch.int64 or torch.int32", "ids")
    if weights.dtype != torch.float32:
        fail(f"weights dtype is {weights.dtype}; expected torch.float32 (the router's)",
             "weights")
    if gate_up.dtype not in WEIGHT_DTYPES or down.dtype != gate_up.dtype:
        fail(f"gate_up / down dtypes are {gate_up.dtype} / {down.dtype}; expected both "
             "torch.float32, torch.bfloat16, torch.int8 (int8), torch.uint8 (packed int4) or "
             "torch.float8_e4m3fn (fp8)", "gate_up")
    quantized = gate_up.dtype in SCALED_DTYPES
    if quantized != (gate_up_scale is not None and down_scale is not None):
        fail(f"gate_up is {gate_up.dtype} and the scales are "
             f"{'given' if gate_up_scale is not None or down_scale is not None else 'None'}; "
             "expected both scales exactly for int8 / int4 / fp8 weights", "gate_up_scale")
    packing = 2 if gate_up.dtype == torch.uint8 else 1  # packed int4: last dims halved
    n, h = (_known(d) for d in x.shape)
    e, i2, hg = (_known(d) for d in gate_up.shape)
    ed, hd, i = (_known(d) for d in down.shape)
    hg, i = hg * packing, i * packing
    if [_known(d) for d in ids.shape] != [_known(d) for d in weights.shape]:
        fail(f"ids {list(ids.shape)} and weights {list(weights.shape)} differ; expected both "
             "[N, k]", "weights")
    if n is not None and _known(ids.shape[0]) not in (None, n):
        fail(f"x has {n} rows but ids has {_known(ids.shape[0])}; expected one ids row per x row",
             "ids")
    if e != ed or i2 != 2 * i or hg != h or hd != h:
        fail(f"x {list(x.shape)}, gate_up {list(gate_up.shape)} and down {list(down.shape)} do "
             "not fit; expected x [N, H], gate_up [E, 2I, H] and down [E, H, I]"
             + (" with the last dims halved (packed int4)" if packing == 2 else ""), "gate_up")
    if quantized:
        for name, scale, stack, k in (("gate_up_scale", gate_up_scale, gate_up, h),
                                      ("down_scale", down_scale, down, i)):
            if scale.dtype != torch.float32 or list(scale.shape[:2]) != list(stack.shape[:2]):
                fail(f"{name} is {scale.dtype} {list(scale.shape)}; expected torch.float32 "
                     f"[{stack.shape[0]}, {stack.shape[1]}, groups]", name)
            _check_groups(name, k, scale.shape[2], packing == 2)


def _check_groups(name: str, k: int, groups: int, int4: bool) -> None:
    """What the kernel reads: a group's scale per 16 (int8, fp8) or 32 (int4) values."""
    step = 32 if int4 else 16
    size = k // groups if groups and k % groups == 0 else 0
    if not size or (int4 and k % 32) or (size % step and not (groups == 1 and not int4)):
        raise MoeOpError(
            f"moe_experts: {name} has {groups} groups over rows of {k} values; expected groups "
            f"of a multiple of {step} values dividing the row" + ("" if int4 else
                                                                  " (or one group per row)"),
            parameter=name,
        )


def _check_ids(ids: Tensor, experts: int) -> None:
    """Expert ids in range: read from the data, so only where data exists (not when tracing)."""
    if ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= experts:
        bad = low if low < 0 else high
        row, slot = (int(v) for v in (ids == bad).nonzero()[0])
        raise MoeOpError(
            f"moe_experts: expert id {bad} at row {row}, slot {slot}; expected 0 .. "
            f"{experts - 1} (gate_up holds {experts} experts)", parameter="ids",
        )


# ---------------------------------------------------------------------------------------------
# Eager face: the torch.library op, with its fake (shape-only) kernel right below it.
# ---------------------------------------------------------------------------------------------


def _grouped_experts(
    x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor,
    gate_up_scale: Tensor | None = None, down_scale: Tensor | None = None,
) -> Tensor:
    """The grouped loop in plain torch calls: the eager op's body, and what autograd
    differentiates when the op's inputs need gradients (training)."""
    _check_ids(ids, gate_up.shape[0])
    n, k = ids.shape
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    rows = order // k  # token row of each (sorted) pair
    slot_weights = weights.reshape(-1)[order]
    quantized = gate_up_scale is not None
    xw = x.float() if quantized else x.to(gate_up.dtype)
    out = torch.zeros(n, x.shape[1], dtype=torch.float32)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        idx = rows[start:start + count]
        if quantized:  # weight-only: this expert's weights widened to f32, activations f32
            w_gate_up = dequantize_experts(gate_up[expert:expert + 1],
                                           gate_up_scale[expert:expert + 1])[0]
            w_down = dequantize_experts(down[expert:expert + 1], down_scale[expert:expert + 1])[0]
        else:
            w_gate_up, w_down = gate_up[expert], down[expert]
        gate, up = F.linear(xw[idx], w_gate_up).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down)
        out.index_add_(0, idx, y.float() * slot_weights[start:start + count, None])
        start += count
    return out.to(x.dtype)


@torch.library.custom_op("numaov::moe_experts", mutates_args=())
def _moe_experts_op(
    x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor,
    gate_up_scale: Tensor | None = None, down_scale: Tensor | None = None,
) -> Tensor:
    return _grouped_experts(x, ids, weights, gate_up, down, gate_up_scale, down_scale)


@_moe_experts_op.register_fake
def _(x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor,
      gate_up_scale: Tensor | None = None, down_scale: Tensor | None = None) -> Tensor:
    return x.new_empty(x.shape)


def moe_experts(x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor,
                gate_up_scale: Tensor | None = None, down_scale: Tensor | None = None) -> Tensor:
    """The routed experts' weighted sum per row: ``[N, H]`` in ``x``'s dtype (see the module
    docstring). Any ``N`` from 0; an expert that gets no rows costs nothing. int8 / int4 / fp8
    stacks (from :func:`quantize_experts`) come with their scales."""
    _check_args(x, ids, weights, gate_up, down, gate_up_scale, down_scale)
    tensors = (x, ids, weights, gate_up, down)
    if gate_up_scale is not None:
        tensors += (gate_up_scale, down_scale)
    if torch.onnx.is_in_onnx_export():
        return torch.onnx.ops.symbolic(
            f"{MOE_DOMAIN}::MoeExperts", tensors, {},
            dtype=x.dtype, shape=x.shape, version=MOE_DOMAIN_VERSION,
        )
    if (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
            and not torch.compiler.is_compiling()):
        # Training (train_tiny_moe): the op has no backward, so the same loop runs outside
        # it and autograd differentiates its torch calls. Under torch.export the op stays
        # (the graph must hold the one node the exporter turns into MoeExperts).
        return _grouped_experts(*tensors)
    return torch.ops.numaov.moe_experts(*tensors)


def _check_linear_args(x: Tensor, weight: Tensor, scale: Tensor | None) -> None:
    def fail(message: str, parameter: str) -> None:
        raise MoeOpError(f"dense_linear: {message}", parameter=parameter)

    if not isinstance(x, Tensor) or x.dim() < 1 or x.dtype not in ACTIVATION_DTYPES:
        fail(f"x is {getattr(x, 'dtype', type(x).__name__)} "
             f"{list(getattr(x, 'shape', []))}; expected a torch.float32 or torch.bfloat16 "
             "tensor [..., K]", "x")
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.dtype not in WEIGHT_DTYPES:
        fail(f"weight is {getattr(weight, 'dtype', type(weight).__name__)} "
             f"{list(getattr(weight, 'shape', []))}; expected [M, K] in torch.float32, "
             "torch.bfloat16, torch.int8, torch.uint8 (packed int4) or torch.float8_e4m3fn",
             "weight")
    quantized = weight.dtype in SCALED_DTYPES
    if quantized != (scale is not None):
        fail(f"weight is {weight.dtype} and scale is {'given' if scale is not None else 'None'}; "
             "expected a scale exactly for int8 / int4 / fp8 weights", "scale")
    packing = 2 if weight.dtype == torch.uint8 else 1
    k = _known(x.shape[-1])
    if k is not None and k != _known(weight.shape[1]) * packing:
        fail(f"x {list(x.shape)} and weight {list(weight.shape)} differ in input size; expected "
             "x [..., K] and weight [M, K]" + (" (K halved: packed int4)" if packing == 2 else ""),
             "weight")
    if quantized:
        if scale.dtype != torch.float32 or scale.dim() != 2 or scale.shape[0] != weight.shape[0]:
            fail(f"scale is {scale.dtype} {list(scale.shape)}; expected torch.float32 "
                 f"[{weight.shape[0]}, groups]", "scale")
        _check_groups("scale", weight.shape[1] * packing, scale.shape[1], packing == 2)


@torch.library.custom_op("numaov::dense_linear", mutates_args=())
def _dense_linear_op(x: Tensor, weight: Tensor, scale: Tensor | None = None) -> Tensor:
    # the experts' numerics: weight-only formats widened to f32 with f32 activations, bf16
    # weights against activations rounded to bf16; one rounding to x's dtype
    if scale is not None:
        w = dequantize_experts(weight[None], scale[None])[0]
        return F.linear(x.float(), w).to(x.dtype)
    return F.linear(x.to(weight.dtype), weight).to(x.dtype)


@_dense_linear_op.register_fake
def _(x: Tensor, weight: Tensor, scale: Tensor | None = None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def dense_linear(x: Tensor, weight: Tensor, scale: Tensor | None = None) -> Tensor:
    """``weight . x`` over the last dim of ``x [..., K]`` (no bias): ``[..., M]`` in ``x``'s
    dtype, for a ``weight [M, K]`` in a weight format of :func:`quantize_experts` (one
    expert's stack; int8 / int4 / fp8 with its ``scale [M, groups]``), computed by the experts'
    kernel in OpenVINO."""
    _check_linear_args(x, weight, scale)
    tensors = (x, weight) if scale is None else (x, weight, scale)
    if torch.onnx.is_in_onnx_export():
        return torch.onnx.ops.symbolic(
            f"{MOE_DOMAIN}::DenseLinear", tensors, {}, dtype=x.dtype,
            shape=(*x.shape[:-1], weight.shape[0]), version=MOE_DOMAIN_VERSION,
        )
    return torch.ops.numaov.dense_linear(*tensors)


# ---------------------------------------------------------------------------------------------
# Weight formats: the stacks as the op (and the IR) hold them.
# ---------------------------------------------------------------------------------------------


def int4_group_size(*row_lengths: int) -> int:
    """The largest of ``INT4_GROUP_SIZES`` dividing every row length (H for gate_up, I for
    down); a MoeOpError when none does."""
    for size in INT4_GROUP_SIZES:
        if all(k % size == 0 for k in row_lengths):
            return size
    raise MoeOpError(
        f"int4 expert weights need rows whose lengths {list(row_lengths)} are multiples of one "
        f"of the group sizes {list(INT4_GROUP_SIZES)}; expected hidden and intermediate sizes "
        "divisible by 32", parameter="weights",
    )


def quantize_experts(stack: Tensor, weight_format: str, group_size: int | None = None
                     ) -> tuple[Tensor, Tensor | None]:
    """An expert stack ``[E, rows, K]`` in ``weight_format``: ``(stored, scales)``.

    ``f32`` / ``bf16``: the stack cast, no scales. ``int8``: symmetric, ``scale =
    max|w| / 127`` per group (``group_size`` None: one group per row, i.e. per output
    channel). ``int4``: symmetric, ``scale = max|w| / 7`` per group of ``group_size`` values
    (default: :func:`int4_group_size`), ``q`` in [-8, 7] stored as ``q + 8``, two per byte:
    each block of 32 values is 16 bytes, low nibbles the first 16 values, high nibbles the
    next 16 (``csrc/kernels/moe_kernels.hpp``). ``fp8``: DeepSeek-V3's released scheme, per
    expert blocks of 128 rows x 128 columns (``group_size``, when given, is the block's
    columns; partial last blocks allowed), ``scale_inv = max|w| / 448`` per block and ``q =
    w / scale_inv`` as ``torch.float8_e4m3fn``; the scales returned are the block scales as
    the kernel's per-row groups (:func:`fp8_row_scales`).
    """
    if weight_format not in WEIGHT_FORMATS:
        raise MoeOpError(f"weight format {weight_format!r}; expected one of "
                         f"{', '.join(WEIGHT_FORMATS)}", parameter="weights")
    if weight_format == "f32":
        return stack.float().contiguous(), None
    if weight_format == "bf16":
        return stack.bfloat16().contiguous(), None
    if weight_format == "fp8":
        return _quantize_fp8(stack, (FP8_BLOCK[0], group_size or FP8_BLOCK[1]))
    e, rows, k = stack.shape
    int4 = weight_format == "int4"
    size = group_size or (int4_group_size(k) if int4 else k)
    step = 32 if int4 else 16
    if k % size or (size % step and size != k) or (int4 and k % 32):
        raise MoeOpError(
            f"{weight_format} group_size {size} for rows of {k} values; expected a multiple of "
            f"{step} dividing {k}" + ("" if int4 else f" (or {k}: one scale per row)"),
            parameter="group_size",
        )
    groups = stack.detach().float().reshape(e, rows, k // size, size)
    limit = 7.0 if int4 else 127.0
    scale = (groups.abs().amax(dim=-1, keepdim=True) / limit).clamp_min(1e-12)
    q = torch.round(groups / scale).clamp(-8 if int4 else -127, limit).reshape(e, rows, k)
    scales = scale.squeeze(-1).contiguous()
    if not int4:
        return q.to(torch.int8).contiguous(), scales
    nibbles = (q + 8).to(torch.uint8).reshape(e, rows, k // 32, 2, 16)
    packed = nibbles[..., 0, :] | (nibbles[..., 1, :] << 4)
    return packed.reshape(e, rows, k // 2).contiguous(), scales


def _quantize_fp8(stack: Tensor, block: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """``quantize_experts(stack, "fp8")``: block scales over ``block`` (rows, columns)."""
    e, rows, k = stack.shape
    q, scale_inv = quantize_block_fp8(stack, block)
    scales = torch.stack([fp8_row_scales(scale_inv[i], 0, rows, 0, k, block) for i in range(e)])
    return q, scales.contiguous()


def quantize_block_fp8(weight: Tensor, block: tuple[int, int] = FP8_BLOCK
                       ) -> tuple[Tensor, Tensor]:
    """``weight [..., N, K]`` as DeepSeek-V3 releases its weights: ``(float8_e4m3fn [..., N,
    K], f32 weight_scale_inv [..., ceil(N / block[0]), ceil(K / block[1])])``, each block's
    scale mapping its largest magnitude to E4M3's largest (448); partial edge blocks have
    their own."""
    *lead, rows, k = weight.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-k // bc)
    w = weight.detach().float()
    padded = F.pad(w, (0, nc * bc - k, 0, nr * br - rows))
    amax = padded.abs().reshape(*lead, nr, br, nc, bc).amax(dim=(-3, -1))
    scale_inv = (amax / FP8_MAX).clamp_min(1e-12)  # [..., nr, nc]
    per_value = scale_inv.repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)
    q = (w / per_value[..., :rows, :k]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale_inv.contiguous()


def fp8_row_scales(block_scale_inv: Tensor, row_start: int, rows: int, col_start: int,
                   cols: int, block: tuple[int, int] = FP8_BLOCK) -> Tensor:
    """The kernel's scales ``f32 [rows, G]`` of rows ``row_start .. row_start + rows`` and
    columns ``col_start .. col_start + cols`` of an FP8 weight ``[N, K]`` whose scales are
    ``block_scale_inv [ceil(N / block[0]), ceil(K / block[1])]`` (DeepSeek-V3's
    ``weight_scale_inv``): what keeps a released FP8 checkpoint's experts as they are, whole or
    sharded (rows of gate / up, columns of down).

    Each row is split into G equal groups of ``gcd(block[1], col_start, cols)`` values, so no
    group crosses a block's columns; when the columns lie inside one block the row is one
    group (G = 1). Raises MoeOpError when the groups would be smaller than 16 values (the
    kernel reads a scale per 16 values) or the slice leaves the scales."""
    br, bc = block
    nr, nc = block_scale_inv.shape
    if (rows < 1 or cols < 1 or row_start < 0 or col_start < 0
            or (row_start + rows - 1) // br >= nr or (col_start + cols - 1) // bc >= nc):
        raise MoeOpError(
            f"fp8 rows {row_start} .. {row_start + rows} and columns {col_start} .. "
            f"{col_start + cols} of a weight with block scales [{nr}, {nc}] of {br} x {bc} "
            f"blocks; expected a slice inside the weight", parameter="weights")
    if col_start % bc + cols <= bc:
        size = cols
    else:
        size = math.gcd(bc, col_start, cols)
        if size < 16:
            raise MoeOpError(
                f"fp8 columns {col_start} .. {col_start + cols} cut {bc}-column scale blocks "
                f"into groups of {size} values; expected slices whose start and length are "
                f"multiples of 16 (groups of 16 or more values) or use --weights bf16",
                parameter="weights")
    groups = cols // size
    row_blocks = (torch.arange(rows) + row_start) // br
    col_blocks = (torch.arange(groups) * size + col_start) // bc
    return block_scale_inv.float()[row_blocks][:, col_blocks].contiguous()


def dequantize_experts(stored: Tensor, scales: Tensor | None) -> Tensor:
    """The f32 stack ``[E, rows, K]`` a stored one stands for (the inverse of
    :func:`quantize_experts` up to its rounding); f32 / bf16 stacks are only cast. int8 and
    fp8 values are widened (``stored.float()``) and multiplied by their group's scale."""
    if scales is None:
        return stored.float()
    e, rows = stored.shape[:2]
    if stored.dtype == torch.uint8:
        blocks = stored.reshape(e, rows, -1, 16)
        q = torch.stack([blocks & 0xF, blocks >> 4], dim=-2).reshape(e, rows, -1).float() - 8
    else:
        q = stored.float()
    k = q.shape[-1]
    groups = scales.shape[-1]
    return (q.reshape(e, rows, groups, k // groups) * scales.unsqueeze(-1)).reshape(e, rows, k)


def kernel_unavailable_reason(weight_format: str) -> str:
    """Why the OpenVINO op's kernel cannot run weights of ``weight_format`` on this CPU
    (``""`` when it can): it needs AVX-512 (F, DQ, BW, VL) or AVX2 with FMA and F16C, for
    every format (``kernel_isa`` says which it runs on)."""
    from numaov.native import native_module

    return native_module().moe_unavailable_reason(weight_format)


# What each format's experts run on (csrc/kernels/moe_kernels.cpp, ``dot_tile_of`` and
# ``dot_rows_avx2``), after the instructions (``kernel_isa``); bf16's choice between AMX tiles
# and AVX512-BF16 is made at run time (``bf16_kernel``).
FORMAT_KERNELS = {
    "f32": "f32 FMA",
    "int8": "int8 weights widened to f32 as read, f32 FMA, scaled per group",
    "int4": "int4 weights widened to f32 as read, f32 FMA, scaled per group",
    "fp8": "E4M3 weights widened to f32 as IEEE halves (F16C), f32 FMA, scaled per group",
}
ISA_NAMES = {"avx512": "AVX-512", "avx2": "AVX2"}


def kernel_isa(weight_format: str) -> str:
    """The instructions the OpenVINO op runs ``weight_format`` on here under
    ``NUMAOV_MOE_ISA`` (read at every call): ``"avx512"`` or ``"avx2"``. Raises MoeOpError
    for a bad setting, or a forced one the CPU lacks."""
    from numaov.native import native_module

    try:
        return str(native_module().moe_kernel_isa(weight_format))
    except (ValueError, RuntimeError) as exc:
        raise MoeOpError(str(exc), parameter="NUMAOV_MOE_ISA") from None


def format_kernels() -> dict[str, dict[str, Any]]:
    """Per weight format, the kernel the OpenVINO op runs its experts on here: ``{"kernel":
    str | None, "reason": str}`` (None, and why, where this CPU cannot run it)."""
    kernels = {}
    fp8_tile_min_rows = None  # a bf16 model's fp8 experts of this many rows on the bf16 tiles
    for weight_format in WEIGHT_FORMATS:
        missing = kernel_unavailable_reason(weight_format)
        try:
            isa = None if missing else kernel_isa(weight_format)
            bf16 = bf16_kernel() if isa and weight_format == "bf16" else None
            int8 = int8_kernel() if isa and weight_format in ("int8", "int4") else None
        except MoeOpError as exc:
            kernels[weight_format] = {"kernel": None, "reason": str(exc)}
            continue
        if missing:
            kernels[weight_format] = {"kernel": None, "reason": missing}
        elif bf16 is not None and bf16["kernel"] is None:
            kernels[weight_format] = {"kernel": None, "reason": bf16["reason"]}
        elif int8 is not None and int8["kernel"] is None:
            kernels[weight_format] = {"kernel": None, "reason": int8["reason"]}
        elif int8 is not None and int8["kernel"] == "vnni":
            kernels[weight_format] = {
                "kernel": f"AVX512-VNNI: {weight_format} weights against activations quantized "
                          f"per row in groups of {int8['act_group']} ({int8['reason']}; weight "
                          f"groups of fewer values widened to f32)", "reason": ""}
        elif bf16 is not None:
            fp8_tile_min_rows = bf16["fp8_tile_min_rows"]
            described = {
                "amx": f"AMX bf16 tiles for experts of {bf16['amx_min_rows']}+ rows, "
                       "AVX512-BF16 dot products below",
                "avx512_bf16": f"AVX512-BF16 outer products for experts of "
                               f"{bf16['outer_min_rows']}+ rows, dot products below",
                "avx2": "AVX2: bf16 weights and activations widened to f32, f32 FMA"}
            kernels[weight_format] = {"kernel": described[bf16["kernel"]],
                                      "reason": bf16["reason"]}
        else:
            kernels[weight_format] = {
                "kernel": f"{ISA_NAMES[isa]}: {FORMAT_KERNELS[weight_format]}", "reason": ""}
    if fp8_tile_min_rows and kernels["fp8"]["kernel"] and kernel_isa("fp8") == "avx512":
        kernels["fp8"]["kernel"] += (f"; in a bf16 model, from {fp8_tile_min_rows} rows per "
                                     "expert, dequantized to bf16 for the bf16 kernel")
    return kernels


def int8_kernel() -> dict[str, Any]:
    """Which kernel the OpenVINO ops run int8 and int4 weights on here, under ``NUMAOV_MOE_VNNI``
    (``auto``: AVX512-VNNI products against activations quantized per row in groups of
    ``act_group`` values in a bf16 model, where the CPU has AVX512-VNNI; ``off``: widened to
    f32; ``always``: VNNI in f32 models too) and ``NUMAOV_MOE_ISA``: ``{"kernel": "vnni" |
    "f32" | None, "act_group": int | None, "reason": str}``. Raises MoeOpError for a bad
    setting of either."""
    return _kernel_report("moe_int8_kernel", "NUMAOV_MOE_VNNI")


def bf16_kernel() -> dict[str, Any]:
    """Which kernel the OpenVINO op runs bf16 experts on here, under ``NUMAOV_MOE_AMX``
    (``auto``: AMX tiles for experts of ``amx_min_rows`` rows or more where AMX is usable;
    ``off``; ``always``) and ``NUMAOV_MOE_ISA``: ``{"kernel": "amx" | "avx512_bf16" | "avx2"
    | None, "amx_min_rows": int | None, "fp8_tile_min_rows": int | None, "outer_min_rows": int
    | None, "reason": str}``; ``outer_min_rows``: the rows from which experts on AVX512-BF16
    run as outer products against packed activations (dot products below);
    ``fp8_tile_min_rows``: the rows per expert (a call's average) from which a bf16 model's fp8
    experts run on these tiles, dequantized to bf16 (None: never). Raises MoeOpError for a bad
    setting of either."""
    return _kernel_report("moe_bf16_kernel", "NUMAOV_MOE_AMX")


def _kernel_report(function: str, variable: str) -> dict[str, Any]:
    """The native library's report ``function()``; a bad ``variable`` or ``NUMAOV_MOE_ISA``
    setting as a MoeOpError naming the one that is wrong."""
    from numaov.native import native_module

    try:
        return dict(getattr(native_module(), function)())
    except ValueError as exc:
        name = "NUMAOV_MOE_ISA" if "NUMAOV_MOE_ISA" in str(exc) else variable
        raise MoeOpError(str(exc), parameter=name) from None


# ---------------------------------------------------------------------------------------------
# ONNX face of the captured op.
# ---------------------------------------------------------------------------------------------


def moe_translation_table() -> dict[Any, Any]:
    """``{torch op overload: onnxscript function}`` writing the ``numaov.moe::MoeExperts``
    node, for ``torch.onnx.export`` of a program captured with ``torch.export`` (see
    ``collective_ops.collective_translation_table``). Imported lazily: onnx and onnxscript are
    only needed when exporting."""
    from onnx.defs import OpSchema
    from onnxscript.values import Op, Opset

    def formal(name: str, type_str: str, optional: bool = False) -> OpSchema.FormalParameter:
        option = (OpSchema.FormalParameterOption.Optional if optional
                  else OpSchema.FormalParameterOption.Single)
        return OpSchema.FormalParameter(name, type_str, param_option=option)

    # The domain is not registered with onnx, so onnxscript needs the schemas given.
    WEIGHT_TYPES = ["tensor(float)", "tensor(bfloat16)", "tensor(int8)", "tensor(uint8)",  # noqa: N806
                    "tensor(float8e4m3fn)"]
    schema = OpSchema(
        "MoeExperts", MOE_DOMAIN, MOE_DOMAIN_VERSION,
        inputs=[formal("x", "T"), formal("ids", "I"), formal("weights", "tensor(float)"),
                formal("gate_up", "W"), formal("down", "W"),
                formal("gate_up_scale", "tensor(float)", optional=True),
                formal("down_scale", "tensor(float)", optional=True)],
        outputs=[formal("y", "T")],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(bfloat16)"], "activations"),
            ("I", ["tensor(int64)", "tensor(int32)"], "expert ids"),
            ("W", WEIGHT_TYPES, "expert weights: f32, bf16, int8, packed int4, fp8"),
        ],
    )
    node = Op(Opset(MOE_DOMAIN, MOE_DOMAIN_VERSION), "MoeExperts", schema)

    def moe_experts_onnx(x, ids, weights, gate_up, down, gate_up_scale=None, down_scale=None):
        if gate_up_scale is None:
            return node(x, ids, weights, gate_up, down)
        return node(x, ids, weights, gate_up, down, gate_up_scale, down_scale)

    linear_schema = OpSchema(
        "DenseLinear", MOE_DOMAIN, MOE_DOMAIN_VERSION,
        inputs=[formal("x", "T"), formal("weight", "W"),
                formal("scale", "tensor(float)", optional=True)],
        outputs=[formal("y", "T")],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(bfloat16)"], "activations"),
            ("W", WEIGHT_TYPES, "the weight: f32, bf16, int8, packed int4, fp8"),
        ],
    )
    linear_node = Op(Opset(MOE_DOMAIN, MOE_DOMAIN_VERSION), "DenseLinear", linear_schema)

    def dense_linear_onnx(x, weight, scale=None):
        return linear_node(x, weight) if scale is None else linear_node(x, weight, scale)

    return {torch.ops.numaov.moe_experts.default: moe_experts_onnx,
            torch.ops.numaov.dense_linear.default: dense_linear_onnx}


def write_moe_onnx(path: Path, gate_up: Tensor, down: Tensor, top_k: int,
                   scales: tuple[Tensor, Tensor] | None = None) -> Path:
    """An ONNX model of one ``numaov.moe::MoeExperts`` node with the expert stacks (and int8 /
    int4 / fp8 scales) as initializers, as the exporter writes the node, and inputs x [N, H], ids
    [N, top_k] int64 and weights [N, top_k] with N dynamic: the op alone, for tests and
    benchmarks of its OpenVINO face."""
    import onnx
    from onnx import TensorProto, helper

    hidden = down.shape[1]
    names = ["x", "ids", "weights", "gate_up", "down"]
    initializers = [_initializer(gate_up, "gate_up"), _initializer(down, "down")]
    if scales is not None:
        names += ["gate_up_scale", "down_scale"]
        initializers += [_initializer(scales[0], "gate_up_scale"),
                         _initializer(scales[1], "down_scale")]
    node = helper.make_node("MoeExperts", names, ["y"], domain=MOE_DOMAIN)
    graph = helper.make_graph(
        [node], "moe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", hidden]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", top_k]),
         helper.make_tensor_value_info("weights", TensorProto.FLOAT, ["N", top_k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", hidden])],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                     helper.make_opsetid(MOE_DOMAIN, MOE_DOMAIN_VERSION)])
    onnx.save(model, path)
    return path


def _initializer(tensor: Tensor, name: str) -> Any:
    """An ONNX initializer of ``tensor`` (fp8, bf16: its bytes as they are, numpy has
    neither)."""
    from onnx import TensorProto, helper, numpy_helper

    raw = {torch.float8_e4m3fn: TensorProto.FLOAT8E4M3FN, torch.bfloat16: TensorProto.BFLOAT16}
    if tensor.dtype in raw:
        return helper.make_tensor(name, raw[tensor.dtype], list(tensor.shape),
                                  tensor.contiguous().view(torch.uint8).numpy().tobytes(),
                                  raw=True)
    return numpy_helper.from_array(tensor.numpy(), name)


def write_dense_linear_onnx(path: Path, weight: Tensor, scale: Tensor | None = None) -> Path:
    """An ONNX model of one ``numaov.moe::DenseLinear`` node with ``weight`` (and its scale) as
    initializers and input x [N, K] f32, N dynamic: the op alone, for tests and benchmarks of
    its OpenVINO face."""
    import onnx
    from onnx import TensorProto, helper

    k = weight.shape[1] * (2 if weight.dtype == torch.uint8 else 1)
    names = ["x", "weight"] + ([] if scale is None else ["scale"])
    initializers = [_initializer(weight, "weight")]
    if scale is not None:
        initializers.append(_initializer(scale, "scale"))
    node = helper.make_node("DenseLinear", names, ["y"], domain=MOE_DOMAIN)
    graph = helper.make_graph(
        [node], "dense_linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", weight.shape[0]])],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid(MOE_DOMAIN, MOE_DOMAIN_VERSION)])
    onnx.save(model, path)
    return path


def write_store_moe_onnx(path: Path, store: str, store_id: str, layer: int, hidden: int,
                         top_k: int) -> Path:
    """An ONNX model of one ``numaov.moe::MoeExperts`` node of the store face, as the exporter
    writes it: inputs x [N, H], ids [N, top_k] int64 and weights [N, top_k], the experts of
    ``layer`` read from the expert store named by ``store`` / ``store_id``; for tests and
    benchmarks of the op over a store."""
    import onnx
    from onnx import TensorProto, helper

    node = helper.make_node("MoeExperts", ["x", "ids", "weights"], ["y"], domain=MOE_DOMAIN,
                            store=store, store_id=store_id, layer=layer)
    graph = helper.make_graph(
        [node], "moe_store",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", hidden]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", top_k]),
         helper.make_tensor_value_info("weights", TensorProto.FLOAT, ["N", top_k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", hidden])])
    model = helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid(MOE_DOMAIN, MOE_DOMAIN_VERSION)])
    onnx.save(model, path)
    return path

"""The routed experts of a MoE layer as one op, ``numaov::moe_experts``, with its three faces.

``moe_experts(x, ids, weights, gate_up, down)`` computes, for every row ``n`` of ``x [N, H]``::

    out[n] = sum_j weights[n, j] * down[e] @ (silu(gate[e] @ x[n]) * (up[e] @ x[n])),  e = ids[n, j]

with the experts as weight stacks ``gate_up [E, 2I, H]`` (gate rows first, then up) and
``down [E, H, I]``. ``ids`` and ``weights`` are ``[N, k]`` (the router's top-k).

- **eager**: the ``torch.library`` op below, a grouped loop: the (row, slot) pairs sorted by
  expert, one pair of matmuls per expert that got rows, over just those rows; every hit
  expert's weights are read once, in place. Its fake kernel is right below it.
- **ONNX**: node ``numaov.moe::MoeExperts`` with the five tensors as inputs (the weights are
  initializers, so an export's weight format is the IR constants' format). Written by
  :func:`moe_translation_table` for a captured program (what ``numaov.exporter`` does) and
  by ``torch.onnx.ops.symbolic`` when ``torch.onnx.export`` traces the public function.
  ONNX Runtime has no kernel for it: ``check_onnxruntime_can_run`` refuses such a graph.
- **OpenVINO**: the extension op ``MoeExperts`` (``csrc/moe_op.cpp``, kernel in
  ``csrc/moe_kernels.cpp``): f32 weights with AVX-512 FMA, bf16 weights with AVX512-BF16 dot
  products, cost proportional to the routed rows.

Numerics: sums over a row's slots are fp32 and the result is rounded once to ``x``'s dtype.
With bf16 weights the activations are rounded to bf16 before each projection (what a bf16
``F.linear`` does).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from numaov import NumaovError

__all__ = [
    "MOE_DOMAIN",
    "MoeOpError",
    "kernel_unavailable_reason",
    "moe_experts",
    "moe_translation_table",
]

#: The ONNX domain of the MoeExperts node; the C++ extension maps the same string.
MOE_DOMAIN = "numaov.moe"
MOE_DOMAIN_VERSION = 1

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16)
ID_DTYPES = (torch.int64, torch.int32)


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


def _check_args(x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor) -> None:
    def fail(message: str, parameter: str) -> None:
        raise MoeOpError(f"moe_experts: {message}", parameter=parameter)

    expected = {"x": 2, "ids": 2, "weights": 2, "gate_up": 3, "down": 3}
    tensors = {"x": x, "ids": ids, "weights": weights, "gate_up": gate_up, "down": down}
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
             "torch.float32 or both torch.bfloat16", "gate_up")
    n, h = (_known(d) for d in x.shape)
    e, i2, hg = (_known(d) for d in gate_up.shape)
    ed, hd, i = (_known(d) for d in down.shape)
    if [_known(d) for d in ids.shape] != [_known(d) for d in weights.shape]:
        fail(f"ids {list(ids.shape)} and weights {list(weights.shape)} differ; expected both "
             "[N, k]", "weights")
    if n is not None and _known(ids.shape[0]) not in (None, n):
        fail(f"x has {n} rows but ids has {_known(ids.shape[0])}; expected one ids row per x row",
             "ids")
    if e != ed or i2 != 2 * i or hg != h or hd != h:
        fail(f"x {list(x.shape)}, gate_up {list(gate_up.shape)} and down {list(down.shape)} do "
             "not fit; expected x [N, H], gate_up [E, 2I, H] and down [E, H, I]", "gate_up")


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


@torch.library.custom_op("numaov::moe_experts", mutates_args=())
def _moe_experts_op(
    x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor
) -> Tensor:
    _check_ids(ids, gate_up.shape[0])
    n, k = ids.shape
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    rows = order // k  # token row of each (sorted) pair
    slot_weights = weights.reshape(-1)[order]
    xw = x.to(gate_up.dtype)
    out = torch.zeros(n, x.shape[1], dtype=torch.float32)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        idx = rows[start:start + count]
        gate, up = F.linear(xw[idx], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert])
        out.index_add_(0, idx, y.float() * slot_weights[start:start + count, None])
        start += count
    return out.to(x.dtype)


@_moe_experts_op.register_fake
def _(x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    return x.new_empty(x.shape)


def moe_experts(x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """The routed experts' weighted sum per row: ``[N, H]`` in ``x``'s dtype (see the module
    docstring). Any ``N`` from 0; an expert that gets no rows costs nothing."""
    _check_args(x, ids, weights, gate_up, down)
    if torch.onnx.is_in_onnx_export():
        return torch.onnx.ops.symbolic(
            f"{MOE_DOMAIN}::MoeExperts", (x, ids, weights, gate_up, down), {},
            dtype=x.dtype, shape=x.shape, version=MOE_DOMAIN_VERSION,
        )
    return torch.ops.numaov.moe_experts(x, ids, weights, gate_up, down)


def kernel_unavailable_reason(weight_format: str) -> str:
    """Why the OpenVINO op's kernel cannot run weights of ``weight_format`` on this CPU
    (``""`` when it can): it needs AVX-512, and AVX512-BF16 for bf16 weights."""
    from numaov.custom_ops.native import native_module

    return native_module().moe_unavailable_reason(weight_format)


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

    def formal(name: str, type_str: str) -> OpSchema.FormalParameter:
        return OpSchema.FormalParameter(name, type_str)

    # The domain is not registered with onnx, so onnxscript needs the schema given.
    schema = OpSchema(
        "MoeExperts", MOE_DOMAIN, MOE_DOMAIN_VERSION,
        inputs=[formal("x", "T"), formal("ids", "I"), formal("weights", "tensor(float)"),
                formal("gate_up", "W"), formal("down", "W")],
        outputs=[formal("y", "T")],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(bfloat16)"], "activations"),
            ("I", ["tensor(int64)", "tensor(int32)"], "expert ids"),
            ("W", ["tensor(float)", "tensor(bfloat16)"], "expert weights"),
        ],
    )
    node = Op(Opset(MOE_DOMAIN, MOE_DOMAIN_VERSION), "MoeExperts", schema)

    def moe_experts_onnx(x, ids, weights, gate_up, down):
        return node(x, ids, weights, gate_up, down)

    return {torch.ops.numaov.moe_experts.default: moe_experts_onnx}

"""Which projections of an LM export run on numaov's ``DenseLinear`` op rather than OpenVINO's
``FullyConnected`` (``layers.kernel_linear.KernelLinear``): the linear layers each module lists
in ``PROJECTIONS`` (the attention's and the MLPs' projections, the head; not the routers, not
MLA's ``kv_b_proj``, which step 3 reads as batched weights).

- **A released FP8 checkpoint's, kept as released** (``--fp8-dense``, :func:`keep_fp8_projections`):
  ``--weights fp8`` of a released block-FP8 checkpoint (DeepSeek-V3 / R1) stores the routed
  experts as released (``expert_streaming``); the projections are FP8 in the release too, and
  loaded as the model's layers they would be dequantized to bf16, which OpenVINO's CPU plugin
  reads so (it has no fp8 weight decompression). Each whose weight the checkpoint holds in
  float8 keeps the released bytes and their block scales (no requantization); under DP each
  rank's slice of a sharded MLP (rows of gate / up, columns of down) with the block scales of
  its slice. The parity reference keeps the dequantized weights, which is what transformers
  computes with. Opt-in: the bytes win at a few rows per call; from about 5 rows widening the
  fp8 weights costs more, on a CPU without AMX, than OpenVINO's bf16 matmul.
- **bf16 ones where the kernel reads them faster** (:func:`bf16_projections`, the rule in
  :func:`bf16_projections_here`): an export computed in bf16 whose other weights are stored
  bf16 (``--weights bf16``, or ``fp8`` experts with a bf16 rest: then every projection not
  kept in FP8 and the head), made where the kernel's bf16 path is AVX512-BF16 (no AMX, or
  ``NUMAOV_MOE_AMX=off``; not ``NUMAOV_MOE_ISA=avx2``). The choice is the export's: its IR
  runs the projections so on any CPU it is given. There a DeepSeek-V3-shaped step with every
  projection on the op decoded 1.19x / 1.20x faster at 1 / 2 sequences and the same from 4 to
  32 (0.99-1.04x), its 512-token prefill 0.98x (``benchmarks/RESULTS.md``). With AMX, OpenVINO's oneDNN tiles run
  the projections of a prefill, which numaov's tiles were not measured against, so they stay
  on the ``FullyConnected``; so do the layers no module lists (the routers, Qwen2-MoE's
  ``shared_expert_gate``).
- **int8 ones where the kernel runs int8 on AVX512-VNNI** (:func:`int8_projections`, the rule in
  :func:`int8_projections_here`): an int8 export computed in bf16 (``--weights int8``), made
  where the kernel's int8 path is VNNI (``moe_ops.int8_kernel``). Each projection is quantized
  as NNCF's ``INT8_SYM`` would compress it on the ``FullyConnected`` (symmetric, one scale per
  output row), and both quantize the activations of a bf16 model per row in groups (the plugin
  of 32 values, the kernel of 64). A chain of 4,096 x 2,048 int8 projections ran 1.2x faster
  than OpenVINO's at 1-4 rows a call, 0.87-0.94x at 8-16, even or faster from 32
  (``benchmarks/RESULTS.md``). int4 stays on NNCF's ``FullyConnected``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from numaov.custom_ops.moe_ops import (
    MoeOpError,
    bf16_kernel,
    fp8_row_scales,
    int8_kernel,
    quantize_experts,
)
from numaov.exporter.expert_streaming import fp8_block, open_checkpoint
from numaov.models.checkpoint import FLOAT8_DTYPES, SCALE_SUFFIX
from numaov.models.layers.kernel_linear import KernelLinear

logger = logging.getLogger(__name__)


def keep_fp8_projections(model: nn.Module, checkpoint_dir: Path, config: Any,
                         dp: Any = None) -> int:
    """Replace ``model``'s FP8-released projections (see the module docstring) with
    ``KernelLinear`` layers read from ``checkpoint_dir``; returns how many (none for a checkpoint
    that is not block-FP8). ``dp``: the ``DataParallelGroup`` whose rank ``model`` holds the
    shard of (None: one rank). A projection whose block scales the kernel cannot group per
    row (a slice's columns not in groups of 16 or more) stays dequantized, with a log line."""
    rank = dp.rank if dp is not None else 0
    block = fp8_block(config)
    if block is None:
        return 0
    checkpoint = None
    kept = 0
    for path, module, attribute, linear in _projections(model):
        if path == "lm_head":  # bf16 in the releases; a rank's slice of it is padded
            continue
        name = f"{path}.weight"
        checkpoint = checkpoint or open_checkpoint(checkpoint_dir, "checkpoint")
        if name not in checkpoint or checkpoint.dtype(name) not in FLOAT8_DTYPES:
            continue
        weight = checkpoint.read_float8(name)
        # this rank's slice (a sharded MLP's rows or columns: the module holds its shape)
        rows, cols = linear.out_features, linear.in_features
        row_start = rank * rows if rows < weight.shape[0] else 0
        col_start = rank * cols if cols < weight.shape[1] else 0
        try:
            scale = fp8_row_scales(checkpoint.read(name + SCALE_SUFFIX), row_start, rows,
                                   col_start, cols, block)
        except MoeOpError as exc:
            logger.info("%s stays dequantized: %s", name, exc)
            continue
        weight = weight[row_start:row_start + rows, col_start:col_start + cols]
        bias = None if linear.bias is None else linear.bias.detach()
        setattr(module, attribute, KernelLinear(weight, scale, bias))
        kept += 1
    return kept


def bf16_projections_here(precision: str, storage: str) -> bool:
    """Whether an export made here runs its bf16 projections on ``DenseLinear`` (the module
    docstring): computed in bf16 with its other weights stored bf16, and the kernel's bf16
    path here is AVX512-BF16 (``moe_ops.bf16_kernel``: no AMX, not AVX2)."""
    if precision != "bf16" or storage != "bf16":
        return False
    return bf16_kernel()["kernel"] == "avx512_bf16"


def int8_projections_here(precision: str, weights: str) -> bool:
    """Whether an export made here runs its int8 projections on ``DenseLinear`` (the module
    docstring): int8 weights computed in bf16, and the kernel runs int8 weights of a bf16 model
    on AVX512-VNNI here (``moe_ops.int8_kernel``, asked for any int8 / int4 export: a bad
    ``NUMAOV_MOE_VNNI`` is refused before the export's slow work)."""
    if weights not in ("int8", "int4"):
        return False
    kernel = int8_kernel()["kernel"]
    return precision == "bf16" and weights == "int8" and kernel == "vnni"


def bf16_projections(model: nn.Module) -> int:
    """Replace each projection of ``model`` still an ``nn.Linear`` with a ``KernelLinear`` of
    its weight in bf16 (and its bias); returns how many (see :func:`_move_projections`)."""
    return _move_projections(model, lambda weight: (weight.to(torch.bfloat16), None))


def int8_projections(model: nn.Module) -> int:
    """Replace each projection of ``model`` still an ``nn.Linear`` with a ``KernelLinear`` of
    its weight in int8, symmetric with one scale per output row (``moe_ops.quantize_experts``,
    as NNCF's ``INT8_SYM``), and its bias; returns how many (see :func:`_move_projections`)."""
    def to_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        stored, scale = quantize_experts(weight.float()[None], "int8")
        return stored[0], scale[0]

    return _move_projections(model, to_int8)


def _move_projections(model: nn.Module, stored: Any) -> int:
    """Each projection of ``model`` still an ``nn.Linear`` as a ``KernelLinear`` of its weight
    as ``stored(weight)`` gives it (``(weight, scale)``), and its bias; returns how many. A
    head that is the embedding table (tied, dp=1) stays, so the IR holds the table once; a
    rank's slice of a tied head is its own copy and moves."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    replaced = 0
    for _, module, attribute, linear in _projections(model):
        if id(linear.weight) in embeddings:
            continue
        bias = None if linear.bias is None else linear.bias.detach()
        weight, scale = stored(linear.weight.detach())
        setattr(module, attribute, KernelLinear(weight, scale, bias))
        replaced += 1
    return replaced


def _projections(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """``(parameter path, module, attribute, layer)`` of each ``nn.Linear`` a module of
    ``model`` lists in its ``PROJECTIONS``."""
    found = []
    for path, module in list(model.named_modules()):
        for attribute in getattr(type(module), "PROJECTIONS", ()):
            linear = getattr(module, attribute, None)
            if isinstance(linear, nn.Linear):
                found.append((f"{path}.{attribute}" if path else attribute, module, attribute, linear))
    return found

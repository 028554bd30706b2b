"""A released FP8 checkpoint's projections kept as released: ``--fp8-dense``.

``--weights fp8`` of a released block-FP8 checkpoint (DeepSeek-V3 / R1) stores the routed
experts as released (``expert_streaming``); the attention and MLP projections are FP8 in the
release too. Loaded as the model's layers they are dequantized to bf16, and OpenVINO's CPU plugin
would read them so (it has no fp8 weight decompression). Here each projection a layer lists in
``FP8_PROJECTIONS`` whose weight the checkpoint holds in float8 becomes a
``layers.fp8_linear.Fp8Linear`` holding the released bytes and their block scales (no
requantization), which the graph runs on numaov's ``DenseLinear`` op: the attention
projections (replicated on every rank under DP attention) and the dense MLPs' and shared
experts' (``GatedMLP``; under DP each rank's slice, rows of gate / up and columns of down, with
the block scales of its slice). The parity reference keeps the dequantized weights, which is
what transformers computes with. Opt-in (``export_lm(fp8_dense=True)``): the bytes win at a
few rows per call; from about 5 rows widening the fp8 weights costs more, on a CPU without
AMX, than OpenVINO's bf16 matmul (``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch import nn

from numaov.custom_ops.moe_ops import MoeOpError, fp8_row_scales
from numaov.exporter.expert_streaming import fp8_block, open_checkpoint
from numaov.models.checkpoint import FLOAT8_DTYPES, SCALE_SUFFIX
from numaov.models.layers.fp8_linear import Fp8Linear

logger = logging.getLogger(__name__)


def keep_fp8_projections(model: nn.Module, checkpoint_dir: Path, config: Any,
                         dp: Any = None) -> int:
    """Replace ``model``'s FP8-released projections (see the module docstring) with
    ``Fp8Linear`` layers read from ``checkpoint_dir``; returns how many (none for a checkpoint
    that is not block-FP8). ``dp``: the ``DataParallelGroup`` whose rank ``model`` holds the
    shard of (None: one rank). A projection whose block scales the kernel cannot group per
    row (a slice's columns not in groups of 16 or more) stays dequantized, with a log line."""
    rank = dp.rank if dp is not None else 0
    block = fp8_block(config)
    if block is None:
        return 0
    checkpoint = None
    kept = 0
    for path, module in list(model.named_modules()):
        for attribute in getattr(type(module), "FP8_PROJECTIONS", ()):
            linear = getattr(module, attribute, None)
            name = f"{path}.{attribute}.weight"
            if not isinstance(linear, nn.Linear):
                continue
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
            setattr(module, attribute, Fp8Linear(weight, scale, bias))
            kept += 1
    return kept

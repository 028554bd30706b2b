"""What the MoE kernel's op tests share (tests/ops/test_moe_op.py, test_dense_linear.py):
whether the kernel runs here, whether its bf16 tiles and its int8 products (AVX512-VNNI) do,
the activations those products see, and the relative error they judge by."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from numaov.custom_ops.moe_ops import bf16_kernel, int8_kernel, kernel_unavailable_reason

# every format runs where the kernel does (AVX-512, or AVX2 with FMA and F16C)
KERNEL_MISSING = kernel_unavailable_reason("f32")
needs_kernel = pytest.mark.skipif(bool(KERNEL_MISSING),
                                  reason=f"the MoE kernel cannot run here: {KERNEL_MISSING}")


def bf16_tiles_missing() -> str:
    """Why bf16 weights do not run on bf16 tiles (AMX or AVX512-BF16) here; "" when they do."""
    if KERNEL_MISSING:
        return KERNEL_MISSING
    kernel = bf16_kernel()
    return "" if kernel["kernel"] in ("amx", "avx512_bf16") else f"bf16 experts run on {kernel}"


def relative_error(got: torch.Tensor | np.ndarray, expected: torch.Tensor | np.ndarray) -> float:
    """max |got - expected| / max |expected| (0 for empty tensors)."""
    got, expected = torch.as_tensor(got).double(), torch.as_tensor(expected).double()
    if expected.numel() == 0:
        return 0.0
    return float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def vnni_missing() -> str:
    """Why int8 weights do not run against quantized activations here; "" when they do (in a
    bf16 model, or any under NUMAOV_MOE_VNNI=always)."""
    if KERNEL_MISSING:
        return KERNEL_MISSING
    kernel = int8_kernel()
    return "" if kernel["kernel"] == "vnni" else f"int8 weights run on {kernel}"


# Values per quantized activation group: the kernel's kActGroup, which int8_kernel() reports as
# act_group where the int8 products run (test_dense_linear checks that it is this one).
ACT_GROUP = 64


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """The rows of ``x [N, K]`` as the int8 products see them, in float64: per row, groups of
    ``ACT_GROUP`` values (the last one shorter) quantized symmetrically, ``q = rint(x * (127 /
    max|x|))`` in f32 (ties to even), standing for ``q * (max|x| / 127)``."""
    group = ACT_GROUP
    x = x.float()
    rows, k = x.shape
    padded = torch.zeros(rows, -(-k // group) * group)
    padded[:, :k] = x
    groups = padded.view(rows, -1, group)
    largest = groups.abs().amax(-1, keepdim=True)
    smallest = torch.tensor(127.0) / torch.finfo(torch.float32).max  # the kernel's: zeros below
    inverse = torch.where(largest > smallest, torch.tensor(127.0) / largest, torch.zeros(()))
    q = torch.round(groups * inverse)
    return (q.double() * (largest / 127.0).double()).view(rows, -1)[:, :k]

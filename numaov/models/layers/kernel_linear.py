"""A linear layer run by numaov's ``DenseLinear`` op (``custom_ops.moe_ops.dense_linear``, the
experts' kernel) instead of OpenVINO's ``FullyConnected``, its weight held in a format of the
kernel: bf16, int8 with one scale per row, or a released checkpoint's FP8 bytes with each row's
block scales.

Why fp8 (``--fp8-dense``): OpenVINO's CPU plugin has no fp8 weight decompression for its
``FullyConnected``: it widens an f8e4m3 constant to bf16 when compiling and reads two bytes a
weight. DeepSeek-V3 / R1 release their attention and MLP projections in FP8 too, and at batch 1
decode reads every weight once a token, so a projection held as released is read in half the
time (at V3's real width the attention projections are 187 M of a MoE layer's 583 M weights
read per token). From about 5 rows a call, widening costs more than the bytes save on a CPU
without AMX, which is why an export keeps them only when asked.

Why bf16: on AVX512-BF16 without AMX the kernel reads a bf16 projection of one or two rows
faster than the ``FullyConnected`` does and keeps up from 4 rows to prefill
(``exporter.dense_projections``).

Why int8: in a bf16 model the kernel runs int8 weights on AVX512-VNNI against quantized
activations, as OpenVINO runs NNCF's, and reads a projection of 1-4 rows 1.2x faster
(``exporter.dense_projections``).

Numerics are the experts' ones: fp8 weights widened exactly and scaled by their block's
``weight_scale_inv``, f32 activations and sums, one rounding to the activations' dtype (in a
model compiled at bf16, calls of 8 rows or more run on the bf16 tiles with the weight
dequantized to bf16 as PyTorch dequantizes it); bf16 weights against activations rounded to
bf16 with f32 sums, as a bf16 ``F.linear``; int8 weights in a bf16 model against activations
quantized per row in groups of 64, exact int32 sums per group (``moe_ops.int8_kernel``).
"""

from __future__ import annotations

from torch import Tensor, nn

from numaov.custom_ops.moe_ops import dense_linear


class KernelLinear(nn.Module):
    """``y = weight . x (+ bias)`` over the last dim of ``x``, with ``weight [M, K]`` bf16, int8
    with ``scale [M, 1]`` f32, or float8_e4m3fn bytes with ``scale [M, groups]`` f32 (each row's 128-column block scales,
    ``moe_ops.fp8_row_scales``). The weight and scale are buffers: an export's graph holds
    them as they are (no widening, no f32 copy)."""

    def __init__(self, weight: Tensor, scale: Tensor | None = None, bias: Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("scale", None if scale is None else scale.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        y = dense_linear(x, self.weight, self.scale)
        return y if self.bias is None else y + self.bias.to(y.dtype)

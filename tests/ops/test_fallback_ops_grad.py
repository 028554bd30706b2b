"""Backward of the ops the built-in models train through: norm_infer and rotary_embedding.

Each gradient is compared with autograd through the same PyTorch arithmetic written inline
(f32; the op recomputes exactly that arithmetic, so the two agree to rounding: 1e-6).
"""

from __future__ import annotations

import pytest
import torch

from numaov.custom_ops import norm_infer, rotary_embedding

TOL = 1e-6


def _grads(fn, inputs: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor | None]:
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    fn(*leaves).backward(grad)
    return [t.grad for t in leaves]


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _layer(x, w, b):
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + 1e-5) * w + b


def _rope_interleaved(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), -1).flatten(-2)


def _rope_half(x, cos, sin):
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)


def test_norm_infer_gradients() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 16, generator=g, requires_grad=True)
    w = torch.randn(16, generator=g, requires_grad=True)
    b = torch.randn(16, generator=g, requires_grad=True)
    grad = torch.randn(4, 3, 16, generator=g)
    for op, ref, ins in (
        (lambda x, w: norm_infer(x, w, None, 1e-6, True), _rms, [x, w]),
        (lambda x, w, b: norm_infer(x, w, b, 1e-5, False), _layer, [x, w, b]),
    ):
        for got, want in zip(_grads(op, ins, grad), _grads(ref, ins, grad), strict=True):
            torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)


def test_norm_infer_gradient_only_where_asked() -> None:
    x = torch.randn(2, 8, requires_grad=True)
    w = torch.randn(8)  # a frozen weight
    (gx, gw) = _grads(lambda x, w: norm_infer(x, w, None, 1e-6, True), [x, w], torch.ones(2, 8))
    assert gx is not None and gw is None


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_embedding_gradient(interleaved: bool) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 3, 8, generator=g, requires_grad=True)
    cos, sin = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    grad = torch.randn(2, 5, 3, 8, generator=g)
    ref = _rope_interleaved if interleaved else _rope_half
    (got,) = _grads(lambda x: rotary_embedding(x, cos, sin, interleaved), [x], grad)
    (want,) = _grads(lambda x: ref(x, cos, sin), [x], grad)
    torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)

"""Eager face of the fallback ops against plain reference formulas (docs/architecture.md,
"Ops and their three faces").

The references are written from the definitions, in float64, with per-frame rows expanded
explicitly (``repeat_interleave``) so they share no code path with the kernels.

Tolerances: a kernel computes in fp32 and rounds once to the activation dtype, the reference
computes in fp64 and rounds once, so the two may land one unit in the last place (ulp) apart
plus fp32 arithmetic error. Per dtype: fp32 rtol/atol 1e-5 (fp32 sums over C <= 64 channels);
bf16 rtol 2**-7 (one bf16 ulp is 2**-8 relative, doubled for values near a binade edge);
fp16 rtol 2**-9 (one fp16 ulp is 2**-10 relative, doubled likewise). atol covers results that
cancel to near zero, where relative error is meaningless.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from numaov import NumaovError
from numaov.custom_ops import (
    FallbackOpError,
    fuse_scale_shift,
    norm_infer,
    rotary_embedding,
    rows_copy,
    scale_residual_norm_scale_shift,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rtol, atol) per activation dtype; reasons in the module docstring.
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2**-7, 2**-7),
    torch.float16: (2**-9, 2**-9),
}
MODULATION_KINDS = ["scalar", "channel", "bc", "b1c", "11c", "blc", "frames"]
FEW = settings(max_examples=25, deadline=None)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = TOL[dtype]
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.double(), expected.to(dtype).double(), rtol=rtol, atol=atol)


def make_modulation(kind: str, b: int, seq: int, c: int, frames: int, dtype: torch.dtype,
                    gen: torch.Generator) -> torch.Tensor:
    shape = {
        "scalar": (),
        "channel": (c,),
        "bc": (b, c),
        "b1c": (b, 1, c),
        "11c": (1, 1, c),
        "blc": (b, seq, c),
        "frames": (b, frames, 1, c),
    }[kind]
    return (torch.randn(shape, generator=gen) * 0.5).to(dtype)


def expand_reference(t: torch.Tensor, b: int, seq: int, c: int) -> torch.Tensor:
    """Any modulation shape as an explicit float64 ``[B, L, C]`` tensor."""
    t = t.double()
    if t.dim() == 4:  # [b, F, 1, C]: frame f covers tokens f*L/F .. (f+1)*L/F - 1
        t = t.squeeze(2).repeat_interleave(seq // t.shape[1], dim=1)
    elif t.dim() == 2:  # [b, C] acts as [b, 1, C]
        t = t.unsqueeze(1)
    return t.expand(b, seq, c)


def reference_norm(x: torch.Tensor, weight, bias, eps: float, rms: bool) -> torch.Tensor:
    x = x.double()
    if rms:
        y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    else:
        mean = x.mean(-1, keepdim=True)
        y = (x - mean) / torch.sqrt(((x - mean) ** 2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.double()
    if bias is not None:
        y = y + bias.double()
    return y


shapes = st.tuples(
    st.integers(1, 2),  # B
    st.integers(1, 4),  # F
    st.integers(1, 5),  # tokens per frame
    st.integers(1, 24),  # C
)


@FEW
@given(
    shape=shapes,
    dtype=st.sampled_from(DTYPES),
    scale_kind=st.sampled_from(MODULATION_KINDS),
    shift_kind=st.sampled_from(MODULATION_KINDS),
    scale_constant=st.sampled_from([0.0, 1.0]),
    aux_fp32=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_fuse_scale_shift_matches_formula(shape, dtype, scale_kind, shift_kind, scale_constant,
                                          aux_fp32, seed):
    b, frames, per_frame, c = shape
    seq = frames * per_frame
    gen = torch.Generator().manual_seed(seed)
    aux = torch.float32 if aux_fp32 else dtype
    x = torch.randn(b, seq, c, generator=gen).to(dtype)
    scale = make_modulation(scale_kind, b, seq, c, frames, aux, gen)
    shift = make_modulation(shift_kind, b, seq, c, frames, aux, gen)
    out = fuse_scale_shift(x, scale, shift, scale_constant)
    expected = x.double() * (scale_constant + expand_reference(scale, b, seq, c)) + expand_reference(
        shift, b, seq, c
    )
    assert out.shape == x.shape
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_modulation_in_blocks(dtype):
    """Low-precision activations are computed block by block in an fp32 scratch buffer; a
    tensor spanning several blocks (token-wise scale, per-frame shift) matches the formula."""
    gen = torch.Generator().manual_seed(7)
    b, frames, per_frame, c = 2, 3, 100, 512  # 2*512 elements per row -> 64-row blocks
    seq = frames * per_frame
    x = torch.randn(b, seq, c, generator=gen).to(dtype)
    scale = torch.randn(b, seq, c, generator=gen) * 0.5
    shift = torch.randn(b, frames, 1, c, generator=gen) * 0.5
    out = fuse_scale_shift(x, scale, shift)
    expected = x.double() * (1 + scale.double()) + expand_reference(shift, b, seq, c)
    assert_close(out, expected, dtype)


@FEW
@given(
    t=st.integers(1, 6),
    heads=st.integers(1, 3),
    half=st.integers(1, 8),
    batched=st.booleans(),
    interleaved=st.booleans(),
    full_table=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_rotary_embedding_matches_formula(t, heads, half, batched, interleaved, full_table,
                                          dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    d = 2 * half
    shape = (2, t, heads, d) if batched else (t, heads, d)
    x = torch.randn(shape, generator=gen).to(dtype)
    angle = torch.rand(t, half, generator=gen, dtype=torch.float64) * 6.3
    cos, sin = angle.cos(), angle.sin()
    if full_table:  # the D-column tables each form is commonly given
        if interleaved:
            cos_in, sin_in = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
        else:
            cos_in, sin_in = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    else:
        cos_in, sin_in = cos, sin
    out = rotary_embedding(x, cos_in.float(), sin_in.float(), interleaved)
    # Reference: the pair (a, b) rotated by the angle, written element by element.
    xd = x.double()
    expected = torch.empty_like(xd)
    c_, s_ = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [T, 1, D/2] over heads
    for i in range(half):
        j, k = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        expected[..., j] = xd[..., j] * c_[..., i] - xd[..., k] * s_[..., i]
        expected[..., k] = xd[..., k] * c_[..., i] + xd[..., j] * s_[..., i]
    assert_close(out, expected, dtype)


@FEW
@given(
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    c=st.integers(2, 64),
    rms=st.booleans(),
    with_weight=st.booleans(),
    with_bias=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_norm_infer_matches_formula(lead, c, rms, with_weight, with_bias, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    # An offset mean makes LayerNorm's centring matter and stresses fp32 statistics.
    x = (torch.randn(*lead, c, generator=gen) * 3 + 2).to(dtype)
    weight = torch.randn(c, generator=gen) if with_weight else None
    bias = torch.randn(c, generator=gen) if with_bias else None
    out = norm_infer(x, weight, bias, 1e-6, rms)
    assert_close(out, reference_norm(x, weight, bias, 1e-6, rms), dtype)


@FEW
@given(
    shape=shapes,
    dtype=st.sampled_from(DTYPES),
    gate_kind=st.sampled_from(MODULATION_KINDS + ["none"]),
    scale_kind=st.sampled_from(MODULATION_KINDS),
    shift_kind=st.sampled_from(MODULATION_KINDS),
    rms=st.booleans(),
    affine=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
# a row of two channels a hair apart: centring loses precision (see kappa below)
@example(shape=(2, 2, 2, 1), dtype=torch.float32, gate_kind="channel", scale_kind="scalar",
         shift_kind="scalar", rms=False, affine=False, seed=279)
def test_scale_residual_norm_scale_shift_matches_formula(shape, dtype, gate_kind, scale_kind,
                                                         shift_kind, rms, affine, seed):
    b, frames, per_frame, c = shape
    c += 1  # a norm over one channel is degenerate
    seq = frames * per_frame
    gen = torch.Generator().manual_seed(seed)
    residual = torch.randn(b, seq, c, generator=gen).to(dtype)
    x = torch.randn(b, seq, c, generator=gen).to(dtype)
    gate = None if gate_kind == "none" else make_modulation(
        gate_kind, b, seq, c, frames, torch.float32, gen)
    scale = make_modulation(scale_kind, b, seq, c, frames, torch.float32, gen)
    shift = make_modulation(shift_kind, b, seq, c, frames, dtype, gen)
    weight = torch.randn(c, generator=gen) if affine else None
    bias = torch.randn(c, generator=gen) if affine else None
    out, new_residual = scale_residual_norm_scale_shift(
        residual, x, gate, weight, bias, 1e-6, rms, scale, shift)
    g = 1.0 if gate is None else expand_reference(gate, b, seq, c)
    r = residual.double() + g * x.double()
    assert_close(new_residual, r, dtype)
    # The residual is rounded to its dtype before the norm (it is what the next block sees),
    # so the reference norms the rounded residual too.
    y = reference_norm(new_residual, weight, bias, 1e-6, rms)
    factor = 1.0 + expand_reference(scale, b, seq, c)
    expected = y * factor + expand_reference(shift, b, seq, c)
    # The op computes its statistics in fp32 by design. LayerNorm of a row whose values nearly
    # agree (two channels a hair apart) loses |r| / sigma of that precision in the centring,
    # which the float64 reference does not, so each row's absolute tolerance grows with that
    # condition number (1 for a well-spread row, and for RMSNorm, which does not centre).
    r64 = new_residual.double()
    spread = (r64.pow(2).mean(-1, keepdim=True) if rms
              else r64.var(-1, unbiased=False, keepdim=True))
    kappa = (r64.abs().amax(-1, keepdim=True) / (spread + 1e-6).sqrt()).clamp(min=1.0)
    gain = factor.abs() * (1.0 if weight is None else weight.double().abs())
    rtol, atol = TOL[dtype]
    error = (out.double() - expected.to(dtype).double()).abs()
    allowed = atol * kappa * (1.0 + gain) + rtol * expected.abs()
    assert out.dtype == dtype
    assert bool((error <= allowed).all()), f"worst excess {float((error - allowed).max()):.3g}"


@FEW
@given(
    dst_rows=st.integers(1, 6),
    src_rows=st.integers(1, 6),
    offset=st.integers(0, 7),
    n=st.integers(0, 7),
    offset_src=st.booleans(),
    dtype=st.sampled_from(DTYPES),
)
def test_rows_copy_both_directions_clamped(dst_rows, src_rows, offset, n, offset_src, dtype):
    src = torch.arange(src_rows * 3, dtype=torch.float32).reshape(src_rows, 3).to(dtype)
    dst = torch.full((dst_rows, 3), -1.0).to(dtype)
    expected = dst.clone()
    # Reference: copy row by row while both tensors have the row.
    for i in range(n):
        s, d = (offset + i, i) if offset_src else (i, offset + i)
        if s < src_rows and d < dst_rows:
            expected[d] = src[s]
    assert rows_copy(dst, src, offset, n, offset_src) is None
    assert torch.equal(dst, expected)  # a copy is exact


def test_ops_are_registered_with_fakes():
    """Each op passes torch.library's own consistency checks (schema, fake kernel, aliasing)."""
    x = torch.randn(2, 6, 8)
    frames = torch.randn(2, 3, 1, 8)
    cases = [
        (torch.ops.numaov.fuse_scale_shift.default, (x, frames, torch.randn(2, 8), 1.0)),
        (torch.ops.numaov.rotary_embedding.default,
         (torch.randn(6, 2, 8), torch.randn(6, 4), torch.randn(6, 4), True)),
        (torch.ops.numaov.norm_infer.default, (x, torch.randn(8), None, 1e-6, True)),
        (torch.ops.numaov.scale_residual_norm_scale_shift.default,
         (x, torch.randn(2, 6, 8), frames, None, None, 1e-6, False, frames,
          torch.randn(8), 1.0)),
        (torch.ops.numaov.rows_copy.default, (torch.zeros(4, 8), torch.randn(3, 8), 1, 2, False)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


BAD_CALLS = {
    "L not divisible by F": (
        lambda: fuse_scale_shift(torch.randn(1, 10, 4), torch.randn(1, 3, 1, 4), torch.randn(4)),
        "multiple of F",
    ),
    "channel mismatch": (
        lambda: fuse_scale_shift(torch.randn(1, 10, 4), torch.randn(1, 5), torch.randn(4)),
        "channels",
    ),
    "x wrong rank": (
        lambda: fuse_scale_shift(torch.randn(10, 4), torch.randn(4), torch.randn(4)),
        "rank 3",
    ),
    "per-frame F disagree": (
        lambda: fuse_scale_shift(torch.randn(1, 12, 4), torch.randn(1, 3, 1, 4),
                                 torch.randn(1, 4, 1, 4)),
        "disagree",
    ),
    "dtype mix": (
        lambda: fuse_scale_shift(torch.randn(1, 4, 4, dtype=torch.bfloat16),
                                 torch.randn(4, dtype=torch.float16), torch.randn(4)),
        "float16",
    ),
    "integer activation": (
        lambda: norm_infer(torch.ones(2, 4, dtype=torch.int32), None, None, 1e-6, True),
        "int32",
    ),
    "odd head dim": (
        lambda: rotary_embedding(torch.randn(3, 2, 5), torch.randn(3, 2), torch.randn(3, 2), True),
        "odd",
    ),
    "rotary wrong rank": (
        lambda: rotary_embedding(torch.randn(3, 8), torch.randn(3, 4), torch.randn(3, 4), True),
        "rank 2",
    ),
    "rotary table rows": (
        lambda: rotary_embedding(torch.randn(3, 2, 8), torch.randn(4, 4), torch.randn(4, 4), True),
        "T=3",
    ),
    "rotary table columns": (
        lambda: rotary_embedding(torch.randn(3, 2, 8), torch.randn(3, 3), torch.randn(3, 3), True),
        "[T, D/2]",
    ),
    "norm weight channels": (
        lambda: norm_infer(torch.randn(2, 8), torch.randn(7), None, 1e-6, False),
        "[8]",
    ),
    "residual and x differ": (
        lambda: scale_residual_norm_scale_shift(
            torch.randn(1, 4, 8), torch.randn(1, 4, 8, dtype=torch.bfloat16), None, None, None,
            1e-6, True, torch.randn(8), torch.randn(8)),
        "same shape and dtype",
    ),
    "rows_copy dtype": (
        lambda: rows_copy(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bfloat16), 0, 1, False),
        "same dtype",
    ),
    "rows_copy row shape": (
        lambda: rows_copy(torch.zeros(2, 3), torch.zeros(2, 4), 0, 1, False),
        "past dim 0",
    ),
    "rows_copy negative": (
        lambda: rows_copy(torch.zeros(2, 3), torch.zeros(2, 3), -1, 1, False),
        "non-negative",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_input_raises_clear_error(case):
    call, fragment = BAD_CALLS[case]
    with pytest.raises(FallbackOpError, match=None) as info:
        call()
    assert isinstance(info.value, NumaovError)
    assert fragment in str(info.value), str(info.value)

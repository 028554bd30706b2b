"""numaov's AMX flash attention: the kernel against PyTorch, the swap of OpenVINO's
ScaledDotProductAttention in a real compiled model, and the NUMAOV_ATTENTION setting.

The kernel rounds Q, K, V and the probabilities to bf16 (as bf16 inference does) and keeps
scores, softmax and output in fp32; its error against fp32 attention is that of PyTorch's own
bf16 SDPA, so the tolerance is stated relative to it: at most 1.5x PyTorch's bf16 error plus
5e-3 (unit-normal inputs, outputs of magnitude ~1-3; PyTorch's bf16 error is 5e-3 to 1.8e-2
on these shapes, numaov's 3e-3 to 1.2e-2).
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest
import torch
import torch.nn.functional as F

from numaov.custom_ops import add_extension
from numaov.custom_ops.flash_attention import (
    AttentionSettingError,
    amx_unavailable_reason,
    attention_setting,
    flash_attention,
    swap_attention,
    use_numaov_attention,
)

SEED = 0
AMX_MISSING = amx_unavailable_reason()
needs_amx = pytest.mark.skipif(bool(AMX_MISSING), reason=f"no usable AMX: {AMX_MISSING}")


def _qkv(shape: tuple[int, ...], kv_len: int, q_gain: float = 2.0, seed: int = SEED):
    rng = np.random.default_rng(seed)
    batch, heads, q_len, head_dim = shape
    q = q_gain * rng.standard_normal(shape, dtype=np.float32)
    k = rng.standard_normal((batch, heads, kv_len, head_dim), dtype=np.float32)
    v = rng.standard_normal((batch, heads, kv_len, head_dim), dtype=np.float32)
    return q, k, v


def _torch_attention(q, k, v, scale=None, dtype=torch.float32) -> np.ndarray:
    tensors = [torch.from_numpy(x).to(dtype) for x in (q, k, v)]
    return F.scaled_dot_product_attention(*tensors, scale=scale).float().numpy()


def _assert_bf16_accurate(ours: np.ndarray, q, k, v, scale=None) -> None:
    """``ours`` is finite and as close to fp32 attention as PyTorch's bf16 SDPA is (see the
    docstring)."""
    reference = _torch_attention(q, k, v, scale)
    assert ours.shape == reference.shape and ours.dtype == np.float32
    assert np.isfinite(ours).all()
    torch_bf16 = _torch_attention(q, k, v, scale, dtype=torch.bfloat16)
    error, torch_error = (float(np.abs(x - reference).max()) for x in (ours, torch_bf16))
    print(f"q {q.shape} k {k.shape} scale {scale}: numaov {error:.2e}, torch bf16 "
          f"{torch_error:.2e}")
    assert error < 1.5 * torch_error + 5e-3


@needs_amx
@pytest.mark.parametrize(
    "shape, kv_len",
    [
        ((1, 2, 32, 128), 128),  # whole tiles and blocks
        ((2, 3, 45, 24), 77),  # tails everywhere; head size padded 24 -> 32
        ((1, 4, 300, 128), 512),  # several 256-row groups and key blocks
        ((1, 2, 1, 64), 16),  # one query row (a single video token)
        ((1, 1, 129, 80), 1),  # one key: every weight is 1
        ((1, 2, 600, 128), 300),  # a query group longer than one pass, uneven keys
        ((1, 2, 20, 64), 300),  # one row block over several key blocks
        ((1, 1, 270, 64), 400),  # a last group of one row block
    ],
)
def test_kernel_matches_torch_attention(shape, kv_len) -> None:
    q, k, v = _qkv(shape, kv_len)
    _assert_bf16_accurate(flash_attention(q, k, v), q, k, v)


@needs_amx
def test_kernel_scale_and_large_scores() -> None:
    # Scores of several hundred: the running max must keep exp() finite; a given scale must
    # be used instead of 1/sqrt(D).
    q, k, v = _qkv((1, 2, 70, 64), 200, q_gain=30.0)
    for scale in (None, 0.3):
        _assert_bf16_accurate(flash_attention(q, k, v, scale), q, k, v, scale)
    assert np.abs(flash_attention(q, k, v, 0.3) - flash_attention(q, k, v)).max() > 0.1


@needs_amx
@pytest.mark.parametrize("q_len", [20, 100])  # one row block, several
@pytest.mark.parametrize("growth", [0.5, 40.0])
def test_kernel_running_max_that_rises_over_the_keys(q_len: int, growth: float) -> None:
    # Key norms rising along the sequence move each row's running max in later key blocks:
    # by less than the kernel's slack (probabilities above 1, no rescale) or by far more
    # (output rows rescaled). Both must match fp32 attention as well as PyTorch's bf16 does.
    q, k, v = _qkv((1, 2, q_len, 64), 640)
    k *= np.linspace(1.0, 1.0 + growth, 640, dtype=np.float32)[:, None]
    _assert_bf16_accurate(flash_attention(q, k, v), q, k, v)


@needs_amx
def test_kernel_minus_infinity_scores_weigh_nothing() -> None:
    # -inf scores (here a whole first key block, and some later keys) get weight 0 as in
    # PyTorch, and do not poison the running max of their rows.
    q, k, v = _qkv((1, 2, 40, 32), 300)
    q[..., 0] = np.abs(q[..., 0]) + 0.5
    k[:, :, :128, 0] = -np.inf
    k[:, :, 200:210, 0] = -np.inf
    _assert_bf16_accurate(flash_attention(q, k, v), q, k, v)


@needs_amx
def test_kernel_reads_and_writes_heads_second_layout() -> None:
    # [B, S, H, D] in and out is the same computation as [B, H, S, D]: bit for bit.
    q, k, v = _qkv((2, 3, 40, 64), 70)
    bhsd = flash_attention(q, k, v)
    to_bshd = (0, 2, 1, 3)
    bshd = flash_attention(q.transpose(to_bshd), k, v.transpose(to_bshd), None,
                           ("bshd", "bhsd", "bshd", "bshd"))
    assert bshd.shape == (2, 40, 3, 64)
    assert np.array_equal(bshd.transpose(to_bshd), bhsd)


@needs_amx
def test_kernel_bf16_tensors_in_and_out() -> None:
    # The op's bf16 form (inside a bf16 model) computes exactly what the f32 form computes on
    # the same bf16 values, rounded to bf16 once at the end.
    q, k, v = (torch.from_numpy(x).to(torch.bfloat16) for x in _qkv((1, 3, 70, 48), 90))
    got = flash_attention(q, k, v)
    assert got.dtype == torch.bfloat16 and got.shape == (1, 3, 70, 48)
    f32 = flash_attention(*(x.float().numpy() for x in (q, k, v)))
    assert torch.equal(got, torch.from_numpy(f32).to(torch.bfloat16))
    for mixed in ((q, k.float().numpy(), v), (q.float().numpy(), k, v), (q, k, v.half())):
        with pytest.raises(ValueError, match="expected all float32 numpy arrays or all "
                                             "torch.bfloat16 tensors"):
            flash_attention(*mixed)
    q.requires_grad_(True)  # a tensor that needs grad is read as it is, not refused
    assert torch.equal(flash_attention(q, k, v), got)


@needs_amx
def test_kernel_rejects_bad_shapes() -> None:
    q, k, v = _qkv((1, 2, 4, 32), 8)
    with pytest.raises(ValueError, match=r"expected q \[B, H, Sq, D\] and k, v \[B, H, Sk, D\]"):
        flash_attention(q, k[:, :1], v)
    with pytest.raises(ValueError, match="expected q"):
        flash_attention(q, k, v[..., :16])
    with pytest.raises(ValueError, match="at least 1"):
        flash_attention(q[:, :, :0], k, v)
    with pytest.raises(ValueError, match="expected four of bhsd, bshd"):
        flash_attention(q, k, v, None, ("bhsd", "bhsd", "bhsd", "hbsd"))
    with pytest.raises(ValueError, match="expected q"):  # [B, S, H, D] read as [B, H, S, D]
        flash_attention(q, k, v, None, ("bshd", "bhsd", "bhsd", "bhsd"))
    with pytest.raises(ValueError, match=r"disagree in head size \(32, 32, 16\)"):
        flash_attention(q, k, v[..., :16])
    with pytest.raises(ValueError, match="k has 8 keys but v has 7 values"):
        flash_attention(q, k, v[:, :, :7])
    for scale in (-0.5, 0.0, float("inf"), float("nan"), "0.25", True):
        with pytest.raises(ValueError, match="expected a finite positive number"):
            flash_attention(q, k, v, scale)


def _sdpa_model():
    """Three attentions over the same q, k, v: plain, with a zero mask and a constant scale,
    and causal. Only the first two are what the kernel computes."""
    params = [ops.parameter([-1, 2, -1, 64], np.float32, name=n) for n in "qkv"]
    zero = ops.constant(np.zeros((), np.float32))
    scale = ops.constant(np.array([0.3], np.float32))
    outputs = [
        ops.scaled_dot_product_attention(*params, causal=False),
        ops.scaled_dot_product_attention(*params, zero, scale, causal=False),
        ops.scaled_dot_product_attention(*params, causal=True),
    ]
    return ov.Model(outputs, params)


@pytest.mark.parametrize(
    "case",
    ["mask that differs across keys", "bool mask all false", "zero mask that broadcasts the batch",
     "sink", "shared-head keys",
     "value size of its own", "dynamic rank", "negative scale", "f16"],
)
def test_swap_leaves_attention_the_kernel_does_not_compute(case: str) -> None:
    q_shape, k_shape, v_shape = [1, 2, -1, 64], [1, 2, -1, 64], [1, 2, -1, 64]
    extra = []
    element = np.float32
    if case == "mask that differs across keys":
        mask = np.where(np.arange(90) % 3 == 0, 0.0, -1e4).astype(np.float32)
        extra = [ops.constant(mask.reshape(1, 1, 1, 90))]
    elif case == "bool mask all false":  # attend nowhere: not the same as no mask
        extra = [ops.constant(np.zeros((), np.bool_))]
    elif case == "zero mask that broadcasts the batch":  # output [3, ...], not q's [1, ...]
        extra = [ops.constant(np.zeros((3, 2, 1, 1), np.float32))]
    elif case == "sink":
        extra = [ops.constant(np.zeros((), np.float32)), ops.constant(np.float32(0.125)),
                 ops.constant(np.zeros((1, 2, 1, 1), np.float32))]
    elif case == "shared-head keys":
        k_shape = v_shape = [1, 1, -1, 64]
    elif case == "value size of its own":
        v_shape = [1, 2, -1, 32]
    elif case == "negative scale":
        extra = [ops.constant(np.zeros((), np.float32)), ops.constant(np.float32(-0.125))]
    elif case == "f16":
        element = np.float16
    if case == "dynamic rank":
        params = [ops.parameter(ov.PartialShape.dynamic(), np.float32, name=n) for n in "qkv"]
    else:
        params = [ops.parameter(shape, element, name=n)
                  for n, shape in zip("qkv", (q_shape, k_shape, v_shape), strict=True)]
    if case == "sink":  # the Python opsets have no argument for it; the node takes 6 inputs
        from openvino.utils.node_factory import NodeFactory

        node = NodeFactory("opset13").create(
            "ScaledDotProductAttention", [*params, *extra], {"causal": False})
    else:
        node = ops.scaled_dot_product_attention(*params, *extra, causal=False)
    model = ov.Model([node], params)
    assert swap_attention(model, "f32") == 0
    assert swap_attention(model) == 0


def test_swap_takes_a_true_bool_mask_as_no_mask() -> None:
    params = [ops.parameter([1, 2, -1, 64], np.float32, name=n) for n in "qkv"]
    node = ops.scaled_dot_product_attention(*params, ops.constant(np.ones((), np.bool_)),
                                            causal=False)
    assert swap_attention(ov.Model([node], params), "f32") == 1


@needs_amx
def test_swap_replaces_only_plain_attention_and_keeps_results() -> None:
    core = ov.Core()
    add_extension(core)
    model = _sdpa_model()
    assert swap_attention(model) == 2
    kinds = [op.get_type_name() for op in model.get_ordered_ops()]
    assert kinds.count("FlashAttention") == 2 and kinds.count("ScaledDotProductAttention") == 1
    assert swap_attention(model) == 0  # nothing plain is left

    q, k, v = _qkv((2, 2, 50, 64), 90)
    config = {"INFERENCE_PRECISION_HINT": "bf16"}
    swapped = core.compile_model(model, "CPU", config)
    runtime_types = [op.get_rt_info()["layerType"].astype(str)
                     for op in swapped.get_runtime_model().get_ordered_ops()]
    assert runtime_types.count("Reference") == 2
    ours = swapped.create_infer_request().infer([q, k, v])
    theirs = core.compile_model(_sdpa_model(), "CPU", config).create_infer_request().infer(
        [q, k, v])
    _assert_bf16_accurate(ours[0], q, k, v)
    _assert_bf16_accurate(ours[1], q, k, v, 0.3)
    # The causal one is left alone: OpenVINO's own, so it matches the unswapped model exactly.
    assert np.array_equal(ours[2], theirs[2])


@needs_amx
def test_swap_reads_through_head_transposes_and_scalar_factors() -> None:
    """The DiT pattern: [B, S, H, D] projections transposed to [B, H, S, D], q times a
    scalar, attention, transposed back. The swap leaves no Transpose or Multiply, and where
    another user needs [B, H, S, D] the output stays in that layout."""
    params = [ops.parameter([-1, -1, 2, 64], np.float32, name=n) for n in "qkv"]
    order = ops.constant(np.array([0, 2, 1, 3], np.int64))
    q, k, v = (ops.transpose(p, order) for p in params)
    q = ops.multiply(q, ops.constant(np.array([[[[0.5]]]], np.float32)))
    attention = ops.scaled_dot_product_attention(q, k, v, causal=False)
    back = ops.transpose(attention, order)
    model = ov.Model([back], params)
    assert swap_attention(model) == 1
    kinds = [op.get_type_name() for op in model.get_ordered_ops()]
    assert "Transpose" not in kinds and "Multiply" not in kinds
    assert kinds.count("Convert") == 4  # bf16 in, bf16 out: OpenVINO's bf16 tensors as they are

    core = ov.Core()
    add_extension(core)
    bshd = [x.transpose(0, 2, 1, 3) for x in _qkv((1, 2, 33, 64), 47)]
    got = core.compile_model(model, "CPU").create_infer_request().infer(bshd)[0]
    q, k, v = (x.transpose(0, 2, 1, 3) for x in bshd)
    _assert_bf16_accurate(got.transpose(0, 2, 1, 3), 0.5 * q, k, v)

    # A second user that is not a transpose keeps the [B, H, S, D] output.
    params = [ops.parameter([-1, -1, 2, 64], np.float32, name=n) for n in "qkv"]
    attention = ops.scaled_dot_product_attention(
        *(ops.transpose(p, order) for p in params), causal=False)
    model = ov.Model([ops.transpose(attention, order), ops.relu(attention)], params)
    assert swap_attention(model, "f32") == 1  # f32: the kernel's own f32 result, exactly
    kinds = [op.get_type_name() for op in model.get_ordered_ops()]
    assert kinds.count("Transpose") == 1  # the output's; the inputs' three are read through
    got = core.compile_model(model, "CPU").create_infer_request().infer(bshd)
    expected = flash_attention(q, k, v)
    assert np.array_equal(got[0], expected.transpose(0, 2, 1, 3))
    assert np.array_equal(got[1], np.maximum(expected, 0))


def test_attention_setting(monkeypatch) -> None:
    monkeypatch.setenv("NUMAOV_ATTENTION", "fast")
    with pytest.raises(AttentionSettingError,
                       match="NUMAOV_ATTENTION='fast' is not a known setting; expected one of "
                             "auto, numaov, openvino"):
        use_numaov_attention()
    monkeypatch.setenv("NUMAOV_ATTENTION", "openvino")
    assert attention_setting() == "openvino" and use_numaov_attention() is False
    monkeypatch.setenv("NUMAOV_ATTENTION", " OpenVINO ")
    assert attention_setting() == "openvino"
    monkeypatch.setenv("NUMAOV_ATTENTION", "")
    assert attention_setting() == "auto"
    monkeypatch.delenv("NUMAOV_ATTENTION")
    assert attention_setting() == "auto"
    assert use_numaov_attention() is (not AMX_MISSING)
    if AMX_MISSING:
        with pytest.raises(AttentionSettingError, match="needs AMX"):
            use_numaov_attention("numaov")
    else:
        assert use_numaov_attention("numaov") is True

"""numaov's AMX flash attention, swapped in for OpenVINO's own attention at compile time.

OpenVINO 2026.4 runs a non-causal ``ScaledDotProductAttention`` outside stateful LLM graphs
as its generic MHA snippet; at video-DiT lengths on AMX, numaov's kernel is faster than both
it and PyTorch's CPU flash attention (figures in benchmarks/RESULTS.md). numaov's
``FlashAttention`` extension op (``csrc/kernels/flash_attention.cpp``) runs it on AMX tiles with an
online softmax.

The exporter never writes the op: an IR stays plain OpenVINO and runs anywhere. The runtime
calls `swap_attention` on the model it is about to compile, which replaces each plain
attention node (see `_plain_attention_scale`) with the extension op when the setting says so:

``NUMAOV_ATTENTION``
    ``auto`` (default): numaov's kernel when the CPU has usable AMX, OpenVINO's otherwise;
    ``numaov``: numaov's kernel, and an error naming the reason when AMX is not usable;
    ``openvino``: always OpenVINO's own attention.

What AMX changes: the tile products of Q K^T and P V are what make the kernel fast; on
AVX512-BF16 alone, OpenVINO's attention is the better choice, so ``auto`` keeps it there.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

from numaov import NumaovError
from numaov.native import library_path, native_module

ATTENTION_ENV = "NUMAOV_ATTENTION"
ATTENTION_SETTINGS = ("auto", "numaov", "openvino")


class AttentionSettingError(NumaovError):
    """NUMAOV_ATTENTION is not a known setting, or asks for a kernel this CPU cannot run."""


def amx_unavailable_reason() -> str:
    """Why numaov's kernel cannot run here; ``""`` when the CPU and kernel allow AMX."""
    return native_module().amx_unavailable_reason()


def attention_setting(setting: str | None = None) -> str:
    """``setting`` or ``NUMAOV_ATTENTION``, checked; unset or empty means ``auto``, and case
    does not matter."""
    raw = setting if setting is not None else os.environ.get(ATTENTION_ENV, "")
    value = raw.strip().lower() or "auto"
    if value not in ATTENTION_SETTINGS:
        raise AttentionSettingError(
            f"{ATTENTION_ENV}={raw!r} is not a known setting; expected one of "
            f"{', '.join(ATTENTION_SETTINGS)}"
        )
    return value


def use_numaov_attention(setting: str | None = None) -> bool:
    """Whether models are compiled with numaov's attention kernel under ``setting``."""
    value = attention_setting(setting)
    if value == "openvino":
        return False
    reason = amx_unavailable_reason()
    if value == "numaov" and reason:
        raise AttentionSettingError(
            f"{ATTENTION_ENV}=numaov asks for numaov's flash attention, which needs AMX: "
            f"{reason}; expected {ATTENTION_ENV}=auto or openvino on this CPU"
        )
    return not reason


def attention_kernel(precision: Any, setting: str | None = None) -> str:
    """The kernel plain attention gets in a model compiled at ``precision`` (an inference
    precision hint, ``"bf16"`` or an ``openvino.Type``): ``"numaov"`` at bf16 when the
    setting (``setting``, else NUMAOV_ATTENTION) allows it, else ``"openvino"``. The setting
    is checked whatever the precision, so a typo in it never waits for a bf16 model to show."""
    setting = attention_setting(setting)
    name = getattr(precision, "get_type_name", None)
    bf16 = (name() if callable(name) else str(precision)) == "bf16"
    return "numaov" if bf16 and use_numaov_attention(setting) else "openvino"


LAYOUTS = ("bhsd", "bshd")


def _as_bhsd(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    return (shape[0], shape[2], shape[1], shape[3]) if layout == "bshd" else shape


def flash_attention(
    q: Any,
    k: Any,
    v: Any,
    scale: float | None = None,
    layouts: tuple[str, str, str, str] = ("bhsd", "bhsd", "bhsd", "bhsd"),
) -> Any:
    """The extension op's kernel: softmax(q k^T * scale) v.

    q, k and v are float32 numpy arrays (the result is one too) or torch bfloat16 tensors (the
    result is one too: the op's bf16 form, as it runs inside a bf16 model). ``layouts`` are
    those of q, k, v and the result: ``"bhsd"`` is [B, H, S, D], ``"bshd"`` [B, S, H, D].
    ``scale`` defaults to 1/sqrt(D), as in ``torch.nn.functional.scaled_dot_product_attention``.
    For tests and benchmarks; models reach the kernel through `swap_attention`.
    """
    if len(layouts) != 4 or any(layout not in LAYOUTS for layout in layouts):
        raise ValueError(f"layouts {layouts!r}; expected four of {', '.join(LAYOUTS)}")
    kinds = ["bf16" if _is_bf16_tensor(x) else "numpy" if isinstance(x, np.ndarray) else None
             for x in (q, k, v)]
    if None in kinds or len(set(kinds)) != 1:
        got = ", ".join(f"{n} {type(x).__name__} {getattr(x, 'dtype', '')}".rstrip()
                        for n, x in zip("qkv", (q, k, v), strict=True))
        raise ValueError(
            f"q, k, v are {got}; expected all float32 numpy arrays or all torch.bfloat16 tensors"
        )
    bf16 = kinds[0] == "bf16"
    if bf16:
        import torch

        q, k, v = (x.detach().contiguous() for x in (q, k, v))
    else:
        q, k, v = (np.ascontiguousarray(x, dtype=np.float32) for x in (q, k, v))
    shapes = [tuple(x.shape) for x in (q, k, v)]
    if any(len(shape) != 4 for shape in shapes):
        raise ValueError(f"q {shapes[0]}, k {shapes[1]}, v {shapes[2]}; expected rank-4 tensors")
    bq, bk, bv = (_as_bhsd(shape, layout) for shape, layout in zip(shapes, layouts[:3], strict=True))
    for axis, what in ((0, "batch"), (1, "heads"), (3, "head size")):
        if not bq[axis] == bk[axis] == bv[axis]:
            raise ValueError(
                f"q, k, v disagree in {what} ({bq[axis]}, {bk[axis]}, {bv[axis]}): shapes "
                f"{shapes[0]}, {shapes[1]}, {shapes[2]} read as [B, H, S, D] through layouts "
                f"{layouts[:3]}; expected q [B, H, Sq, D] and k, v [B, H, Sk, D]"
            )
    if bk[2] != bv[2]:
        raise ValueError(f"k has {bk[2]} keys but v has {bv[2]} values; expected the same")
    if 0 in bq or 0 in bk:
        raise ValueError(f"q {shapes[0]}, k {shapes[1]}: every dimension must be at least 1")
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < np.inf
    ):
        raise ValueError(f"scale {scale!r}; expected a finite positive number")
    out_shape = _as_bhsd(bq, layouts[3])
    if bf16:
        out = torch.empty(out_shape, dtype=torch.bfloat16)
        addresses = [x.data_ptr() for x in (q, k, v, out)]
    else:
        out = np.empty(out_shape, dtype=np.float32)
        addresses = [x.ctypes.data for x in (q, k, v, out)]
    batch, heads, q_len, head_dim = bq
    native_module().flash_attention(
        *addresses,
        [batch, heads, q_len, bk[2], head_dim],
        float(head_dim**-0.5 if scale is None else scale),
        list(layouts),
        bf16,
    )
    return out


def _is_bf16_tensor(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return str(dtype) == "torch.bfloat16"


@functools.cache
def _node_factory() -> Any:
    from openvino.utils.node_factory import NodeFactory

    factory = NodeFactory()
    factory.add_extension(str(library_path()))
    return factory


def _constant_values(output: Any) -> np.ndarray | None:
    node = output.get_node()
    return node.get_data() if node.get_type_name() == "Constant" else None


def _is_no_mask(values: np.ndarray | None) -> bool:
    """A constant mask that changes nothing: one element, float 0 or boolean True (a larger
    one could broadcast the output to more rows than q has)."""
    if values is None or values.size != 1:
        return False
    value = values.reshape(())
    return bool(value) if values.dtype == np.bool_ else float(value) == 0.0


def _plain_attention_scale(node: Any) -> float | None:
    """The scale of a ScaledDotProductAttention the kernel computes exactly, or None.

    Plain means: not causal, no mask (or a constant one-element zero / True one), no sink,
    f32 q/k/v of static rank 4 whose heads and head size are static and the same in all three
    (no shared-head keys, no value size of its own), and a constant scale (or none:
    1/sqrt(D)).
    """
    if node.get_type_name() != "ScaledDotProductAttention":
        return None
    if node.get_attributes().get("causal", False):
        return None
    inputs = [node.input_value(i) for i in range(node.get_input_size())]
    if len(inputs) > 5:  # a sink input changes the softmax
        return None
    shapes = []
    for value in inputs[:3]:
        shape = value.get_partial_shape()
        if value.get_element_type().get_type_name() != "f32" or not shape.rank.is_static:
            return None
        if shape.rank.get_length() != 4:
            return None
        shapes.append(shape)
    for axis in (1, 3):  # heads and head size: static, and equal in q, k and v
        dims = {d.get_length() if d.is_static else None for d in (s[axis] for s in shapes)}
        if None in dims or len(dims) != 1:
            return None
    if not shapes[1][2].compatible(shapes[2][2]) or not all(
        shapes[0][0].compatible(s[0]) for s in shapes[1:]
    ):
        return None
    if len(inputs) > 3 and not _is_no_mask(_constant_values(inputs[3])):
        return None
    if len(inputs) > 4:
        scale = _constant_values(inputs[4])
        if scale is None or scale.size != 1 or not 0 < float(scale.reshape(())) < np.inf:
            return None
        return float(scale.reshape(()))
    return shapes[0][3].get_length() ** -0.5


# A Transpose between [B, S, H, D] and [B, H, S, D] (the same permutation both ways).
_HEADS_TO_FRONT = [0, 2, 1, 3]


def _is_head_transpose(node: Any) -> bool:
    if node.get_type_name() != "Transpose":
        return False
    order = _constant_values(node.input_value(1))
    return order is not None and order.tolist() == _HEADS_TO_FRONT


def _scalar_factor(output: Any) -> tuple[Any, float] | None:
    """``output`` = x * c with a positive scalar constant c: (x, c); else None."""
    node = output.get_node()
    if node.get_type_name() != "Multiply":
        return None
    for constant, other in ((1, 0), (0, 1)):
        values = _constant_values(node.input_value(constant))
        x = node.input_value(other)
        if (
            values is not None
            and values.size == 1
            and float(values.reshape(())) > 0
            and x.get_partial_shape() == output.get_partial_shape()
        ):
            return x, float(values.reshape(()))
    return None


def _source(output: Any) -> tuple[Any, str, float]:
    """Where the kernel can read an attention input from: (tensor, layout, factor).

    A positive scalar factor on the input moves into the scale, and a transpose from
    [B, S, H, D] is read through (layout "bshd"), so neither runs as its own node.
    """
    factor = 1.0
    scaled = _scalar_factor(output)
    if scaled is not None:
        output, factor = scaled
    node = output.get_node()
    if _is_head_transpose(node):
        return node.input_value(0), "bshd", factor
    return output, "bhsd", factor


def swap_attention(model: Any, element_type: str = "bf16") -> int:
    """Replace each plain attention node of ``model`` with numaov's FlashAttention.

    Returns how many were replaced. The op reads q, k and v through the [B, S, H, D] -> [B, H,
    S, D] transposes and scalar factors that feed them, and writes [B, S, H, D] when all the
    attention's users transpose back to it. With ``element_type="bf16"`` (for models compiled
    at bf16, where activations are bf16 anyway) the op is typed bf16 between Converts, so
    OpenVINO hands it its bf16 tensors as they are instead of converting them to f32 and back;
    ``"f32"`` keeps it f32. The model then needs numaov's extension loaded in the Core that
    compiles it (`numaov.custom_ops.add_extension`).
    """
    import openvino.opset13 as ops

    if element_type not in ("bf16", "f32"):
        raise ValueError(f"element_type {element_type!r}; expected 'bf16' or 'f32'")
    swapped = 0
    for node in model.get_ordered_ops():
        scale = _plain_attention_scale(node)
        if scale is None:
            continue
        inputs, layouts = [], []
        for index in range(3):
            tensor, layout, factor = _source(node.input_value(index))
            if index < 2:  # factors on q and k scale the scores; one on v does not
                scale *= factor
            elif factor != 1.0:
                tensor, layout = node.input_value(index), "bhsd"
            inputs.append(tensor)
            layouts.append(layout)
        users = [target.get_node() for target in node.output(0).get_target_inputs()]
        out_bshd = bool(users) and all(_is_head_transpose(user) for user in users)
        layouts.append("bshd" if out_bshd else "bhsd")
        if element_type == "bf16":
            inputs = [ops.convert(x, "bf16").output(0) for x in inputs]
        flash = _node_factory().create(
            "FlashAttention",
            inputs,
            {
                "scale": scale,
                "q_layout": layouts[0],
                "k_layout": layouts[1],
                "v_layout": layouts[2],
                "out_layout": layouts[3],
            },
        )
        flash.set_friendly_name(node.get_friendly_name())
        result = flash.output(0)
        if element_type == "bf16":
            result = ops.convert(result, "f32").output(0)
        for replaced in users if out_bshd else [node]:
            replaced.output(0).replace(result)
        swapped += 1
    if swapped:
        model.validate_nodes_and_infer_types()
    return swapped

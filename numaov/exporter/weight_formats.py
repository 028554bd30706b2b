"""The weight formats a language-model export can store (``numaov export lm --weights``).

- ``f32``: as trained.
- ``bf16``: every large weight constant stored bf16 (``openvino_convert``); the routed experts
  reach numaov's MoE kernel as bf16 (its AVX512-BF16 path), the other layers are widened back
  when OpenVINO compiles them.
- ``int8`` / ``int4``: weight-only compression. The routed experts are quantized in PyTorch
  before the ONNX export (``moe_ops.quantize_experts``: symmetric, int8 per output channel,
  int4 per group of ``weights_group_size`` values), so the ``MoeExperts`` node takes the
  integer stacks and their scales as its inputs, the IR holds them as constants and the op's
  kernel reads them in place. Every other matmul and the embeddings are compressed on the
  converted ``openvino.Model`` by NNCF's ``compress_weights`` (``INT8_SYM`` / ``INT4_SYM`` with
  the same group size), which OpenVINO's CPU plugin runs as weight-compressed
  ``FullyConnected`` nodes; the embedding lookup stays f32 (see ``compress_other_weights``).
  The router stays f32, as in PyTorch (a rounded router flips
  near-tied experts): its matmuls, found as those whose constant weight has as many rows as the
  family has routed experts (``LMFamily.expert_shape``), go into NNCF's ``ignored_scope``.

The parity check at export compares against the f32 PyTorch model. An export that rounds
nothing (f32 weights computed in f32) keeps the whole-output criterion (f32's 1e-4). Every
other one is checked per row (``parity`` module docstring, :func:`row_criterion`): int8 / int4 /
fp8 weights, bf16 weights, and bf16 inference, whose rounded activations reach the f32 router
too: at least ``MIN_ROW_SHARE`` of every output's rows within ``WEIGHT_TOLERANCES`` (bf16: bf16
inference's tolerance) of its scale, and ``MIN_TOKEN_SHARE`` of the logits rows keeping
PyTorch's greedy token (reasons beside them).
"""

from __future__ import annotations

import logging
from typing import Any

from numaov import NumaovError
from numaov.console import quiet_nncf
from numaov.manifest import WEIGHT_FORMATS

logger = logging.getLogger(__name__)

# Largest |OpenVINO - PyTorch f32| of a row over the largest |PyTorch f32| of its output, per
# format (before the per-row criterion, the same figures bounded the whole output).
WEIGHT_TOLERANCES: dict[str, float] = {
    # int8: each weight moves by at most half a step (max|w| / 254 of its row or group); with
    # every matmul compressed the tiny model's logits move by 0.027 .. 0.036 of their scale
    # (its routed experts alone: 0.005). 0.06 leaves a 1.7x margin; a wrong scale, layout or
    # expert is off by O(1).
    "int8": 6e-2,
    # int4: half a step is max|w| / 14 per group of 32, ~7% of a group's largest weight;
    # measured 0.19 .. 0.33 of the logits' scale on the tiny model (hidden size 64: every
    # output sums few weights, so their errors average out little; the routed experts alone:
    # 0.14). 0.5 bounds that; a graph that reads the packed values wrongly is off by O(1).
    "int4": 0.5,
    # fp8 (E4M3, 128 x 128 block scales), the routed experts only (the other weights keep the
    # precision): half a step is 2^-4 of a weight's own magnitude (3 mantissa bits); the
    # trained tiny-moe's outputs move by 0.003 .. 0.014 of their scale (every row within,
    # every greedy token kept). 0.05 leaves 3.5x; a wrong scale or block is off by O(1). A
    # released FP8 checkpoint stored as it is follows its precision's tolerance instead.
    "fp8": 5e-2,
}


# The per-row criterion of the exports that round: at least MIN_ROW_SHARE of an output's rows
# (over every parity input) within WEIGHT_TOLERANCES (bf16: 0.1) of its scale, and at least
# MIN_TOKEN_SHARE of the logits rows keeping PyTorch's greedy token. Why shares and not every
# row: rounding (of the weights, or of the activations the f32 router reads) moves a near-tied
# router score across the tie at a few positions, and such a position takes another expert, a
# legitimate result of the format that moves its row (and, through attention, the later rows
# of its sequence) far more than the rounding itself; and near-flat logits swap their best two
# tokens. On the trained tiny-moe, rounding only its four kv_b_proj matrices to int8 moves the
# logits by 0.148 of their scale.
# Measured at export (``benchmarks/parity_shares.py``; 70 logits rows: 34 of prefill, 36 of
# decode with a cache, 714 cached-token rows), correct exports of 11 models (5 seeded
# DeepSeek-V3 of hidden 256 and 8 experts, the tests' seeded V3, 2 seeded Qwen3-MoE, 2 Qwen2-MoE,
# the trained tiny-moe), each in int8, int4 and fp8 at f32 and at bf16 inference, and in bf16:
# - worst rows within / greedy tokens kept: bf16 67 / 67 of 70 (96%), int8 63 / 62 (90% /
#   89%), fp8 53 / 60 (76% / 86%, a seeded Qwen3-MoE at f32), int4 59 / 34 (84% / 49%: int4
#   moves near-flat logits most); a phase's own rows: 67% at worst (that fp8 export's decode).
#   The earlier shares (90% of the rows; 90% of the tokens, int4 50%; then 38 rows, no cached
#   decode step) refused 27 of 66 correct int8 / int4 / fp8 exports, and bf16's whole-output
#   criterion 6 of 10 seeded bf16 exports (0.30-0.67 of the logits' scale at 1-4 rows, 0.01
#   elsewhere) and a released FP8 checkpoint's bf16 export.
# - broken exports of 3 seeded models (V3 of hidden 256, Qwen3-MoE, Qwen2-MoE), the first MoE
#   layer's stored experts edited (``--break``), int8 / int4 / fp8 / bf16: gate_up (or its
#   scales) x2 leaves 0-2 of 70 rows within; experts 0 and 1 swapped 25-46 rows (66% at
#   most) and 43-52 tokens (74%), int4 43-55 rows but 24-31 tokens (44%). So rows 70%,
#   tokens 75% (int4 45%) are between.
# What no share separates: an error confined to one layer's experts of the trained tiny-moe,
# which routes few rows to any one expert (experts 0 and 1 swapped: 60-70 of 70 rows, 59-69
# tokens in each format; int4 gate_up scales x2 keeps every row and 43 tokens), moves as few
# rows as the rounding does; an f32 export (whole output, 1e-4) refuses it, and the expert store's and
# op's own tests check each expert.
MIN_ROW_SHARE: dict[str, float] = {"int8": 0.7, "int4": 0.7, "fp8": 0.7, "bf16": 0.7}
MIN_TOKEN_SHARE: dict[str, float] = {"int8": 0.75, "int4": 0.45, "fp8": 0.75, "bf16": 0.75}


def row_criterion(rounded: str, inference_precision: str) -> str | None:
    """The format whose shares (``MIN_ROW_SHARE``, ``MIN_TOKEN_SHARE``) judge an export
    rounding its weights to ``rounded`` and computing at ``inference_precision`` per row:
    the rounded format's own, else bf16's when the weights or the activations are bf16; None
    (the whole output is judged) for f32 weights computed in f32, where no rounding can flip
    a router choice."""
    if rounded in WEIGHT_TOLERANCES:
        return rounded
    if "bf16" in (rounded, inference_precision):
        return "bf16"
    return None


def row_criterion_note(criterion: str, inference_precision: str, figures: Any) -> str:
    """The manifest's note saying how an export judged per row (``criterion``, from
    :func:`row_criterion`) was checked, with each output's figures (``parity.row_shares``)."""
    from numaov.exporter.parity import row_shares

    worst = max((f.rel_error for f in figures), default=0.0)
    rounding = "bf16 rounding" if criterion == "bf16" else f"the {criterion} weights"
    if criterion != "bf16" and inference_precision == "bf16":
        rounding += " and bf16 activations"
    return (
        f"parity under {rounding} checked per row against the f32 PyTorch model, over "
        f"every parity input ({rounding} may flip a near-tied router choice at a few "
        "positions, so a share of the rows is required, not all): "
        + "; ".join(s.describe() for s in row_shares(figures))
        + f"; worst whole-output error {worst:.3g} of its scale"
    )


def parity_tolerance(weights: str, inference_precision: str) -> float | None:
    """The parity tolerance of an export storing ``weights``; None: the inference precision's
    own (``parity.TOLERANCES``), which bf16 weights share with bf16 inference."""
    from numaov.exporter.parity import TOLERANCES

    if weights in WEIGHT_TOLERANCES:
        return max(WEIGHT_TOLERANCES[weights], TOLERANCES[inference_precision].max_rel_error)
    if weights == "bf16":
        return TOLERANCES["bf16"].max_rel_error
    return None


class WeightFormatError(NumaovError):
    """An export was asked for a weight format it cannot store for this model."""


def check_weights(weights: str | None, precision: str) -> str:
    """The export's weight format: ``weights``, or ``precision``'s own when None."""
    chosen = precision if weights is None else weights
    if chosen not in WEIGHT_FORMATS:
        raise WeightFormatError(
            f"weights format {chosen!r}; expected one of {', '.join(WEIGHT_FORMATS)}",
            parameter="weights",
        )
    return chosen


def expert_group_size(weights: str, hidden: int, intermediate: int) -> int | None:
    """The int4 scale group for expert rows of ``hidden`` (gate_up) and ``intermediate``
    (down, this rank's shard) values; None (one scale per row) for the other formats."""
    if weights != "int4":
        return None
    from numaov.custom_ops.moe_ops import int4_group_size

    try:
        return int4_group_size(hidden, intermediate)
    except NumaovError as exc:
        raise WeightFormatError(f"{exc} (this rank's expert shard)", parameter="weights") from exc


def other_weights_storage(weights: str, precision: str) -> str:
    """The format the IR stores its weights other than the routed experts in (which go to the
    expert store in ``weights``): bf16 for bf16 exports and for fp8 ones at bf16 precision,
    else f32 (int8 / int4 exports then compress them with NNCF,
    :func:`compress_other_weights`)."""
    return "bf16" if weights == "bf16" or (weights == "fp8" and precision == "bf16") else "f32"


def rounding_format(weights: str, precision: str, released_fp8: bool) -> str:
    """The format whose parity rules an export follows: ``weights``, except fp8 experts of a
    released FP8 checkpoint, which are stored as released (no rounding beyond the
    checkpoint's own, which the reference reads too): those follow ``precision``."""
    return precision if weights == "fp8" and released_fp8 else weights


def compress_other_weights(model: Any, weights: str, group_size: int | None,
                           keep_rows: int | None) -> None:
    """NNCF ``compress_weights`` on an ``openvino.Model`` for int8 / int4 (in place): every
    matmul weight but the router's.

    ``keep_rows``: matmuls whose constant weight has this many rows (the router's
    ``[n_routed_experts, hidden]``) are left in f32.
    """
    import nncf
    from nncf.quantization.advanced_parameters import (
        AdvancedCompressionParameters,
        GroupSizeFallbackMode,
    )

    ignored = [node.get_friendly_name() for node in model.get_ordered_ops()
               if keep_rows is not None and _is_router(node, keep_rows)]
    # The embedding (a Gather) stays f32: a step reads only its tokens' rows, so compressing
    # it saves memory but no decode time, and on the tiny model it was most of int8's error
    # (0.10 of the logits' scale with it, 0.03 without).
    scope = nncf.IgnoredScope(names=ignored, types=["Gather"], validate=False)
    with quiet_nncf():
        if weights == "int8":
            nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_SYM,
                                  ignored_scope=scope)
        else:
            # A matmul whose rows the group does not divide (e.g. MLA's small latent
            # projections) gets the largest power of two that does, as NNCF's ADJUST mode
            # computes.
            nncf.compress_weights(
                model, mode=nncf.CompressWeightsMode.INT4_SYM, group_size=group_size or 32,
                ratio=1.0, ignored_scope=scope,
                advanced_parameters=AdvancedCompressionParameters(
                    group_size_fallback_mode=GroupSizeFallbackMode.ADJUST),
            )
    logger.info("NNCF compressed the non-expert weights to %s (%d router matmuls kept f32)",
                weights, len(ignored))


def _is_router(node: Any, rows: int) -> bool:
    if node.get_type_name() != "MatMul":
        return False
    for value in node.input_values():
        source = value.get_node()
        while source.get_type_name() == "Convert":
            source = source.input_value(0).get_node()
        shape = source.get_output_partial_shape(0)
        if (source.get_type_name() == "Constant" and shape.is_static and len(shape) == 2
                and rows in (shape[0].get_length(), shape[1].get_length())):
            return True
    return False

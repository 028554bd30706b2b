"""Rotary embedding tables for given positions: plain, yarn and Llama-3-style scaling, as
transformers computes them (``modeling_rope_utils``), and yarn's attention scale.

The families read their own config keys and hand this module plain numbers: the rotated
dims, the base and the Hugging Face ``rope_scaling`` dict (``rope_type`` / ``type``: ``yarn``,
``llama3``, ``linear``; None or ``default`` for plain rope).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from numaov import NumaovError

#: The ``rope_scaling`` kinds :class:`RotaryEmbedding` computes.
ROPE_KINDS = ("default", "linear", "yarn", "llama3")


class RopeConfigError(NumaovError):
    """A ``rope_scaling`` entry names a kind or lacks a key the tables need."""


def rope_kind(scaling: Mapping[str, Any] | None) -> str:
    """The kind of a Hugging Face ``rope_scaling`` dict (``default`` for None)."""
    if not scaling:
        return "default"
    kind = scaling.get("rope_type", scaling.get("type")) or "default"
    if kind not in ROPE_KINDS:
        raise RopeConfigError(f"rope_scaling type {kind!r} is not supported; expected one of "
                              f"{ROPE_KINDS}")
    return str(kind)


def read_rope_keys(values: Mapping[str, Any], what: str, error: type[NumaovError], *,
                   kinds: tuple[str, ...] = ROPE_KINDS,
                   kind_key: str = "rope_type") -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` of a ``config.json`` mapping, from either spelling: the
    classic ``rope_theta`` / ``rope_scaling`` keys or transformers 5's ``rope_parameters``
    (theta and kind inside). The scaling is None for plain rope, else the Hugging Face dict
    without theta, its kind under ``kind_key`` (the key the family's ``to_dict`` writes).

    A malformed entry, a kind outside the family's ``kinds`` or a ``partial_rotary_factor``
    other than 1 (rope on all of the family's rope dims) raises ``error``, prefixed by ``what``.
    """
    params = values.get("rope_parameters")
    scaling = values.get("rope_scaling")
    theta = values.get("rope_theta")
    if isinstance(params, Mapping) and params:
        theta = params.get("rope_theta", theta)
        scaling = dict(params)
    if scaling is not None and not isinstance(scaling, Mapping):
        raise error(f"{what}: rope_scaling is {scaling!r}; expected an object or null")
    theta = float(theta if theta is not None else 10000.0)
    if not scaling:
        return theta, None
    partial = scaling.get("partial_rotary_factor", values.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise error(f"{what}: partial_rotary_factor is {partial!r}; expected 1 (rope on the "
                    "whole head)")
    kind = scaling.get("rope_type", scaling.get("type")) or "default"
    if kind not in kinds:
        scaled = [repr(k) for k in kinds if k != "default"]
        expected = scaled[0] if len(scaled) == 1 else f"one of {', '.join(scaled)}"
        raise error(f"{what}: rope type {kind!r} is not supported; expected no scaling or "
                    f"{expected}")
    if kind == "default":
        return theta, None
    kept = {k: v for k, v in scaling.items()
            if k not in ("rope_theta", "type", "rope_type", "partial_rotary_factor")}
    kept[kind_key] = kind
    return theta, kept


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """Yarn's magnitude correction for a context ``scale`` times the original."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_factor(scaling: Mapping[str, Any] | None) -> float:
    """How much yarn with ``mscale_all_dim`` sharpens the softmax: ``mscale(factor,
    mscale_all_dim) ** 2`` (DeepSeek's attention multiplies its ``1/sqrt(d)`` scale by it); 1
    without."""
    if scaling is None or rope_kind(scaling) != "yarn" or not scaling.get("mscale_all_dim"):
        return 1.0
    return yarn_mscale(float(scaling["factor"]), scaling["mscale_all_dim"]) ** 2


def _required(scaling: Mapping[str, Any], key: str, kind: str) -> float:
    if scaling.get(key) is None:
        raise RopeConfigError(f"rope_scaling of type {kind!r} has no {key!r}; expected it")
    return float(scaling[key])


class RotaryEmbedding:
    """cos/sin tables of ``dim`` rotated dims for given positions.

    Not an nn.Module with a buffer on purpose: ``model.to(torch.bfloat16)`` must not round the
    frequencies, and the tables are rebuilt from positions every forward (cheap: [B*T, D/2]).
    ``max_position_embeddings`` is the model's (yarn's ``original_max_position_embeddings``
    defaults to it, as transformers' does).
    """

    def __init__(self, dim: int, base: float, scaling: Mapping[str, Any] | None = None,
                 max_position_embeddings: int | None = None) -> None:
        # Explicitly on the CPU: the model may be built under a meta-device context.
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
        inv_freq = 1.0 / (base ** exponents)
        self.attention_factor = 1.0
        kind = rope_kind(scaling)
        if kind == "linear":
            inv_freq = inv_freq / _required(scaling, "factor", kind)
        elif kind == "yarn":
            inv_freq = self._yarn(inv_freq, dim, base, scaling, max_position_embeddings)
        elif kind == "llama3":
            inv_freq = _llama3(inv_freq, scaling)
        self.inv_freq = inv_freq

    def _yarn(self, inv_freq: Tensor, dim: int, base: float, yarn: Mapping[str, Any],
              max_positions: int | None) -> Tensor:
        factor = _required(yarn, "factor", "yarn")
        original = yarn.get("original_max_position_embeddings") or max_positions
        if original is None:
            raise RopeConfigError("rope_scaling of type 'yarn' has no "
                                  "'original_max_position_embeddings'; expected it")
        original = float(original)
        beta_fast = float(yarn.get("beta_fast") or 32)
        beta_slow = float(yarn.get("beta_slow") or 1)
        mscale, mscale_all_dim = yarn.get("mscale"), yarn.get("mscale_all_dim")
        attention_factor = yarn.get("attention_factor")
        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(
                    factor, mscale_all_dim)
            else:
                attention_factor = yarn_mscale(factor)
        self.attention_factor = float(attention_factor)

        # Blend interpolated and extrapolated frequencies over the dims whose rotation
        # count at the original context falls between beta_slow and beta_fast.
        def correction_dim(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if yarn.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low)
                / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        return (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation

    def __call__(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """``position_ids [B, T]`` -> fp32 ``cos, sin [B*T, D/2]`` (rows batch-major)."""
        freqs = position_ids.reshape(-1, 1).float() * self.inv_freq.to(position_ids.device)
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor


def _llama3(inv_freq: Tensor, scaling: Mapping[str, Any]) -> Tensor:
    """Llama 3.1's scaling: long wavelengths divided by ``factor``, short ones kept, a smooth
    blend between ``high_freq_factor`` and ``low_freq_factor`` wavelengths."""
    factor = _required(scaling, "factor", "llama3")
    low_freq_factor = _required(scaling, "low_freq_factor", "llama3")
    high_freq_factor = _required(scaling, "high_freq_factor", "llama3")
    original = _required(scaling, "original_max_position_embeddings", "llama3")
    low_wavelen, high_wavelen = original / low_freq_factor, original / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)

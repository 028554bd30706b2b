"""Rotary embedding of the ``qk_rope_head_dim`` slice (plain or yarn) and the softmax scale,
which yarn changes too."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from numaov.models.deepseek.config import DeepseekV2Config


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _softmax_scale(config: DeepseekV2Config) -> float:
    """``1/sqrt(qk_head_dim)``, times ``mscale(factor, mscale_all_dim)**2`` under yarn (the
    longer context sharpens attention by the same factor the rope tables are scaled by)."""
    scale = config.qk_head_dim ** -0.5
    yarn = config.rope_scaling
    if yarn is not None and yarn.get("mscale_all_dim"):
        scale *= _yarn_mscale(float(yarn["factor"]), yarn["mscale_all_dim"]) ** 2
    return scale


class RotaryEmbedding:
    """cos/sin tables of the ``qk_rope_head_dim`` slice for given positions (plain or yarn).

    Not an nn.Module with a buffer on purpose: ``model.to(torch.bfloat16)`` must not round the
    frequencies, and the tables are rebuilt from positions every forward (cheap: [B*T, D/2]).
    """

    def __init__(self, config: DeepseekV2Config) -> None:
        dim, base = config.qk_rope_head_dim, config.rope_theta
        # Explicitly on the CPU: the model may be built under a meta-device context.
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
        inv_freq = 1.0 / (base ** exponents)
        self.attention_factor = 1.0
        yarn = config.rope_scaling
        if yarn is not None:
            factor = float(yarn["factor"])
            original = float(yarn["original_max_position_embeddings"])
            beta_fast = float(yarn.get("beta_fast") or 32)
            beta_slow = float(yarn.get("beta_slow") or 1)
            mscale, mscale_all_dim = yarn.get("mscale"), yarn.get("mscale_all_dim")
            attention_factor = yarn.get("attention_factor")
            if attention_factor is None:
                if mscale and mscale_all_dim:
                    attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(
                        factor, mscale_all_dim)
                else:
                    attention_factor = _yarn_mscale(factor)
            self.attention_factor = float(attention_factor)

            # Blend interpolated and extrapolated frequencies over the dims whose rotation
            # count at the original context falls between beta_slow and beta_fast.
            def correction_dim(rotations: float) -> float:
                return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

            low = max(math.floor(correction_dim(beta_fast)), 0)
            high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
            if low == high:
                high += 0.001  # avoid a zero-width ramp
            ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
            extrapolation = 1 - ramp
            inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
        self.inv_freq = inv_freq

    def __call__(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """``position_ids [B, T]`` -> fp32 ``cos, sin [B*T, D/2]`` (rows batch-major)."""
        freqs = position_ids.reshape(-1, 1).float() * self.inv_freq.to(position_ids.device)
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

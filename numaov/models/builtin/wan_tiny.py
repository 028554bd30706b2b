"""A tiny Wan transformer with seeded random weights, saved in the diffusers layout.

It has the real model's structure (16 latent channels, patch (1, 2, 2), 3-D RoPE,
cross-attention norm) at a size that exports and converts in seconds, so the demo
and the tests exercise the whole export -> OpenVINO -> sampling path without a
download. Its weights are untrained: outputs are deterministic noise, good for
parity and speed, not for pictures.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from numaov.models.wan.transformer import (
    CONFIG_NAME,
    DIFFUSERS_CLASS_NAME,
    WEIGHTS_NAME,
    WanTransformer,
    WanTransformerConfig,
)

TINY_WAN_CONFIG = WanTransformerConfig(
    patch_size=(1, 2, 2),
    num_attention_heads=4,
    attention_head_dim=24,  # RoPE parts: 8 frame, 8 height, 8 width channels
    in_channels=16,
    out_channels=16,
    text_dim=64,
    freq_dim=64,
    ffn_dim=256,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)

# The diffusers release whose config.json layout this writes (diffusers reads it back).
_DIFFUSERS_VERSION = "0.42.1"


def save_wan_checkpoint(model: WanTransformer, directory: str | Path) -> Path:
    """Write ``model`` as a diffusers checkpoint: config.json + one safetensors file."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "_class_name": DIFFUSERS_CLASS_NAME,
        "_diffusers_version": _DIFFUSERS_VERSION,
        **model.config.to_dict(),
    }
    (path / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
    return path


def build_tiny_wan(directory: str | Path, seed: int = 0,
                   config: WanTransformerConfig = TINY_WAN_CONFIG) -> Path:
    """Build the tiny Wan model (``config``) from ``seed`` and save it to ``directory``;
    return the path.

    The same seed gives the same weights on the same torch version; the global RNG state
    of the caller is left untouched.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = WanTransformer(config)
        # Norm weights start at exactly 1 and biases at 0; perturb them so a checkpoint
        # that swapped or dropped one would be caught by parity checks.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.add_(0.1 * torch.randn_like(param))
    return save_wan_checkpoint(model, directory)

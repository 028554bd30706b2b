"""The memory a Wan run will hold, estimated before anything is allocated.

``estimate_memory`` adds up the transformers' compiled weights (per worker), the live
activations of a guidance pair (of one sample at guidance 1) and the latent-sized arrays of the loop; the pipeline adds its
VAE's part. ``check_memory`` refuses a run larger than ``MemAvailable``, with the numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from numaov.runtime.manifest_reader import ModelManifest
from numaov.runtime.wan.request import SamplerInputError, video_tokens

_GIB = 1 << 30
# What a compiled transformer holds for its IR weights once they are packed and the IR's
# mapped pages let go (measured 1.29x for Wan 1.3B's bf16 transformer, RESULTS.md).
COMPILED_WEIGHTS_FACTOR = 1.3
# Live f32 activations per video token and sample: about six hidden-width tensors (residual,
# norm, q, k, v, attention output) plus one feed-forward column block (FFN_COLUMN_BLOCK at
# export); measured 2.1-2.8 GiB for Wan 1.3B at 32,760 tokens, batch 2 (README).
ACTIVATION_WIDTHS = 6
FFN_BLOCK = 2048
# Latent-sized f32 arrays alive in the loop: noise, latents, the guidance batch, predictions,
# the scheduler's history.
LATENT_COPIES = 8


@dataclass(frozen=True)
class MemoryEstimate:
    """What a run will hold, estimated before anything is allocated (bytes per part)."""

    tokens: int
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        parts = ", ".join(f"{name} {value / _GIB:.2f} GiB" for name, value in self.parts.items())
        return f"{self.tokens:,} video tokens, about {self.total / _GIB:.2f} GiB ({parts})"


def available_memory() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def resident_bytes() -> int:
    """This process's resident memory now (``VmRSS``: anonymous and file pages), 0 where
    /proc has none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return 0


def held_line(what: str, since: int, manifests: Sequence[ModelManifest]) -> str:
    """A progress line: what the process holds above ``since`` (``resident_bytes()`` before
    ``what`` was loaded) against the IR weights of ``manifests``."""
    held = max(resident_bytes() - since, 0)
    weights = sum(graph_weight_bytes(m) for m in manifests)
    ratio = f", {held / weights:.2f}x" if weights else ""
    return f"{what} held {_size(held)} after running ({_size(weights)} of IR weights{ratio})"


def _size(n: int) -> str:
    return f"{n / _GIB:.2f} GiB" if n >= _GIB else f"{n / 2**20:.0f} MiB"


def graph_weight_bytes(manifest: ModelManifest) -> int:
    return sum(d.size for name, d in manifest.record.files.items() if name.endswith(".bin"))


def estimate_memory(
    experts: Sequence[ModelManifest], shape: Sequence[int], text_length: int, workers: int,
    extra: dict[str, int] | None = None, branches: int = 2,
) -> MemoryEstimate:
    """The transformers' part of a run of ``shape`` latents; ``extra`` adds other parts.
    ``branches`` is the samples per forward on one worker (1 at guidance 1)."""
    config = experts[0].config
    tokens = video_tokens(config, shape)
    width = int(config.get("num_attention_heads", 1)) * int(config.get("attention_head_dim", 1))
    ffn = min(int(config.get("ffn_dim", width)), FFN_BLOCK)
    per_sample = (tokens * (ACTIVATION_WIDTHS * width + ffn) + 2 * text_length * width) * 4
    parts = {
        "weights": int(sum(graph_weight_bytes(m) for m in experts) * COMPILED_WEIGHTS_FACTOR)
        * workers,
        "activations": branches * per_sample,
        "latents": int(np.prod(shape)) * 4 * LATENT_COPIES,
        **(extra or {}),
    }
    return MemoryEstimate(tokens=tokens, parts=parts)


def check_memory(estimate: MemoryEstimate, available: int | None = None) -> None:
    """Refuse a run the machine cannot hold, with the numbers."""
    available = available_memory() if available is None else available
    if available is not None and estimate.total > available:
        raise SamplerInputError(
            f"this video needs {estimate.describe()}, but {available / _GIB:.2f} GiB of memory "
            "is available; expected a smaller video (fewer frames, height or width)"
        )


"""What a Wan sampling request is, and the checks and loaders of its inputs.

A request (``WanSampleRequest``) names the video in pixels and frames, the schedule and the
seed; ``latent_shape`` turns the video's size into the latents' (Wan's VAE factors and the
transformer's patch size, refusing sizes that do not fit rather than rounding them), and the
loaders read the ``.npy`` inputs (text embeddings, first-frame latents) with their shapes,
dtypes and values checked. Every refusal is a ``SamplerInputError`` that says what was
expected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from numaov import NumaovError
from numaov.runtime.manifest_reader import ModelManifest

DEFAULT_SHIFT = 5.0
# Wan's VAE: 4x temporal compression with the first frame kept (frames = 4k + 1), 8x spatial.
VAE_TEMPORAL_FACTOR = 4
VAE_SPATIAL_FACTOR = 8
INPUT_NAMES = ("hidden_states", "timestep", "encoder_hidden_states")
PER_FRAME = "per-frame"  # the manifest's ``timestep`` for [B, F'] graphs


class SamplerInputError(NumaovError):
    """A sampling request whose arguments or input files do not fit the model."""


@dataclass(frozen=True)
class WanSampleRequest:
    """What to sample: the video size (in pixels / frames), the schedule and the seed."""

    frames: int
    height: int
    width: int
    steps: int
    guidance: float
    seed: int
    # The timestep shift: None is the pipeline scheduler's own (``flow_shift`` / ``shift``),
    # or DEFAULT_SHIFT for latents from embeddings.
    shift: float | None = None
    # The sampler (``schedules.SAMPLERS``): "unipc" or "euler"; None is the pipeline's own
    # scheduler, or flow-matching Euler for latents from embeddings.
    sampler: str | None = None
    # A diffusers scheduler config (a pipeline's scheduler/scheduler_config.json, or the one
    # ``schedules.scheduler_config`` made of ``sampler`` and ``shift``): when set, that
    # scheduler steps the latents instead of flow-matching Euler with ``shift``.
    scheduler: dict[str, Any] | None = None
    # Two experts (Wan 2.2 A14B): steps at timesteps below ``boundary_timestep`` run the
    # second transformer with guidance ``guidance_2`` (default: ``guidance``).
    boundary_timestep: float | None = None
    guidance_2: float | None = None
    # Step caching (``step_cache.StepCacheSetting``: "first-block:THRESHOLD",
    # "magcache:THRESHOLD", ...), None for none.
    cache: str | None = None

    def expert(self, timestep: float) -> int:
        """0 (the first transformer, high noise) or 1 (the second, low noise)."""
        return int(self.boundary_timestep is not None and timestep < self.boundary_timestep)

    def guidance_at(self, expert: int) -> float:
        """Expert ``expert``'s guidance scale; 1 for both at ``guidance`` 1, which turns
        classifier-free guidance off in diffusers' Wan pipelines whatever ``guidance_2`` is."""
        if self.unguided or expert == 0 or self.guidance_2 is None:
            return self.guidance
        return self.guidance_2

    @property
    def unguided(self) -> bool:
        """Every step at guidance 1: one branch per step, no unconditional prediction (the
        guidance-free sampling distilled LoRAs are made for)."""
        return self.guidance == 1

    @property
    def unused_guidance_2(self) -> str | None:
        """A line saying ``guidance_2`` goes unused (at ``guidance`` 1), else None."""
        if not self.unguided or self.guidance_2 in (None, 1):
            return None
        return (f"guidance_2 {self.guidance_2:g} is not used: guidance 1 turns classifier-free "
                "guidance off for both transformers, as in diffusers' Wan pipelines")

    @property
    def branches(self) -> int:
        """Predictions per step at most: 1 unguided, else 2 (conditional, unconditional)."""
        return 1 if self.unguided else 2


def condition_channels(config: dict[str, Any]) -> int:
    """Channels a transformer takes beside the latents it predicts (Wan 2.2 I2V: 36 in, 16
    out, so 20: the first-frame mask and the condition video); 0 for text to video."""
    return int(config["in_channels"]) - int(config.get("out_channels") or config["in_channels"])


def latent_shape(config: dict[str, Any], frames: int, height: int, width: int,
                 spatial_factor: int = VAE_SPATIAL_FACTOR,
                 temporal_factor: int = VAE_TEMPORAL_FACTOR) -> tuple[int, ...]:
    """``(1, C, F, H, W)`` latents for a video of ``frames`` x ``height`` x ``width`` pixels.

    Wan's VAE maps ``frames = tk + 1`` to ``k + 1`` latent frames (``t``: its
    ``temporal_factor``, 4) and divides height and width by ``spatial_factor`` (8; Wan 2.2's
    48-channel VAE: 16; the built-in digits-wan's: 4); the transformer then needs
    latent sizes divisible by its patch size. Sizes that do not fit are errors (diffusers
    rounds them; here nothing is silently changed).
    """
    patch = list(config.get("patch_size", (1, 2, 2)))
    # The latents are what the transformer predicts: an image-to-video transformer takes
    # condition channels beside them (Wan 2.2 I2V: in_channels 36, out_channels 16).
    channels = int(config.get("out_channels") or config["in_channels"])
    for name, value in (("frames", frames), ("height", height), ("width", width)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SamplerInputError(f"{name}={value!r}; expected a positive integer")
    t = temporal_factor
    if (frames - 1) % t != 0:
        lower = (frames - 1) // t * t + 1
        raise SamplerInputError(
            f"frames={frames}; expected {t}k+1 video frames (Wan's VAE keeps "
            f"the first frame and compresses the rest {t}x), e.g. {lower} or "
            f"{lower + t}"
        )
    latent_frames = (frames - 1) // t + 1
    if latent_frames % patch[0] != 0:
        raise SamplerInputError(
            f"frames={frames} gives {latent_frames} latent frames, not a multiple of the temporal "
            f"patch size {patch[0]}"
        )
    dims = [latent_frames]
    for name, value, p in (("height", height, patch[1]), ("width", width, patch[2])):
        multiple = spatial_factor * p
        if value % multiple != 0:
            lower = max(multiple, value // multiple * multiple)
            raise SamplerInputError(
                f"{name}={value}; expected a multiple of {multiple} (VAE factor "
                f"{spatial_factor} x patch size {p}), e.g. {lower} or {lower + multiple}"
            )
        dims.append(value // spatial_factor)
    return (1, channels, *dims)

def video_tokens(config: dict[str, Any], hidden_states_shape: Sequence[int]) -> int:
    """Video tokens per sample of ``[B, C, F, H, W]`` latents (after patching)."""
    patch = list(config.get("patch_size", (1, 2, 2)))
    frames, height, width = hidden_states_shape[2:5]
    return frames // patch[0] * (height // patch[1]) * (width // patch[2])


def _load_npy(path: str | Path, what: str) -> np.ndarray:
    path = Path(path)
    if not path.is_file():
        raise SamplerInputError(f"{what} file {str(path)!r} not found")
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise SamplerInputError(f"{what} file {str(path)!r} is not a .npy array ({exc})") from exc


def _finite_f32(array: np.ndarray, path: str | Path, what: str) -> np.ndarray:
    if not np.issubdtype(array.dtype, np.floating):
        raise SamplerInputError(
            f"{what} in {str(path)!r} have dtype {array.dtype}; expected floats"
        )
    array = array.astype(np.float32)
    if not np.all(np.isfinite(array)):
        raise SamplerInputError(f"{what} in {str(path)!r} contain NaN or infinity")
    return array


def load_text_embeddings(path: str | Path, text_dim: int, what: str) -> np.ndarray:
    """Read ``[S, D]`` (or ``[1, S, D]``) f32 text embeddings from a ``.npy`` file."""
    array = _load_npy(path, what)
    if array.ndim == 3 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] != text_dim:
        raise SamplerInputError(
            f"{what} in {str(path)!r} have shape {list(array.shape)}; expected [text_length, "
            f"{text_dim}] or [1, text_length, {text_dim}] (text_dim of the model)"
        )
    return _finite_f32(array, path, what)


def load_first_frame_latents(
    path: str | Path, shape: Sequence[int], manifest: ModelManifest
) -> np.ndarray:
    """Read first-frame latents for ``shape`` = (1, C, F, H', W') as ``[1, C, 1, H', W']`` f32.

    They are the VAE-encoded first frame, normalised as the transformer sees latents
    (diffusers' ``(z - latents_mean) * (1 / latents_std)``); the file may omit the batch axis.
    """
    what = "first-frame latents"
    if manifest.timestep != PER_FRAME:
        raise SamplerInputError(
            f"first-frame latents need a model exported with per-frame timesteps (Wan 2.2 TI2V "
            f"gives the conditioned frame timestep 0), but the model in "
            f"{str(manifest.directory)!r} takes one timestep per sample: re-export it with "
            f"timestep {PER_FRAME!r}", parameter="first_frame_latents"
        )
    patch_t = int(list(manifest.config.get("patch_size", (1, 2, 2)))[0])
    if patch_t != 1:
        raise SamplerInputError(
            f"first-frame latents need temporal patch size 1 (one latent frame per timestep, "
            f"as Wan 2.2 TI2V); this model's is {patch_t}", parameter="first_frame_latents"
        )
    array = _load_npy(path, what)
    expected = (1, shape[1], 1, *shape[3:])
    if tuple(array.shape) not in (expected, expected[1:]):
        raise SamplerInputError(
            f"{what} in {str(path)!r} have shape {list(array.shape)}; expected "
            f"{list(expected[1:])} or {list(expected)} (latent channels, one frame, and the "
            "latent height and width of the requested video)"
        )
    return _finite_f32(array.reshape(expected), path, what)


def check_against_manifest(manifest: ModelManifest, feeds: dict[str, tuple[int, ...]]) -> None:
    """Static axes recorded in the manifest must match; dynamic (named) axes take any size."""
    for name, shape in feeds.items():
        expected = manifest.inputs.get(name)
        if expected is None:
            raise SamplerInputError(
                f"model in {str(manifest.directory)!r} has no input {name!r}; expected a Wan "
                f"export with inputs {', '.join(INPUT_NAMES)}"
            )
        if len(expected) != len(shape) or any(
            isinstance(e, int) and e != s for e, s in zip(expected, shape, strict=False)
        ):
            raise SamplerInputError(
                f"input {name!r} would have shape {list(shape)} but the model was exported for "
                f"{expected} (names are dynamic axes)"
            )


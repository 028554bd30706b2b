"""Decoding Wan latents to video with the exported VAE decoder, whole or in tiles.

The decoder is two graphs (``numaov.models.wan_components``): the first latent frame, then
every later one with the caches the previous frame left. ``VaeDecoder`` runs that loop.

Tiling follows diffusers' ``AutoencoderKLWan.tiled_decode`` (enabled by ``enable_tiling()``,
whose defaults ``VaeTiling`` has): when the latents are wider or taller than a tile, they are
cut into overlapping tiles of ``min`` pixels every ``stride`` pixels (divided by the VAE's 8x),
each tile is decoded on its own (its own caches, all frames), each tile is blended linearly
with the tile above and the one to its left over ``min - stride`` pixels, cropped to
``stride`` and the rows are joined; the result is clamped to [-1, 1] at the end, as diffusers
does. The blending runs in the order diffusers' does and in place as its does, so a tile
blended with the one above is what the one below blends with. Tiles are independent, so
with two workers each decodes every other tile (``decode_tiles_on_workers``) and this process
blends them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from numaov import NumaovError
from numaov.runtime.binding import BindingPlan
from numaov.runtime.graph_runner import GraphRunner
from numaov.runtime.manifest_reader import ModelManifest, read_manifest

SPATIAL_FACTOR = 8
TEMPORAL_FACTOR = 4


class VaeTilingError(NumaovError):
    """Tile sizes that cannot tile a video."""


@dataclass(frozen=True)
class VaeTiling:
    """diffusers' Wan VAE tiling, in pixels (its ``enable_tiling()`` defaults)."""

    min_height: int = 256
    min_width: int = 256
    stride_height: int = 192
    stride_width: int = 192

    def check(self) -> VaeTiling:
        for name in ("min_height", "min_width", "stride_height", "stride_width"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < SPATIAL_FACTOR or value % SPATIAL_FACTOR:
                raise VaeTilingError(f"VAE tile {name}={value!r}; expected a positive multiple "
                                     f"of {SPATIAL_FACTOR} pixels", parameter="tiling")
        if self.stride_height > self.min_height or self.stride_width > self.min_width:
            raise VaeTilingError(f"VAE tile strides {self.stride_height}x{self.stride_width} "
                                 f"exceed the tile {self.min_height}x{self.min_width}; expected "
                                 "overlapping tiles", parameter="tiling")
        return self

    def applies(self, latent_height: int, latent_width: int) -> bool:
        """diffusers tiles only latents larger than one tile."""
        return (latent_width > self.min_width // SPATIAL_FACTOR
                or latent_height > self.min_height // SPATIAL_FACTOR)


class VaeDecoder:
    """The decoder's frame loop: ``[1, C, F, h, w]`` latents to ``[1, 3, 4F-3, 8h, 8w]``
    video, not clamped."""

    def __init__(self, first: ModelManifest, following: ModelManifest, backend: str,
                 config: dict[str, Any] | None = None) -> None:
        self._first = GraphRunner(first, backend, config)
        self._following = GraphRunner(following, backend, config)

    def __call__(self, latents: np.ndarray) -> np.ndarray:
        frames, *caches = self._first({"latents": np.ascontiguousarray(latents[:, :, :1])})
        video = [frames]
        for k in range(1, latents.shape[2]):
            feeds = {"latents": np.ascontiguousarray(latents[:, :, k:k + 1])}
            feeds.update({f"caches_{i}": cache for i, cache in enumerate(caches)})
            frames, *caches = self._following(feeds)
            video.append(frames)
        return np.concatenate(video, axis=2)


TileDecoder = Callable[[Sequence[np.ndarray]], list[np.ndarray]]


def tiles_of(latents: np.ndarray, tiling: VaeTiling) -> list[list[np.ndarray]]:
    """The latent tiles, row by row (diffusers' grid: a tile every stride, cut at the edge)."""
    height, width = latents.shape[3:]
    size_h, size_w = tiling.min_height // SPATIAL_FACTOR, tiling.min_width // SPATIAL_FACTOR
    step_h, step_w = tiling.stride_height // SPATIAL_FACTOR, tiling.stride_width // SPATIAL_FACTOR
    return [[np.ascontiguousarray(latents[:, :, :, i:i + size_h, j:j + size_w])
             for j in range(0, width, step_w)] for i in range(0, height, step_h)]


def _blend_v(a: np.ndarray, b: np.ndarray, extent: int) -> np.ndarray:
    extent = min(a.shape[-2], b.shape[-2], extent)
    for y in range(extent):
        b[:, :, :, y, :] = a[:, :, :, -extent + y, :] * (1 - y / extent) + b[:, :, :, y, :] * (
            y / extent)
    return b


def _blend_h(a: np.ndarray, b: np.ndarray, extent: int) -> np.ndarray:
    extent = min(a.shape[-1], b.shape[-1], extent)
    for x in range(extent):
        b[:, :, :, :, x] = a[:, :, :, :, -extent + x] * (1 - x / extent) + b[:, :, :, :, x] * (
            x / extent)
    return b


def decode_video(
    decoder: Callable[[np.ndarray], np.ndarray] | None, latents: np.ndarray,
    tiling: VaeTiling | None = None, decode_tiles: TileDecoder | None = None,
) -> np.ndarray:
    """``[1, 3, T, H, W]`` video in [-1, 1]: whole, or tiled as diffusers tiles when
    ``tiling`` is given and the latents exceed one tile. ``decode_tiles`` decodes a list of
    tiles (default: one after the other with ``decoder``; on workers:
    ``decode_tiles_on_workers``)."""
    if tiling is None or not tiling.applies(*latents.shape[3:]):
        return np.clip(decoder(latents), -1.0, 1.0)
    grid = tiles_of(latents, tiling)
    flat = [tile for row in grid for tile in row]
    decoded = (decode_tiles or (lambda tiles: [decoder(t) for t in tiles]))(flat)
    rows, k = [], 0
    for row in grid:
        rows.append(decoded[k:k + len(row)])
        k += len(row)
    blend_h = tiling.min_height - tiling.stride_height
    blend_w = tiling.min_width - tiling.stride_width
    result_rows = []
    for i, row in enumerate(rows):
        result_row = []
        for j, tile in enumerate(row):
            if i > 0:
                tile = _blend_v(rows[i - 1][j], tile, blend_h)
            if j > 0:
                tile = _blend_h(row[j - 1], tile, blend_w)
            result_row.append(tile[:, :, :, :tiling.stride_height, :tiling.stride_width])
        result_rows.append(np.concatenate(result_row, axis=-1))
    height, width = (s * SPATIAL_FACTOR for s in latents.shape[3:])
    video = np.concatenate(result_rows, axis=3)[:, :, :, :height, :width]
    return np.clip(video, -1.0, 1.0)


def to_frames(video: np.ndarray) -> np.ndarray:
    """``[1, 3, F, H, W]`` in [-1, 1] to ``[F, H, W, 3]`` in [0, 1] (diffusers' postprocess)."""
    return np.clip(video[0].transpose(1, 2, 3, 0) / 2 + 0.5, 0.0, 1.0).astype(np.float32)


def vae_memory(component: ModelManifest, latent: Sequence[int],
               tiling: VaeTiling | None = None) -> dict[str, int]:
    """The decoder's caches (in, out and the layer at work) and the decoded video, in bytes."""
    _, _, frames, height, width = latent
    pixels = 3 * ((frames - 1) * TEMPORAL_FACTOR + 1) * height * width * SPATIAL_FACTOR**2
    if tiling is not None and tiling.applies(height, width):
        height = min(height, tiling.min_height // SPATIAL_FACTOR)
        width = min(width, tiling.min_width // SPATIAL_FACTOR)
    channels = [int(spec[1]) for name, spec in component.inputs.items()
                if name.startswith("caches_")]
    factors = component.config.get("spatial_factors", [1] * len(channels))
    caches = sum(c * 2 * (f * height) * (f * width) * 4
                 for c, f in zip(channels, factors, strict=False))
    return {"vae_caches": 3 * caches, "video": pixels * 4 * 3}


# -- tiles on two workers ---------------------------------------------------------------------


@dataclass(frozen=True)
class _TileJob:
    first_dir: str
    next_dir: str
    backend: str
    tiles: list[np.ndarray]


def _decode_tiles_rank(context: Any, job: _TileJob) -> list[np.ndarray]:
    decoder = VaeDecoder(read_manifest(job.first_dir), read_manifest(job.next_dir),
                         job.backend, context.openvino_config())
    return [decoder(tile) for tile in job.tiles]


def decode_tiles_on_workers(
    plan: BindingPlan, first: ModelManifest, following: ModelManifest, backend: str
) -> TileDecoder:
    """A ``decode_tiles`` that gives rank r the tiles r, r + n, ... of the plan's n workers."""
    from numaov.runtime.workers import run_on_ranks

    def decode(tiles: Sequence[np.ndarray]) -> list[np.ndarray]:
        n = plan.world_size
        jobs = [_TileJob(str(first.directory), str(following.directory), backend,
                         list(tiles[r::n])) for r in range(n)]
        results = run_on_ranks(plan, _decode_tiles_rank, jobs)
        decoded: list[np.ndarray] = [np.empty(0)] * len(tiles)
        for r, mine in enumerate(results):
            decoded[r::n] = mine
        return decoded

    return decode

"""Decoding Wan latents to video with the exported VAE decoder, whole or in tiles.

The decoder is two graphs (``numaov.models.wan.components``): the first latent frame, then
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

Wan 2.2's VAE (TI2V-5B: 48 latent channels, ``patch_size=2``, 16x spatial) decodes to
``3 * 2 * 2`` channels at half the video's size, which diffusers' ``unpatchify`` turns into
RGB at the end. diffusers tiles that VAE in those patched units (tile, stride and blend
extents divided by the patch size) and unpatchifies after blending; ``VaeGeometry`` carries
the two factors, and tiling and the final unpatchify here follow the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from numaov import NumaovError
from numaov.runtime.manifest_reader import ModelManifest, read_manifest
from numaov.runtime.placement.binding import BindingPlan
from numaov.runtime.wan.chunk_loop import ChunkLoop

# Wan 2.1's VAE, for exports that record no factors; Wan 2.2's is 16x spatial, the built-in
# digits-wan's 4x (VaeGeometry reads the exported config).
SPATIAL_FACTOR = 8
TEMPORAL_FACTOR = 4


# The OpenVINO requests of a decode (first frame, then two taking turns) hold intermediate
# buffers of about 6.5 sets of caches beyond the caches themselves: measured 6.3-6.7 on the
# tiny test VAE at 512x512 and on Wan 2.1's published VAE (base_dim 96) at 256x256 (f32),
# each a whole decode's growth of resident memory against vae_memory's cache set; the
# published VAE at bf16 grew 2.80 GiB for 17x256x256 and 15.0 GiB for 33x480x832 against
# 2.77 and 17.0 estimated in bf16 elements.
VAE_WORK_CACHE_SETS = 6.5


@dataclass(frozen=True)
class VaeGeometry:
    """Pixels per latent (``scale_factor_spatial``), the decoder's output patch
    (``patch_size``: 1, or Wan 2.2's 2, unpatchified at the end) and video frames per latent
    frame after the first (``scale_factor_temporal``)."""

    spatial: int = SPATIAL_FACTOR
    patch: int = 1
    temporal: int = TEMPORAL_FACTOR

    @classmethod
    def of(cls, component: ModelManifest) -> VaeGeometry:
        """A VAE decoder graph's geometry, from its manifest (exports before Wan 2.2 record
        no factors: Wan 2.1's 8x, 4x and no patch)."""
        config = component.config
        return cls(int(config.get("scale_factor_spatial") or SPATIAL_FACTOR),
                   int(config.get("patch_size") or 1),
                   int(config.get("scale_factor_temporal") or TEMPORAL_FACTOR))

    def unpatchify(self, video: np.ndarray) -> np.ndarray:
        """``[B, C*p*p, T, h, w]`` to ``[B, C, T, h*p, w*p]``, as diffusers' ``unpatchify``."""
        p = self.patch
        if p == 1:
            return video
        b, c, t, h, w = video.shape
        x = video.reshape(b, c // (p * p), p, p, t, h, w).transpose(0, 1, 4, 5, 3, 6, 2)
        return np.ascontiguousarray(x.reshape(b, c // (p * p), t, h * p, w * p))


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

    def applies(self, latent_height: int, latent_width: int,
                geometry: VaeGeometry = VaeGeometry()) -> bool:
        """diffusers tiles only latents larger than one tile."""
        return (latent_width > self.min_width // geometry.spatial
                or latent_height > self.min_height // geometry.spatial)


class VaeDecoder:
    """The decoder's frame loop: ``[1, C, F, h, w]`` latents to ``[1, 3*p*p, 4F-3, s*h/p,
    s*w/p]`` video (``s``, ``p``: its ``geometry``; Wan 2.1: ``[1, 3, 4F-3, 8h, 8w]``), not
    clamped and not unpatchified: one latent frame a call (``chunk_loop.ChunkLoop``)."""

    def __init__(self, first: ModelManifest, following: ModelManifest, backend: str,
                 config: dict[str, Any] | None = None) -> None:
        self.geometry = VaeGeometry.of(first)
        self._loop = ChunkLoop(first, following, backend, config)

    def __call__(self, latents: np.ndarray) -> np.ndarray:
        return self._loop([latents[:, :, k:k + 1] for k in range(latents.shape[2])])


TileDecoder = Callable[[Sequence[np.ndarray]], list[np.ndarray]]


def tiles_of(latents: np.ndarray, tiling: VaeTiling,
             geometry: VaeGeometry = VaeGeometry()) -> list[list[np.ndarray]]:
    """The latent tiles, row by row (diffusers' grid: a tile every stride, cut at the edge)."""
    height, width = latents.shape[3:]
    s = geometry.spatial
    size_h, size_w = tiling.min_height // s, tiling.min_width // s
    step_h, step_w = tiling.stride_height // s, tiling.stride_width // s
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
    geometry: VaeGeometry = VaeGeometry(),
) -> np.ndarray:
    """``[1, 3, T, H, W]`` video in [-1, 1]: whole, or tiled as diffusers tiles when
    ``tiling`` is given and the latents exceed one tile. ``decode_tiles`` decodes a list of
    tiles (default: one after the other with ``decoder``; on workers:
    ``decode_tiles_on_workers``); ``geometry`` is the decoder's (``VaeGeometry.of``)."""
    if tiling is None or not tiling.applies(*latents.shape[3:], geometry):
        video = geometry.unpatchify(decoder(latents))
        return np.clip(video, -1.0, 1.0, out=video)  # in place: a video is hundreds of MB
    grid = tiles_of(latents, tiling, geometry)
    flat = [tile for row in grid for tile in row]
    decoded = (decode_tiles or (lambda tiles: [decoder(t) for t in tiles]))(flat)
    rows, k = [], 0
    for row in grid:
        rows.append(decoded[k:k + len(row)])
        k += len(row)
    # Blending and cropping in the decoder's patched units, as diffusers' tiled_decode.
    p = geometry.patch
    stride_h, stride_w = tiling.stride_height // p, tiling.stride_width // p
    blend_h, blend_w = tiling.min_height // p - stride_h, tiling.min_width // p - stride_w
    result_rows = []
    for i, row in enumerate(rows):
        result_row = []
        for j, tile in enumerate(row):
            if i > 0:
                tile = _blend_v(rows[i - 1][j], tile, blend_h)
            if j > 0:
                tile = _blend_h(row[j - 1], tile, blend_w)
            result_row.append(tile[:, :, :, :stride_h, :stride_w])
        result_rows.append(np.concatenate(result_row, axis=-1))
    height, width = (n * geometry.spatial // p for n in latents.shape[3:])
    video = np.concatenate(result_rows, axis=3)[:, :, :, :height, :width]
    return np.clip(geometry.unpatchify(video), -1.0, 1.0)


def to_frames(video: np.ndarray) -> np.ndarray:
    """``[1, 3, F, H, W]`` in [-1, 1] to ``[F, H, W, 3]`` in [0, 1] (diffusers' postprocess),
    in one new array (no temporaries of the video's size)."""
    frames = np.empty(video.shape[2:] + video.shape[1:2], np.float32)
    np.multiply(video[0].transpose(1, 2, 3, 0), 0.5, out=frames)
    frames += 0.5
    return np.clip(frames, 0.0, 1.0, out=frames)


def vae_memory(component: ModelManifest, latent: Sequence[int],
               tiling: VaeTiling | None = None) -> dict[str, int]:
    """The decoder's caches (in, out and the layer at work), its requests' working memory
    and the decoded video, in bytes."""
    _, _, frames, height, width = latent
    geometry = VaeGeometry.of(component)
    pixels = 3 * ((frames - 1) * geometry.temporal + 1) * height * width * geometry.spatial**2
    if tiling is not None and tiling.applies(height, width, geometry):
        height = min(height, tiling.min_height // geometry.spatial)
        width = min(width, tiling.min_width // geometry.spatial)
    channels = [int(spec[1]) for name, spec in component.inputs.items()
                if name.startswith("caches_")]
    factors = component.config.get("spatial_factors", [1] * len(channels))
    # A bf16 decoder's caches and intermediate buffers are bf16 (measured with the published
    # VAE, bf16, 33x480x832 untiled: 15.0 GiB grown for this estimate's 17.0; counting 4 bytes
    # made it 33.8 GiB and refused the video on a 24 GiB machine).
    element = 2 if component.inference_precision == "bf16" else 4
    caches = sum(c * 2 * (f * height) * (f * width) * element
                 for c, f in zip(channels, factors, strict=False))
    return {"vae_caches": 3 * caches, "vae_work": int(VAE_WORK_CACHE_SETS * caches),
            "video": pixels * (2 * 4 + 1)}


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
    from numaov.runtime.placement.workers import run_on_ranks

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

"""The image conditioning of Wan image-to-video (``run wan --image FILE``), built from the
exported VAE encoder as diffusers' ``WanImageToVideoPipeline.prepare_latents`` builds it.

The image is read by ``image_input.read_image`` (RGB in [-1, 1] at the video's size). Then,
by the pipeline the export came from:

- **first frame** (``expand_timesteps``, Wan 2.2 TI2V): the image alone is encoded (the
  encoder's first chunk, ``vae_encoder``); its latents are the first latent frame at every
  step, at timestep 0 (``TimestepLayout.first_frame``).
- **condition channels** (``WanImageToVideoPipeline`` without ``expand_timesteps``: Wan 2.2
  I2V A14B): the image followed by ``frames - 1`` zero frames is encoded, the first frame by
  ``vae_encoder`` and each later chunk of 4 by ``vae_encoder_next`` with the caches the chunk
  before left (``ImageEncoder``, diffusers' ``_encode`` loop); the graphs normalise with the
  VAE's latents mean and std. In front go ``t`` mask channels (``first_frame_mask``, ``t``
  the VAE's temporal factor): ``[1, t + C, F', h, w]``, concatenated after the noisy latents
  in every model input (``TimestepLayout.channels``), so the transformer takes ``2C + t``
  channels (36 for Wan 2.2 I2V) and predicts the latents' ``C``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from numaov.runtime.manifest_reader import ModelManifest
from numaov.runtime.wan.chunk_loop import ChunkLoop
from numaov.runtime.wan.graph_runner import GraphRunner

# Video frames per later chunk of diffusers' _encode loop (its two 2x temporal downsamplers).
CHUNK_FRAMES = 4


def first_frame_mask(frames: int, temporal: int, height: int, width: int) -> np.ndarray:
    """diffusers' ``mask_lat_size`` for a video of ``frames`` whose first frame is given:
    ``[1, temporal, F', height, width]`` f32. Per video frame 1 on the first and 0 on the
    others; the first repeated ``temporal`` times, so the frames fold into latent frames of
    ``temporal`` channels each (latent frame 0 all ones, the others zeros)."""
    per_frame = np.zeros(frames + temporal - 1, dtype=np.float32)
    per_frame[:temporal] = 1.0
    folded = per_frame.reshape(-1, temporal).T  # [temporal, F']: diffusers' view + transpose
    shape = (1, temporal, folded.shape[1], height, width)
    return np.ascontiguousarray(np.broadcast_to(folded[None, :, :, None, None], shape))


@dataclass(frozen=True)
class ImageCondition:
    """What the image gives the sampler: ``first_frame`` ``[1, C, 1, h, w]`` (Wan 2.2 TI2V)
    or ``channels`` ``[1, t + C, F', h, w]`` (Wan 2.2 I2V), the other None."""

    first_frame: np.ndarray | None = None
    channels: np.ndarray | None = None


class ImageEncoder:
    """The exported VAE encoder of a pipeline: ``first`` (``vae_encoder``) alone gives the
    first frame's latents; with ``following`` (``vae_encoder_next``) it runs the encoder's
    chunk loop (``chunk_loop.ChunkLoop``) over the image and zero frames and gives the
    condition channels."""

    def __init__(self, first: ModelManifest, following: ModelManifest | None, backend: str,
                 temporal: int, config: dict[str, Any] | None = None) -> None:
        self._first = GraphRunner(first, backend, config) if following is None else None
        self._loop = (None if following is None else
                      ChunkLoop(first, following, backend, config, inputs=("image", "video")))
        self._temporal = temporal

    def __call__(self, image: np.ndarray, frames: int) -> ImageCondition:
        """``image`` ``[1, 3, 1, H, W]`` in [-1, 1] for a video of ``frames`` (``4k + 1``)."""
        if self._loop is None:
            latents, *_caches = self._first({"image": np.ascontiguousarray(image)})
            return ImageCondition(first_frame=latents)
        # diffusers encodes torch.cat([image, zeros]): every later chunk is zeros, so one
        # chunk of zeros serves them all.
        zeros = np.zeros((*image.shape[:2], CHUNK_FRAMES, *image.shape[3:]), dtype=np.float32)
        chunks = [image, *[zeros] * ((frames - 1) // CHUNK_FRAMES)]
        condition = self._loop(chunks)  # [1, C, F', h, w]
        mask = first_frame_mask(frames, self._temporal, *condition.shape[3:])
        return ImageCondition(channels=np.ascontiguousarray(
            np.concatenate([mask, condition], axis=1)))

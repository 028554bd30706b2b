"""Reading the conditioning image of image-to-video (``run wan --image FILE``, the service's
``input_reference``).

The image is taken at the video's size exactly: diffusers' ``VideoProcessor.preprocess``
resizes to the requested height and width (a no-op at that size), and numaov resizes nothing
silently, so another size is an error naming both. It becomes what diffusers feeds the VAE
encoder: RGB, ``x / 255 * 2 - 1`` in f32, ``[1, 3, 1, H, W]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import numpy as np

from numaov import NumaovError


class ImageInputError(NumaovError):
    """An image that cannot be read, or not of the video's size."""


def read_image(source: str | Path | BinaryIO, height: int, width: int,
               name: str | None = None) -> np.ndarray:
    """``source`` (a file name, or an open binary file such as a request's decoded bytes) as
    ``[1, 3, 1, height, width]`` f32 in [-1, 1]. Errors call it ``name`` (default: its path)."""
    from PIL import Image, UnidentifiedImageError

    what = name or repr(str(source))
    try:
        with Image.open(source if hasattr(source, "read") else Path(source)) as image:
            size = image.size
            rgb = np.asarray(image.convert("RGB"), dtype=np.float32)
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        raise ImageInputError(f"cannot read {what} as an image ({exc}); expected a PNG, JPEG "
                              "or WebP file", parameter="image") from exc
    if size != (width, height):
        raise ImageInputError(
            f"image {what} is {size[0]}x{size[1]} pixels; expected the video's "
            f"{width}x{height} (width x height)", parameter="image")
    pixels = rgb / np.float32(255.0) * np.float32(2.0) - np.float32(1.0)
    return np.ascontiguousarray(pixels.transpose(2, 0, 1)[None, :, None])

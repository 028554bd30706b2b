"""Reading the conditioning image of image-to-video (``run wan --image FILE``, the service's
``input_reference``).

The image is taken at the video's size exactly: diffusers' ``VideoProcessor.preprocess``
resizes to the requested height and width (a no-op at that size), and numaov resizes nothing
silently, so another size is an error naming both. It becomes what diffusers feeds the VAE
encoder: RGB, ``x / 255 * 2 - 1`` in f32, ``[1, 3, 1, H, W]``. An image decoded once (the
service decodes ``input_reference`` to check it before it queues) is passed on as that array
(:func:`image_pixels`), not decoded again.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import numpy as np

from numaov import NumaovError


class ImageInputError(NumaovError):
    """An image that cannot be read, or not of the video's size."""


FORMATS = ("PNG", "JPEG", "WEBP")


def read_image(source: str | Path | BinaryIO, height: int, width: int,
               name: str | None = None) -> np.ndarray:
    """``source`` (a file name, or an open binary file such as a request's decoded bytes) as
    ``[1, 3, 1, height, width]`` f32 in [-1, 1]. Errors call it ``name`` (default: its path).
    The size is checked from the header, before any pixel is decoded."""
    from PIL import Image, UnidentifiedImageError

    is_file = hasattr(source, "read")
    what = name or repr(str(source))
    try:
        with Image.open(source if is_file else Path(source), formats=FORMATS) as image:
            if image.size != (width, height):
                raise ImageInputError(
                    f"image {what} is {image.size[0]}x{image.size[1]} pixels; expected the "
                    f"video's {width}x{height} (width x height)", parameter="image")
            rgb = np.asarray(image.convert("RGB"), dtype=np.float32)
    except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as exc:
        # PIL's message for an open file names the object (and its address): left out
        cause = "" if is_file else f" ({exc})"
        raise ImageInputError(f"cannot read {what} as an image{cause}; expected a PNG, JPEG "
                              "or WebP file", parameter="image") from exc
    pixels = rgb / np.float32(255.0) * np.float32(2.0) - np.float32(1.0)
    return np.ascontiguousarray(pixels.transpose(2, 0, 1)[None, :, None])


def image_pixels(image: str | Path | BinaryIO | np.ndarray, height: int, width: int,
                 name: str | None = None) -> np.ndarray:
    """The pixels of ``image``: a file read by :func:`read_image`, or an array it returned
    (checked to be of the video's size)."""
    if not isinstance(image, np.ndarray):
        return read_image(image, height, width, name)
    if image.shape[:3] != (1, 3, 1) or image.ndim != 5 or image.dtype != np.float32:
        raise ImageInputError(f"image {name or 'array'} has shape {list(image.shape)} "
                              f"({image.dtype}); expected [1, 3, 1, {height}, {width}] float32 "
                              "as read_image returns", parameter="image")
    if image.shape[3:] != (height, width):
        raise ImageInputError(
            f"image {name or 'array'} is {image.shape[4]}x{image.shape[3]} pixels; expected "
            f"the video's {width}x{height} (width x height)", parameter="image")
    return image

"""Writing a video by the output path's extension.

- ``.mp4``: H.264 (``libx264``, ``yuv420p``) through PyAV. PyAV's wheels carry FFmpeg's
  libraries with the x264 encoder inside, so encoding runs in this process with nothing to
  download or install beside the wheel, and the same library decodes the file back (the
  tests do). imageio would need its ffmpeg plugin, which drives a separate ffmpeg executable
  through a pipe.
- ``.webp`` / ``.gif``: animated, with Pillow (a dependency of diffusers already).
- a directory (a path with no extension, or an existing directory): one PNG per frame,
  ``frame_00000.png``, ... (Pillow).
- ``.npy``: the final latents, not a video (``run wan`` skips the VAE).

Frames come in as diffusers' ``output_type="np"`` gives them: f32 ``[F, H, W, 3]`` in [0, 1];
they are rounded to 8 bits. :func:`write_video` writes a file; :func:`encode_video` returns
the same file's bytes (the service answers with them, nothing written to disk).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import BinaryIO

import numpy as np

from numaov import NumaovError

VIDEO_FORMATS = (".mp4", ".webp", ".gif")
LATENTS_FORMAT = ".npy"
FRAMES_DIR = "png"
DEFAULT_FPS = 16  # Wan's frame rate


class VideoOutputError(NumaovError):
    """An output path that names no known format, or that cannot be written."""


def output_format(path: str | Path) -> str:
    """``".mp4"``, ``".webp"``, ``".gif"``, ``".npy"`` or ``"png"`` (a frame directory) for
    ``path``, checked before any work: a known extension and an existing parent directory."""
    path = Path(path)
    if path.is_dir():
        kind = FRAMES_DIR
    elif path.suffix == "":
        kind = FRAMES_DIR
    elif path.suffix.lower() in (*VIDEO_FORMATS, LATENTS_FORMAT):
        kind = path.suffix.lower()
    else:
        raise VideoOutputError(
            f"output {str(path)!r} has the unknown extension {path.suffix!r}; expected "
            f"{', '.join((*VIDEO_FORMATS, LATENTS_FORMAT))} or a directory for PNG frames",
            parameter="out",
        )
    if kind == FRAMES_DIR and path.is_dir() and any(path.iterdir()):
        raise VideoOutputError(
            f"output directory {str(path)!r} is not empty; expected a new or empty directory "
            "for the PNG frames", parameter="out",
        )
    if not path.parent.is_dir():
        raise VideoOutputError(
            f"the directory of output {str(path)!r} does not exist; expected a path in an "
            "existing directory", parameter="out",
        )
    return kind


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """``[F, H, W, 3]`` floats in [0, 1] as 8-bit frames (rounded, as PIL's conversion), a
    frame at a time (temporaries of the whole video's size would double its memory)."""
    pixels = np.empty(frames.shape, np.uint8)
    for k, frame in enumerate(frames):
        pixels[k] = np.clip(np.round(frame * 255.0), 0, 255)
    return pixels


def _pixels(frames: np.ndarray, fps: int) -> np.ndarray:
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise VideoOutputError(f"frames of shape {list(frames.shape)}; expected [F, H, W, 3]")
    if not (isinstance(fps, int) and fps > 0):
        raise VideoOutputError(f"fps={fps!r}; expected a positive integer", parameter="fps")
    return to_uint8(frames)


def encode_video(frames: np.ndarray, kind: str, fps: int = DEFAULT_FPS) -> bytes:
    """``[F, H, W, 3]`` frames in [0, 1] as the bytes of a ``kind`` file: ``".mp4"``,
    ``".webp"``, ``".gif"``, or ``".png"`` (one frame: ``F`` must be 1)."""
    pixels = _pixels(frames, fps)
    buffer = io.BytesIO()
    if kind == ".mp4":
        _write_mp4(pixels, buffer, fps)
    elif kind in (".webp", ".gif"):
        _write_animation(pixels, buffer, fps, kind)
    elif kind == ".png" and len(pixels) == 1:
        from PIL import Image

        Image.fromarray(pixels[0]).save(buffer, format="PNG")
    else:
        raise VideoOutputError(f"cannot encode {len(pixels)} frame(s) as {kind!r}; expected "
                               f"{', '.join(VIDEO_FORMATS)}, or .png for one frame",
                               parameter="format")
    return buffer.getvalue()


def write_video(frames: np.ndarray, path: str | Path, fps: int = DEFAULT_FPS) -> str:
    """Write ``[F, H, W, 3]`` frames in [0, 1] to ``path`` by its format; returns the format."""
    kind = output_format(path)
    pixels = _pixels(frames, fps)
    path = Path(path)
    try:
        if kind == ".mp4":
            _write_mp4(pixels, path, fps)
        elif kind in (".webp", ".gif"):
            _write_animation(pixels, path, fps, kind)
        elif kind == FRAMES_DIR:
            from PIL import Image

            path.mkdir(exist_ok=True)
            for i, frame in enumerate(pixels):
                Image.fromarray(frame).save(path / f"frame_{i:05d}.png")
        else:
            raise VideoOutputError(f"{str(path)!r} is a latents file, not a video")
    except OSError as exc:
        raise VideoOutputError(f"cannot write {str(path)!r} ({exc})", parameter="out") from exc
    return kind


def _write_mp4(pixels: np.ndarray, target: Path | BinaryIO, fps: int) -> None:
    import av

    where = str(target) if isinstance(target, Path) else target
    with av.open(where, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = int(pixels.shape[2]), int(pixels.shape[1])
        stream.pix_fmt = "yuv420p"  # what players expect; needs even sizes (Wan's are x16)
        stream.options = {"crf": "18"}
        for frame in pixels:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _write_animation(pixels: np.ndarray, target: Path | BinaryIO, fps: int,
                     kind: str) -> None:
    from PIL import Image

    images = [Image.fromarray(frame) for frame in pixels]
    options = {"lossless": True} if kind == ".webp" else {}
    images[0].save(target, format=kind[1:].upper(), save_all=True, append_images=images[1:],
                   duration=round(1000 / fps), loop=0, **options)

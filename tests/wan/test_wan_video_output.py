"""Video files by extension: written and decoded back (PyAV for H.264, Pillow for the rest)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from numaov.runtime.wan.video_output import VideoOutputError, output_format, to_uint8, write_video

# 5 frames at 32x48 (H x W): odd count, non-square.
FRAMES = np.random.default_rng(0).uniform(0, 1, (5, 32, 48, 3)).astype(np.float32)


def test_mp4_is_h264_with_every_frame(tmp_path: Path) -> None:
    import av

    write_video(FRAMES, tmp_path / "v.mp4", fps=8)
    with av.open(str(tmp_path / "v.mp4")) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        assert stream.average_rate == 8
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
    assert decoded.shape == (5, 32, 48, 3)


@pytest.mark.parametrize("suffix", [".webp", ".gif"])
def test_animations_hold_every_frame(tmp_path: Path, suffix: str) -> None:
    from PIL import Image

    write_video(FRAMES, tmp_path / f"v{suffix}")
    with Image.open(tmp_path / f"v{suffix}") as image:
        assert image.n_frames == 5 and image.size == (48, 32)
        if suffix == ".webp":  # lossless: the 8-bit frames come back exactly
            image.seek(3)
            assert np.array_equal(np.asarray(image.convert("RGB")), to_uint8(FRAMES[3]))


def test_png_directory(tmp_path: Path) -> None:
    from PIL import Image

    assert write_video(FRAMES, tmp_path / "frames") == "png"
    names = sorted(p.name for p in (tmp_path / "frames").iterdir())
    assert names == [f"frame_{i:05d}.png" for i in range(5)]
    assert np.array_equal(np.asarray(Image.open(tmp_path / "frames" / names[2])),
                          to_uint8(FRAMES[2]))


def test_bad_outputs_are_named(tmp_path: Path) -> None:
    with pytest.raises(VideoOutputError, match=r"unknown extension '\.avi'.*\.mp4") as info:
        output_format(tmp_path / "v.avi")
    assert info.value.parameter == "out"
    with pytest.raises(VideoOutputError, match="does not exist"):
        output_format(tmp_path / "missing" / "v.mp4")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(VideoOutputError, match="not empty"):
        output_format(tmp_path / "full")
    assert output_format(tmp_path / "v.NPY") == ".npy"

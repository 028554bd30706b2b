"""Wan 2.2 TI2V-5B-style text to video: a tiny pipeline with ``expand_timesteps`` and the
48-channel VAE (residual blocks, 2x2 patches, 16x spatial), exported whole; numaov's frames
against diffusers' WanPipeline, whole and with the VAE tiled."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from wan_pipeline_harness import TI2V_Z_DIM, build_tiny_pipeline

from numaov.exporter.wan_export import export_wan
from numaov.runtime.wan_pipeline import WanSampleRequest
from numaov.runtime.wan_vae import VaeGeometry, VaeTiling
from numaov.runtime.wan_video import VAE_FIRST_FRAME, read_pipeline, run_wan_pipeline

pytestmark = pytest.mark.slow  # exports a whole pipeline

SEED = 7
STEPS = 3
PROMPT, NEGATIVE = "a w1 w2", "w3"
# As in test_wan_pipeline: f32 frames in [0, 1], 1.5e-6 measured on every backend; a wrong
# timestep layout, latent statistics or patch order moves pixels by 1e-2 and more.
F32_FRAME_TOL = 1e-4
# Odd frame counts, non-square: 16x compression makes 32x64 pixels 2x4 latents.
SIZES = ((5, 32, 64), (9, 64, 32))


@pytest.fixture(scope="module")
def ti2v(tmp_path_factory: pytest.TempPathFactory) -> dict:
    print(f"seed {SEED}")
    root = tmp_path_factory.mktemp("wan_ti2v")
    pipe = build_tiny_pipeline(root / "pipeline", seed=SEED, ti2v=True)
    export_wan(root / "pipeline", root / "export")
    return {"root": root, "pipe": pipe, "export": root / "export"}


def _diffusers_frames(pipe, frames: int, height: int, width: int) -> np.ndarray:
    return pipe(PROMPT, negative_prompt=NEGATIVE, num_frames=frames, height=height,
                width=width, num_inference_steps=STEPS, guidance_scale=5.0,
                generator=torch.Generator().manual_seed(SEED), output_type="np").frames[0]


def _request(frames: int, height: int, width: int) -> WanSampleRequest:
    return WanSampleRequest(frames=frames, height=height, width=width, steps=STEPS,
                            guidance=5.0, seed=SEED)


def test_export_takes_per_frame_timesteps_and_the_patched_vae(ti2v: dict) -> None:
    pipeline = read_pipeline(ti2v["export"])
    assert pipeline.components["transformer"].timestep == "per-frame"
    assert VaeGeometry.of(pipeline.components[VAE_FIRST_FRAME]) == VaeGeometry(16, 2)
    assert pipeline.record.config["vae"]["z_dim"] == TI2V_Z_DIM
    for name, component in pipeline.components.items():
        assert all(f["rel_error"] <= f["tolerance"] for f in component.record.parity), name


# OpenVINO at both sizes; the other backends at one (the same graphs).
CASES = [("openvino", SIZES[0]), ("openvino", SIZES[1]), ("onnxruntime", SIZES[0]),
         ("torch", SIZES[0])]


@pytest.mark.parametrize(("backend", "size"), CASES,
                         ids=[f"{b}-{'x'.join(map(str, s))}" for b, s in CASES])
def test_frames_equal_diffusers(ti2v: dict, backend: str, size: tuple, tmp_path) -> None:
    expected = _diffusers_frames(ti2v["pipe"], *size)
    result = run_wan_pipeline(ti2v["export"], _request(*size), PROMPT, tmp_path / "v.gif",
                              negative_prompt=NEGATIVE, backend=backend)
    assert result.frames.shape == expected.shape == (size[0], size[1], size[2], 3)
    assert result.sample.latents.shape == (1, TI2V_Z_DIM, (size[0] - 1) // 4 + 1,
                                           size[1] // 16, size[2] // 16)
    error = float(np.max(np.abs(result.frames - expected)))
    print(f"{backend} {size}: max |numaov - diffusers| = {error:.3g}")
    assert error <= F32_FRAME_TOL


# 64x96 pixels are 4x6 latents; 48-pixel tiles every 32 pixels are 3x3-latent tiles every 2
# latents, blended over 8 patched pixels (diffusers divides tile, stride and blend by the
# patch size 2): a 2 x 3 grid cut at the bottom and right.
TILING = VaeTiling(min_height=48, min_width=48, stride_height=32, stride_width=32)


def test_tiled_vae_equals_diffusers(ti2v: dict, tmp_path) -> None:
    pipe = ti2v["pipe"]
    pipe.vae.enable_tiling(tile_sample_min_height=48, tile_sample_min_width=48,
                           tile_sample_stride_height=32, tile_sample_stride_width=32)
    try:
        expected = _diffusers_frames(pipe, 5, 64, 96)
    finally:
        pipe.vae.disable_tiling()
    untiled = _diffusers_frames(pipe, 5, 64, 96)
    assert float(np.max(np.abs(expected - untiled))) > 10 * F32_FRAME_TOL  # tiling shows
    got = run_wan_pipeline(ti2v["export"], _request(5, 64, 96), PROMPT, tmp_path / "v.gif",
                           negative_prompt=NEGATIVE, vae_tiling=TILING).frames
    error = float(np.max(np.abs(got - expected)))
    print(f"tiled 48-channel VAE: max |numaov - diffusers| = {error:.3g}")
    assert error <= F32_FRAME_TOL


def test_sizes_follow_the_16x_vae(ti2v: dict, tmp_path) -> None:
    from numaov.runtime.wan_pipeline import SamplerInputError

    with pytest.raises(SamplerInputError, match=r"height=40; expected a multiple of 32 "
                                                r"\(VAE factor 16 x patch size 2\)"):
        run_wan_pipeline(ti2v["export"], _request(5, 40, 64), PROMPT, tmp_path / "v.gif")

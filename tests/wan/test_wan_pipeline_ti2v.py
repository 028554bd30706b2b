"""Wan 2.2 TI2V-5B-style text to video: a tiny pipeline with ``expand_timesteps`` and the
48-channel VAE (residual blocks, 2x2 patches, 16x spatial), exported whole; numaov's frames
against diffusers' WanPipeline, whole and with the VAE tiled."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.wan_pipeline_harness import (
    TI2V_Z_DIM,
    diffusers_tiling,
    export_tiny_pipeline,
    export_without,
    wan_prompt_embeds,
    write_image,
)

from numaov.runtime.wan.pipeline import (
    VAE_FIRST_FRAME,
    read_pipeline,
    run_wan_pipeline,
)
from numaov.runtime.wan.request import WanSampleRequest
from numaov.runtime.wan.vae import VaeGeometry, VaeTiling

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
def ti2v(tmp_path_factory: pytest.TempPathFactory, wan_pipeline_exported: dict) -> dict:
    # the text encoder is the shared pipeline's
    return export_tiny_pipeline(tmp_path_factory.mktemp("wan_ti2v"), SEED,
                                reuse=wan_pipeline_exported["export"], ti2v=True)


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
    with diffusers_tiling(pipe, TILING):
        expected = _diffusers_frames(pipe, 5, 64, 96)
    untiled = _diffusers_frames(pipe, 5, 64, 96)
    assert float(np.max(np.abs(expected - untiled))) > 10 * F32_FRAME_TOL  # tiling shows
    got = run_wan_pipeline(ti2v["export"], _request(5, 64, 96), PROMPT, tmp_path / "v.gif",
                           negative_prompt=NEGATIVE, vae_tiling=TILING).frames
    error = float(np.max(np.abs(got - expected)))
    print(f"tiled 48-channel VAE: max |numaov - diffusers| = {error:.3g}")
    assert error <= F32_FRAME_TOL


def test_sizes_follow_the_16x_vae(ti2v: dict, tmp_path) -> None:
    from numaov.runtime.wan.request import SamplerInputError

    with pytest.raises(SamplerInputError, match=r"height=40; expected a multiple of 32 "
                                                r"\(VAE factor 16 x patch size 2\)"):
        run_wan_pipeline(ti2v["export"], _request(5, 40, 64), PROMPT, tmp_path / "v.gif")


# -- image to video (diffusers' WanImageToVideoPipeline with expand_timesteps) ----------------


def _diffusers_i2v_frames(pipe, image_path, frames: int, height: int, width: int) -> np.ndarray:
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    i2v = WanImageToVideoPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder,
                                  vae=pipe.vae, scheduler=pipe.scheduler,
                                  transformer=pipe.transformer, expand_timesteps=True)
    embeds, negative = wan_prompt_embeds(pipe, PROMPT, NEGATIVE)
    with Image.open(image_path) as image:
        return i2v(image.convert("RGB"), prompt_embeds=embeds, negative_prompt_embeds=negative,
                   num_frames=frames,
                   height=height, width=width, num_inference_steps=STEPS, guidance_scale=5.0,
                   generator=torch.Generator().manual_seed(SEED), output_type="np").frames[0]


def test_image_encoder_is_exported_with_parity(ti2v: dict) -> None:
    encoder = read_pipeline(ti2v["export"]).components["vae_encoder"]
    assert {f["backend"] for f in encoder.record.parity} == {"onnxruntime", "openvino"}
    assert all(f["rel_error"] <= f["tolerance"] for f in encoder.record.parity)


@pytest.mark.parametrize(("backend", "size"), [("openvino", SIZES[1]), ("torch", SIZES[0])],
                         ids=["openvino-9x64x32", "torch-5x32x64"])
def test_image_to_video_equals_diffusers(ti2v: dict, backend: str, size: tuple,
                                         tmp_path) -> None:
    frames, height, width = size
    image = write_image(tmp_path / "first.png", height, width)
    expected = _diffusers_i2v_frames(ti2v["pipe"], image, *size)
    got = run_wan_pipeline(ti2v["export"], _request(*size), PROMPT, tmp_path / "v.gif",
                           negative_prompt=NEGATIVE, backend=backend, image=image)
    text_only = _diffusers_frames(ti2v["pipe"], *size)
    # The image changes the video, so equality with diffusers' image-to-video is a real check.
    assert float(np.max(np.abs(expected - text_only))) > 10 * F32_FRAME_TOL
    assert "vae_encode" in got.seconds
    error = float(np.max(np.abs(got.frames - expected)))
    print(f"image to video, {backend} {size}: max |numaov - diffusers| = {error:.3g}")
    assert error <= F32_FRAME_TOL


def test_bad_images_are_one_line_errors(ti2v: dict, tmp_path) -> None:
    import subprocess
    import sys

    run = [sys.executable, "-m", "numaov.cli", "run", "wan", "--model-dir", str(ti2v["export"]),
           "--prompt", "a", "--frames", "5", "--height", "32", "--width", "64", "--steps", "1",
           "--guidance", "5", "--seed", "0", "--out", str(tmp_path / "v.gif")]
    proc = subprocess.run([*run, "--image", str(write_image(tmp_path / "small.png", 32, 32))],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"numaov: error: --image: image {str(tmp_path / 'small.png')!r} is 32x32 pixels; "
        "expected the video's 64x32 (width x height)"]
    from numaov.runtime.wan.image_input import ImageInputError
    from numaov.runtime.wan.request import SamplerInputError

    (tmp_path / "broken.png").write_bytes(b"not an image")
    with pytest.raises(ImageInputError, match="cannot read .*broken.png.* as an image"):
        run_wan_pipeline(ti2v["export"], _request(5, 32, 64), PROMPT, tmp_path / "v.gif",
                         image=tmp_path / "broken.png")
    # An export without the encoder (as every text-to-video-only pipeline's) refuses --image.
    text_only = export_without(ti2v["export"], tmp_path / "export", "vae_encoder")
    with pytest.raises(SamplerInputError, match="has no image conditioning"):
        run_wan_pipeline(text_only, _request(5, 32, 64), PROMPT, tmp_path / "v.gif",
                         image=tmp_path / "small.png")


def test_served_videos_take_the_first_frame_as_input_reference(ti2v: dict, tmp_path) -> None:
    """`numaov serve` on the TI2V export: ``input_reference`` (base64, or a data URL with
    MIME line breaks) gives the frames ``run_wan_pipeline(image=...)`` gives; a reference of
    another size, or one that is not an image, is a 400 naming the field before anything
    runs."""
    import base64
    import io

    import httpx
    from PIL import Image, ImageSequence
    from support.service_harness import start_server, stop_server

    from numaov.runtime.wan.video_output import to_uint8

    frames, height, width = SIZES[0]
    image = write_image(tmp_path / "first.png", height, width)
    encoded = base64.b64encode(image.read_bytes()).decode("ascii")
    direct = to_uint8(run_wan_pipeline(ti2v["export"], _request(*SIZES[0]), PROMPT,
                                       tmp_path / "direct.gif", negative_prompt=NEGATIVE,
                                       image=image).frames)
    body = {"prompt": PROMPT, "negative_prompt": NEGATIVE, "size": f"{width}x{height}",
            "frames": frames, "steps": STEPS, "guidance": 5.0, "seed": SEED, "format": "webp"}

    def frames_of(response: httpx.Response) -> np.ndarray:
        assert response.status_code == 200, response.text
        webp = Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"])))
        return np.stack([np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(webp)])

    # the synchronous form: the answer carries the frames compared below
    server, url = start_server(ti2v["export"], "", "--sync-videos")
    try:
        with httpx.Client(base_url=url, timeout=600) as client:
            wrapped = "\n".join(encoded[i:i + 76] for i in range(0, len(encoded), 76))
            for reference in (encoded, f"data:image/png;base64,{wrapped}"):
                got = frames_of(client.post("/v1/videos",
                                            json={**body, "input_reference": reference}))
                assert got.shape == direct.shape
                assert int(np.max(np.abs(got.astype(int) - direct.astype(int)))) <= 1
            text_only = frames_of(client.post("/v1/videos", json=body))
            assert int(np.max(np.abs(text_only.astype(int) - direct.astype(int)))) > 8
            small = base64.b64encode(write_image(tmp_path / "small.png", 32, 32).read_bytes())
            for reference, message in (
                    (small.decode("ascii"), "input_reference is 32x32 pixels; expected the "
                                            f"video's {width}x{height}"),
                    (base64.b64encode(b"not an image").decode("ascii"),
                     "cannot read input_reference as an image"),
                    ("%%%", "expected a PNG, JPEG or WebP image as base64"),
                    (7, "expected a PNG, JPEG or WebP image as base64")):
                response = client.post("/v1/videos", json={**body, "input_reference": reference})
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["param"] == "input_reference" and message in error["message"], error
    finally:
        stop_server(server)

"""Wan 2.2 I2V A14B-style image to video: a tiny ``WanImageToVideoPipeline`` directory (no
image encoder; two experts switched at ``boundary_ratio``; transformers taking 16 latent, 4
mask and 16 condition channels) exported through the CLI; numaov's frames against diffusers'
``WanImageToVideoPipeline`` on every backend and on two workers, and the one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support.wan_pipeline_harness import (
    I2V_IN_CHANNELS,
    build_tiny_pipeline,
    export_without,
    one_line_error,
    wan_prompt_embeds,
    write_image,
)

from numaov.exporter.wan_export import export_wan
from numaov.exporter.wan_pipeline_export import PipelineExportError
from numaov.runtime.wan.image_condition import first_frame_mask
from numaov.runtime.wan.image_input import ImageInputError
from numaov.runtime.wan.pipeline import read_pipeline, run_wan_pipeline
from numaov.runtime.wan.request import SamplerInputError, WanSampleRequest
from numaov.runtime.wan.sampler import run_wan
from numaov.runtime.wan.schedules import DiffusersSchedule

SEED = 11
BOUNDARY = 0.9  # Wan 2.2 I2V A14B's model_index.json
STEPS = 4
PROMPT, NEGATIVE = "a w1 w2", "w3"
CLI = [sys.executable, "-m", "numaov.cli"]
# As in test_wan_pipeline: f32 frames in [0, 1], 2.5e-6 measured on every backend; a wrong
# mask, condition latents (normalisation, cache, chunk order) or expert moves pixels by 1e-2
# and more.
F32_FRAME_TOL = 1e-4
# Odd frame counts, non-square: 9 frames at 48x32 are 3 latent frames of 6x4 (the encoder's
# next-frames graph runs twice on its own caches), 5 at 32x48 are 2 of 4x6.
SIZES = ((9, 48, 32), (5, 32, 48))


@pytest.fixture(scope="module")
def i2v(tmp_path_factory: pytest.TempPathFactory, wan_pipeline_exported: dict) -> dict:
    root = tmp_path_factory.mktemp("wan_i2v")
    print(f"seed {SEED}")
    pipe = build_tiny_pipeline(root / "pipeline", seed=SEED, boundary_ratio=BOUNDARY, i2v=True)
    proc = subprocess.run([*CLI, "export", "wan", "--checkpoint", str(root / "pipeline"),
                           "--out", str(root / "export"), "--quiet",
                           # the text encoder and VAE decoder are the shared pipeline's
                           "--reuse", str(wan_pipeline_exported["export"])],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    return {"root": root, "pipe": pipe, "export": root / "export"}


def _diffusers_frames(pipe, image: Path, frames: int, height: int, width: int) -> np.ndarray:
    from PIL import Image

    embeds, negative = wan_prompt_embeds(pipe, PROMPT, NEGATIVE)
    with Image.open(image) as rgb:
        return pipe(rgb.convert("RGB"), prompt_embeds=embeds, negative_prompt_embeds=negative,
                    num_frames=frames, height=height, width=width,
                    num_inference_steps=STEPS, guidance_scale=5.0, guidance_scale_2=3.0,
                    generator=torch.Generator().manual_seed(SEED), output_type="np").frames[0]


def _request(frames: int, height: int, width: int) -> WanSampleRequest:
    return WanSampleRequest(frames=frames, height=height, width=width, steps=STEPS,
                            guidance=5.0, guidance_2=3.0, seed=SEED)


@pytest.mark.slow
def test_export_has_the_encoder_graphs_and_both_experts(i2v: dict) -> None:
    pipeline = read_pipeline(i2v["export"])
    assert set(pipeline.components) == {
        "text_encoder", "transformer", "transformer_2", "vae_decoder/first_frame",
        "vae_decoder/next_frame", "vae_encoder", "vae_encoder_next"}
    for name, component in pipeline.components.items():
        assert {f["backend"] for f in component.record.parity} == {"onnxruntime", "openvino"}
        assert all(f["rel_error"] <= f["tolerance"] for f in component.record.parity), name
    for expert in pipeline.experts:
        assert (expert.config["in_channels"], expert.config["out_channels"]) == (
            I2V_IN_CHANNELS, 16)
    assert pipeline.needs_image and pipeline.condition_channels == 4 + 16
    boundary = pipeline.boundary_timestep(pipeline.scheduler_config)
    request = WanSampleRequest(frames=5, height=32, width=48, steps=STEPS, guidance=5.0,
                               seed=SEED, boundary_timestep=boundary)
    timesteps = DiffusersSchedule(STEPS, pipeline.scheduler_config).timesteps
    assert {request.expert(t) for t in timesteps} == {0, 1}  # the tests see the switch


# OpenVINO at the odd, tall size; the other backends at the wide one (the same graphs).
CASES = [("openvino", SIZES[0]), ("onnxruntime", SIZES[1]), ("torch", SIZES[1])]


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "size"), CASES,
                         ids=[f"{b}-{'x'.join(map(str, s))}" for b, s in CASES])
def test_frames_equal_diffusers(i2v: dict, backend: str, size: tuple, tmp_path: Path) -> None:
    frames, height, width = size
    image = write_image(tmp_path / "first.png", height, width)
    expected = _diffusers_frames(i2v["pipe"], image, *size)
    result = run_wan_pipeline(i2v["export"], _request(*size), PROMPT, tmp_path / "v.gif",
                              negative_prompt=NEGATIVE, backend=backend, image=image)
    assert result.frames.shape == expected.shape == (frames, height, width, 3)
    assert result.sample.latents.shape == (1, 16, (frames - 1) // 4 + 1, height // 8,
                                           width // 8)
    assert "vae_encode" in result.seconds
    error = float(np.max(np.abs(result.frames - expected)))
    print(f"{backend} {size}: max |numaov - diffusers| = {error:.3g}")
    assert error <= F32_FRAME_TOL


@pytest.mark.slow
def test_two_workers_give_the_same_video_and_the_image_shows(i2v: dict, tmp_path: Path) -> None:
    size = SIZES[1]
    image = write_image(tmp_path / "first.png", *size[1:])
    videos = [run_wan_pipeline(i2v["export"], _request(*size), PROMPT, tmp_path / f"v{w}.gif",
                               negative_prompt=NEGATIVE, image=image, workers=w).frames
              for w in (1, 2)]
    # Each worker runs one guidance branch at batch 1 instead of both at batch 2: the same
    # f32 math in another order, so the frames tolerance applies.
    error = float(np.max(np.abs(videos[0] - videos[1])))
    print(f"one vs two workers: max frame difference {error:.3g}")
    assert error <= F32_FRAME_TOL
    # Another first frame gives another video, so equality with diffusers is a real check.
    other = write_image(tmp_path / "other.png", *size[1:], seed=1)
    changed = run_wan_pipeline(i2v["export"], _request(*size), PROMPT, tmp_path / "o.gif",
                               negative_prompt=NEGATIVE, image=other).frames
    assert float(np.max(np.abs(changed - videos[0]))) > 10 * F32_FRAME_TOL


@pytest.mark.slow
def test_bad_inputs_are_one_line_errors(i2v: dict, wan_pipeline_exported: dict,
                                        tmp_path: Path) -> None:
    run = ["run", "wan", "--frames", "5", "--height", "32", "--width", "48", "--steps", "1",
           "--guidance", "5", "--seed", "0", "--prompt", "a", "--out", str(tmp_path / "v.gif")]
    at = ["--model-dir", str(i2v["export"])]
    # An image-to-video pipeline has no text-only mode.
    one_line_error(subprocess.run([*CLI, *run, *at], capture_output=True, text=True,
                                  timeout=300),
                   "--image: ", "is image-to-video (WanImageToVideoPipeline): expected an image")
    (tmp_path / "broken.png").write_bytes(b"not an image")
    one_line_error(subprocess.run([*CLI, *run, *at, "--image", str(tmp_path / "broken.png")],
                                  capture_output=True, text=True, timeout=300),
                   "--image: ", "cannot read", "broken.png", "as an image")
    small = write_image(tmp_path / "small.png", 32, 32)
    with pytest.raises(ImageInputError, match="is 32x32 pixels; expected the video's 48x32"):
        run_wan_pipeline(i2v["export"], _request(5, 32, 48), PROMPT, tmp_path / "v.gif",
                         image=small)
    # A text-only pipeline export (the shared Wan 2.1 one) has no image conditioning.
    one_line_error(subprocess.run(
        [*CLI, *run, "--model-dir", str(wan_pipeline_exported["export"]), "--image", str(small)],
        capture_output=True, text=True, timeout=300), "--image: ", "has no image conditioning")
    # The latent path cannot feed the condition channels: its transformer alone is refused.
    np.save(tmp_path / "text.npy", np.zeros((8, 32), dtype=np.float32))
    with pytest.raises(SamplerInputError, match=r"takes 20 image-to-video condition channels "
                                                r"beside its latents \(in_channels 36\)"):
        run_wan(i2v["export"] / "transformer", WanSampleRequest(
            frames=5, height=32, width=48, steps=1, guidance=5.0, seed=0),
            tmp_path / "text.npy", None)
    # An export that lost the encoder's next-frames graph is named, not run with 16 channels.
    export = export_without(i2v["export"], tmp_path / "export", "vae_encoder_next")
    with pytest.raises(SamplerInputError, match="has no 'vae_encoder_next' component"):
        run_wan_pipeline(export, _request(5, 32, 48), PROMPT, tmp_path / "v.gif",
                         image=write_image(tmp_path / "first.png", 32, 48))


# -- checks before any export work (the files the index check reads, in the real layout) ------


@pytest.mark.slow  # the i2v fixture's export (about a minute) and a server
def test_served_image_to_video_asks_for_input_reference(i2v: dict) -> None:
    """`numaov serve` on an export that needs an image refuses requests without one, naming
    the field and where the image goes, before anything runs."""
    import httpx
    from support.service_harness import start_server, stop_server

    server, url = start_server(i2v["export"], "")
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            for path, message in (
                    ("/v1/videos", "'export' is image-to-video: expected input_reference"),
                    ("/v1/images/generations", "expected POST /v1/videos with input_reference")):
                response = client.post(path, json={"prompt": PROMPT, "size": "32x48"})
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["param"] == "input_reference" and message in error["message"], error
    finally:
        stop_server(server)


def _i2v_directory(root: Path, *, image_encoder: list | None = None, in_channels: int = 36,
                   vae: bool = True) -> Path:
    index = {"_class_name": "WanImageToVideoPipeline", "boundary_ratio": BOUNDARY,
             "expand_timesteps": False, "image_encoder": image_encoder or [None, None],
             "image_processor": [None, None],
             "scheduler": ["diffusers", "UniPCMultistepScheduler"],
             "text_encoder": ["transformers", "UMT5EncoderModel"],
             "tokenizer": ["transformers", "TokenizersBackend"],
             "transformer": ["diffusers", "WanTransformer3DModel"],
             "transformer_2": ["diffusers", "WanTransformer3DModel"],
             "vae": ["diffusers", "AutoencoderKLWan"]}
    root.mkdir()
    (root / "model_index.json").write_text(json.dumps(index))
    for name in ("scheduler", "text_encoder", "tokenizer", "transformer", "transformer_2"):
        (root / name).mkdir()
    for name in ("transformer", "transformer_2"):
        (root / name / "config.json").write_text(json.dumps(
            {"_class_name": "WanTransformer3DModel", "in_channels": in_channels,
             "out_channels": 16}))
    if vae:
        (root / "vae").mkdir()
        (root / "vae" / "config.json").write_text(json.dumps(
            {"_class_name": "AutoencoderKLWan", "z_dim": 16, "scale_factor_temporal": 4}))
    return root


def test_unexportable_image_to_video_directories_are_refused(tmp_path: Path) -> None:
    clip = _i2v_directory(tmp_path / "wan21_i2v",
                          image_encoder=["transformers", "CLIPVisionModel"])
    with pytest.raises(PipelineExportError, match=r"names an image_encoder .*CLIPVisionModel.* "
                                                  r"\(Wan 2.1 I2V's CLIP image embeddings\)"):
        export_wan(clip, tmp_path / "out")
    channels = _i2v_directory(tmp_path / "channels", in_channels=32)
    with pytest.raises(PipelineExportError, match=r"in_channels, out_channels = 32, 16; "
                                                  r"expected 36, 16"):
        export_wan(channels, tmp_path / "out")
    no_vae = _i2v_directory(tmp_path / "no_vae", vae=False)
    with pytest.raises(PipelineExportError, match="has no 'vae' component"):
        export_wan(no_vae, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_first_frame_mask_is_diffusers_mask() -> None:
    """The mask beside diffusers' own arithmetic (prepare_latents, batch 1, no last image)."""
    frames, temporal, height, width = 13, 4, 2, 3
    mask = torch.ones(1, 1, frames, height, width)
    mask[:, :, list(range(1, frames))] = 0
    first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=temporal)
    mask = torch.concat([first, mask[:, :, 1:, :]], dim=2)
    expected = mask.view(1, -1, temporal, height, width).transpose(1, 2).numpy()
    got = first_frame_mask(frames, temporal, height, width)
    assert got.shape == (1, temporal, (frames - 1) // temporal + 1, height, width)
    assert np.array_equal(got, expected)

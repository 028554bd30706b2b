"""Wan 2.2 A14B-style two experts: a tiny pipeline with transformer_2 and boundary_ratio,
exported whole; numaov's frames against diffusers' WanPipeline with guidance_scale_2."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from support.wan_pipeline_harness import export_tiny_pipeline

from numaov.runtime.wan.pipeline import read_pipeline, run_wan_pipeline
from numaov.runtime.wan.request import WanSampleRequest
from numaov.runtime.wan.schedules import DiffusersSchedule

pytestmark = pytest.mark.slow  # exports a whole pipeline

SEED = 5
BOUNDARY = 0.875  # Wan 2.2 A14B's
STEPS = 4
# As in test_wan_pipeline: f32 frames in [0, 1], ~2e-6 measured; a step on the wrong expert
# or with the wrong guidance moves pixels by 1e-2 and more.
F32_FRAME_TOL = 1e-4


@pytest.fixture(scope="module")
def two_experts(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return export_tiny_pipeline(tmp_path_factory.mktemp("wan_two_experts"), SEED,
                                boundary_ratio=BOUNDARY)


def test_both_experts_are_exported_and_both_run(two_experts: dict) -> None:
    pipeline = read_pipeline(two_experts["export"])
    assert [m.directory.name for m in pipeline.experts] == ["transformer", "transformer_2"]
    boundary = pipeline.boundary_timestep(pipeline.scheduler_config)
    assert boundary == BOUNDARY * 1000
    timesteps = DiffusersSchedule(STEPS, pipeline.scheduler_config).timesteps
    request = WanSampleRequest(frames=5, height=32, width=48, steps=STEPS, guidance=5.0,
                               seed=SEED, boundary_timestep=boundary)
    assert {request.expert(t) for t in timesteps} == {0, 1}  # the test sees the switch


@pytest.mark.parametrize("backend", ["openvino", "torch"])
def test_frames_equal_diffusers_with_guidance_2(two_experts: dict, backend: str,
                                                tmp_path) -> None:
    frames, height, width = 9, 48, 32
    expected = two_experts["pipe"](
        "a w1 w2", negative_prompt="w3", num_frames=frames, height=height, width=width,
        num_inference_steps=STEPS, guidance_scale=5.0, guidance_scale_2=2.0,
        generator=torch.Generator().manual_seed(SEED), output_type="np").frames[0]
    request = WanSampleRequest(frames=frames, height=height, width=width, steps=STEPS,
                               guidance=5.0, guidance_2=2.0, seed=SEED)
    got = run_wan_pipeline(two_experts["export"], request, "a w1 w2", tmp_path / "v.gif",
                           negative_prompt="w3", backend=backend).frames
    error = float(np.max(np.abs(got - expected)))
    print(f"{backend}: max |numaov - diffusers| = {error:.3g}")
    assert error <= F32_FRAME_TOL


def test_guidance_2_without_a_second_expert_is_refused(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "numaov.cli", "run", "wan", "--model-dir", str(tmp_path),
         "--frames", "5", "--height", "32", "--width", "32", "--steps", "2", "--guidance", "5",
         "--guidance-2", "3", "--seed", "0", "--text-embeddings", str(tmp_path / "t.npy"),
         "--out", str(tmp_path / "l.npy")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.startswith("numaov: error: --guidance-2: guidance_2=3.0"), proc.stderr

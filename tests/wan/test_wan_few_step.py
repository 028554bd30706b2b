"""Guidance-free, few-step sampling without an export: one branch per step at guidance 1, the
sampler and shift chosen at run time (step by step against diffusers' schedulers at f32), and
the one-line refusals. The frames of a LoRA-merged export at these settings against diffusers
are tests/wan/test_wan_lora_pipeline.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from support.wan_harness import cli_refusal
from support.wan_pipeline_harness import one_line_error

from numaov.runtime.wan.request import SamplerInputError, WanSampleRequest
from numaov.runtime.wan.sampler import GuidedPredictor, sample, validate_request
from numaov.runtime.wan.schedules import (
    DiffusersSchedule,
    EulerSchedule,
    make_schedule,
    scheduler_config,
)

# The tiny pipelines' scheduler (wan_pipeline_harness), as Wan's published pipelines ship it.
UNIPC = {"_class_name": "UniPCMultistepScheduler", "prediction_type": "flow_prediction",
         "use_flow_sigmas": True, "num_train_timesteps": 1000, "flow_shift": 3.0}
SHAPE = (1, 16, 2, 4, 6)


class CountingPredictor(GuidedPredictor):
    """A fake transformer: a fixed linear map of the latents; counts each kind of call."""

    def __init__(self, gain: float) -> None:
        self.gain, self.pairs, self.singles = gain, 0, 0

    def __call__(self, latents, timestep):
        self.pairs += 1
        return self.gain * latents, -0.5 * latents

    def conditional(self, latents, timestep):
        self.singles += 1
        return self.gain * latents


def _request(**fields) -> WanSampleRequest:
    return WanSampleRequest(**{"frames": 5, "height": 32, "width": 48, "steps": 4,
                               "guidance": 1.0, "seed": 0, **fields})


def test_guidance_1_runs_one_branch_per_step() -> None:
    predictor = CountingPredictor(0.3)
    latents, _ = sample([predictor], SHAPE, _request())
    assert (predictor.pairs, predictor.singles) == (0, 4)
    # diffusers' WanPipeline at guidance_scale 1: noise_pred is the conditional prediction.
    expected = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0)
    scheduler.set_timesteps(4)
    for t in scheduler.timesteps:
        expected = scheduler.step(0.3 * expected, t, expected, return_dict=False)[0]
    assert np.array_equal(latents, expected.numpy())


def test_two_experts_guidance_per_step() -> None:
    """guidance 5 on the first expert's steps, guidance_2 1 on the second's: pairs there,
    single branches here."""
    high, low = CountingPredictor(0.3), CountingPredictor(0.2)
    request = _request(guidance=5.0, guidance_2=1.0, boundary_timestep=875.0)
    steps = [request.expert(t) for t in make_schedule(request).timesteps]
    sample([high, low], SHAPE, request)
    assert (high.pairs, high.singles) == (steps.count(0), 0)
    assert (low.pairs, low.singles) == (0, steps.count(1)) and steps.count(1) > 0


def test_guidance_1_turns_guidance_off_for_both_experts_as_diffusers() -> None:
    """diffusers' Wan pipelines guide only when guidance_scale > 1, whatever
    guidance_scale_2: single branches on both experts, and a line says guidance_2 is unused."""
    high, low = CountingPredictor(0.3), CountingPredictor(0.2)
    request = _request(guidance=1.0, guidance_2=5.0, boundary_timestep=875.0)
    steps = [request.expert(t) for t in make_schedule(request).timesteps]
    sample([high, low], SHAPE, request)
    assert (high.pairs, high.singles) == (0, steps.count(0))
    assert (low.pairs, low.singles) == (0, steps.count(1)) and steps.count(1) > 0
    assert request.unguided and "guidance_2 5 is not used" in request.unused_guidance_2
    assert _request(guidance=1.0, guidance_2=1.0).unused_guidance_2 is None


@pytest.mark.parametrize(("sampler", "shift"), [("euler", 5.0), ("unipc", 5.0), ("euler", None),
                                                (None, 7.0), ("unipc", None)])
def test_sampler_and_shift_step_like_diffusers(sampler: str | None, shift: float | None) -> None:
    """What a diffusers user writes to swap the scheduler of a pipeline shipping UNIPC, step by
    step at f32: the same timesteps and the same latents after every step."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    config = scheduler_config(sampler, shift, UNIPC)
    if sampler == "euler":
        reference = FlowMatchEulerDiscreteScheduler(shift=3.0 if shift is None else shift)
    else:  # the pipeline's own UniPC, its flow_shift replaced when given
        reference = UniPCMultistepScheduler.from_config(
            UNIPC, **({} if shift is None else {"flow_shift": shift}))
    ours = DiffusersSchedule(4, config)
    reference.set_timesteps(4)
    assert ours.timesteps == [float(t) for t in reference.timesteps]
    generator = torch.Generator().manual_seed(1)
    x = ours_x = torch.randn(SHAPE, generator=generator)
    ours_x = ours_x.numpy()
    for i, t in enumerate(reference.timesteps):
        velocity = torch.randn(SHAPE, generator=generator)
        x = reference.step(velocity, t, x, return_dict=False)[0]
        ours_x = ours.step(velocity.numpy(), i, ours_x)
        assert np.array_equal(ours_x, x.numpy()), i


def test_latents_mode_samplers() -> None:
    # Euler stays numpy (the same numbers as diffusers', tests/wan/test_wan_sampler.py); unipc is
    # Wan's UniPC with the request's shift.
    assert scheduler_config(None, None, None) is None
    assert scheduler_config("euler", 3.0, None) is None
    assert isinstance(make_schedule(_request(shift=3.0)), EulerSchedule)
    unipc = scheduler_config("unipc", 3.0, None)
    assert unipc == {**UNIPC, "flow_shift": 3.0}


def test_bad_settings_are_refused() -> None:
    with pytest.raises(SamplerInputError, match="parallel=guidance puts the guidance branches "
                       "on their own workers, but at guidance 1"):
        validate_request(_request(), "openvino", 2, "guidance")
    # two workers at guidance 1 split the video's tokens instead
    assert validate_request(_request(), "openvino", 2).name == "sequence"
    mixed = validate_request(_request(guidance=5.0, guidance_2=1.0), "openvino", 2)
    assert mixed.name == "guidance"  # mixed: both branches run on some steps
    with pytest.raises(SamplerInputError, match="unknown sampler 'ddim'; expected one of unipc, "
                       "euler"):
        validate_request(_request(sampler="ddim"), "openvino", 1)
    with pytest.raises(SamplerInputError, match="shift=-1.0; expected a positive number"):
        validate_request(_request(shift=-1.0), "openvino", 1)
    with pytest.raises(SamplerInputError, match="whose shift numaov does not set"):
        scheduler_config(None, 5.0, {"_class_name": "DDIMScheduler"})
    # a config diffusers' Wan pipeline cannot step either (it never passes mu): one line
    dynamic = {"_class_name": "FlowMatchEulerDiscreteScheduler", "use_dynamic_shifting": True}
    with pytest.raises(SamplerInputError, match="scheduler FlowMatchEulerDiscreteScheduler "
                       "cannot set 4 steps: .*mu.*; expected a scheduler config") as caught:
        make_schedule(_request(scheduler=dynamic))
    assert "\n" not in str(caught.value)


def test_cli_refusals_are_one_line(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess:
        return cli_refusal("run", "wan", "--model-dir", str(tmp_path / "missing"), "--frames",
                           "5", "--height", "32", "--width", "32", "--steps", "4", "--seed", "0",
                           *args)

    prompt = ["--prompt", "a cat", "--out", str(tmp_path / "v.mp4")]
    one_line_error(run("--guidance", "1", "--workers", "2", "--parallel", "guidance", *prompt),
                   "--parallel: parallel=guidance", "at guidance 1")
    one_line_error(run("--guidance", "1", "--negative-prompt", "blurry", *prompt),
                   "--negative-prompt:", "with guidance 1")
    one_line_error(run("--guidance", "1", "--negative-embeddings", "n.npy", "--text-embeddings",
                       "t.npy", "--out", str(tmp_path / "l.npy")),
                   "--negative-embeddings:", "with guidance 1")
    one_line_error(run("--guidance", "1", "--shift", "0", *prompt), "--shift: shift=0.0")
    one_line_error(run("--guidance", "1", "--scheduler", "ddim", *prompt),
                   "argument --scheduler: invalid choice: 'ddim'")

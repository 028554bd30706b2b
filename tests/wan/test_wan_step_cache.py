"""Step caching (``run wan --cache first-block:THRESHOLD`` / ``magcache:...``) against
diffusers' ``transformer.enable_cache(FirstBlockCacheConfig(threshold))`` and
``enable_cache(MagCacheConfig(...))`` on the tiny Wan 2.1 pipeline export: the same
evaluations skipped, step by step and branch by branch, and the same frames, with both
branches in one batch, one per worker, and at guidance 1; MagCache's calibrated ratios equal
diffusers' calibration; the one-line refusals."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support.wan_harness import cli_refusal
from support.wan_pipeline_harness import one_line_error

from numaov.runtime.wan.pipeline import run_wan_pipeline
from numaov.runtime.wan.request import SamplerInputError, WanSampleRequest
from numaov.runtime.wan.step_cache import (
    RATIOS_FILE,
    StepCacheSetting,
    nearest_ratios,
    read_ratios,
)

pytestmark = pytest.mark.slow  # the shared pipeline export, diffusers' pipeline

SEED = 3
PROMPT, NEGATIVE = "a w1 w2 b", "w3 c"
SIZE = {"frames": 9, "height": 48, "width": 32}
STEPS = 20
# As tests/wan/test_wan_pipeline.py: f32 graphs within ~1e-6 of PyTorch; a skipped or computed
# evaluation on the other side would move frames by 1e-3 or more.
F32_FRAME_TOL = 1e-4
CLI = [sys.executable, "-m", "numaov.cli"]


def _diffusers(pipe, threshold: float, guidance: float) -> tuple[np.ndarray, list[str]]:
    """diffusers' frames with First Block Cache, and its decisions per branch ("C": every
    block ran), recorded from the cache's own rule."""
    from diffusers.hooks import FirstBlockCacheConfig
    from diffusers.hooks import first_block_cache as fbc

    seen: dict[str, list[bool]] = {"cond": [], "uncond": []}
    rule = fbc.FBCHeadBlockHook._should_compute_remaining_blocks

    def recorded(hook, residual):
        decision = rule(hook, residual)
        seen[hook.state_manager.context.name].append(decision)
        return decision

    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    fbc.FBCHeadBlockHook._should_compute_remaining_blocks = recorded
    try:
        frames = pipe(PROMPT, negative_prompt=NEGATIVE if guidance > 1 else None,
                      num_inference_steps=STEPS, guidance_scale=guidance,
                      generator=torch.Generator().manual_seed(SEED), output_type="np",
                      **{"num_frames": SIZE["frames"], "height": SIZE["height"],
                         "width": SIZE["width"]}).frames[0]
    finally:
        fbc.FBCHeadBlockHook._should_compute_remaining_blocks = rule
        pipe.transformer.disable_cache()
    return frames, ["".join("C" if d else "." for d in seen[b]) for b in seen if seen[b]]


def _numaov(export: Path, threshold: float | str, guidance: float, workers: int = 1,
            steps: int = STEPS):
    cache = threshold if isinstance(threshold, str) else f"first-block:{threshold}"
    request = WanSampleRequest(**SIZE, steps=steps, guidance=guidance, seed=SEED, cache=cache)
    lines: list[str] = []
    result = run_wan_pipeline(export, request, PROMPT, None,
                              negative_prompt=NEGATIVE if guidance > 1 else "",
                              workers=workers, progress=lines.append)
    return result, lines


@pytest.mark.parametrize("threshold", [0.05, 0.2])
def test_skips_what_diffusers_skips_with_its_frames(wan_pipeline_exported: dict,
                                                    threshold: float) -> None:
    expected, decisions = _diffusers(wan_pipeline_exported["pipe"], threshold, 5.0)
    result, lines = _numaov(wan_pipeline_exported["export"], threshold, 5.0)
    print(threshold, decisions)
    assert result.sample.cache_decisions == decisions
    skipped = sum(d.count(".") for d in decisions)
    assert skipped > 0  # the thresholds were chosen so that the cache does skip here
    assert result.sample.skipped == skipped
    assert np.abs(result.frames - expected).max() <= F32_FRAME_TOL
    assert any(f"step cache first-block:{threshold:g}: skipped {skipped} of {2 * STEPS}" in line
               for line in lines), lines


def test_two_guidance_workers_and_guidance_1_keep_diffusers_decisions(
        wan_pipeline_exported: dict) -> None:
    export, pipe = wan_pipeline_exported["export"], wan_pipeline_exported["pipe"]
    one, _ = _numaov(export, 0.2, 5.0)
    two, _ = _numaov(export, 0.2, 5.0, workers=2)
    assert two.sample.cache_decisions == one.sample.cache_decisions
    assert np.abs(two.frames - one.frames).max() <= F32_FRAME_TOL
    expected, decisions = _diffusers(pipe, 0.2, 1.0)
    unguided, _ = _numaov(export, 0.2, 1.0)
    assert unguided.sample.cache_decisions == decisions and len(decisions) == 1
    assert np.abs(unguided.frames - expected).max() <= F32_FRAME_TOL


def test_cli_reports_skipped_evaluations_and_refuses_bad_settings(
        wan_pipeline_exported: dict, tmp_path: Path) -> None:
    export = wan_pipeline_exported["export"]
    base = [*CLI, "run", "wan", "--model-dir", str(export), "--prompt", PROMPT, "--frames", "5",
            "--height", "32", "--width", "48", "--steps", "8", "--guidance", "5", "--seed", "1",
            "--out", str(tmp_path / "video.mp4")]
    proc = subprocess.run([*base, "--cache", "first-block:0.3"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "numaov: step cache first-block:0.3: skipped" in proc.stderr
    assert "evaluations skipped by the step cache" in proc.stdout
    # the refusals, in this process (each would cost an interpreter's start-up)
    base = base[len(CLI):]
    for setting, needle in (("fbc", "expected first-block[:THRESHOLD]"),
                            ("first-block:-1", "expected a number >= 0"),
                            ("first-block:x", "expected a number >= 0")):
        one_line_error(cli_refusal(*base, "--cache", setting), needle)
    one_line_error(cli_refusal(*base, "--cache", "first-block", "--backend", "onnxruntime"),
                   "expected backend openvino")

    # An export made before the transformer returned its block states.
    old = tmp_path / "old_export"
    shutil.copytree(export, old)
    manifest = old / "transformer" / "manifest.json"
    record = json.loads(manifest.read_text())
    record["outputs"] = record["outputs"][:1]
    manifest.write_text(json.dumps(record))
    one_line_error(cli_refusal(*base[:2], "--model-dir", str(old), *base[4:], "--cache",
                               "first-block"), "has no block outputs", "expected a re-export")


def test_settings_parse_as_diffusers_names_them() -> None:
    assert StepCacheSetting.parse("first-block") == StepCacheSetting("first-block", 0.05)
    assert str(StepCacheSetting.parse("first-block:0.1")) == "first-block:0.1"
    assert StepCacheSetting.parse("magcache") == StepCacheSetting("magcache", 0.06, 3, 0.2)
    assert StepCacheSetting.parse("magcache:0.1:2:0.3") == StepCacheSetting("magcache", 0.1, 2,
                                                                            0.3)
    assert str(StepCacheSetting.parse("magcache:0.1:3")) == "magcache:0.1"
    assert StepCacheSetting.parse("magcache:calibrate").calibrate
    for text, needle in (("teacache", "expected first-block[:THRESHOLD], magcache"),
                         ("first-block:0.1:2", "expected first-block[:THRESHOLD], magcache"),
                         ("magcache:0.1:2:0.2:1", "expected first-block"),
                         ("magcache:0.1:1.5", "max skip '1.5'"),
                         ("magcache:0.1:-1", "max skip '-1'"),
                         ("magcache:0.1:2:1.5", "expected a number in [0, 1]"),
                         ("magcache:nan", "expected a number >= 0")):
        with pytest.raises(SamplerInputError, match=r"step cache") as info:
            StepCacheSetting.parse(text)
        assert needle in str(info.value) and "\n" not in str(info.value), (text, info.value)


@pytest.mark.parametrize("count", [1, 2, 7, 20, 28, 50, 51])
@pytest.mark.parametrize("length", [1, 5, 20, 28])
def test_ratios_stretch_as_diffusers_interpolates(length: int, count: int) -> None:
    from diffusers.hooks.mag_cache import nearest_interp

    ratios = torch.linspace(0.8, 1.3, length)
    expected = nearest_interp(ratios, count).numpy()
    assert np.array_equal(nearest_ratios(ratios.numpy(), count), expected)


# -- MagCache ----------------------------------------------------------------------------------

# A skipped step adds the last residual to the blocks' input; at f32 the ratios are means of
# norm ratios of graph outputs that are within ~1e-6 of PyTorch's.
RATIO_TOL = 1e-4


def _diffusers_magcache(pipe, guidance: float, steps: int = STEPS,
                        **config) -> tuple[np.ndarray, dict, dict]:
    """diffusers' frames with MagCache (``config``: MagCacheConfig's), its decisions per
    branch (from its head hook's state) and, when calibrating, its ratios per branch."""
    from diffusers.hooks import mag_cache as mc

    seen: dict[str, list[bool]] = {"cond": [], "uncond": []}
    ratios: dict[str, list[float]] = {"cond": [], "uncond": []}
    head = mc.MagCacheHeadHook.new_forward
    calibration = mc.MagCacheBlockHook._perform_calibration_step

    def decided(hook, module, *args, **kwargs):
        output = head(hook, module, *args, **kwargs)
        state = hook.state_manager.get_state()
        seen[hook.state_manager.context.name].append(state.should_compute)
        return output

    def measured(hook, state, residual):
        calibration(hook, state, residual)
        ratios[hook.state_manager.context.name].append(state.calibration_ratios[-1])

    # (the hooks bind new_forward when they are registered)
    mc.MagCacheHeadHook.new_forward, mc.MagCacheBlockHook._perform_calibration_step = (
        decided, measured)
    try:
        pipe.transformer.enable_cache(mc.MagCacheConfig(num_inference_steps=steps, **config))
        frames = pipe(PROMPT, negative_prompt=NEGATIVE if guidance > 1 else None,
                      num_inference_steps=steps, guidance_scale=guidance,
                      generator=torch.Generator().manual_seed(SEED), output_type="np",
                      **{"num_frames": SIZE["frames"], "height": SIZE["height"],
                         "width": SIZE["width"]}).frames[0]
    finally:
        mc.MagCacheHeadHook.new_forward, mc.MagCacheBlockHook._perform_calibration_step = (
            head, calibration)
        pipe.transformer.disable_cache()
    decisions = {b: "".join("C" if d else "." for d in seen[b]) for b in seen if seen[b]}
    return frames, decisions, ratios


@pytest.fixture(scope="module")
def calibrated(wan_pipeline_exported: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The shared export's files linked into a directory of its own, and its transformer's
    magnitude ratios measured there by ``magcache:calibrate`` (and by diffusers)."""
    export = tmp_path_factory.mktemp("magcache") / "export"
    shutil.copytree(wan_pipeline_exported["export"], export, copy_function=os.link)
    result, lines = _numaov(export, "magcache:calibrate", 5.0)
    _, _, expected = _diffusers_magcache(wan_pipeline_exported["pipe"], 5.0, calibrate=True)
    return {"export": export, "result": result, "lines": lines, "diffusers": expected}


def test_magcache_calibration_measures_diffusers_ratios(calibrated: dict) -> None:
    path = calibrated["export"] / "transformer" / RATIOS_FILE
    record = json.loads(path.read_text())
    print(record["ratios"])
    assert len(record["ratios"]) == STEPS and record["steps"] == STEPS
    assert record["ratios"][0] == 1.0  # no residual before the first step
    expected = calibrated["diffusers"]["cond"]
    assert len(expected) == STEPS
    assert np.allclose(record["ratios"], expected, rtol=RATIO_TOL, atol=0)
    # calibration skips nothing, and says where the ratios went
    assert calibrated["result"].sample.skipped == 0
    assert any(f"magcache:calibrate: measured the magnitude ratios of {STEPS} step(s), written "
               f"to {path}" in line for line in calibrated["lines"]), calibrated["lines"]


@pytest.mark.parametrize("setting", ["magcache:0.02", "magcache:1:2:0.1"])
def test_magcache_skips_what_diffusers_skips_with_its_frames(
        wan_pipeline_exported: dict, calibrated: dict, setting: str) -> None:
    ratios = json.loads((calibrated["export"] / "transformer" / RATIOS_FILE).read_text())["ratios"]
    parsed = StepCacheSetting.parse(setting)
    expected, decisions, _ = _diffusers_magcache(
        wan_pipeline_exported["pipe"], 5.0, mag_ratios=ratios, threshold=parsed.threshold,
        max_skip_steps=parsed.max_skip, retention_ratio=parsed.retention)
    result, lines = _numaov(calibrated["export"], setting, 5.0)
    print(setting, decisions)
    assert result.sample.cache_decisions == [decisions["cond"], decisions["uncond"]]
    skipped = sum(d.count(".") for d in decisions.values())
    assert skipped > 0  # the settings were chosen so that the cache does skip here
    assert result.sample.skipped == skipped
    assert np.abs(result.frames - expected).max() <= F32_FRAME_TOL
    assert any(f"step cache {parsed}: skipped {skipped} of {2 * STEPS}" in line
               and "the patch embedding and the output head only" in line
               for line in lines), lines


def test_magcache_at_guidance_1_and_on_two_workers(wan_pipeline_exported: dict,
                                                   calibrated: dict) -> None:
    export = calibrated["export"]
    one, _ = _numaov(export, "magcache:0.3", 5.0)
    two, _ = _numaov(export, "magcache:0.3", 5.0, workers=2)
    assert two.sample.cache_decisions == one.sample.cache_decisions
    assert np.abs(two.frames - one.frames).max() <= F32_FRAME_TOL
    ratios = read_ratios(export / "transformer", STEPS).tolist()
    expected, decisions, _ = _diffusers_magcache(wan_pipeline_exported["pipe"], 1.0,
                                                 mag_ratios=ratios, threshold=0.3)
    unguided, _ = _numaov(export, "magcache:0.3", 1.0)
    assert unguided.sample.cache_decisions == [decisions["cond"]]
    assert unguided.sample.skipped > 0
    assert np.abs(unguided.frames - expected).max() <= F32_FRAME_TOL
    # a run of another length: the 20 ratios stretched to its 12 steps, as diffusers does
    expected, decisions, _ = _diffusers_magcache(wan_pipeline_exported["pipe"], 1.0, steps=12,
                                                 mag_ratios=ratios, threshold=0.02)
    shorter, _ = _numaov(export, "magcache:0.02", 1.0, steps=12)
    assert shorter.sample.cache_decisions == [decisions["cond"]]
    assert np.abs(shorter.frames - expected).max() <= F32_FRAME_TOL


def test_magcache_refuses_missing_or_bad_ratios(wan_pipeline_exported: dict,
                                                tmp_path: Path) -> None:
    export = tmp_path / "export"
    shutil.copytree(wan_pipeline_exported["export"], export, copy_function=os.link)
    base = ["run", "wan", "--model-dir", str(export), "--prompt", PROMPT, "--frames", "5",
            "--height", "32", "--width", "48", "--steps", "4", "--guidance", "5", "--seed", "1",
            "--out", str(tmp_path / "video.mp4")]
    one_line_error(cli_refusal(*base, "--cache", "magcache"), RATIOS_FILE, "is missing",
                   "cache magcache:calibrate")
    for content in ("{", '{"ratios": []}', '{"ratios": [1, "x"]}', '{"ratio": [1]}'):
        (export / "transformer" / RATIOS_FILE).write_text(content)
        one_line_error(cli_refusal(*base, "--cache", "magcache:0.1"), "are not readable",
                       "a non-empty list of finite numbers")
    one_line_error(cli_refusal(*base, "--cache", "magcache:0.1:x"), "max skip 'x'")

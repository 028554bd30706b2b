"""Step caching (``run wan --cache first-block:THRESHOLD``) against diffusers'
``transformer.enable_cache(FirstBlockCacheConfig(threshold))`` on the tiny Wan 2.1 pipeline
export: the same evaluations skipped, step by step and branch by branch, and the same frames,
with both branches in one batch, one per worker, and at guidance 1; the one-line refusals."""

from __future__ import annotations

import json
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
from numaov.runtime.wan.step_cache import StepCacheSetting

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


def _numaov(export: Path, threshold: float, guidance: float, workers: int = 1):
    request = WanSampleRequest(**SIZE, steps=STEPS, guidance=guidance, seed=SEED,
                               cache=f"first-block:{threshold}")
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
                   "expected --backend openvino")

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
    with pytest.raises(SamplerInputError, match="expected first-block"):
        StepCacheSetting.parse("magcache")

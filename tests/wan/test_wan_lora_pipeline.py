"""A tiny Wan 2.2 A14B-style pipeline (two experts, boundary_ratio) exported whole through the
CLI with LoRAs merged: two stacked LoRAs of different layouts on the transformer, a third on
transformer_2. Both experts run (the switch at the boundary, guidance_scale_2), and numaov's
frames equal diffusers' WanPipeline with load_lora_weights + fuse_lora, with guidance and
guidance-free (guidance 1, 4 steps of Euler or UniPC at shift 5, the recipe of lightx2v's
distilled LoRAs). One export serves both subjects: a pipeline export is the slow part."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support.wan_lora_harness import musubi_lora, peft_lora, wan_lora
from support.wan_pipeline_harness import build_tiny_pipeline

from numaov.manifest import digest_file
from numaov.runtime.wan.pipeline import read_pipeline, run_wan_pipeline
from numaov.runtime.wan.request import SamplerInputError, WanSampleRequest
from numaov.runtime.wan.schedules import DiffusersSchedule

pytestmark = pytest.mark.slow  # exports a whole pipeline

pytest.importorskip("peft")  # diffusers' load_lora_weights, the reference, needs it

SEED = 11
BOUNDARY = 0.875
PROMPT, NEGATIVE = "a w1 w2", "w3"
# As in test_wan_pipeline: f32 frames in [0, 1], each graph ~1e-6 of PyTorch; a LoRA left
# out, scaled wrongly or merged into the wrong expert moves pixels by 1e-2 and more (the
# test checks that too), as does a step with the wrong sampler, shift or guidance.
F32_FRAME_TOL = 1e-4


@pytest.fixture(scope="module")
def lora_export(tmp_path_factory: pytest.TempPathFactory, wan_pipeline_exported: dict) -> dict:
    root = tmp_path_factory.mktemp("wan_lora_pipeline")
    print(f"seed {SEED}")
    pipe = build_tiny_pipeline(root / "pipeline", seed=SEED, boundary_ratio=BOUNDARY)
    loras = {
        "a": (wan_lora(root / "a.safetensors", seed=SEED, lightx2v=True, dtype=torch.bfloat16),
              0.8),
        "b": (peft_lora(root / "b.safetensors", seed=SEED + 1, rank=2, alpha=4), 1.0),
        "c": (musubi_lora(root / "c.safetensors", seed=SEED + 2), 1.2),
    }
    # Small LoRA updates, so that the video stays in range and every one of them shows.
    proc = subprocess.run(
        [sys.executable, "-m", "numaov.cli", "export", "wan", "--checkpoint",
         str(root / "pipeline"), "--out", str(root / "export"),
         "--lora", f"{loras['a'][0]}:{loras['a'][1]}", "--lora", str(loras["b"][0]),
         "--lora-2", f"{loras['c'][0]}:{loras['c'][1]}",
         "--reuse", str(wan_pipeline_exported["export"])],
        capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr
    # diffusers' pipeline with the same LoRAs fused, one after the other.
    for name, component in (("a", "transformer"), ("b", "transformer"), ("c", "transformer_2")):
        path, scale = loras[name]
        pipe.load_lora_weights(str(path), load_into_transformer_2=component == "transformer_2")
        pipe.fuse_lora(components=[component], lora_scale=scale)
        pipe.unload_lora_weights()
    return {"root": root, "pipe": pipe, "export": root / "export", "loras": loras,
            "summary": proc.stdout, "progress": proc.stderr,
            "shared": wan_pipeline_exported["export"]}


def _diffusers_frames(pipe, guidance: float, steps: int, scheduler=None, **kwargs) -> np.ndarray:
    original = pipe.scheduler
    if scheduler is not None:
        pipe.scheduler = scheduler
    try:
        return pipe(PROMPT, num_frames=9, height=48, width=32, num_inference_steps=steps,
                    guidance_scale=guidance, generator=torch.Generator().manual_seed(SEED),
                    output_type="np", **kwargs).frames[0]
    finally:
        pipe.scheduler = original


def _numaov_frames(export: Path, tmp_path: Path, guidance: float, steps: int,
                   backend: str = "openvino", **fields) -> np.ndarray:
    negative = fields.pop("negative_prompt", "")
    request = WanSampleRequest(frames=9, height=48, width=32, steps=steps, guidance=guidance,
                               seed=SEED, **fields)
    return run_wan_pipeline(export, request, PROMPT, tmp_path / "v.gif", backend=backend,
                            negative_prompt=negative).frames


def test_manifests_record_each_lora(lora_export: dict) -> None:
    pipeline = read_pipeline(lora_export["export"])
    loras = lora_export["loras"]

    def entry(name: str) -> dict:
        path, scale = loras[name]
        return {"file": path.name, "path": str(path.resolve()),
                "xxh3_128": digest_file(path).xxh3_128, "scale": scale}

    def recorded(records: list[dict]) -> list[dict]:
        return [{k: r[k] for k in ("file", "path", "xxh3_128", "scale")} for r in records]

    assert recorded(pipeline.components["transformer"].record.loras) == [entry("a"), entry("b")]
    assert recorded(pipeline.components["transformer_2"].record.loras) == [entry("c")]
    assert [(r["component"], r["file"]) for r in pipeline.record.loras] == [
        ("transformer", "a.safetensors"), ("transformer", "b.safetensors"),
        ("transformer_2", "c.safetensors")]
    assert pipeline.components["transformer"].record.loras[0]["layers"] == 21  # 20 + the head
    assert "3 LoRA(s) merged" in lora_export["summary"]


def test_both_experts_are_exported_and_both_run(lora_export: dict) -> None:
    pipeline = read_pipeline(lora_export["export"])
    assert [m.directory.name for m in pipeline.experts] == ["transformer", "transformer_2"]
    boundary = pipeline.boundary_timestep(pipeline.scheduler_config)
    assert boundary == BOUNDARY * 1000
    timesteps = DiffusersSchedule(4, pipeline.scheduler_config).timesteps
    request = WanSampleRequest(frames=5, height=32, width=48, steps=4, guidance=5.0,
                               seed=SEED, boundary_timestep=boundary)
    assert {request.expert(t) for t in timesteps} == {0, 1}  # the test sees the switch


@pytest.mark.parametrize("backend", ["openvino", "torch"])
def test_guided_frames_with_guidance_2_equal_diffusers_fused(lora_export: dict, tmp_path: Path,
                                                             backend: str) -> None:
    expected = _diffusers_frames(lora_export["pipe"], 5.0, 4, negative_prompt=NEGATIVE,
                                 guidance_scale_2=3.0)
    got = _numaov_frames(lora_export["export"], tmp_path, 5.0, 4, backend, guidance_2=3.0,
                         negative_prompt=NEGATIVE)
    error = float(np.max(np.abs(got - expected)))
    print(f"{backend}, guided, guidance_2 3, 3 LoRAs: max |numaov - diffusers| = {error:.3g}")
    assert error <= F32_FRAME_TOL


def test_guidance_2_without_a_second_expert_is_refused(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "numaov.cli", "run", "wan", "--model-dir", str(tmp_path),
         "--frames", "5", "--height", "32", "--width", "32", "--steps", "2", "--guidance", "5",
         "--guidance-2", "3", "--seed", "0", "--text-embeddings", str(tmp_path / "t.npy"),
         "--out", str(tmp_path / "l.npy")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.startswith("numaov: error: --guidance-2: guidance_2=3.0"), proc.stderr


@pytest.mark.parametrize("sampler", ["euler", "unipc"])
def test_guidance_free_few_steps_equal_diffusers(lora_export: dict, tmp_path: Path,
                                                 sampler: str) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    pipe = lora_export["pipe"]
    scheduler = (FlowMatchEulerDiscreteScheduler(shift=5.0) if sampler == "euler" else
                 UniPCMultistepScheduler.from_config(pipe.scheduler.config, flow_shift=5.0))
    expected = _diffusers_frames(pipe, 1.0, 4, scheduler)
    # The torch backend merges the LoRAs again from the files the manifest names.
    backends = ("openvino", "torch") if sampler == "unipc" else ("openvino",)
    for backend in backends:
        got = _numaov_frames(lora_export["export"], tmp_path, 1.0, 4, backend,
                             sampler=sampler, shift=5.0)
        error = float(np.max(np.abs(got - expected)))
        print(f"{backend}, guidance 1, {sampler} shift 5: max |numaov - diffusers| = "
              f"{error:.3g}")
        assert error <= F32_FRAME_TOL
    # The LoRAs show: without them (diffusers' pipeline before the fuse) the frames differ.
    unmerged = build_tiny_pipeline(tmp_path / "plain", seed=SEED, boundary_ratio=BOUNDARY)
    assert float(np.max(np.abs(_diffusers_frames(unmerged, 1.0, 4, scheduler) - expected))) \
        > 100 * F32_FRAME_TOL


def test_torch_backend_refuses_a_changed_lora(lora_export: dict, tmp_path: Path) -> None:
    export = tmp_path / "export"
    shutil.copytree(lora_export["export"], export)
    changed = tmp_path / "c.safetensors"
    musubi_lora(changed, seed=SEED + 3)  # same layout, other weights
    manifest = export / "transformer_2" / "manifest.json"
    record = json.loads(manifest.read_text())
    record["loras"][0]["path"] = str(changed)
    manifest.write_text(json.dumps(record))
    with pytest.raises(SamplerInputError, match="changed since"):
        _numaov_frames(export, tmp_path, 1.0, 2, "torch")


def test_magcache_calibrates_and_skips_each_expert_on_its_own_steps(lora_export: dict,
                                                                    tmp_path: Path) -> None:
    """MagCache on two experts: calibration writes each expert's ratios over the steps it runs
    (beside its own manifest), and each expert then keeps its own state per branch, deciding
    as diffusers' MagCache on that transformer with its own step count (the decisions do not
    depend on the weights, so the base pipeline is the reference)."""
    import json
    import os
    import shutil

    from diffusers.hooks import mag_cache as mc

    from numaov.runtime.wan.step_cache import RATIOS_FILE

    export = tmp_path / "export"
    shutil.copytree(lora_export["export"], export, copy_function=os.link)
    pipeline = read_pipeline(export)
    steps, setting = 12, "magcache:1:2:0"
    fields = {"frames": 9, "height": 48, "width": 32, "steps": steps, "guidance": 5.0,
              "seed": SEED}
    plain = run_wan_pipeline(export, WanSampleRequest(**fields), PROMPT, None,
                             negative_prompt=NEGATIVE)
    calibrated = run_wan_pipeline(export, WanSampleRequest(**fields, cache="magcache:calibrate"),
                                  PROMPT, None, negative_prompt=NEGATIVE)
    assert calibrated.sample.skipped == 0
    assert np.abs(calibrated.frames - plain.frames).max() <= F32_FRAME_TOL
    counts = [len(d) for d in calibrated.sample.cache_decisions[::2]]
    assert len(counts) == 2 and sum(counts) == steps and min(counts) > 0
    ratios = []
    for expert, count in zip(pipeline.experts, counts, strict=True):
        ratios.append(json.loads((export / expert.directory.name / RATIOS_FILE).read_text())[
            "ratios"])
        assert len(ratios[-1]) == count and ratios[-1][0] == 1.0
    cached = run_wan_pipeline(export, WanSampleRequest(**fields, cache=setting), PROMPT, None,
                              negative_prompt=NEGATIVE)
    assert cached.sample.skipped > 0

    pipe = lora_export["pipe"]
    transformers = (pipe.transformer, pipe.transformer_2)
    seen: dict[tuple[int, str], list[bool]] = {}
    head = mc.MagCacheHeadHook.new_forward

    def decided(hook, module, *args, **kwargs):
        output = head(hook, module, *args, **kwargs)
        which = next(k for k, t in enumerate(transformers) if module is t.blocks[0])
        seen.setdefault((which, hook.state_manager.context.name), []).append(
            hook.state_manager.get_state().should_compute)
        return output

    mc.MagCacheHeadHook.new_forward = decided  # (bound when the hooks are registered)
    try:
        for transformer, count, measured in zip(transformers, counts, ratios, strict=True):
            transformer.enable_cache(mc.MagCacheConfig(
                threshold=1.0, max_skip_steps=2, retention_ratio=0.0,
                num_inference_steps=count, mag_ratios=measured))
        _diffusers_frames(pipe, 5.0, steps, negative_prompt=NEGATIVE)
    finally:
        mc.MagCacheHeadHook.new_forward = head
        for transformer in transformers:
            transformer.disable_cache()
    expected = ["".join("C" if d else "." for d in seen[(k, b)])
                for k in (0, 1) for b in ("cond", "uncond")]
    assert cached.sample.cache_decisions == expected

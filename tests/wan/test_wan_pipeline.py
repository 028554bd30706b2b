"""Wan text-to-video end to end: a tiny diffusers pipeline directory exported through the CLI,
numaov's frames against diffusers' ``WanPipeline`` on every backend, the video files, and the
one-line errors."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support.wan_harness import cli_in_process, cli_refusal
from support.wan_pipeline_harness import diffusers_tiling, one_line_error

from numaov.runtime.wan.pipeline import MAX_TEXT_TOKENS, read_pipeline, run_wan_pipeline
from numaov.runtime.wan.request import WanSampleRequest
from numaov.runtime.wan.vae import VaeTiling

pytestmark = pytest.mark.slow  # exports a whole pipeline

SEED = 3  # conftest.WAN_PIPELINE_SEED: the seed the shared export was built with
CLI = [sys.executable, "-m", "numaov.cli"]
PROMPT, NEGATIVE = "a w1 w2 b  &amp; w7", "w3 c"
# Frames are in [0, 1]. The backends compute diffusers' f32 math in another order: each graph
# is within ~1e-6 of PyTorch (the export's parity figures), and 4 scheduler steps, the VAE's
# frame loop and the [-1, 1] -> [0, 1] map keep that order (2e-6 measured). 1e-4 is 1/40 of
# an 8-bit level, while a wrong schedule, prompt encoding, cache or frame order moves pixels by
# 1e-2 and more.
F32_FRAME_TOL = 1e-4
# Odd frame counts (4k+1) and non-square sizes: 5 frames at 32x48 (2 latent frames of 4x6),
# 9 frames at 48x32 (3 latent frames: the next-frame graph runs twice on its own caches).
SIZES = ((5, 32, 48), (9, 48, 32))
STEPS = 4


def _cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def pipeline(wan_pipeline_exported: dict) -> dict:
    return wan_pipeline_exported


def _diffusers_frames(pipe, frames: int, height: int, width: int) -> np.ndarray:
    out = pipe(PROMPT, negative_prompt=NEGATIVE, num_frames=frames, height=height, width=width,
               num_inference_steps=STEPS, guidance_scale=5.0,
               generator=torch.Generator().manual_seed(SEED), output_type="np")
    return out.frames[0]


def test_export_has_every_component_with_parity(pipeline: dict) -> None:
    export = read_pipeline(pipeline["export"])
    assert set(export.components) == {"text_encoder", "transformer", "vae_decoder/first_frame",
                                      "vae_decoder/next_frame"}
    for name, component in export.components.items():
        backends = {f["backend"] for f in component.record.parity}
        assert backends == {"onnxruntime", "openvino"}, name
        assert all(f["rel_error"] <= f["tolerance"] for f in component.record.parity), name
    for copied in ("tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json",
                   "scheduler/scheduler_config.json", "model_index.json"):
        assert copied in export.record.files
    assert "exported wan-pipeline" in pipeline["summary"]


@pytest.mark.parametrize("backend", ["openvino", "onnxruntime", "torch"])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
def test_frames_equal_diffusers(pipeline: dict, backend: str, size: tuple, tmp_path) -> None:
    frames, height, width = size
    expected = _diffusers_frames(pipeline["pipe"], frames, height, width)
    request = WanSampleRequest(frames=frames, height=height, width=width, steps=STEPS,
                               guidance=5.0, seed=SEED)
    result = run_wan_pipeline(pipeline["export"], request, PROMPT, tmp_path / "v.webp",
                              negative_prompt=NEGATIVE, backend=backend)
    assert result.frames.shape == expected.shape == (frames, height, width, 3)
    error = float(np.max(np.abs(result.frames - expected)))
    print(f"{backend} {size}: max |numaov - diffusers| = {error:.3g}")
    assert error <= F32_FRAME_TOL


def test_cli_writes_mp4_and_webp_that_decode_back(pipeline: dict) -> None:
    import av
    from PIL import Image

    root = pipeline["root"]
    for out in (root / "v.mp4", root / "v.webp"):
        proc = _cli("run", "wan", "--model-dir", str(pipeline["export"]), "--prompt", PROMPT,
                    "--frames", "9", "--height", "32", "--width", "48", "--steps", "2",
                    "--guidance", "5", "--seed", "0", "--out", str(out), "--quiet")
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == ""  # --quiet
    with av.open(str(root / "v.mp4")) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    assert len(decoded) == 9 and decoded[0].shape == (32, 48, 3)
    with Image.open(root / "v.webp") as image:
        assert image.n_frames == 9 and image.size == (48, 32)


def test_png_frames_and_npy_latents(pipeline: dict, tmp_path: Path) -> None:
    request = WanSampleRequest(frames=5, height=32, width=48, steps=2, guidance=5.0, seed=0)
    video = run_wan_pipeline(pipeline["export"], request, PROMPT, tmp_path / "frames")
    assert len(list((tmp_path / "frames").glob("frame_*.png"))) == 5
    latents = run_wan_pipeline(pipeline["export"], request, PROMPT, tmp_path / "l.npy")
    assert latents.frames is None
    assert np.array_equal(np.load(tmp_path / "l.npy"), video.sample.latents)
    assert video.sample.latents.shape == (1, 16, 2, 4, 6)


def test_progress_says_elapsed_and_remaining(pipeline: dict, tmp_path: Path) -> None:
    proc = _cli("run", "wan", "--model-dir", str(pipeline["export"]), "--prompt", PROMPT,
                "--frames", "5", "--height", "32", "--width", "32", "--steps", "2",
                "--guidance", "5", "--seed", "0", "--out", str(tmp_path / "v.gif"))
    assert proc.returncode == 0, proc.stderr
    assert "video tokens, about" in proc.stderr
    assert "step 1/2" in proc.stderr and "remaining ~" in proc.stderr
    # what each component held once it had run, against its IR weights
    for what in ("the text encoder", "the transformer(s) on openvino",
                 "the VAE decoder (with the decoded video)"):
        assert re.search(rf"numaov: {re.escape(what)} held [\d.]+ [MG]iB after running "
                         r"\([\d.]+ [MG]iB of IR weights, \d+\.\d\dx\)", proc.stderr), what


def test_doctor_lists_each_graph_with_its_weights(pipeline: dict) -> None:
    from numaov.runtime.wan.memory import COMPILED_WEIGHTS_FACTOR

    code, out, err = cli_in_process("doctor", "--json", str(pipeline["export"]))
    assert code == 0, err
    graphs = json.loads(out)["wan_components"]
    manifest = json.loads((pipeline["export"] / "manifest.json").read_text())
    assert [g["component"] for g in graphs] == manifest["components"]
    for graph in graphs:
        weights = sum(f.stat().st_size for f in (pipeline["export"] / graph["component"])
                      .glob("*.bin"))
        assert graph["weights_bytes"] == weights > 0
        assert graph["compiled_bytes"] == int(weights * COMPILED_WEIGHTS_FACTOR)
    code, out, _ = cli_in_process("doctor", str(pipeline["export"]))
    assert "Wan graphs" in out and "  transformer: " in out


def test_bad_inputs_are_one_line_errors(pipeline: dict, tmp_path: Path) -> None:
    run = ["run", "wan", "--model-dir", str(pipeline["export"]), "--frames", "5", "--height",
           "32", "--width", "32", "--steps", "2", "--guidance", "5", "--seed", "0"]
    one_line_error(cli_refusal(*run, "--prompt", PROMPT, "--out", str(tmp_path / "v.avi")),
                   "--out:", "'.avi'", ".mp4")
    long_prompt = " ".join(["w1"] * (MAX_TEXT_TOKENS + 5))
    one_line_error(cli_refusal(*run, "--prompt", long_prompt, "--out", str(tmp_path / "v.mp4")),
                   "--prompt:", f"{MAX_TEXT_TOKENS + 6} tokens", f"at most {MAX_TEXT_TOKENS}")
    one_line_error(cli_refusal(*run, "--prompt", "a", "--negative-prompt", long_prompt, "--out",
                        str(tmp_path / "v.mp4")), "--negative-prompt:")
    one_line_error(cli_refusal(*run, "--out", str(tmp_path / "v.mp4")), "exactly one of --prompt")
    one_line_error(cli_refusal(*run, "--prompt", "a", "--first-frame-latents", "f.npy", "--out",
                        str(tmp_path / "v.mp4")), "--first-frame-latents: not used with --prompt")
    # Far more than this machine holds: refused with the numbers before anything is allocated.
    big = [*run[:4], "--frames", "81", "--height", "8192", "--width", "8192", *run[10:]]
    one_line_error(cli_refusal(*big, "--prompt", "a", "--out", str(tmp_path / "v.mp4")),
                   "video tokens", "GiB of memory is available")

    # A pipeline directory without its text encoder: the export names it, before any work.
    broken = tmp_path / "pipeline"
    shutil.copytree(pipeline["root"] / "pipeline", broken)
    shutil.rmtree(broken / "text_encoder")
    one_line_error(cli_refusal("export", "wan", "--checkpoint", str(broken), "--out",
                        str(tmp_path / "export")), "--checkpoint:", "'text_encoder'")
    assert not (tmp_path / "export").exists()
    # A text encoder without its weights: transformers' error, made one line.
    shutil.copytree(pipeline["root"] / "pipeline", broken, dirs_exist_ok=True)
    for weights in (broken / "text_encoder").glob("*.safetensors"):
        weights.unlink()
    one_line_error(cli_refusal("export", "wan", "--checkpoint", str(broken), "--out",
                        str(tmp_path / "export"), "--quiet"),  # (no progress lines before it)
                   "UMT5 text encoder in", "cannot be loaded")
    assert not (tmp_path / "export").exists()
    # An export with a component's manifest gone.
    export = tmp_path / "export_copy"
    shutil.copytree(pipeline["export"], export)
    (export / "vae_decoder" / "next_frame" / "manifest.json").unlink()
    one_line_error(cli_refusal(*run[:3], str(export), *run[4:], "--prompt", "a", "--out",
                        str(tmp_path / "v.mp4")), "vae_decoder/next_frame/manifest.json",
                   "missing")
    # A tokenizer.json damaged in place (same size: the manifest's size check passes).
    damaged = tmp_path / "tokenizer_damaged"
    shutil.copytree(pipeline["export"], damaged)
    tokenizer_json = damaged / "tokenizer" / "tokenizer.json"
    text = tokenizer_json.read_bytes()
    tokenizer_json.write_bytes(b"x" + text[1:])
    one_line_error(cli_refusal(*run[:3], str(damaged), *run[4:], "--prompt", "a", "--out",
                        str(tmp_path / "v.mp4")), "the tokenizer in", "cannot be read")
    # A Wan 2.2 two-expert index is named as such, not half exported.
    index = json.loads((pipeline["root"] / "pipeline" / "model_index.json").read_text())
    two = tmp_path / "two_experts"
    shutil.copytree(pipeline["root"] / "pipeline", two)
    (two / "model_index.json").write_text(json.dumps(
        {**index, "transformer_2": ["diffusers", "WanTransformer3DModel"]}))
    one_line_error(cli_refusal("export", "wan", "--checkpoint", str(two), "--out",
                        str(tmp_path / "export2")), "transformer_2")


def test_two_guidance_workers_give_the_same_video(pipeline: dict, tmp_path: Path) -> None:
    request = WanSampleRequest(frames=5, height=32, width=48, steps=3, guidance=5.0, seed=SEED)
    videos = [run_wan_pipeline(pipeline["export"], request, PROMPT, tmp_path / f"v{w}.gif",
                               negative_prompt=NEGATIVE, workers=w).frames
              for w in (1, 2)]
    # Each worker runs one branch at batch 1 instead of both at batch 2: the same f32 math
    # in another order, so the frames tolerance above applies.
    error = float(np.max(np.abs(videos[0] - videos[1])))
    print(f"one vs two workers: max frame difference {error:.3g}")
    assert error <= F32_FRAME_TOL


# 48x64 pixels are 6x8 latents; 32-pixel tiles every 16 (rows) and 24 (columns) pixels make a
# 3 x 3 grid of 4x4-latent tiles with 16- and 8-pixel blends, cut at the bottom and right.
TILING = VaeTiling(min_height=32, min_width=32, stride_height=16, stride_width=24)


def test_tiled_vae_equals_diffusers_and_splits_over_two_workers(pipeline: dict,
                                                               tmp_path: Path) -> None:
    pipe = pipeline["pipe"]
    with diffusers_tiling(pipe, TILING):
        expected = _diffusers_frames(pipe, 5, 48, 64)
    request = WanSampleRequest(frames=5, height=48, width=64, steps=STEPS, guidance=5.0,
                               seed=SEED)
    frames = {w: run_wan_pipeline(pipeline["export"], request, PROMPT, tmp_path / f"v{w}.gif",
                                  negative_prompt=NEGATIVE, workers=w, vae_tiling=TILING).frames
              for w in (1, 2)}
    untiled = _diffusers_frames(pipe, 5, 48, 64)
    # Tiling changes the video (the blends), so equality with tiled diffusers is a real check.
    assert float(np.max(np.abs(expected - untiled))) > 10 * F32_FRAME_TOL
    for workers, got in frames.items():
        error = float(np.max(np.abs(got - expected)))
        print(f"tiled VAE, {workers} worker(s): max |numaov - diffusers| = {error:.3g}")
        assert error <= F32_FRAME_TOL


def test_vae_caches_pass_as_bf16_tensors_at_bf16(pipeline: dict) -> None:
    """At bf16 the VAE's frame loop on OpenVINO hands its caches over as bf16 tensors (both
    frame graphs' ``caches_*`` / ``cache_*``, not the frames), and the decoded video stays
    within the export's bf16 VAE tolerance of the f32 decode, over three latent frames (the
    next-frame graph twice on its own caches, on the two requests in turn)."""
    import openvino as ov

    from numaov.runtime.wan.chunk_loop import CACHE_PREFIXES
    from numaov.runtime.wan.pipeline import VAE_FIRST_FRAME, VAE_NEXT_FRAME
    from numaov.runtime.wan.vae import VaeDecoder

    components = read_pipeline(pipeline["export"]).components
    first, following = components[VAE_FIRST_FRAME], components[VAE_NEXT_FRAME]
    latents = np.random.default_rng(0).standard_normal((1, 16, 3, 6, 4), dtype=np.float32)
    f32 = VaeDecoder(first, following, "openvino")(latents)
    bf16_config = {"INFERENCE_PRECISION_HINT": "bf16"}
    bf16 = VaeDecoder(first, following, "openvino", bf16_config)(latents)
    for manifest in (first, following):
        compiled = manifest.compile_rank(0, bf16_config, bf16_io=CACHE_PREFIXES)
        ports = [*compiled.model.inputs, *compiled.model.outputs]
        types = {p.get_any_name(): p.get_element_type() for p in ports}
        assert all((t == ov.Type.bf16) == name.startswith(CACHE_PREFIXES)
                   for name, t in types.items()), types
        assert any(name.startswith(CACHE_PREFIXES) for name in types)
    assert bf16.shape == f32.shape == (1, 3, 9, 48, 32)
    error = float(np.max(np.abs(bf16 - f32)) / np.max(np.abs(f32)))
    print(f"bf16 caches: max relative difference from the f32 decode {error:.3g}")
    assert 0 < error <= 0.1  # the export's bf16 VAE tolerance; 0: bf16 did not run


def test_memory_estimate_is_within_a_quarter_of_the_measured_growth(pipeline: dict,
                                                                   tmp_path: Path) -> None:
    """The estimate run_wan_pipeline checks and the service admits jobs by, against what a run
    adds to a warm process's anonymous resident memory (sampled every 10 ms). At 512x512 the
    VAE decoder's caches and working memory are most of it, as in a real video."""
    probe = Path(__file__).parents[1] / "support" / "wan_memory_probe.py"
    proc = subprocess.run([sys.executable, str(probe), str(pipeline["export"]), "512", "512",
                           "17", str(tmp_path / "video.mp4")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    print(figures)
    assert figures["described"].startswith("5,120 video tokens, about")
    assert abs(figures["estimate"] - figures["growth"]) <= 0.25 * figures["growth"], figures

"""Wan text to video end to end: numaov on OpenVINO bf16 against diffusers' WanPipeline eager
bf16, in the same run, split per component (text encoder, denoising, VAE decode).

The pipeline is built here with random weights at a small but real width: the transformer at
Wan 2.1 1.3B width (hidden 1536, 12 heads, FFN 8960, text dim 4096) with 2 blocks, the VAE at
its published channel sizes (``AutoencoderKLWan``'s defaults, which are Wan 2.1's), UMT5 at
its published width (d_model 4096, 64 heads, FFN 10240) with 2 layers and a 32k vocabulary
(the embedding lookup's cost does not depend on the vocabulary; the published 256k would add
4 GiB of f32 weights to the export), a word-level tokenizer. It is saved in diffusers' layout,
exported by ``numaov export wan`` at bf16, and both pipelines run the same prompt, seed and
scheduler (UniPC, flow_shift 3) for ``--steps`` steps:

- 17 frames at 256x256 (5 latent frames of 32x32: 1,280 video tokens);
- 33 frames at 480x832 (9 latent frames of 60x104: 14,040 video tokens), with ``--large``.

Per component the best, the median and the range of ``--rounds`` runs (round-robin: numaov,
then diffusers); numaov's
loading and compiling is timed apart ("load"), as diffusers' models are loaded before the run
and its timers see only the forward calls; "total" is each run's whole wall time. With
``--large`` the VAE decode also runs tiled (diffusers' tiling defaults) on one worker and on
two workers of the binding plan (on a one-node machine the cores are split between them).

With ``--cache first-block:THRESHOLD`` (or ``magcache:THRESHOLD``) each configuration also
times the denoising of numaov and diffusers each without and with the step cache (numaov's
``--cache``, diffusers' ``enable_cache``; for MagCache both on the ratios a numaov
``magcache:calibrate`` run measures first) in alternating rounds, with the evaluations skipped
and each side's largest frame change from its uncached run; ``--layers`` sets the
transformer's blocks (a skipped evaluation still runs the embedding and output head, and
with first-block the first block, so the savings need more than the default 2 to show).

With ``--few-step`` each configuration also runs the few-step recipe of step-distillation
LoRAs end to end on both sides: a random rank-32 LoRA in diffusers' layout on every block's
attention and feed-forward projections, merged by ``numaov export wan --lora`` and by
diffusers' ``load_lora_weights`` + ``fuse_lora``, 4 steps of flow-matching Euler at shift 5
without guidance. ``--no-baseline`` leaves the guided end-to-end comparison out.

    python benchmarks/wan_pipeline.py [--steps 2] [--rounds 2] [--large | --configs NAMES]
        [--work DIR] [--layers N] [--cache first-block:T|magcache:T] [--few-step]
        [--no-baseline]

Writes benchmarks/out/wan_pipeline.json. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from machine import cpu_model  # benchmarks/machine.py, beside this file

from numaov.exporter.wan_export import export_wan
from numaov.runtime.placement.binding import plan_for_ranks
from numaov.runtime.wan.pipeline import (
    VAE_FIRST_FRAME,
    VAE_NEXT_FRAME,
    read_pipeline,
    run_wan_pipeline,
)
from numaov.runtime.wan.request import WanSampleRequest
from numaov.runtime.wan.step_cache import RATIOS_FILE, StepCacheSetting
from numaov.runtime.wan.vae import VaeDecoder, VaeTiling, decode_tiles_on_workers, decode_video

OUT = Path(__file__).resolve().parent / "out" / "wan_pipeline.json"
SEED = 0
PROMPT = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12"
CONFIGS = {"17x256x256": (17, 256, 256), "33x480x832": (33, 480, 832)}


def build(directory: Path, layers: int = 2):
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    torch.manual_seed(SEED)
    words = ["<pad>", "</s>", "<unk>", *(f"w{i}" for i in range(1000))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>",
                                                       special_tokens=[("</s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                        unk_token="<unk>", model_max_length=512)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=2, num_heads=64,
        relative_attention_num_buckets=32, relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0)).eval()
    vae = AutoencoderKLWan().eval()
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
        out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=layers,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads").eval()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=3.0)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                       transformer=transformer, scheduler=scheduler)
    pipe.save_pretrained(directory)
    return pipe


class _Timer:
    """Seconds spent in a module's forward (or a method), summed over a run."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def diffusers_cache_config(cache: str, steps: int, ratios: list[float] | None = None):
    """diffusers' config for numaov's ``--cache`` setting ``cache`` (MagCache with
    ``ratios``, the ones numaov calibrated)."""
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig

    setting = StepCacheSetting.parse(cache)
    if setting.kind == "first-block":
        return FirstBlockCacheConfig(threshold=setting.threshold)
    return MagCacheConfig(threshold=setting.threshold, max_skip_steps=setting.max_skip,
                          retention_ratio=setting.retention, num_inference_steps=steps,
                          mag_ratios=ratios)


def run_diffusers(pipe, size, steps: int, cache: object = None, frames: dict | None = None,
                  guidance: float = 5.0) -> dict[str, float]:
    """diffusers' run, timed per component; ``cache`` (``diffusers_cache_config``'s) turns on
    its step cache for the run; ``frames`` (a dict) receives the frames."""
    if cache is not None:
        pipe.transformer.enable_cache(cache)
    timers = {"text_encoder": _Timer(), "denoise": _Timer(), "vae_decode": _Timer()}
    originals = (pipe.text_encoder.forward, pipe.transformer.forward, pipe.vae.decode)
    pipe.text_encoder.forward = timers["text_encoder"].wrap(originals[0])
    pipe.transformer.forward = timers["denoise"].wrap(originals[1])
    pipe.vae.decode = timers["vae_decode"].wrap(originals[2])
    try:
        start = time.perf_counter()
        with torch.inference_mode():
            video = pipe(PROMPT, num_frames=size[0], height=size[1], width=size[2],
                         num_inference_steps=steps, guidance_scale=guidance,
                         generator=torch.Generator().manual_seed(SEED), output_type="np")
        total = time.perf_counter() - start
    finally:
        pipe.text_encoder.forward, pipe.transformer.forward, pipe.vae.decode = originals
        if cache is not None:
            pipe.transformer.disable_cache()
    if frames is not None:
        frames["frames"] = video.frames[0]
    return {**{k: t.seconds for k, t in timers.items()}, "total": total}


def run_numaov(export: Path, size, steps: int, out: Path | None, cache: str | None = None,
               frames: dict | None = None, guidance: float = 5.0,
               sampler: str | None = None, shift: float | None = None,
               tiled: bool = False) -> dict[str, float]:
    request = WanSampleRequest(frames=size[0], height=size[1], width=size[2], steps=steps,
                               guidance=guidance, seed=SEED, cache=cache, sampler=sampler,
                               shift=shift)
    start = time.perf_counter()
    result = run_wan_pipeline(export, request, PROMPT, out,
                              vae_tiling=VaeTiling() if tiled else None)
    if frames is not None:
        frames["frames"], frames["skipped"] = result.frames, result.sample.skipped
    return {**result.seconds, "total": time.perf_counter() - start}


def cached_rounds(export: Path, pipe, size, steps: int, rounds: int, cache: str) -> dict:
    """numaov and diffusers, each without and with the step cache, in alternating rounds:
    denoising seconds (medians and ranges), each side's cached speed-up, the evaluations
    numaov skipped and how far each side's cached frames are from its uncached ones."""
    runs: dict[str, list[float]] = {k: [] for k in ("numaov", "numaov_cached", "diffusers",
                                                    "diffusers_cached")}
    frames: dict[str, dict] = {k: {} for k in runs}
    ratios = None
    if StepCacheSetting.parse(cache).kind == "magcache":  # both sides on numaov's ratios
        print(f"step cache {cache}: calibrating", file=sys.stderr)
        run_numaov(export, size, steps, None, "magcache:calibrate")
        ratios = json.loads((export / "transformer" / RATIOS_FILE).read_text())["ratios"]
    config = diffusers_cache_config(cache, steps, ratios)
    for r in range(rounds):
        print(f"step cache {cache}: round {r + 1}/{rounds}", file=sys.stderr)
        runs["numaov"].append(run_numaov(export, size, steps, None, None,
                                         frames["numaov"])["denoise"])
        runs["numaov_cached"].append(run_numaov(export, size, steps, None, cache,
                                                frames["numaov_cached"])["denoise"])
        runs["diffusers"].append(run_diffusers(pipe, size, steps, None,
                                               frames["diffusers"])["denoise"])
        runs["diffusers_cached"].append(run_diffusers(pipe, size, steps, config,
                                                      frames["diffusers_cached"])["denoise"])
    median = {k: float(np.median(v)) for k, v in runs.items()}
    entry = {
        "cache": cache, "denoise_median_seconds": median,
        "denoise_range_seconds": {k: [min(v), max(v)] for k, v in runs.items()},
        "evaluations": 2 * steps, "numaov_skipped": frames["numaov_cached"]["skipped"],
        "cache_speedup": {"numaov": median["numaov"] / median["numaov_cached"],
                          "diffusers": median["diffusers"] / median["diffusers_cached"]},
        "numaov_cached_vs_diffusers_cached": median["diffusers_cached"]
        / median["numaov_cached"],
        "max_frame_change": {side: float(np.abs(frames[f"{side}_cached"]["frames"]
                                                - frames[side]["frames"]).max())
                             for side in ("numaov", "diffusers")},
    }
    print(f"  step cache {cache}: denoise medians {median}; numaov skipped "
          f"{entry['numaov_skipped']} of {2 * steps}; cached speed-up numaov "
          f"{entry['cache_speedup']['numaov']:.2f}x, diffusers "
          f"{entry['cache_speedup']['diffusers']:.2f}x; numaov cached "
          f"{entry['numaov_cached_vs_diffusers_cached']:.2f}x diffusers cached; largest frame "
          f"change from uncached: {entry['max_frame_change']}")
    return entry


# (b) the few-step recipe of distilled LoRAs (lightx2v's): 4 steps of flow-matching Euler at
# shift 5 without guidance, the LoRA merged.
FEW_STEPS, FEW_SHIFT, LORA_RANK = 4, 5.0, 32
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]


def write_lora(transformer, path: Path) -> Path:
    """A random rank-``LORA_RANK`` LoRA on every block's attention and feed-forward
    projections (a step-distillation LoRA's layers), in diffusers' layout."""
    import copy

    from diffusers import WanPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    maker = copy.deepcopy(transformer).float()
    config = LoraConfig(r=LORA_RANK, lora_alpha=1, target_modules=LORA_TARGETS,
                        init_lora_weights=False)
    torch.manual_seed(SEED + 1)
    maker.add_adapter(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    WanPipeline.save_lora_weights(path.parent, transformer_lora_layers=get_peft_model_state_dict(
        maker), weight_name=path.name, transformer_lora_adapter_metadata=config.to_dict())
    return path


def few_step_rounds(root: Path, size, rounds: int) -> dict:
    """numaov (the LoRA merged at export, ``--guidance 1 --scheduler euler --shift 5``) and
    diffusers (``load_lora_weights`` + ``fuse_lora``, ``FlowMatchEulerDiscreteScheduler``,
    ``guidance_scale=1``), end to end in alternating rounds; above 256x256 both decode in
    tiles (diffusers' tiling defaults: untiled, numaov's estimate of the VAE's memory at
    33x480x832 is more than this 24 GiB machine has beside diffusers' pipeline)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    from numaov.models.wan.lora import LoraSpec

    pipe = WanPipeline.from_pretrained(root / "pipeline")
    lora = root / "lora" / "few_step_lora.safetensors"
    if not lora.is_file():
        write_lora(pipe.transformer, lora)
    export = root / "export_lora"
    if not (export / "manifest.json").is_file():
        print("exporting the pipeline with the LoRA merged (bf16)", file=sys.stderr)
        export_wan(root / "pipeline", export, precision="bf16", loras=[LoraSpec(lora)],
                   reuse=root / "export")
    pipe.load_lora_weights(lora)
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=FEW_SHIFT)
    pipe.to(torch.bfloat16)
    tiled = size[1] * size[2] > 256 * 256
    if tiled:
        pipe.vae.enable_tiling()
    rows: dict[str, list[dict[str, float]]] = {"numaov": [], "diffusers": []}
    for r in range(rounds):
        print(f"few-step: round {r + 1}/{rounds}", file=sys.stderr)
        rows["numaov"].append(run_numaov(export, size, FEW_STEPS, None, guidance=1.0,
                                         sampler="euler", shift=FEW_SHIFT, tiled=tiled))
        rows["diffusers"].append(run_diffusers(pipe, size, FEW_STEPS, guidance=1.0))
    return {"steps": FEW_STEPS, "guidance": 1.0, "shift": FEW_SHIFT, "lora_rank": LORA_RANK,
            "vae_tiled": tiled, **compare(rows)}


def compare(rows: dict[str, list[dict[str, float]]]) -> dict:
    """Per component: both sides' best, median and range, and diffusers over numaov."""
    best = {who: {k: min(run[k] for run in runs) for k in runs[0]}
            for who, runs in rows.items()}
    median = {who: {k: float(np.median([run[k] for run in runs])) for k in runs[0]}
              for who, runs in rows.items()}
    spread = {who: {k: [min(run[k] for run in runs), max(run[k] for run in runs)]
                    for k in runs[0]} for who, runs in rows.items()}
    return {"best_seconds": best, "median_seconds": median, "range_seconds": spread,
            "speedup": {k: best["diffusers"][k] / best["numaov"][k] for k in best["numaov"]
                        if k in best["diffusers"]},
            "median_speedup": {k: median["diffusers"][k] / median["numaov"][k]
                               for k in median["numaov"] if k in median["diffusers"]}}


def print_comparison(title: str, entry: dict) -> None:
    best, median, spread = (entry[k] for k in ("best_seconds", "median_seconds",
                                                "range_seconds"))
    print(f"{title}:")
    for key, ratio in entry["speedup"].items():
        lo, hi = spread["numaov"][key]
        dlo, dhi = spread["diffusers"][key]
        print(f"  {key:13s} numaov {best['numaov'][key]:8.2f} s  diffusers "
              f"{best['diffusers'][key]:8.2f} s  {ratio:.2f}x  (medians "
              f"{median['numaov'][key]:.2f} [{lo:.2f}-{hi:.2f}] / "
              f"{median['diffusers'][key]:.2f} [{dlo:.2f}-{dhi:.2f}] s, "
              f"{entry['median_speedup'][key]:.2f}x)")
    print(f"  numaov load and compile {best['numaov']['load']:.2f} s")


def vae_workers(export: Path, size) -> dict[str, float]:
    """Tiled VAE decode of random latents on one worker (this process) and on two."""
    pipeline = read_pipeline(export)
    first, following = pipeline.components[VAE_FIRST_FRAME], pipeline.components[VAE_NEXT_FRAME]
    latents = np.random.default_rng(SEED).standard_normal(
        (1, 16, (size[0] - 1) // 4 + 1, size[1] // 8, size[2] // 8), dtype=np.float32)
    tiling = VaeTiling()
    start = time.perf_counter()
    one = decode_video(VaeDecoder(first, following, "openvino"), latents, tiling)
    seconds = {"tiled_one_worker": time.perf_counter() - start}
    start = time.perf_counter()
    two = decode_video(None, latents, tiling,
                       decode_tiles_on_workers(plan_for_ranks(2), first, following, "openvino"))
    seconds["tiled_two_workers"] = time.perf_counter() - start
    seconds["max_abs_difference"] = float(np.max(np.abs(one - two)))
    return seconds


def write_results(path: Path, results: dict) -> None:
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2,
                        help="guided steps of the baseline and of --cache's runs")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="the guided end-to-end comparison (--no-baseline: only --cache's "
                        "or --few-step's)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--large", action="store_true", help="also 33 frames at 480x832")
    parser.add_argument("--configs", help="comma-separated subset of " + ", ".join(CONFIGS)
                        + " (default: the first, with --large both)")
    parser.add_argument("--work", type=Path, help="keep the pipeline and its export here "
                        "(reused when present; default: a temporary directory)")
    parser.add_argument("--layers", type=int, default=2,
                        help="transformer blocks (default 2; Wan 2.1 1.3B has 30)")
    parser.add_argument("--cache", metavar="first-block:T|magcache:T",
                        help="also time both sides with this step cache (numaov's --cache, "
                        "diffusers' enable_cache; MagCache on the ratios numaov calibrates "
                        "first), denoising only, and compare the frames")
    parser.add_argument("--few-step", action="store_true",
                        help=f"also time {FEW_STEPS} steps at guidance 1 (Euler, shift "
                        f"{FEW_SHIFT:g}) with a random rank-{LORA_RANK} LoRA merged, end to end")
    args = parser.parse_args()
    names = (args.configs.split(",") if args.configs
             else list(CONFIGS) if args.large else ["17x256x256"])
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"--configs {','.join(unknown)}: expected names among {', '.join(CONFIGS)}")
    configs = {n: CONFIGS[n] for n in names}
    results: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model(),
        "steps": args.steps, "rounds": args.rounds, "layers": args.layers, "configs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = args.work or Path(tmp)
        print("building and exporting the pipeline (bf16)", file=sys.stderr)
        pipe = build(root / "pipeline", args.layers)
        if not (root / "export" / "manifest.json").is_file():
            start = time.perf_counter()
            export_wan(root / "pipeline", root / "export", precision="bf16")
            results["export_seconds"] = round(time.perf_counter() - start, 1)
        pipe.to(torch.bfloat16)
        for name, size in configs.items():
            rows: dict[str, list[dict[str, float]]] = {"numaov": [], "diffusers": []}
            for r in range(args.rounds if args.baseline else 0):
                print(f"{name}: round {r + 1}/{args.rounds}", file=sys.stderr)
                rows["numaov"].append(run_numaov(root / "export", size, args.steps,
                                                 root / f"{name}.mp4"))
                rows["diffusers"].append(run_diffusers(pipe, size, args.steps))
            entry = compare(rows) if args.baseline else {}
            if name == "33x480x832" and args.baseline:
                entry["vae_workers"] = vae_workers(root / "export", size)
            if args.cache:
                entry["step_cache"] = cached_rounds(root / "export", pipe, size, args.steps,
                                                    args.rounds, args.cache)
            if args.few_step:
                entry["few_step"] = few_step_rounds(root, size, args.rounds)
                print_comparison(f"{name}, {FEW_STEPS} steps at guidance 1 with a merged LoRA",
                                 entry["few_step"])
            results["configs"][name] = entry
            if args.baseline:
                print_comparison(name, entry)
            if "vae_workers" in entry:
                print(f"  tiled VAE: {entry['vae_workers']}")
    write_results(OUT, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

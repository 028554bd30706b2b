"""Wan 2.2 I2V's image conditioning: numaov's exported VAE encoder on OpenVINO against
diffusers' ``WanImageToVideoPipeline.prepare_latents`` eager, in the same run.

The conditioning is the part of image to video that text to video does not have: the image
followed by ``frames - 1`` zero frames encoded by the VAE encoder (diffusers' ``_encode``
loop: the first frame, then chunks of 4), normalised, with the first-frame mask in front.
The pipeline is built here with random weights: the VAE at its published channel sizes
(``AutoencoderKLWan``'s defaults, Wan 2.1's, which Wan 2.2 I2V A14B ships), a tiny text
encoder and one tiny 36-channel transformer (only the encoding is timed). It is saved in
diffusers' layout and exported by ``numaov export wan`` at ``--precision`` (the encoder graphs
are f32 at every precision, see ``ENCODER_PRECISION`` in ``exporter/wan_pipeline_export.py``);
diffusers runs its VAE in ``--precision``'s dtype. Rounds alternate (numaov, then diffusers); per competitor the
median and the range of ``--rounds`` runs, numaov's compile timed apart ("load"), and the
largest difference between the two condition tensors.

    python benchmarks/wan_i2v_encode.py [--precision bf16] [--rounds 3] [--frames 17]
        [--height 256] [--width 256]

Writes benchmarks/out/wan_i2v_encode.json. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from wan_pipeline import cpu_model, write_results

from numaov.exporter.wan_export import export_wan
from numaov.models.builtin.tiny_text_encoder import tiny_umt5_encoder, word_tokenizer
from numaov.runtime.wan.image_condition import ImageEncoder
from numaov.runtime.wan.image_input import read_image
from numaov.runtime.wan.pipeline import VAE_ENCODER, VAE_ENCODER_NEXT, read_pipeline

OUT = Path(__file__).resolve().parent / "out" / "wan_i2v_encode.json"
SEED = 0
WORDS = ["<pad>", "</s>", "<unk>", *(f"w{i}" for i in range(60))]


def build(directory: Path):
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanImageToVideoPipeline,
        WanTransformer3DModel,
    )

    torch.manual_seed(SEED)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=36,
        out_channels=16, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=1,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=1024).eval()
    pipe = WanImageToVideoPipeline(
        tokenizer=word_tokenizer(WORDS), text_encoder=tiny_umt5_encoder(len(WORDS), 32),
        vae=AutoencoderKLWan().eval(), transformer=transformer,
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction",
                                          use_flow_sigmas=True, flow_shift=3.0))
    pipe.save_pretrained(directory)
    return pipe


def run_numaov(encoder: ImageEncoder, pixels: np.ndarray, frames: int) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    channels = encoder(pixels, frames).channels
    return time.perf_counter() - start, channels


def run_diffusers(pipe, image: torch.Tensor, frames: int) -> tuple[float, np.ndarray]:
    height, width = image.shape[-2:]
    start = time.perf_counter()
    with torch.inference_mode():
        _, condition = pipe.prepare_latents(image, 1, 16, height, width, frames, torch.float32,
                                            torch.device("cpu"),
                                            torch.Generator().manual_seed(SEED))
    return time.perf_counter() - start, condition.float().numpy()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=("f32", "bf16"), default="bf16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--height", type=int, default=256)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--work", type=Path, help="keep the pipeline and its export here "
                        "(reused when present; default: a temporary directory)")
    args = parser.parse_args()
    frames, height, width = args.frames, args.height, args.width
    results: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model(),
        "precision": args.precision, "rounds": args.rounds, "size": [frames, height, width],
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = args.work or Path(tmp)
        print(f"building and exporting the pipeline ({args.precision})", file=sys.stderr)
        pipe = build(root / "pipeline")
        if not (root / "export" / "manifest.json").is_file():
            start = time.perf_counter()
            export_wan(root / "pipeline", root / "export", precision=args.precision)
            results["export_seconds"] = round(time.perf_counter() - start, 1)
        if args.precision == "bf16":
            pipe.vae.to(torch.bfloat16)
        from PIL import Image

        rng = np.random.default_rng(SEED)
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
            root / "first.png")
        pixels = read_image(root / "first.png", height, width)
        image = torch.from_numpy(pixels[:, :, 0])  # [1, 3, H, W], as VideoProcessor gives
        pipeline = read_pipeline(root / "export")
        start = time.perf_counter()
        encoder = ImageEncoder(pipeline.components[VAE_ENCODER],
                               pipeline.components[VAE_ENCODER_NEXT], "openvino",
                               pipeline.vae_temporal_factor)
        results["numaov_load_seconds"] = round(time.perf_counter() - start, 2)
        seconds: dict[str, list[float]] = {"numaov": [], "diffusers": []}
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
            t, ours = run_numaov(encoder, pixels, frames)
            seconds["numaov"].append(t)
            t, theirs = run_diffusers(pipe, image, frames)
            seconds["diffusers"].append(t)
        results["seconds"] = seconds
        results["median_seconds"] = {k: float(np.median(v)) for k, v in seconds.items()}
        results["median_speedup"] = (results["median_seconds"]["diffusers"]
                                     / results["median_seconds"]["numaov"])
        results["max_abs_difference"] = float(np.max(np.abs(ours - theirs)))
        results["condition_max_abs"] = float(np.max(np.abs(theirs)))
    for who, values in seconds.items():
        print(f"{who:9s} median {np.median(values):7.2f} s  range "
              f"[{min(values):.2f}-{max(values):.2f}] s")
    print(f"numaov / diffusers: {results['median_speedup']:.2f}x (medians); load and compile "
          f"{results['numaov_load_seconds']} s; max |numaov - diffusers| "
          f"{results['max_abs_difference']:.3g} of max |condition| "
          f"{results['condition_max_abs']:.3g}")
    write_results(OUT, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

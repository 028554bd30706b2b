"""Train the built-in ``next-digit`` LoRA for ``digits-wan``: prompted with digit k, the
pipeline with this LoRA merged draws digit k + 1 (9 draws 0), moving as prompted.

    python -m numaov.models.builtin.train_digits_lora [--out DIR] [--seed 0]

A LoRA in the layout diffusers' Wan loader reads (``WanPipeline.save_lora_weights``: PEFT
keys ``transformer.blocks.N.attn2.to_q.lora_A.weight``, rank ``RANK``, alpha = rank, so scale
1), on the projections of every block's self- and cross-attention and feed-forward of the
committed transformer, trained by the same flow matching as the transformer itself
(``train_digits_wan.train_transformer``: the committed VAE's latents, the prompt dropped to ""
a tenth of the time), on clips of digit k + 1 under the prompts of digit k. It shows what
``numaov export wan --lora`` is for: a small adapter, trained for minutes, changes what a
model draws, and the export merges it into the weights it ships.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from numaov import NumaovError
from numaov.models.builtin.digit_clips import DIRECTIONS, all_prompts, load_digit_images
from numaov.models.builtin.train_digits_wan import (
    DEFAULT_OUT as DIGITS_WAN_DIR,
)
from numaov.models.builtin.train_digits_wan import (
    clip_set,
    encode_latents,
    prompt_embeddings,
    scaled_latents,
    train_transformer,
)
from numaov.models.builtin.training_run import set_up_threads, training_main

DEFAULT_OUT = Path(__file__).parent / "digits-wan-next-digit-lora"
WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' default LoRA file name
RANK = 16
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]
STEPS, LR = 3000, 3e-3


def next_digit_prompts(prompt_index: np.ndarray) -> np.ndarray:
    """Each clip's prompt moved to the digit before its own (the clip of digit k + 1 is what
    the prompt of digit k should draw), the direction kept."""
    directions = len(DIRECTIONS)
    digit, direction = prompt_index // directions, prompt_index % directions
    return (digit - 1) % 10 * directions + direction


def train(out: Path, seed: int = 0, threads: int = 1, say=print,
          base: Path = DIGITS_WAN_DIR, steps: int | None = None) -> dict[str, float]:
    """Train the LoRA on ``base`` (the committed digits-wan) for ``steps`` (default
    ``STEPS``) and save it to ``out``; returns the figures."""
    from diffusers import WanPipeline
    from diffusers.utils import logging as diffusers_logging
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    if not (base / "model_index.json").is_file():
        raise NumaovError(f"no digits-wan pipeline in {str(base)!r} (model_index.json missing); "
                          "expected the directory train_digits_wan saved", parameter="base")
    steps = STEPS if steps is None else steps
    set_up_threads(threads)
    started = time.perf_counter()
    torch.manual_seed(seed)
    diffusers_logging.disable_progress_bar()  # no environment variable turns it off
    pipe = WanPipeline.from_pretrained(base)
    transformer, vae = pipe.transformer, pipe.vae.eval()
    images, labels = load_digit_images()
    clips, prompt_index = clip_set(images, labels, np.random.default_rng(seed))
    latents = scaled_latents(vae, encode_latents(vae, clips))

    text = prompt_embeddings(pipe, [p for _, _, p in all_prompts()])
    empty = prompt_embeddings(pipe, [""])[0]
    transformer.requires_grad_(False)
    config = LoraConfig(r=RANK, lora_alpha=RANK, target_modules=TARGETS, init_lora_weights=True)
    transformer.add_adapter(config)
    trained = sum(p.numel() for p in transformer.parameters() if p.requires_grad)
    say(f"{len(clips)} clips; a rank-{RANK} LoRA of {trained} parameters on {TARGETS}")
    flow_mse = train_transformer(transformer, latents, next_digit_prompts(prompt_index), text,
                                 empty, torch.Generator().manual_seed(seed), say, steps=steps,
                                 lr=LR)
    out.mkdir(parents=True, exist_ok=True)
    WanPipeline.save_lora_weights(out, transformer_lora_layers=get_peft_model_state_dict(
        transformer), weight_name=WEIGHT_NAME, transformer_lora_adapter_metadata=config.to_dict())
    figures = {"seed": seed, "base": base.name, "rank": RANK, "alpha": RANK,
               "targets": TARGETS, "parameters": trained, "steps": steps, "lr": LR,
               "flow_mse": round(flow_mse, 5),
               "seconds": round(time.perf_counter() - started, 1),
               "threads": torch.get_num_threads()}
    (out / "training.json").write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    say(f"saved {out / WEIGHT_NAME} in {figures['seconds']:.0f} s")
    return figures


def main(argv: list[str] | None = None) -> int:
    return training_main(__doc__, DEFAULT_OUT, train, argv)


if __name__ == "__main__":
    raise SystemExit(main())

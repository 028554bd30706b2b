"""A tiny Wan 2.1 text-to-video pipeline in diffusers' real layout, built in the test.

Every component is the real class at a tiny size, seeded: a word-level tokenizer built with
``tokenizers`` (saved as tokenizer.json + tokenizer_config.json), transformers'
``UMT5EncoderModel``, diffusers' ``AutoencoderKLWan``, ``WanTransformer3DModel`` and the
``UniPCMultistepScheduler`` with ``flow_shift`` that Wan's published pipelines ship, saved
with ``WanPipeline.save_pretrained``. Nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from numaov.models.builtin.tiny_text_encoder import tiny_umt5_encoder, word_tokenizer

WORDS = ["<pad>", "</s>", "<unk>", *(f"w{i}" for i in range(60)), *"abcdefghijklmnopqrstuvwxyz"]
TEXT_DIM = 32
SHARED_COMPONENTS_SEED = 3


# Wan 2.2 TI2V-5B's VAE options (its vae/config.json) at a tiny width: 48 latent channels,
# residual up/down blocks, 2x2 patches in and out, 16x spatial compression.
TI2V_Z_DIM = 48


# Wan 2.2 I2V A14B's transformer input: 16 latent channels, 4 first-frame mask channels (the
# VAE's temporal factor) and 16 channels of the encoded condition video.
I2V_IN_CHANNELS = 16 + 4 + 16


def _tiny_transformer(channels: int = 16, in_channels: int | None = None) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
        in_channels=in_channels or channels, out_channels=channels, text_dim=TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,
    ).eval()


def _tiny_vae(ti2v: bool) -> torch.nn.Module:
    from diffusers import AutoencoderKLWan

    if not ti2v:
        return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                temperal_downsample=[False, True, True]).eval()
    # Latent statistics away from 0 / 1, so a graph that skipped de-normalising fails.
    generator = torch.Generator().manual_seed(1)
    mean = (torch.randn(TI2V_Z_DIM, generator=generator) * 0.5).tolist()
    std = (torch.rand(TI2V_Z_DIM, generator=generator) + 0.5).tolist()
    return AutoencoderKLWan(
        base_dim=8, decoder_base_dim=16, z_dim=TI2V_Z_DIM, dim_mult=[1, 2, 2, 2],
        num_res_blocks=1, temperal_downsample=[False, True, True], is_residual=True,
        in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
        latents_mean=mean, latents_std=std,
    ).eval()


def build_tiny_pipeline(directory: Path, seed: int = 0,
                        boundary_ratio: float | None = None, ti2v: bool = False,
                        i2v: bool = False) -> object:
    """Save a tiny ``WanPipeline`` to ``directory``; returns the pipeline (in memory).

    ``boundary_ratio`` makes it a Wan 2.2 A14B-style pipeline with a second expert
    (``transformer_2``) taking the steps below ``boundary_ratio * 1000``; ``ti2v`` a Wan 2.2
    TI2V-5B-style one (``expand_timesteps``, the 48-channel VAE with 2x2 patches and 16x
    spatial compression); ``i2v`` a Wan 2.2 I2V A14B-style ``WanImageToVideoPipeline`` (no
    image encoder; transformers taking the mask and condition channels beside the latents)."""
    from diffusers import (
        UniPCMultistepScheduler,
        WanImageToVideoPipeline,
        WanPipeline,
    )

    # The text encoder and VAE the same in every pipeline (of one VAE kind), so an export can
    # take them from the session's shared one (`export wan --reuse`); the transformers by seed.
    torch.manual_seed(SHARED_COMPONENTS_SEED)
    fast = word_tokenizer(WORDS)
    text_encoder = tiny_umt5_encoder(len(WORDS), TEXT_DIM)
    vae = _tiny_vae(ti2v)
    torch.manual_seed(seed)
    channels = TI2V_Z_DIM if ti2v else 16
    in_channels = I2V_IN_CHANNELS if i2v else channels
    transformer = _tiny_transformer(channels, in_channels)
    transformer_2 = (_tiny_transformer(channels, in_channels) if boundary_ratio is not None
                     else None)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=3.0)
    pipe = (WanImageToVideoPipeline if i2v else WanPipeline)(tokenizer=fast, text_encoder=text_encoder, vae=vae,
                       transformer=transformer, scheduler=scheduler,
                       transformer_2=transformer_2, boundary_ratio=boundary_ratio,
                       expand_timesteps=ti2v)
    pipe.save_pretrained(directory)
    return pipe


def export_tiny_pipeline(root: Path, seed: int, reuse: Path | None = None,
                         **options: object) -> dict:
    """``build_tiny_pipeline(root / "pipeline", seed, **options)`` exported to
    ``root / "export"`` (a module's one export, shared by its tests), taking what it can from
    the export ``reuse``; ``progress`` lists the export's progress lines."""
    from numaov.exporter.wan_export import export_wan

    print(f"seed {seed}")
    pipe = build_tiny_pipeline(root / "pipeline", seed=seed, **options)
    progress: list[str] = []
    export_wan(root / "pipeline", root / "export", reuse=reuse, progress=progress.append)
    return {"root": root, "pipe": pipe, "export": root / "export", "progress": progress}


@contextmanager
def diffusers_tiling(pipe: object, tiling: object) -> Iterator[None]:
    """diffusers' tiled VAE decoding with ``tiling``'s (a ``VaeTiling``) sizes, then off."""
    pipe.vae.enable_tiling(tile_sample_min_height=tiling.min_height,
                           tile_sample_min_width=tiling.min_width,
                           tile_sample_stride_height=tiling.stride_height,
                           tile_sample_stride_width=tiling.stride_width)
    try:
        yield
    finally:
        pipe.vae.disable_tiling()


def write_image(path: Path, height: int, width: int, seed: int = 0) -> Path:
    """A seeded random RGB PNG of ``width`` x ``height`` pixels: a first frame to condition on."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
    return path


def wan_prompt_embeds(pipe: object, prompt: str, negative: str) -> tuple:
    """The prompts encoded by ``WanPipeline`` from ``pipe``'s tokenizer and text encoder, for
    diffusers' image-to-video pipeline: diffusers 0.42's image-to-video ``prompt_clean`` calls
    ftfy unguarded (WanPipeline's only when it is installed, as numaov's tokenize does), and
    ``encode_prompt``'s default length is 226, its ``__call__``'s (and numaov's) 512."""
    from diffusers import WanPipeline

    t2v = WanPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae,
                      scheduler=pipe.scheduler, transformer=pipe.transformer)
    return t2v.encode_prompt(prompt, negative_prompt=negative, max_sequence_length=512)


def export_without(export: Path, copy: Path, component: str) -> Path:
    """A copy of the pipeline export ``export`` at ``copy`` whose manifest lost ``component``."""
    import json
    import shutil

    shutil.copytree(export, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["components"].remove(component)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def one_line_error(proc: object, *needles: str) -> str:
    """A ``numaov`` process's failure: exit code 1 and one ``numaov: error:`` line on stderr
    holding every needle; returns the line."""
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("numaov: error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]

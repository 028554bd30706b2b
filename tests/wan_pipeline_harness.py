"""A tiny Wan 2.1 text-to-video pipeline in diffusers' real layout, built in the test.

Every component is the real class at a tiny size, seeded: a word-level tokenizer built with
``tokenizers`` (saved as tokenizer.json + tokenizer_config.json), transformers'
``UMT5EncoderModel``, diffusers' ``AutoencoderKLWan``, ``WanTransformer3DModel`` and the
``UniPCMultistepScheduler`` with ``flow_shift`` that Wan's published pipelines ship, saved
with ``WanPipeline.save_pretrained``. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = ["<pad>", "</s>", "<unk>", *(f"w{i}" for i in range(60)), *"abcdefghijklmnopqrstuvwxyz"]
TEXT_DIM = 32


def _tiny_transformer() -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
        out_channels=16, text_dim=TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,
    ).eval()


def build_tiny_pipeline(directory: Path, seed: int = 0,
                        boundary_ratio: float | None = None) -> object:
    """Save a tiny ``WanPipeline`` to ``directory``; returns the pipeline (in memory).

    ``boundary_ratio`` makes it a Wan 2.2 A14B-style pipeline with a second expert
    (``transformer_2``) taking the steps below ``boundary_ratio * 1000``."""
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanPipeline,
    )
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    # T5's template: the prompt's tokens, then the end-of-sequence token.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", 1)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=512)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(WORDS), d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16,
        feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )).eval()
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    transformer = _tiny_transformer()
    transformer_2 = _tiny_transformer() if boundary_ratio is not None else None
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=3.0)
    pipe = WanPipeline(tokenizer=fast, text_encoder=text_encoder, vae=vae,
                       transformer=transformer, scheduler=scheduler,
                       transformer_2=transformer_2, boundary_ratio=boundary_ratio)
    pipe.save_pretrained(directory)
    return pipe

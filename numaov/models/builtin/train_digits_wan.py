"""Train the built-in ``digits-wan`` pipeline: a tiny Wan 2.1 text-to-video model of
scikit-learn's handwritten digits drifting left, right, up or down.

    python -m numaov.models.builtin.train_digits_wan [--out DIR] [--seed 0] [--transformer-only]

Every component is the real diffusers / transformers class, saved with
``WanPipeline.save_pretrained`` in the layout ``numaov export wan`` reads:

1. the tokenizer: a word-level ``tokenizers`` vocabulary of the prompts' words;
2. the text encoder: a UMT5 encoder left at its seeded random weights (the prompts are
   40 fixed sentences; the transformer learns to read its outputs);
3. the VAE (``AutoencoderKLWan``): 4x spatial and 2x temporal compression (16x16 frames are
   4x4 latents; 5 frames are 3 latent frames) with Wan 2.2's residual up and down blocks,
   trained as an autoencoder on the posterior's mean, moved by a little noise (L1 plus
   squared error of the clips); ``latents_mean`` / ``latents_std`` are measured on the data;
4. the transformer (``WanTransformer3DModel``): trained by flow matching on the VAE's
   latents, as Wan's flow-prediction scheduler samples it (``x_s = (1 - s) x + s noise``,
   target ``noise - x``, timestep ``1000 s``, ``s`` drawn with the scheduler's shift), with
   the prompt dropped to "" a tenth of the time so classifier-free guidance works.

Seeded; step counts, not time, bound each phase, so a run repeats exactly on one machine.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from numaov import NumaovError
from numaov.models.builtin.digit_clips import (
    DIRECTIONS,
    DigitJudge,
    all_prompts,
    load_digit_images,
    make_clip,
)
from numaov.models.builtin.tiny_text_encoder import tiny_umt5_encoder, word_tokenizer
from numaov.models.builtin.training_run import (
    one_cycle_adamw,
    optimizer_step,
    set_up_threads,
    training_main,
)

DEFAULT_OUT = Path(__file__).parent / "digits-wan"
FLOW_SHIFT = 3.0
TEXT_DIM = 32
WORDS = ["<pad>", "</s>", "<unk>", "a", "handwritten", "moving",
         *(str(d) for d in range(10)), *DIRECTIONS]
VAE_STEPS, VAE_BATCH = 1500, 8
# The decoder trains on latents moved by noise of this share of their spread per channel: the
# denoiser's latents are never the encoder's exact ones.
LATENT_NOISE = 0.1
TRANSFORMER_STEPS, TRANSFORMER_BATCH = 8000, 32
TRANSFORMER_LR = 3e-3
UNCONDITIONAL_RATE = 0.1
RECONSTRUCTED_DIGITS = 50  # real digits (x 4 directions) whose reconstructions are judged


def build_components(seed: int) -> dict[str, object]:
    """The untrained pipeline components, seeded."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel

    torch.manual_seed(seed)
    fast = word_tokenizer(WORDS)
    text_encoder = tiny_umt5_encoder(len(WORDS), TEXT_DIM)
    # Two levels, not Wan 2.1's three: at 8x a 16x16 frame is a 2x2 latent, through which
    # no variant measured (model card) reconstructed a digit the judge reads. The residual
    # blocks' shortcuts (space to channels and back, as Wan 2.2's VAE) and 2x temporal
    # compression left the average-blob plateau several times sooner than plain blocks and
    # 4x (judged 46% at 600 steps, against 21% and 8%). diffusers takes both factors from the
    # config, not from the levels: they are set to match.
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2], num_res_blocks=1,
                           temperal_downsample=[True, False], is_residual=True,
                           scale_factor_spatial=4, scale_factor_temporal=2)
    # Width 96 (6 heads of 16): at width 64 every training length and learning rate measured
    # stayed near 90% judged right, a digit or two at 60-75% of 20 clips; width 96 at 8000
    # steps drew 98-99%, six layers of width 64 (12000 steps, about three times the time)
    # 93% (model card, "Runs measured").
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=6, attention_head_dim=16, in_channels=16,
        out_channels=16, text_dim=TEXT_DIM, freq_dim=64, ffn_dim=384, num_layers=4,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,
    )
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=FLOW_SHIFT)
    return {"tokenizer": fast, "text_encoder": text_encoder, "vae": vae,
            "transformer": transformer, "scheduler": scheduler}


def clip_set(images: np.ndarray, labels: np.ndarray, rng: np.random.Generator,
             ) -> tuple[torch.Tensor, np.ndarray]:
    """Every digit in every direction once: ``[N, 3, F, H, W]`` in [-1, 1] and the index of
    each clip's prompt in ``all_prompts()``."""
    names = list(DIRECTIONS)
    clips, prompt_index = [], []
    for image, label in zip(images, labels, strict=True):
        for k, name in enumerate(names):
            clips.append(make_clip(image, name, rng))
            prompt_index.append(int(label) * len(names) + k)
    grey = torch.from_numpy(np.stack(clips)).unsqueeze(1) * 2.0 - 1.0  # [N, 1, F, H, W]
    return grey.expand(-1, 3, -1, -1, -1).contiguous(), np.array(prompt_index)


def decode_unclamped(vae: torch.nn.Module, z: torch.Tensor) -> torch.Tensor:
    """``AutoencoderKLWan.decode`` without its final clamp to [-1, 1]: the clamp has no
    gradient outside that range, and the background (-1) pulled every pixel there within 40
    steps, after which the decoder learnt nothing. The same frame loop as diffusers'
    ``_decode`` (no tiling, no patch size)."""
    vae.clear_cache()
    x = vae.post_quant_conv(z)
    frames = []
    for i in range(x.shape[2]):
        vae._conv_idx = [0]
        frames.append(vae.decoder(x[:, :, i : i + 1], feat_cache=vae._feat_map,
                                  feat_idx=vae._conv_idx, first_chunk=i == 0))
    vae.clear_cache()
    return torch.cat(frames, 2)


def train_vae(vae: torch.nn.Module, clips: torch.Tensor, generator: torch.Generator,
              say) -> float:
    optimizer, schedule = one_cycle_adamw(vae.parameters(), 3e-3, VAE_STEPS, weight_decay=0.0,
                                          fused=True)
    vae.train()
    mse = torch.tensor(0.0)
    for step in range(VAE_STEPS):
        batch = clips[torch.randint(len(clips), (VAE_BATCH,), generator=generator)]
        # An autoencoder on the posterior's mean, no draw from its learnt variance: that starts
        # at 1 (log-variance 0) against a mean of ~0.01, and noise of that size drowned the
        # mean for every step this budget allows (the decoder learnt the average clip). The
        # noise here scales with the latents' own spread instead (LATENT_NOISE), so the
        # decoder learns to draw a digit from latents near the encoder's, as the denoiser's
        # are. The latents are normalised afterwards (latents_mean / latents_std), as Wan's.
        z = vae.encode(batch).latent_dist.mean
        spread = z.detach().std(dim=(0, 2, 3, 4), keepdim=True)
        z = z + LATENT_NOISE * spread * torch.randn(z.shape, generator=generator)
        error = decode_unclamped(vae, z) - batch
        # L1 with the squared error: L1 keeps pulling on the strokes' pixels once the squared
        # error of the blob is small, the squared error keeps the first steps as fast.
        mse = error.pow(2).mean()
        loss = error.abs().mean() + mse
        optimizer_step(loss, optimizer, schedule)
        if step % 20 == 0 or step == VAE_STEPS - 1:
            say(f"vae step {step}: reconstruction mse {mse.item():.4f}")
    vae.eval()
    return float(mse.item())


@torch.no_grad()
def judged_reconstructions(vae: torch.nn.Module, judge: DigitJudge, seed: int,
                           count: int = RECONSTRUCTED_DIGITS) -> float:
    """The share of the VAE's reconstructions of real clips that the judge labels as their
    digit: what the decoder draws from the encoder's exact latents, a check that it draws
    digits at all (the denoiser's clips, each digit's typical strokes, are read more often).
    Its own random generator, so measuring it leaves the training draws as they were."""
    images, labels = load_digit_images()
    rng = np.random.default_rng(seed + 1)
    rows = rng.choice(len(images), count, replace=False)
    clips, prompt_index = clip_set(images[rows], labels[rows], rng)
    reconstruction = decode_unclamped(vae, encode_latents(vae, clips))
    grey = ((reconstruction[:, 0].clamp(-1, 1) + 1) / 2).numpy()
    return float((judge.clip_labels(grey) == prompt_index // len(DIRECTIONS)).mean())


@torch.no_grad()
def encode_latents(vae: torch.nn.Module, clips: torch.Tensor) -> torch.Tensor:
    return torch.cat([vae.encode(clips[i : i + 256]).latent_dist.mean
                      for i in range(0, len(clips), 256)])


def scaled_latents(vae: torch.nn.Module, mu: torch.Tensor) -> torch.Tensor:
    """Encoded clips ``[N, 16, F', h, w]`` scaled by the VAE's ``latents_mean`` /
    ``latents_std``, as the pipeline scales the latents the transformer sees."""
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return (mu - mean) / std


@torch.no_grad()
def prompt_embeddings(pipe, prompts: list[str]) -> torch.Tensor:
    """``[P, 512, D]`` text embeddings exactly as WanPipeline (and numaov's runtime) feed the
    transformer: the prompt's tokens, then zeros."""
    embeds, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False,
                                   max_sequence_length=512)
    return embeds.float()


SHORT_CONTEXT = 8  # text rows kept in training: every prompt's tokens, then zero rows


class PaddingWeightedCrossAttention:
    """Wan's cross-attention processor, over a prompt's tokens and a few of the zero rows that
    pad it to the 512 the pipeline feeds, each zero row's logit raised by ``log`` of how many
    padding rows it stands for. Every padding row gives the same key and value (the text
    projection, the key norm and the projections act per row), so the softmax over the short
    context equals the one over all 512 rows, while each training step costs 3.6x less (0.022
    s against 0.080 at batch 16, one thread, width 64: the 512 rows' projections were most of a
    step). ``tests/test_builtin_models.py`` checks the equality on the built-in transformer."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.bias: torch.Tensor | None = None  # [B, 1, 1, SHORT_CONTEXT], set per batch

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None):
        return self.inner(attn, hidden_states, encoder_hidden_states, self.bias, rotary_emb)


def padding_bias(text: torch.Tensor, full_length: int) -> torch.Tensor:
    """``[B, 1, 1, L]`` additive logits for ``text`` (``[B, L, D]``, a prompt's rows then zero
    rows), cut from a ``full_length``-row context: 0 on a token, ``log(padding rows in the
    full context / padding rows kept)`` on a zero row."""
    padding = (text == 0).all(dim=-1)  # [B, L]
    if not padding.any(dim=1).all():
        raise NumaovError(f"a prompt fills the {text.shape[1]} text rows kept; expected a padding "
                          "row after each prompt's tokens to stand for the rest")
    kept = padding.sum(dim=1, keepdim=True)
    full = kept + (full_length - text.shape[1])
    bias = torch.where(padding, torch.log(full.float() / kept.float()), torch.zeros(()))
    return bias[:, None, None, :]


def short_context(transformer: torch.nn.Module) -> list[PaddingWeightedCrossAttention]:
    """Put :class:`PaddingWeightedCrossAttention` on every block's cross-attention."""
    processors = []
    for block in transformer.blocks:
        processors.append(PaddingWeightedCrossAttention(block.attn2.processor))
        block.attn2.set_processor(processors[-1])
    return processors


def full_context(transformer: torch.nn.Module,
                 processors: list[PaddingWeightedCrossAttention]) -> None:
    """Give the blocks back the processors :func:`short_context` wrapped."""
    for block, processor in zip(transformer.blocks, processors, strict=True):
        block.attn2.set_processor(processor.inner)


def train_transformer(transformer: torch.nn.Module, latents: torch.Tensor,
                      prompt_index: np.ndarray, text: torch.Tensor, empty: torch.Tensor,
                      generator: torch.Generator, say, steps: int | None = None,
                      lr: float = TRANSFORMER_LR) -> float:
    """Flow matching over the short context (:class:`PaddingWeightedCrossAttention`):
    ``text`` and ``empty`` are the pipeline's 512-row embeddings, cut here. Only the
    parameters that require a gradient train (all, or a LoRA's), for ``steps`` (default
    ``TRANSFORMER_STEPS``)."""
    steps = TRANSFORMER_STEPS if steps is None else steps
    full_length = text.shape[1]
    text, empty = text[:, :SHORT_CONTEXT], empty[:SHORT_CONTEXT]
    padding_bias(text, full_length)  # every prompt leaves a padding row (else it says so)
    processors = short_context(transformer)
    trained = [p for p in transformer.parameters() if p.requires_grad]
    optimizer, schedule = one_cycle_adamw(trained, lr, steps, weight_decay=0.01, fused=True)
    index = torch.from_numpy(prompt_index)
    transformer.train()
    loss = torch.tensor(0.0)
    for step in range(steps):
        rows = torch.randint(len(latents), (TRANSFORMER_BATCH,), generator=generator)
        x = latents[rows]
        context = text[index[rows]]
        drop = torch.rand(TRANSFORMER_BATCH, generator=generator) < UNCONDITIONAL_RATE
        context = torch.where(drop[:, None, None], empty, context)
        bias = padding_bias(context, full_length)
        for processor in processors:
            processor.bias = bias
        u = torch.rand(TRANSFORMER_BATCH, generator=generator)
        sigma = FLOW_SHIFT * u / (1 + (FLOW_SHIFT - 1) * u)  # the scheduler's shifted sigmas
        noise = torch.randn(x.shape, generator=generator)
        s = sigma.view(-1, 1, 1, 1, 1)
        noisy = (1 - s) * x + s * noise
        prediction = transformer(noisy, timestep=sigma * 1000, encoder_hidden_states=context,
                                 return_dict=False)[0]
        loss = (prediction - (noise - x)).pow(2).mean()
        optimizer_step(loss, optimizer, schedule, clip=trained)
        if step % 100 == 0 or step == steps - 1:
            say(f"transformer step {step}: flow-matching mse {loss.item():.4f}")
    full_context(transformer, processors)
    transformer.eval()
    return float(loss.item())


def train(out: Path, seed: int = 0, threads: int = 1, say=print,
          transformer_only: bool = False) -> dict[str, float]:
    """Train every component and save the pipeline to ``out``; returns the figures. With
    ``transformer_only`` the VAE is the one already saved in ``out`` (its weights and latent
    statistics): only the transformer is trained and saved, and ``training.json`` keeps the
    VAE's figures from the run that trained it."""
    from diffusers import AutoencoderKLWan, WanPipeline

    set_up_threads(threads)
    started = time.perf_counter()
    parts = build_components(seed)
    generator = torch.Generator().manual_seed(seed)
    images, labels = load_digit_images()
    clips, prompt_index = clip_set(images, labels, np.random.default_rng(seed))
    say(f"{len(clips)} clips of {tuple(clips.shape[2:])} frames x pixels")

    if transformer_only:
        missing = [str(out / name) for name in ("vae/config.json", "training.json")
                   if not (out / name).is_file()]
        if missing:
            raise NumaovError(f"no trained VAE to start from: {', '.join(missing)} missing; "
                              "expected a directory this script saved", parameter="out")
        parts["vae"] = AutoencoderKLWan.from_pretrained(out / "vae").eval()
        figures = json.loads((out / "training.json").read_text(encoding="utf-8"))
        mu = encode_latents(parts["vae"], clips)
    else:
        vae_mse = train_vae(parts["vae"], clips, generator, say)
        vae_seconds = time.perf_counter() - started
        vae_judged = judged_reconstructions(parts["vae"], DigitJudge.fit(), seed)
        say(f"the judge labels {vae_judged:.0%} of the VAE's reconstructions of real clips right")
        mu = encode_latents(parts["vae"], clips)  # [N, 16, F', h, w]
        parts["vae"].register_to_config(latents_mean=mu.mean(dim=(0, 2, 3, 4)).tolist(),
                                        latents_std=mu.std(dim=(0, 2, 3, 4)).tolist())
        figures = {"seed": seed, "clips": len(clips), "vae_steps": VAE_STEPS,
                   "vae_mse": round(vae_mse, 5), "vae_judged": round(vae_judged, 3),
                   "vae_seconds": round(vae_seconds, 1)}
    latents = scaled_latents(parts["vae"], mu)

    pipe = WanPipeline(**parts)
    prompts = [p for _, _, p in all_prompts()]
    text = prompt_embeddings(pipe, prompts)
    empty = prompt_embeddings(pipe, [""])[0]
    # The transformer phase draws from its own generator, so it reruns the same from a saved
    # VAE (``transformer_only``).
    transformer_started, transformer_cpu = time.perf_counter(), time.process_time()
    flow_mse = train_transformer(parts["transformer"], latents, prompt_index, text, empty,
                                 torch.Generator().manual_seed(seed), say)
    figures.update({
        "transformer_steps": TRANSFORMER_STEPS, "transformer_batch": TRANSFORMER_BATCH,
        "flow_mse": round(flow_mse, 5),
        "transformer_seconds": round(time.perf_counter() - transformer_started, 1),
        "transformer_cpu_seconds": round(time.process_time() - transformer_cpu, 1),
        "transformer_only": transformer_only, "seconds": round(time.perf_counter() - started, 1),
        "threads": torch.get_num_threads()})
    out.mkdir(parents=True, exist_ok=True)
    if transformer_only:
        parts["transformer"].save_pretrained(out / "transformer")
    else:
        pipe.save_pretrained(out)
    (out / "training.json").write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    say(f"saved {out} in {figures['seconds']:.0f} s")
    return figures


def main(argv: list[str] | None = None) -> int:
    return training_main(__doc__, DEFAULT_OUT, train, argv, flags={
        "--transformer-only": "train only the transformer, from the VAE already saved in --out"})


if __name__ == "__main__":
    raise SystemExit(main())

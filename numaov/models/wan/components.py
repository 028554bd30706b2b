"""The Wan pipeline's other components as graphs: the UMT5 text encoder, the VAE decoder and
encoder.

Both wrap the reference implementations as published (transformers' ``UMT5EncoderModel``,
diffusers' ``AutoencoderKLWan``), loaded from a diffusers pipeline directory's
``text_encoder/`` and ``vae/``, so the exported graphs and the PyTorch backend compute what
diffusers' ``WanPipeline`` does.

- ``TextEncoderGraph(input_ids [B, S], attention_mask [B, S]) -> [B, S, D]``: UMT5's last
  hidden state.
- The VAE decoder runs one latent frame at a time with a cache of the last two frames each
  causal convolution saw (diffusers' ``_decode`` loop). The loop is the runtime's; the graphs
  are its two bodies, the cache made explicit:

  - ``VaeFirstFrameGraph(latents [B, C, 1, h, w]) -> (frames [B, 3, 1, 8h, 8w], cache_0, ...)``
  - ``VaeNextFrameGraph(latents [B, C, 1, h, w], cache_0, ...) -> (frames [B, 3, 4, 8h, 8w],
    cache_0, ...)``

  Every cache is ``[B, C_l, 2, h_l, w_l]``. diffusers' first chunk leaves one frame in most
  caches and the marker ``"Rep"`` (no cache: zero padding) in the temporal upsamplers; both
  are the same as two frames with zeros in front, because a causal convolution pads with
  zeros, so the graphs always pass two frames and the next-frame graph is one graph for every
  later frame. The latents come in as the transformer sees them; the graphs de-normalise
  them (``z * std + mean``, diffusers' pipeline before ``vae.decode``). The output is not
  clamped: tiles are blended before diffusers clamps, so the runtime clamps at the end.
  With Wan 2.2's VAE (``patch_size=2``) the frames are the decoder's patched output
  ``[B, 12, T, 8h, 8w]`` (16x spatial in all), unpatchified by the runtime after blending.
- The VAE encoder runs the same way, diffusers' ``_encode`` loop (the first frame alone, then
  chunks of 4 frames) with its caches made explicit:

  - ``VaeImageEncoderGraph(image [B, 3, 1, H, W] in [-1, 1]) -> (latents [B, C, 1, H/s, W/s],
    cache_0, ...)``: the encoder's first chunk on one image, the posterior's mode (diffusers'
    ``retrieve_latents(..., sample_mode="argmax")``), normalised as the transformer sees
    latents (``(z - mean) / std``): the conditioning first frame of Wan 2.2 TI2V's
    image-to-video (which uses the latents only), and the first latent frame of a video;
  - ``VaeNextFramesEncoderGraph(video [B, 3, 4, H, W], cache_0, ...) -> (latents [B, C, 1,
    H/s, W/s], cache_0, ...)``: every later chunk of 4 frames, one latent frame. Wan 2.1 /
    2.2 I2V A14B encode the image followed by zero frames this way.

  The encoder's caches are two frames too: its causal convolutions' one-frame caches after
  the first chunk get zeros in front as the decoder's do, and its temporal downsamplers read
  only the last frame of theirs, so two frames with the real one last are the same to them.
  ``quant_conv`` is a 1x1x1 convolution, so applying it per chunk (here) or to the joined
  chunks (diffusers) is the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from numaov import exception_text
from numaov.manifest import (
    TEXT_ENCODER_KIND,
    VAE_ENCODER_KIND,
    VAE_ENCODER_NEXT_KIND,
    VAE_FIRST_FRAME_KIND,
    VAE_NEXT_FRAME_KIND,
)


class TextEncoderGraph(torch.nn.Module):
    """UMT5's encoder as one graph: token ids and mask in, last hidden state out."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def load_text_encoder(directory: str | Path,
                      weights_dtype: torch.dtype = torch.float32) -> TextEncoderGraph:
    """``text_encoder/`` of a pipeline directory (transformers ``UMT5EncoderModel``), computing
    in f32. ``weights_dtype=torch.bfloat16`` holds the weights in bf16 (transformers keeps its
    ``_keep_in_fp32_modules`` in f32), each widened where it is read (``compute_in_f32``): what
    a bf16 export traces, with no f32 copy of UMT5-XXL's 5.7 B parameters.

    Eager attention: the same math as the default, and what ``torch.export`` captures whole.
    """
    from transformers import UMT5EncoderModel

    from numaov.models.checkpoint import compute_in_f32

    with _loading(directory, "UMT5 text encoder"):
        model = UMT5EncoderModel.from_pretrained(
            str(directory), torch_dtype=weights_dtype, attn_implementation="eager"
        )
    compute_in_f32(model)
    return TextEncoderGraph(model.eval()).eval()


def _two_frames(cache: torch.Tensor) -> torch.Tensor:
    """A causal convolution's cache as two frames: a one-frame ``[B, C, 1, h, w]`` gets zeros
    in front (what the convolution pads with), so every later chunk's graph takes one shape."""
    if cache.shape[2] == 1:
        return torch.cat([torch.zeros_like(cache), cache], dim=2)
    return cache


def _rms_norm(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """diffusers' ``WanRMS_norm.forward`` (``F.normalize(x) * scale * gamma + bias``) as one
    reduction and a product: ``x / max(|x|, eps)`` is ``x * rsqrt(max(sum(x^2), eps^2))``.
    ``F.normalize`` exports as ReduceL2, a clamp, an Expand of the norm to the input's shape
    and a Div; OpenVINO ran that Expand on its reference kernel (90 ms of a 2.1 s next-frame
    call at 17x256x256, and its Swish after it in f32). The decoder's next-frame call takes
    1.8 s this way; the frames agree with diffusers' to f32 rounding."""
    dim = 1 if self.channel_first else -1
    inverse = torch.rsqrt(torch.clamp((x * x).sum(dim=dim, keepdim=True), min=1e-24))
    return x * (inverse * self.scale) * self.gamma + self.bias


def _export_rms_norms(module: torch.nn.Module) -> None:
    """Give every ``WanRMS_norm`` under ``module`` the export-friendly :func:`_rms_norm`."""
    import types

    from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

    for norm in module.modules():
        if isinstance(norm, WanRMS_norm):
            norm.forward = types.MethodType(_rms_norm, norm)


class _VaeFrameGraph(torch.nn.Module):
    first = False

    def __init__(self, vae: torch.nn.Module) -> None:
        super().__init__()
        self.vae = vae
        config = vae.config
        z_dim = int(config.z_dim)
        self.register_buffer("latents_mean", torch.tensor(config.latents_mean).view(1, z_dim, 1, 1, 1))
        self.register_buffer("latents_std", torch.tensor(config.latents_std).view(1, z_dim, 1, 1, 1))
        self._slots = int(vae._cached_conv_counts["decoder"])
        _export_rms_norms(vae.decoder)
        # Inputs of the temporal upsamplers in the first frame: their "Rep" becomes zeros.
        self._upsampler_shapes: dict[int, tuple[Any, ...]] = {}
        from diffusers.models.autoencoders.autoencoder_kl_wan import WanResample, WanUpsample

        for module in vae.decoder.modules():
            if isinstance(module, WanResample) and module.mode == "upsample3d":
                module.register_forward_pre_hook(self._record_upsampler_input, with_kwargs=True)
            if (isinstance(module, WanUpsample) and module.mode == "nearest-exact"
                    and all(float(f).is_integer() for f in module.scale_factor)):
                # At an integer scale "nearest" picks the same pixels as "nearest-exact"
                # (floor(i / s) = floor((i + 0.5) / s)), and exports as one ONNX Resize instead
                # of an index computation ending in a GatherND. OpenVINO 2026.4's bf16 AMX
                # convolution (brgconv_avx512_amx_bf16) that reads that GatherND's result
                # crashes (segmentation fault) at 192x192 and larger; behind Interpolate it runs.
                module.mode = "nearest"

    def _record_upsampler_input(self, _module: Any, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs["x"]
        self._upsampler_shapes[kwargs["feat_idx"][0]] = tuple(x.shape)

    def _decode(
        self, latents: torch.Tensor, caches: list[torch.Tensor | None]
    ) -> tuple[torch.Tensor, ...]:
        z = latents * self.latents_std + self.latents_mean
        x = self.vae.post_quant_conv(z)
        cache: list[Any] = caches + [None] * (self._slots - len(caches))
        used = [0]
        self._upsampler_shapes.clear()
        frames = self.vae.decoder(x, feat_cache=cache, feat_idx=used, first_chunk=self.first)
        out = []
        for slot, entry in enumerate(cache[: used[0]]):
            if isinstance(entry, str):  # "Rep": no cache yet, i.e. zeros
                b, c, _, h, w = self._upsampler_shapes[slot]
                entry = frames.new_zeros(b, c, 2, h, w)
            out.append(_two_frames(entry))
        return (frames, *out)

    def cache_slots(self, latents: torch.Tensor) -> list[torch.Tensor]:
        """The caches the first frame leaves for ``latents`` (to size the next-frame graph)."""
        with torch.no_grad():
            return list(VaeFirstFrameGraph(self.vae)(latents[:, :, :1])[1:])


class VaeFirstFrameGraph(_VaeFrameGraph):
    """The first latent frame: 1 video frame and the caches for the next."""

    first = True

    def forward(self, latents: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self._decode(latents, [])


class VaeNextFrameGraph(_VaeFrameGraph):
    """Every later latent frame: 4 video frames and the updated caches."""

    def forward(self, latents: torch.Tensor, caches: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return self._decode(latents, list(caches))


class _VaeEncoderChunkGraph(torch.nn.Module):
    """One chunk of diffusers' ``_encode`` loop: patchify, the encoder with its caches,
    ``quant_conv``, the posterior's mean normalised; returns the latents and the caches."""

    def __init__(self, vae: torch.nn.Module) -> None:
        super().__init__()
        self.vae = vae
        z_dim = int(vae.config.z_dim)
        self.z_dim = z_dim
        self.register_buffer("latents_mean", torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1))
        self.register_buffer("latents_std", torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1))
        self._slots = int(vae._cached_conv_counts["encoder"])
        _export_rms_norms(vae.encoder)

    def _encode(self, video: torch.Tensor,
                caches: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        from diffusers.models.autoencoders.autoencoder_kl_wan import patchify

        patch = self.vae.config.patch_size
        x = video if patch is None else patchify(video, patch_size=patch)
        cache: list[Any] = list(caches) + [None] * (self._slots - len(caches))
        used = [0]
        moments = self.vae.quant_conv(self.vae.encoder(x, feat_cache=cache, feat_idx=used))
        latents = (moments[:, : self.z_dim] - self.latents_mean) / self.latents_std
        return (latents, *(_two_frames(entry) for entry in cache[: used[0]]))

    def cache_slots(self, image: torch.Tensor) -> list[torch.Tensor]:
        """The caches the first chunk leaves for ``image`` (to size the next-frames graph)."""
        with torch.no_grad():
            return list(VaeImageEncoderGraph(self.vae)(image[:, :, :1])[1:])


class VaeImageEncoderGraph(_VaeEncoderChunkGraph):
    """One image to its normalised first-frame latents and the encoder's caches."""

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self._encode(image, [])


class VaeNextFramesEncoderGraph(_VaeEncoderChunkGraph):
    """Every later chunk of 4 video frames to one latent frame, with the updated caches."""

    def forward(self, video: torch.Tensor,
                caches: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return self._encode(video, list(caches))


class GraphInputs(torch.nn.Module):
    """A graph module called with its ONNX graph's flat input names: the next-frame graph's
    cache list is ``caches_0``, ``caches_1``, ... there (and ``cache_0``, ... among outputs)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, **feeds: torch.Tensor) -> Any:
        if not isinstance(self.module, (VaeNextFrameGraph, VaeNextFramesEncoderGraph)):
            return self.module(**feeds)
        caches = [feeds[f"caches_{i}"] for i in range(len(feeds) - 1)]
        frames = "latents" if isinstance(self.module, VaeNextFrameGraph) else "video"
        return self.module(feeds[frames], caches)


def load_vae(directory: str | Path) -> torch.nn.Module:
    """``vae/`` of a pipeline directory (diffusers ``AutoencoderKLWan``), in f32."""
    from diffusers import AutoencoderKLWan

    with _loading(directory, "Wan VAE"):
        return AutoencoderKLWan.from_pretrained(str(directory), torch_dtype=torch.float32).eval()


@contextlib.contextmanager
def _loading(directory: str | Path, what: str) -> Iterator[None]:
    """transformers' and diffusers' loaders fail on a broken component (missing or truncated
    weights, a config its weights do not fit) with their own exceptions and multi-line text:
    one line of CheckpointError naming the directory instead."""
    from numaov.models.checkpoint import CheckpointError

    try:
        yield
    except (OSError, RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{what} in {str(directory)!r} cannot be loaded: "
                              f"{exception_text(exc, 300)}; "
                              "expected the component as diffusers saves it") from None


def load_component(kind: str, directory: str | Path) -> torch.nn.Module:
    """The PyTorch module exported as a component of ``kind`` from ``directory``."""
    if kind == TEXT_ENCODER_KIND:
        return load_text_encoder(directory)
    if kind == VAE_FIRST_FRAME_KIND:
        return VaeFirstFrameGraph(load_vae(directory)).eval()
    if kind == VAE_NEXT_FRAME_KIND:
        return VaeNextFrameGraph(load_vae(directory)).eval()
    if kind == VAE_ENCODER_KIND:
        return VaeImageEncoderGraph(load_vae(directory)).eval()
    if kind == VAE_ENCODER_NEXT_KIND:
        return VaeNextFramesEncoderGraph(load_vae(directory)).eval()
    raise ValueError(f"unknown component kind {kind!r}")

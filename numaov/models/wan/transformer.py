"""The Wan 2.1 / 2.2 video Diffusion Transformer, written on numaov's fallback ops.

Semantics follow diffusers' ``WanTransformer3DModel`` (the public checkpoint
layout): the parameter names are diffusers' state-dict names, so a diffusers
checkpoint directory (``config.json`` plus ``diffusion_pytorch_model.safetensors``
or a sharded ``*.safetensors.index.json``) loads directly with
:meth:`WanTransformer.from_pretrained`.

What differs from diffusers is how the model is written, so that one definition
serves eager PyTorch and ``torch.onnx.export(dynamo=True)`` with batch, frames,
height, width and text length dynamic:

- modulation, norms, the gated residual and rotary embedding are one call each
  to :mod:`numaov.custom_ops`, whose ONNX face OpenVINO fuses (RMS, MVN, RoPE);
- the 3-D RoPE tables are computed from the runtime video shape with torch ops
  (no table of ``rope_max_seq_len`` rows to slice, no numpy);
- self-attention q/k channels are stored in half-split order per head, so the
  rotary embedding lowers to OpenVINO's fused ``RoPE`` without transposes (the
  state dict still reads and writes diffusers' order; see :class:`WanAttention`);
- per-frame timesteps (Wan 2.2 TI2V) are ``[B, F]`` and give ``[B, F, 1, C]``
  modulation rows that the ops broadcast over each frame's tokens, instead of
  diffusers' per-token ``[B, L]`` timesteps expanded to ``[B, L, 6, C]``;
- no data-dependent Python control flow: the only branches are on tensor
  *rank* and on the configuration, both fixed when a graph is exported.

Text-to-video checkpoints (Wan 2.1 T2V, Wan 2.2 T2V/TI2V) are supported; the
image-conditioned variants (``image_dim`` / ``added_kv_proj_dim`` set) are
refused with a clear error.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx.experimental.symbolic_shapes import optimization_hint

from numaov import NumaovError
from numaov.custom_ops import (
    fuse_scale_shift,
    norm_infer,
    rotary_embedding,
    scale_residual_norm_scale_shift,
)
from numaov.models.checkpoint import (
    CheckpointError,
    load_into_module,
    open_safetensors_checkpoint,
    read_config,
    read_state_dict,
)
from numaov.models.wan.lora import WanLora, check_loras_fit, merge_loras
from numaov.models.wan.sequence_parallel import RankTokens, SequenceSplit, check_sequence_split

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
DIFFUSERS_CLASS_NAME = "WanTransformer3DModel"

# Parameters diffusers keeps in fp32 when the model runs in bf16/fp16
# (WanTransformer3DModel._keep_in_fp32_modules; its norm1/norm3 have no parameters): the
# timestep MLP and the modulation tables feed every block's scale/shift/gate, and the
# cross-attention norm weights are applied in the fp32 part of the norm; rounding them to bf16
# would move the output for no speed gain.
KEEP_IN_FP32 = ("time_embedder", "scale_shift_table", "norm2")

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class WanConfigError(NumaovError):
    """A Wan config.json value is missing, mistyped or not supported."""


class WanInputError(NumaovError):
    """Inputs to the Wan transformer have shapes that do not fit the model."""


@dataclass(frozen=True)
class WanTransformerConfig:
    """diffusers' ``WanTransformer3DModel`` config, same key names and defaults.

    The defaults are Wan 2.1 T2V 14B's; ``from_dict`` reads a diffusers ``config.json``.
    """

    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int | None = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: str | None = "rms_norm_across_heads"
    eps: float = 1e-6
    image_dim: int | None = None
    added_kv_proj_dim: int | None = None
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None

    def __post_init__(self) -> None:
        # JSON gives lists; the frozen dataclass stores the tuple.
        if isinstance(self.patch_size, list):
            object.__setattr__(self, "patch_size", tuple(self.patch_size))
        if isinstance(self.eps, int) and not isinstance(self.eps, bool):
            object.__setattr__(self, "eps", float(self.eps))
        self._validate()

    def _validate(self) -> None:
        def fail(key: str, expected: str) -> WanConfigError:
            value = getattr(self, key)
            return WanConfigError(f"Wan config: {key}={value!r} is invalid; expected {expected}")

        def int_at_least(value: Any, minimum: int = 1) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= minimum

        patch = self.patch_size
        if not (isinstance(patch, tuple) and len(patch) == 3 and all(map(int_at_least, patch))):
            raise fail("patch_size", "three positive integers [t, h, w]")
        for key in (
            "num_attention_heads",
            "attention_head_dim",
            "in_channels",
            "text_dim",
            "freq_dim",
            "ffn_dim",
            "rope_max_seq_len",
        ):
            if not int_at_least(getattr(self, key)):
                raise fail(key, "a positive integer")
        # 0 layers is legal (diffusers allows it): embeddings and head only, which is how the
        # cost outside the blocks is measured.
        if not int_at_least(self.num_layers, minimum=0):
            raise fail("num_layers", "a non-negative integer")
        if self.out_channels is not None and not int_at_least(self.out_channels):
            raise fail("out_channels", "a positive integer or null (same as in_channels)")
        if not isinstance(self.cross_attn_norm, bool):
            raise fail("cross_attn_norm", "true or false")
        if not (isinstance(self.eps, float) and self.eps > 0):
            raise fail("eps", "a positive number")
        # The 3-D RoPE splits the head dim into frame / height / width parts of even sizes
        # (2 * (D // 6) each for height and width, the rest for frames), so D must be even and
        # leave a positive frame part.
        head_dim = self.attention_head_dim
        if head_dim % 2 != 0 or head_dim - 4 * (head_dim // 6) <= 0:
            raise fail("attention_head_dim", "an even number >= 2 (3-D RoPE pairs channels)")
        if self.qk_norm != "rms_norm_across_heads":
            raise fail(
                "qk_norm",
                "'rms_norm_across_heads' (the only q/k norm of diffusers' Wan transformer)",
            )
        for key in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
            if getattr(self, key) is not None:
                raise fail(
                    key,
                    "null: image-conditioned Wan variants (I2V / FLF2V) are not supported, "
                    "only text-to-video checkpoints",
                )

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def output_channels(self) -> int:
        # diffusers: `out_channels = out_channels or in_channels`
        return self.out_channels or self.in_channels

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> WanTransformerConfig:
        """Build from a diffusers config dict.

        Keys starting with ``_`` (``_class_name``, ``_diffusers_version``) are metadata;
        other unknown keys are logged and ignored, as diffusers does.
        """
        class_name = values.get("_class_name")
        if class_name is not None and class_name != DIFFUSERS_CLASS_NAME:
            raise WanConfigError(
                f"Wan config: _class_name is {class_name!r}; expected {DIFFUSERS_CLASS_NAME!r} "
                "(other Wan variants such as VACE or Animate are not supported)"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in values if k not in known and not k.startswith("_"))
        if unknown:
            logger.warning("Wan config: ignoring unknown keys %s", ", ".join(unknown))
        return cls(**{k: v for k, v in values.items() if k in known})

    def to_dict(self) -> dict[str, Any]:
        """The diffusers ``config.json`` form (``patch_size`` as a list)."""
        values = dataclasses.asdict(self)
        values["patch_size"] = list(self.patch_size)
        return values


def _size_hint(size: int | torch.SymInt) -> int:
    """A size as a plain int without adding an export shape guard.

    During export a dynamic size is symbolic; its hint is the example input's size. Checking
    the hint validates the example while leaving the dimension dynamic, so the same checks run
    on real inputs in eager mode and on the example at export time.
    """
    return optimization_hint(size)


# ---------------------------------------------------------------------------------------------
# Embeddings
# ---------------------------------------------------------------------------------------------


class WanRotaryPosEmbed(nn.Module):
    """3-D rotary tables: the head dim is split into frame, height and width parts.

    Height and width get ``2 * (D // 6)`` channels each, frames the rest; each part has its own
    frequency ladder ``theta ** (-2i / part)``. The tables are built from the runtime patch-grid
    size, so exported graphs keep frames/height/width dynamic.
    """

    def __init__(self, attention_head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        h_dim = w_dim = 2 * (attention_head_dim // 6)
        t_dim = attention_head_dim - h_dim - w_dim
        # Inverse frequencies as Python floats computed in double precision (as diffusers
        # does), turned into fp32 tensors in forward: a registered buffer would be rounded
        # to bf16 by `model.to(torch.bfloat16)`.
        self.inv_freqs = tuple(
            tuple(1.0 / theta ** (i / dim) for i in range(0, dim, 2))
            for dim in (t_dim, h_dim, w_dim)
        )

    def forward(
        self,
        frames: int | torch.SymInt,
        height: int | torch.SymInt,
        width: int | torch.SymInt,
        device: torch.device,
        positions: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``(cos, sin)``, each ``[frames * height * width, D/2]`` fp32, tokens frame-major;
        with ``positions`` (global token indices, a sequence-parallel rank's) one row each."""
        # Each token's (frame, row, column) from its index, instead of expanding three per-axis
        # tables to the grid: the same values, but no broadcast of size-1 axes, so an exported
        # graph stays valid for every grid size (one frame or one row included).
        # (Only // and * on the symbolic sizes: the ONNX exporter cannot translate % by one.)
        token = torch.arange(frames * height * width, device=device) if positions is None \
            else positions
        frame = token // (height * width)
        in_frame = token - frame * (height * width)
        row = in_frame // width
        positions = (frame, row, in_frame - row * width)
        angles = [
            pos.float()[:, None] * torch.tensor(inv_freq, dtype=torch.float32, device=device)
            for pos, inv_freq in zip(positions, self.inv_freqs, strict=True)
        ]
        angles = torch.cat(angles, dim=-1)  # [F*H*W, D/2]
        return angles.cos(), angles.sin()


def timestep_sinusoids(timestep: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    """Sinusoidal timestep embedding, ``[...]`` -> ``[..., dim]`` fp32, cos half first.

    The arithmetic order is diffusers' ``get_timestep_embedding`` (``flip_sin_to_cos=True``,
    ``downscale_freq_shift=0``) so fp32 results match bit for bit.
    """
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(
        half, dtype=torch.float32, device=timestep.device
    )
    freqs = torch.exp(exponent / half)
    # The timestep meets the frequencies before anything reshapes it: exported, a reshape of
    # the timestep input first ran in bf16 under OpenVINO's bf16 precision, which rounds 999
    # to 1000 and turns the high-frequency angles into noise (4% of every block's output).
    # Frequencies first, then the angle axis moved last: the same products (and so diffusers'
    # values bit for bit in f32), the input multiplied as it comes.
    timestep = timestep.float()
    args = freqs.reshape(half, *([1] * timestep.dim())) * timestep
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=0).movedim(0, -1)
    if dim % 2 == 1:
        emb = F.pad(emb, (0, 1))
    return emb


class _TwoLayerMLP(nn.Module):
    """``linear_2(act(linear_1(x)))``: diffusers' TimestepEmbedding / PixArtAlphaTextProjection."""

    def __init__(self, in_dim: int, dim: int, act: nn.Module) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.act = act
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class WanConditionEmbedder(nn.Module):
    """Timestep MLP, its 6-row modulation projection, and the text projection."""

    def __init__(self, dim: int, freq_dim: int, text_dim: int) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.time_embedder = _TwoLayerMLP(freq_dim, dim, nn.SiLU())
        self.act_fn = nn.SiLU()
        self.time_proj = nn.Linear(dim, 6 * dim)
        self.text_embedder = _TwoLayerMLP(text_dim, dim, nn.GELU(approximate="tanh"))

    def forward(
        self, timestep: Tensor, encoder_hidden_states: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(temb, modulation, text)``.

        ``timestep`` [B] gives temb [B, C] and modulation [B, 6, C]; per-frame ``timestep``
        [B, F] gives temb [B, F, C] and modulation [B, F, 6, C].
        """
        sinusoids = timestep_sinusoids(timestep, self.freq_dim)
        # The timestep MLP may be kept in fp32 while the rest runs in bf16 (KEEP_IN_FP32).
        sinusoids = sinusoids.to(self.time_embedder.linear_1.weight.dtype)
        temb = self.time_embedder(sinusoids).to(encoder_hidden_states.dtype)
        modulation = self.time_proj(self.act_fn(temb)).unflatten(-1, (6, -1))
        text = self.text_embedder(encoder_hidden_states)
        return temb, modulation, text


# ---------------------------------------------------------------------------------------------
# Transformer block
# ---------------------------------------------------------------------------------------------


class WanAttention(nn.Module):
    """Multi-head attention with RMSNorm on q and k across all heads (before the head split).

    With ``rotary=True`` (self-attention) the q/k projections and norms hold their output
    channels in *half-split* order within each head, ``(0, 2, 4, .., 1, 3, 5, ..)``, while the
    state dict keeps diffusers' interleaved order (a load pre-hook and a state-dict post-hook
    translate). Wan's RoPE rotates adjacent channel pairs; in half-split order the same pairs
    are ``(i, i + D/2)``, which OpenVINO fuses into one ``RoPE`` node without the two
    de-/re-interleaving transposes per tensor the interleaved form needs. Attention scores are
    dot products over the head dim, unchanged when q and k permute their channels alike, and
    the RMSNorm statistics run over all channels, so the output is the same.
    """

    _ROTARY_PARAMETERS = (
        "to_q.weight",
        "to_q.bias",
        "norm_q.weight",
        "to_k.weight",
        "to_k.bias",
        "norm_k.weight",
    )

    def __init__(self, dim: int, heads: int, eps: float, rotary: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.eps = eps
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        # A list so the state-dict name is diffusers' `to_out.0` (its slot 1 is a dropout).
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])
        self.norm_q = nn.RMSNorm(dim, eps=eps)
        self.norm_k = nn.RMSNorm(dim, eps=eps)
        if rotary:
            head_dim = dim // heads
            within = [*range(0, head_dim, 2), *range(1, head_dim, 2)]
            # Python lists, not tensors: the module may be built on the meta device.
            self._half_split = [h * head_dim + i for h in range(heads) for i in within]
            self._interleaved = sorted(range(dim), key=self._half_split.__getitem__)
            self.register_load_state_dict_pre_hook(self._to_half_split)
            self.register_state_dict_post_hook(self._to_interleaved)

    @staticmethod
    def _reorder(state_dict: dict, prefix: str, order: list[int]) -> None:
        for name in WanAttention._ROTARY_PARAMETERS:
            tensor = state_dict.get(prefix + name)
            if tensor is not None:  # absent: load_into_module reports it as missing
                index = torch.tensor(order, device=tensor.device)
                state_dict[prefix + name] = tensor.index_select(0, index)

    @staticmethod
    def _to_half_split(module: WanAttention, state_dict: dict, prefix: str, *_: Any) -> None:
        WanAttention._reorder(state_dict, prefix, module._half_split)

    @staticmethod
    def _to_interleaved(module: WanAttention, state_dict: dict, prefix: str, *_: Any) -> None:
        WanAttention._reorder(state_dict, prefix, module._interleaved)

    def forward(
        self, x: Tensor, context: Tensor, rotary: tuple[Tensor, Tensor] | None = None,
        sequence: RankTokens | None = None,
    ) -> Tensor:
        """``x`` [B, L, C] attends to ``context`` [B, S, C]; ``rotary`` only for self-attention.
        ``sequence``: ``x`` and ``context`` are a sequence-parallel rank's share of the tokens,
        whose heads are exchanged with the other ranks' around the attention."""
        query = norm_infer(self.to_q(x), self.norm_q.weight, None, self.eps, True)
        key = norm_infer(self.to_k(context), self.norm_k.weight, None, self.eps, True)
        value = self.to_v(context)

        query = query.unflatten(2, (self.heads, -1))  # [B, L, H, D]
        key = key.unflatten(2, (self.heads, -1))  # [B, S, H, D]
        value = value.unflatten(2, (self.heads, -1))
        if rotary is not None:
            cos, sin = rotary
            # Channels are in half-split order (see the class docstring).
            query = rotary_embedding(query, cos, sin, interleaved=False)
            key = rotary_embedding(key, cos, sin, interleaved=False)
        if sequence is not None:  # every token, this rank's heads
            query, key, value = sequence.to_heads(query, key, value)

        out = F.scaled_dot_product_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        ).transpose(1, 2)  # [B, L, H, D]
        if sequence is not None:  # back to this rank's tokens, every head
            out = sequence.to_tokens(out)
        return self.to_out[0](out.flatten(2))


class _GeluProjection(nn.Module):
    """diffusers' ``GELU`` activation module: a projection followed by tanh-approximate GELU."""

    def __init__(self, dim: int, inner_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner_dim)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class WanFeedForward(nn.Module):
    """Projection up, tanh-GELU, projection down.

    ``split_columns(n)`` computes the same function as ``n`` narrower FFNs summed: part ``j``
    holds rows ``j`` of the up projection and the matching columns of the down projection
    (GELU is element-wise, so nothing else changes). Exports use it: OpenVINO's bf16
    FullyConnected runs faster on five 1,792-wide pairs than on one 8,960-wide pair (figures
    in ``benchmarks/RESULTS.md``), while PyTorch is fastest with one matmul each, the default.
    The parts are weights of their own, not slices taken in ``forward``: a traced graph then
    feeds each stored weight (and, for a bf16 export, its one widening Cast) straight to its
    MatMul, which OpenVINO keeps compressed, where a Slice after the Cast would be folded into
    an f32 copy or run on every call.
    """

    def __init__(self, dim: int, inner_dim: int) -> None:
        super().__init__()
        # Slots match diffusers' `ffn.net.{0,2}` names; slot 1 is its (inference no-op) dropout.
        self.net = nn.ModuleList(
            [_GeluProjection(dim, inner_dim), nn.Identity(), nn.Linear(inner_dim, dim)]
        )
        self.up_parts: nn.ModuleList | None = None
        self.down_parts: nn.ParameterList | None = None

    @property
    def column_blocks(self) -> int:
        return 1 if self.up_parts is None else len(self.up_parts)

    def split_columns(self, blocks: int) -> None:
        """Hold the weights as ``blocks`` column parts (one layer's weights copied at a time,
        the whole ones let go after)."""
        if blocks == 1:
            return
        up, down = self.net[0].proj, self.net[2]
        inner = up.out_features
        bounds = [inner * j // blocks for j in range(blocks + 1)]
        up_parts, down_parts = nn.ModuleList(), nn.ParameterList()
        with torch.no_grad():
            for begin, end in zip(bounds[:-1], bounds[1:], strict=True):
                part = nn.Linear(up.in_features, end - begin, device="meta")
                part.weight = nn.Parameter(up.weight[begin:end].clone(), requires_grad=False)
                part.bias = nn.Parameter(up.bias[begin:end].clone(), requires_grad=False)
                up_parts.append(part)
                down_parts.append(nn.Parameter(down.weight[:, begin:end].contiguous(),
                                               requires_grad=False))
        self.up_parts, self.down_parts = up_parts, down_parts
        # the whole projections are replaced: only the down bias is still read
        self.net[0] = nn.Identity()
        self.net[2] = _Bias(down.bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.up_parts is None:
            return self.net[2](self.net[0](x))
        out = None
        for up, down in zip(self.up_parts, self.down_parts, strict=True):
            part = F.linear(F.gelu(up(x), approximate="tanh"), down)
            out = part if out is None else out + part
        return self.net[2](out)


class _Bias(nn.Module):
    """The down projection's bias alone, added after the column parts are summed."""

    def __init__(self, bias: nn.Parameter) -> None:
        super().__init__()
        self.bias = bias

    def forward(self, x: Tensor) -> Tensor:
        return x + self.bias


class WanTransformerBlock(nn.Module):
    def __init__(
        self, dim: int, ffn_dim: int, num_heads: int, cross_attn_norm: bool, eps: float
    ) -> None:
        super().__init__()
        self.eps = eps

        # 1. Self-attention (its LayerNorm has no affine parameters: modulation replaces them)
        self.attn1 = WanAttention(dim, num_heads, eps, rotary=True)

        # 2. Cross-attention
        self.attn2 = WanAttention(dim, num_heads, eps)
        self.norm2 = nn.LayerNorm(dim, eps=eps) if cross_attn_norm else None

        # 3. Feed-forward
        self.ffn = WanFeedForward(dim, ffn_dim)

        # Rows: shift, scale, gate (self-attention), shift, scale, gate (feed-forward).
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(
        self,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor,
        modulation: Tensor,
        rotary: tuple[Tensor, Tensor],
        sequence: RankTokens | None = None,
    ) -> Tensor:
        # modulation [B, 6, C] -> six [B, 1, C] rows; per-frame [B, F, 6, C] -> six [B, F, 1, C].
        # The table [1, 6, C] broadcasts against both ranks; the sum is fp32 as in diffusers.
        shift_msa, scale_msa, gate_msa, c_shift, c_scale, c_gate = (
            self.scale_shift_table.float() + modulation.float()
        ).chunk(6, dim=-2)

        # 1. Self-attention
        normed = fuse_scale_shift(
            norm_infer(hidden_states, None, None, self.eps, False), scale_msa, shift_msa
        )
        attn_output = self.attn1(normed, normed, rotary, sequence)

        # 2. Cross-attention: gated residual, then the optional affine LayerNorm (no modulation)
        if self.norm2 is not None:
            zero = torch.zeros((), dtype=torch.float32, device=hidden_states.device)
            normed, hidden_states = scale_residual_norm_scale_shift(
                hidden_states,
                attn_output,
                gate_msa,
                self.norm2.weight,
                self.norm2.bias,
                self.eps,
                False,
                zero,
                zero,
            )
        else:
            # x + gate * attn: the residual enters as the shift, with no constant scale term.
            hidden_states = fuse_scale_shift(
                attn_output, gate_msa, hidden_states, scale_constant=0.0
            )
            normed = hidden_states
        attn_output = self.attn2(normed, encoder_hidden_states)

        # 3. Feed-forward: residual (no gate), LayerNorm and modulation in one op
        normed, hidden_states = scale_residual_norm_scale_shift(
            hidden_states, attn_output, None, None, None, self.eps, False, c_scale, c_shift
        )
        ff_output = self.ffn(normed)
        return fuse_scale_shift(ff_output, c_gate, hidden_states, scale_constant=0.0)


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


class WanTransformer(nn.Module):
    """The Wan transformer: ``[B, C, F, H, W]`` video latents to ``[B, C_out, F, H, W]``."""

    def __init__(self, config: WanTransformerConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.inner_dim

        # 1. Patch & position embedding
        self.rope = WanRotaryPosEmbed(config.attention_head_dim)
        self.patch_embedding = nn.Conv3d(
            config.in_channels, dim, kernel_size=config.patch_size, stride=config.patch_size
        )

        # 2. Condition embeddings
        self.condition_embedder = WanConditionEmbedder(dim, config.freq_dim, config.text_dim)

        # 3. Transformer blocks
        self.blocks = nn.ModuleList(
            WanTransformerBlock(
                dim, config.ffn_dim, config.num_attention_heads, config.cross_attn_norm, config.eps
            )
            for _ in range(config.num_layers)
        )

        # 4. Output norm & projection (rows: shift, scale)
        self.proj_out = nn.Linear(dim, config.output_channels * math.prod(config.patch_size))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)
        # The exporter sets it: forward also returns the token states along the blocks
        # (BLOCK_OUTPUTS first), so the runtime's step cache can run the graph in parts
        # (runtime/wan/step_cache.py) and the export's parity judge it block by block.
        self.block_outputs = False
        # Set by split_sequence: forward takes its rank's share of the video's tokens
        # (models/wan/sequence_parallel.py).
        self.sequence: SequenceSplit | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: that of the projections (some small tables may stay fp32)."""
        return self.proj_out.weight.dtype

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, dtype: torch.dtype = torch.float32,
        loras: Sequence[WanLora] = ()
    ) -> WanTransformer:
        """Load a diffusers ``WanTransformer3DModel`` checkpoint directory.

        ``dtype`` is the compute dtype (float32, bfloat16 or float16); as in diffusers, the
        timestep MLP, modulation tables and norm weights stay fp32 under bf16/fp16.
        ``loras`` (``numaov.models.wan.lora.WanLora``) are merged into the checkpoint's weights
        in f32, in order, before the cast to ``dtype`` (diffusers' ``fuse_lora``).
        """
        if dtype not in SUPPORTED_DTYPES:
            raise WanConfigError(
                f"Wan model: dtype {dtype} is not supported; expected torch.float32, "
                "torch.bfloat16 or torch.float16"
            )
        what = f"Wan checkpoint {str(directory)!r}"
        config = WanTransformerConfig.from_dict(read_config(directory, CONFIG_NAME, what))
        checkpoint = open_safetensors_checkpoint(directory, WEIGHTS_NAME, WEIGHTS_INDEX_NAME,
                                                 what)
        check_loras_fit(loras, checkpoint.shapes(), what)
        # Build on the meta device and adopt the tensors as read (each merged and cast before
        # the next is read): no random initial weights, no checkpoint copy beside the model.
        with torch.device("meta"):
            model = cls(config)
        state_dict = read_state_dict(
            checkpoint, lambda name: parameter_dtype(name, dtype), what,
            (lambda name, tensor: merge_loras(name, tensor, loras)) if loras else None)
        load_into_module(model, state_dict, what, assign=True)
        return model.eval()

    def to_compute_dtype(self, dtype: torch.dtype) -> WanTransformer:
        """Cast to ``dtype`` keeping the KEEP_IN_FP32 parameters in fp32 (as from_pretrained)."""
        for name, param in self.named_parameters():
            param.data = param.data.to(parameter_dtype(name, dtype))
        return self

    def split_ffn_columns(self, max_columns: int) -> WanTransformer:
        """Compute each block's FFN in column blocks of at most ``max_columns`` (see
        WanFeedForward; the exporter does this, eager runs keep one block)."""
        if max_columns < 1:
            raise WanConfigError(f"FFN column block width {max_columns}; expected at least 1")
        blocks = -(-self.config.ffn_dim // max_columns)
        for block in self.blocks:
            block.ffn.split_columns(blocks)
        return self

    def split_sequence(self, world_size: int) -> WanTransformer:
        """Run as one of ``world_size`` sequence-parallel ranks: ``forward`` then takes the
        rank's index (``sequence_rank``) and computes its share of the tokens, exchanging
        attention heads with the other ranks (``models/wan/sequence_parallel.py``)."""
        check_sequence_split(self.config.num_attention_heads, world_size)
        self.sequence = SequenceSplit(world_size)
        return self

    def check_inputs(
        self, hidden_states: Tensor, timestep: Tensor, encoder_hidden_states: Tensor
    ) -> None:
        """Raise WanInputError naming the first input whose shape does not fit the model."""
        config = self.config
        if hidden_states.dim() != 5:
            raise WanInputError(
                f"Wan model: hidden_states has shape {list(hidden_states.shape)}; expected "
                "[batch, channels, frames, height, width]"
            )
        batch, channels, frames, height, width = (_size_hint(s) for s in hidden_states.shape)
        if channels != config.in_channels:
            raise WanInputError(
                f"Wan model: hidden_states has {channels} channels; expected in_channels="
                f"{config.in_channels}"
            )
        for name, size, patch in zip(
            ("frames", "height", "width"), (frames, height, width), config.patch_size, strict=True
        ):
            if size < patch or size % patch != 0:
                raise WanInputError(
                    f"Wan model: hidden_states {name}={size} is not a positive multiple of the "
                    f"patch size {patch} (patch_size={list(config.patch_size)})"
                )
        t_shape = [_size_hint(s) for s in timestep.shape]
        latent_frames = frames // config.patch_size[0]
        if (
            timestep.dim() not in (1, 2)
            or t_shape[0] not in (1, batch)
            or (timestep.dim() == 2 and t_shape[1] != latent_frames)
        ):
            raise WanInputError(
                f"Wan model: timestep has shape {t_shape}; expected [{batch}] or per-frame "
                f"[{batch}, {latent_frames}] (frames after patching)"
            )
        e_shape = [_size_hint(s) for s in encoder_hidden_states.shape]
        if len(e_shape) != 3 or e_shape[0] != batch or e_shape[2] != config.text_dim:
            raise WanInputError(
                f"Wan model: encoder_hidden_states has shape {e_shape}; expected "
                f"[{batch}, text_length, {config.text_dim}]"
            )

    def _rank_tokens(self, hidden_states: Tensor, timestep: Tensor,
                     rank: Tensor | None) -> RankTokens | None:
        """This rank's share of the tokens, or None when the model is not split."""
        _check_rank(rank, self.sequence)
        if self.sequence is None:
            return None
        if timestep.dim() != 1:
            # per-frame modulation rows broadcast over whole frames, which a share need not be
            raise WanInputError("Wan model: a sequence-parallel model takes one timestep per "
                                "sample; expected timestep [batch], not per-frame")
        _, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.config.patch_size
        tokens = (frames // p_t) * (height // p_h) * (width // p_w)
        return RankTokens.of_rank(self.sequence, tokens, rank)

    def embed_patches(self, hidden_states: Tensor) -> Tensor:
        """``[B, C_in, F, H, W]`` latents -> ``[B, L, C]`` tokens, frame-major.

        The same function as ``patch_embedding`` (a Conv3d whose stride is its kernel)
        followed by the tokens-first transpose, computed as one matrix product over
        flattened patches: the transpose then moves the 16-channel latents rather than the
        1,536-channel embeddings, and OpenVINO runs the product as a FullyConnected
        instead of a convolution plus a Reorder and a Transpose of the embeddings.
        """
        batch, channels, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.config.patch_size
        patches = hidden_states.reshape(
            batch, channels, frames // p_t, p_t, height // p_h, p_h, width // p_w, p_w
        )
        # [B, F', H', W', C_in, p_t, p_h, p_w]: a patch's values in the conv weight's order
        patches = patches.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4).flatten(1, 3)
        conv = self.patch_embedding
        return F.linear(patches, conv.weight.flatten(1), conv.bias)

    def forward(
        self, hidden_states: Tensor, timestep: Tensor, encoder_hidden_states: Tensor,
        sequence_rank: Tensor | None = None,
    ) -> Tensor:
        """Predict the flow for video latents.

        Args:
            hidden_states: ``[B, in_channels, F, H, W]`` latents; F, H, W multiples of the patch.
            timestep: ``[B]`` one timestep per sample, or ``[B, F / patch_t]`` one per latent
                frame (Wan 2.2 TI2V). Integer or float.
            encoder_hidden_states: ``[B, S, text_dim]`` text embeddings.
            sequence_rank: ``[1]`` int64, this rank's index, after ``split_sequence`` (every
                rank is given the whole video and returns the whole prediction).

        Returns:
            ``[B, out_channels, F, H, W]`` in the model's compute dtype; with
            ``block_outputs``, also the ``[B, L, C]`` tokens into the first block, out of it
            and out of the last (``BLOCK_OUTPUTS``), then out of each block between them.
        """
        self.check_inputs(hidden_states, timestep, encoder_hidden_states)
        sequence = self._rank_tokens(hidden_states, timestep, sequence_rank)
        dtype = self.dtype
        hidden_states = hidden_states.to(dtype)
        encoder_hidden_states = encoder_hidden_states.to(dtype)
        batch, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.config.patch_size
        grid = (frames // p_t, height // p_h, width // p_w)

        # 1. Patch & position embedding
        rotary = self.rope(*grid, device=hidden_states.device,
                           positions=None if sequence is None else sequence.positions)
        hidden_states = self.embed_patches(hidden_states)  # [B, L, C]
        if sequence is not None:
            hidden_states = sequence.own(hidden_states)  # [B, share, C]

        # 2. Condition embeddings
        # timestep [B] -> temb [B, C], modulation [B, 6, C];
        # timestep [B, F'] -> temb [B, F', C], modulation [B, F', 6, C]
        temb, modulation, encoder_hidden_states = self.condition_embedder(
            timestep, encoder_hidden_states
        )

        # 3. Transformer blocks
        states = [hidden_states]
        for block in self.blocks:
            hidden_states = block(hidden_states, encoder_hidden_states, modulation, rotary,
                                  sequence)
            states.append(hidden_states)

        # 4. Output norm, projection & unpatchify
        # temb [B, C] -> shift, scale [B, 1, C]; per-frame [B, F', C] -> [B, F', 1, C]
        shift, scale = (self.scale_shift_table.float() + temb.float().unsqueeze(-2)).chunk(
            2, dim=-2
        )
        hidden_states = fuse_scale_shift(
            norm_infer(hidden_states, None, None, self.config.eps, False), scale, shift
        )
        hidden_states = self.proj_out(hidden_states)  # [B, L, C_out * p_t * p_h * p_w]
        out_channels = self.config.output_channels
        if sequence is None:
            hidden_states = hidden_states.reshape(batch, *grid, p_t, p_h, p_w, out_channels)
            hidden_states = hidden_states.permute(0, 7, 1, 4, 2, 5, 3, 6)  # [B, C, F', p_t, ..]
        else:  # every rank's tokens, tokens first: [L, B, ...]
            hidden_states = sequence.gather(hidden_states).reshape(
                *grid, batch, p_t, p_h, p_w, out_channels)
            hidden_states = hidden_states.permute(3, 7, 0, 4, 1, 5, 2, 6)
        sample = hidden_states.reshape(
            batch, out_channels, grid[0] * p_t, grid[1] * p_h, grid[2] * p_w
        )
        if self.block_outputs:  # the states models/wan.state_outputs names, in its order
            # one block: its output is both the first and the last block's, and a graph's
            # outputs must be distinct values (else the export keeps one name of the two)
            last = states[-1] if len(states) > 2 else states[-1].clone()
            return sample, states[0], states[1], last, *states[2:-1]
        return sample


def _check_rank(rank: Tensor | None, split: SequenceSplit | None) -> None:
    if split is None:
        if rank is not None:
            raise WanInputError("Wan model: sequence_rank given to a model that is not split "
                                "(split_sequence); expected no sequence_rank")
        return
    if rank is None or rank.shape != (1,) or rank.dtype != torch.int64:
        raise WanInputError("Wan model: a sequence-parallel model takes sequence_rank, [1] "
                            "int64; expected this rank's index")
    if not torch.compiler.is_compiling() and not 0 <= int(rank) < split.world_size:
        raise WanInputError(f"Wan model: sequence_rank {int(rank)}; expected 0 to "
                            f"{split.world_size - 1}")


def parameter_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype parameter ``name`` gets when the model computes in ``dtype``."""
    if dtype != torch.float32 and any(part in name for part in KEEP_IN_FP32):
        return torch.float32
    return dtype


__all__ = [
    "CheckpointError",
    "WanConfigError",
    "WanInputError",
    "WanTransformer",
    "WanTransformerConfig",
    "parameter_dtype",
    "timestep_sinusoids",
]

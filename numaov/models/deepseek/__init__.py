"""DeepSeek-V2: multi-head latent attention (MLA) and a shared + routed-expert MoE, with
data-parallel (DP) attention across ranks.

Parameter names are those of Hugging Face ``DeepseekV2ForCausalLM.state_dict()``
(transformers 5), so a ``deepseek_v2`` checkpoint directory (``config.json`` +
``model.safetensors`` or a sharded index) loads with :meth:`DeepseekV2.from_pretrained`. On
disk, DeepSeek checkpoints keep one tensor per expert
(``mlp.experts.{e}.gate_proj.weight`` ...); like transformers, the model holds the experts as
stacks (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``), because
an expert stack can be indexed by the router's choice inside one graph.

Semantics follow transformers' ``deepseek_v2`` (which follows DeepSeek's own code):

- rope on the ``qk_rope_head_dim`` slice only, adjacent pairs rotated (interleaved layout);
  yarn scales cos/sin by ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` and the
  softmax scale by ``mscale(factor, mscale_all_dim) ** 2``;
- the router is fp32: softmax over all experts, then greedy top-k or group-limited top-k
  (keep the ``topk_group`` groups with the best single expert, top-k inside them);
- the top-k weights are multiplied by ``routed_scaling_factor``. ``norm_topk_prob=True``
  instead renormalises them to sum 1 (no scaling) as DeepSeek's own V2 code does;
  transformers ignores that flag, and every published V2 checkpoint sets it False;
- layer ``i`` is an MoE layer when ``i >= first_k_dense_replace`` and
  ``i % moe_layer_freq == 0``, else a dense MLP.

DP attention (REFERENCE.md section 3, DESIGN.md "DP attention, in one paragraph"). With a
:class:`DataParallelGroup` of ``dp`` ranks, each rank holds its own sequences and KV cache and
runs attention (embedding, norms, attention, lm_head: all replicated) on them only. Around
every MLP and MoE block:

1. the ranks agree on the padded row count ``M = max_r rows_r`` (one all-gather of the counts
   per forward, at least 1 row so an idle rank's empty batch still has a shape);
2. each rank pads its normalised rows to ``M`` and ``all_gather_into_tensor`` stacks them:
   rank r's rows sit at ``r*M ..`` (MAX_LEN layout);
3. every rank runs its shard of the block on all ``dp*M`` rows: a partial sum;
4. ``reduce_scatter_tensor`` sums the partials and hands rank r rows ``r*M ..``; it keeps its
   first ``rows_r`` and adds its residual. There is no all-reduce anywhere: an all-reduce
   before the reduce-scatter would count every partial ``dp`` times.

Sharding is along the intermediate dim (dense MLP, shared experts, and inside every routed
expert), not by expert. Why: with an intermediate split every rank does exactly ``1/dp`` of
every token's work whatever the router picks, and the shapes stay data-independent (one graph,
no token dispatch); an expert split makes the busiest rank's experts set the step time and
needs a data-dependent dispatch of tokens to the rank owning each expert. The router is
replicated: every rank routes the same gathered rows with the same fp32 weights, so all ranks
pick the same experts. ``--dp`` must therefore divide ``intermediate_size``,
``moe_intermediate_size`` and ``n_shared_experts * moe_intermediate_size``
(:func:`check_dp_divides`). The model calls the collectives of
:mod:`numaov.custom_ops.collective_ops` by group name only; which transport (gloo,
shared memory, the OpenVINO extension op) serves the group is not its concern.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

from numaov import NumaovError
from numaov.custom_ops import (
    all_gather_into_tensor,
    norm_infer,
    reduce_scatter_tensor,
    rotary_embedding,
)
from numaov.models.checkpoint import (
    check_state_dict,
    load_into_module,
    load_safetensors_state_dict,
    read_config,
)

logger = logging.getLogger(__name__)

__all__ = [
    "DataParallelGroup",
    "DeepseekConfigError",
    "DeepseekV2",
    "DeepseekV2Config",
    "DeepseekV2Step",
    "GreedyOutput",
    "ModelInputError",
    "ShardError",
    "check_dp_divides",
    "checkpoint_to_model_state_dict",
    "generate_greedy",
    "model_to_checkpoint_state_dict",
    "shard_state_dict",
]

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# The latent norms inside MLA use the RMSNorm default, not config.rms_norm_eps (as in
# DeepSeek's code and transformers).
LATENT_NORM_EPS = 1e-6


class DeepseekConfigError(NumaovError):
    """A DeepSeek-V2 config is malformed or asks for something the model does not support."""


class ShardError(NumaovError):
    """The requested DP degree does not divide the dims the experts and MLPs are sharded along."""


class ModelInputError(NumaovError):
    """Token ids, prompts or generation arguments the model cannot take."""


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------

# Keys a config.json must state: the defaults transformers has for them describe one specific
# large model, and silently building that when a key is missing would only fail later, at
# the shapes, or not at all (rope, routing flags).
_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
)
_TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class DeepseekV2Config:
    """The Hugging Face ``deepseek_v2`` config keys the model reads (defaults: transformers').

    ``rope_scaling`` is None (plain rope) or the yarn dict (``factor``,
    ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``mscale``,
    ``mscale_all_dim``, optional ``attention_factor``); :meth:`from_dict` also reads the
    transformers-5 form ``rope_parameters`` (``rope_type`` and ``rope_theta`` inside).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    num_key_value_heads: int | None = None
    moe_intermediate_size: int = 1407
    n_routed_experts: int | None = None
    n_shared_experts: int | None = None
    num_experts_per_tok: int | None = None
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = False
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    scoring_func: str = "softmax"
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], what: str = "DeepSeek-V2 config") -> DeepseekV2Config:
        """Build from a ``config.json`` mapping; keys the model does not read go to ``extra``."""
        missing = [k for k in _REQUIRED_KEYS if values.get(k) is None]
        if missing:
            raise DeepseekConfigError(
                f"{what}: missing required key(s) {', '.join(missing)}; expected a Hugging Face "
                "deepseek_v2 config.json"
            )
        model_type = values.get("model_type")
        if model_type not in (None, "deepseek_v2"):
            raise DeepseekConfigError(
                f"{what}: model_type is {model_type!r}; expected 'deepseek_v2'"
            )
        names = {f.name for f in fields(cls)} - {"extra", "rope_scaling", "rope_theta"}
        kwargs: dict[str, Any] = {k: values[k] for k in names if k in values}
        kwargs["rope_theta"], kwargs["rope_scaling"] = _read_rope(values, what)
        used = names | {"rope_scaling", "rope_theta", "rope_parameters"}
        kwargs["extra"] = {k: v for k, v in values.items() if k not in used}
        try:
            return cls(**kwargs)
        except TypeError as exc:  # a wrongly typed value that broke arithmetic in _validate
            raise DeepseekConfigError(f"{what}: {exc}") from exc

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> DeepseekV2Config:
        return cls.from_dict(read_config(directory, what="DeepSeek-V2 checkpoint"))

    def to_dict(self) -> dict[str, Any]:
        """The config.json form (Hugging Face keys; rope in the classic rope_theta/rope_scaling
        form, which transformers 5 reads too)."""
        out = dict(self.extra)
        out.update({k: v for k, v in asdict(self).items() if k != "extra"})
        out["model_type"] = "deepseek_v2"
        out.setdefault("architectures", ["DeepseekV2ForCausalLM"])
        return out

    # -- derived sizes -----------------------------------------------------------------------

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Per-token, per-layer cache width: the normalised latent and the rotated rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return (self.n_shared_experts or 0) * self.moe_intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.n_routed_experts is not None
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    # -- checks ------------------------------------------------------------------------------

    def _validate(self) -> None:
        def fail(message: str) -> None:
            raise DeepseekConfigError(f"DeepSeek-V2 config: {message}")

        positive = (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
            "v_head_dim", "moe_intermediate_size", "moe_layer_freq", "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(f"{name} is {value!r}; expected a positive integer")
        for name in ("q_lora_rank", "n_routed_experts", "num_experts_per_tok", "n_group",
                     "topk_group", "num_key_value_heads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                fail(f"{name} is {value!r}; expected a positive integer or null")
        if self.n_shared_experts is not None and (
            isinstance(self.n_shared_experts, bool) or not isinstance(self.n_shared_experts, int)
            or self.n_shared_experts < 0
        ):
            fail(f"n_shared_experts is {self.n_shared_experts!r}; expected a non-negative integer")
        if self.first_k_dense_replace < 0:
            fail(f"first_k_dense_replace is {self.first_k_dense_replace}; expected >= 0")
        if self.qk_rope_head_dim % 2:
            fail(f"qk_rope_head_dim is {self.qk_rope_head_dim}; expected an even number "
                 "(rope rotates pairs)")
        if self.num_key_value_heads not in (None, self.num_attention_heads):
            fail(f"num_key_value_heads is {self.num_key_value_heads} but num_attention_heads is "
                 f"{self.num_attention_heads}; MLA expands its latent to every head, expected "
                 "them equal")
        if self.hidden_act != "silu":
            fail(f"hidden_act is {self.hidden_act!r}; expected 'silu'")
        if self.mlp_bias:
            fail("mlp_bias is true; expected false (DeepSeek-V2 MLPs and experts have no bias)")
        if self.scoring_func != "softmax":
            fail(f"scoring_func is {self.scoring_func!r}; expected 'softmax' (DeepSeek-V2)")
        if self.n_routed_experts is not None:
            k = self.num_experts_per_tok
            if k is None or k > self.n_routed_experts:
                fail(f"num_experts_per_tok is {k!r}; expected 1 .. n_routed_experts "
                     f"({self.n_routed_experts})")
            if self.topk_method not in _TOPK_METHODS:
                fail(f"topk_method is {self.topk_method!r}; expected one of "
                     f"{', '.join(_TOPK_METHODS)}")
            if self.topk_method == "group_limited_greedy":
                g, tg = self.n_group, self.topk_group
                if g is None or tg is None or self.n_routed_experts % g or tg > g:
                    fail(f"group_limited_greedy needs n_group dividing n_routed_experts "
                         f"({self.n_routed_experts}) and 1 <= topk_group <= n_group; got "
                         f"n_group={g!r}, topk_group={tg!r}")
                if tg * (self.n_routed_experts // g) < k:
                    fail(f"topk_group={tg} groups of {self.n_routed_experts // g} experts hold "
                         f"fewer than num_experts_per_tok={k} experts")
        if self.rope_scaling is not None:
            _check_yarn(self.rope_scaling, "DeepSeek-V2 config")


def _read_rope(values: Mapping[str, Any], what: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, yarn dict or None) from either the classic or the transformers-5 keys."""
    params = values.get("rope_parameters")
    scaling = values.get("rope_scaling")
    theta = values.get("rope_theta")
    if isinstance(params, Mapping) and params:
        theta = params.get("rope_theta", theta)
        scaling = dict(params)
    if scaling is not None and not isinstance(scaling, Mapping):
        raise DeepseekConfigError(f"{what}: rope_scaling is {scaling!r}; expected an object or null")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            scaling = None
        elif kind == "yarn":
            scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type",
                                                                       "rope_type")}
            scaling["type"] = "yarn"
        else:
            raise DeepseekConfigError(
                f"{what}: rope type {kind!r} is not supported; expected no scaling or 'yarn'"
            )
    else:
        scaling = None
    return float(theta if theta is not None else 10000.0), scaling


def _check_yarn(scaling: Mapping[str, Any], what: str) -> None:
    for key in ("factor", "original_max_position_embeddings"):
        if not isinstance(scaling.get(key), (int, float)) or scaling[key] <= 0:
            raise DeepseekConfigError(
                f"{what}: yarn rope_scaling needs a positive {key!r}; got {scaling.get(key)!r}"
            )


# ---------------------------------------------------------------------------------------------
# Data-parallel group and sharding
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataParallelGroup:
    """The DP group this model instance is one rank of.

    ``group`` names the communicator the collective ops look up (registered by the process
    before the first forward); ``world_size`` fixes the shard shapes.
    """

    group: str
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.group, str) or not self.group:
            raise ShardError(f"DP group name is {self.group!r}; expected a non-empty string")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ShardError(
                f"DP rank {self.rank} of world size {self.world_size}; expected "
                "0 <= rank < world_size"
            )


def _sharded_dims(config: DeepseekV2Config) -> list[tuple[str, int, str]]:
    """(config key, size, what is split along it) for every dim DP shards."""
    dims = []
    if any(not config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
        dims.append(("intermediate_size", config.intermediate_size, "dense MLP layers"))
    if config.n_routed_experts is not None:
        dims.append(("moe_intermediate_size", config.moe_intermediate_size, "routed experts"))
        if config.shared_intermediate_size:
            dims.append(("n_shared_experts * moe_intermediate_size",
                         config.shared_intermediate_size, "shared experts"))
    return dims


def check_dp_divides(config: DeepseekV2Config, world_size: int) -> None:
    """Raise ShardError unless ``world_size`` divides every dim the MLPs are sharded along."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ShardError(f"--dp is {world_size!r}; expected a positive integer")
    dims = _sharded_dims(config)
    bad = [(key, size, role) for key, size, role in dims if size % world_size]
    if bad:
        common = math.gcd(*(size for _, size, _ in dims))
        valid = [d for d in range(1, common + 1) if common % d == 0]
        listed = ", ".join(f"{key}={size} ({role})" for key, size, role in bad)
        raise ShardError(
            f"--dp {world_size} does not divide {listed}: the MLP and expert weights are split "
            f"along these dims; expected a dp that divides all of them "
            f"(possible: {', '.join(map(str, valid[:16]))}{' ...' if len(valid) > 16 else ''})"
        )


# Which tensors are split and along which dim (all others are replicated). gate_up_proj
# stacks [gate; up] along dim 1, so each half is split separately (see shard_state_dict).
_SHARD_RULES: tuple[tuple[re.Pattern[str], int], ...] = (
    (re.compile(r"\.mlp\.(shared_experts\.)?(gate_proj|up_proj)\.weight$"), 0),
    (re.compile(r"\.mlp\.(shared_experts\.)?down_proj\.weight$"), 1),
    (re.compile(r"\.mlp\.experts\.down_proj$"), 2),
)
_GATE_UP = re.compile(r"\.mlp\.experts\.gate_up_proj$")


def shard_state_dict(
    state_dict: Mapping[str, Tensor], config: DeepseekV2Config, rank: int, world_size: int,
    presharded: Collection[str] = (),
) -> dict[str, Tensor]:
    """Rank ``rank``'s weights out of a full (model-layout) state dict.

    Intermediate-dim slices of the dense MLPs, shared experts and routed experts; everything
    else is shared by reference. Sharded tensors are copied, so the full ones can be freed.
    Tensors named in ``presharded`` already hold this rank's slice and pass through.
    """
    check_dp_divides(config, world_size)
    if not 0 <= rank < world_size:
        raise ShardError(f"rank {rank} is outside 0 .. {world_size - 1}")
    out: dict[str, Tensor] = {}
    for name, tensor in state_dict.items():
        if name in presharded:
            out[name] = tensor
            continue
        if _GATE_UP.search(name):
            e, two_i, h = tensor.shape
            halves = tensor.view(e, 2, two_i // 2, h)
            step = two_i // 2 // world_size
            shard = halves[:, :, rank * step:(rank + 1) * step]
            out[name] = shard.reshape(e, 2 * step, h).clone()
            continue
        for pattern, dim in _SHARD_RULES:
            if pattern.search(name):
                step = tensor.shape[dim] // world_size
                out[name] = tensor.narrow(dim, rank * step, step).clone()
                break
        else:
            out[name] = tensor
    return out


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return norm_infer(x, self.weight, None, self.eps, True)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _softmax_scale(config: DeepseekV2Config) -> float:
    """``1/sqrt(qk_head_dim)``, times ``mscale(factor, mscale_all_dim)**2`` under yarn (the
    longer context sharpens attention by the same factor the rope tables are scaled by)."""
    scale = config.qk_head_dim ** -0.5
    yarn = config.rope_scaling
    if yarn is not None and yarn.get("mscale_all_dim"):
        scale *= _yarn_mscale(float(yarn["factor"]), yarn["mscale_all_dim"]) ** 2
    return scale


class RotaryEmbedding:
    """cos/sin tables of the ``qk_rope_head_dim`` slice for given positions (plain or yarn).

    Not an nn.Module with a buffer on purpose: ``model.to(torch.bfloat16)`` must not round the
    frequencies, and the tables are rebuilt from positions every forward (cheap: [B*T, D/2]).
    """

    def __init__(self, config: DeepseekV2Config) -> None:
        dim, base = config.qk_rope_head_dim, config.rope_theta
        # Explicitly on the CPU: the model may be built under a meta-device context.
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
        inv_freq = 1.0 / (base ** exponents)
        self.attention_factor = 1.0
        yarn = config.rope_scaling
        if yarn is not None:
            factor = float(yarn["factor"])
            original = float(yarn["original_max_position_embeddings"])
            beta_fast = float(yarn.get("beta_fast") or 32)
            beta_slow = float(yarn.get("beta_slow") or 1)
            mscale, mscale_all_dim = yarn.get("mscale"), yarn.get("mscale_all_dim")
            attention_factor = yarn.get("attention_factor")
            if attention_factor is None:
                if mscale and mscale_all_dim:
                    attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(
                        factor, mscale_all_dim)
                else:
                    attention_factor = _yarn_mscale(factor)
            self.attention_factor = float(attention_factor)

            # Blend interpolated and extrapolated frequencies over the dims whose rotation
            # count at the original context falls between beta_slow and beta_fast.
            def correction_dim(rotations: float) -> float:
                return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

            low = max(math.floor(correction_dim(beta_fast)), 0)
            high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
            if low == high:
                high += 0.001  # avoid a zero-width ramp
            ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
            extrapolation = 1 - ramp
            inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
        self.inv_freq = inv_freq

    def __call__(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """``position_ids [B, T]`` -> fp32 ``cos, sin [B*T, D/2]`` (rows batch-major)."""
        freqs = position_ids.reshape(-1, 1).float() * self.inv_freq.to(position_ids.device)
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor


class DeepseekV2Attention(nn.Module):
    """MLA: queries from a (low-rank) projection, keys and values from a shared latent.

    The cache holds, per token, the normalised latent ``[kv_lora_rank]`` and the rotated rope
    key ``[qk_rope_head_dim]`` (the same compressed cache as transformers); keys and values
    are expanded from it with ``kv_b_proj`` at every step.
    """

    def __init__(self, config: DeepseekV2Config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.qk_dim = config.qk_head_dim
        hidden, heads = config.hidden_size, config.num_attention_heads
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            hidden, config.kv_lora_rank + self.rope_dim, bias=config.attention_bias
        )
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            config.kv_lora_rank, heads * (self.nope_dim + self.v_dim), bias=False
        )
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=config.attention_bias)
        self.softmax_scale = _softmax_scale(config)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, past: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``x [B, T, H]``, ``cos/sin [B*T, Dr/2]``, ``mask [B, 1, T, P+T]`` (bool, True =
        attend), ``past [B, P, R+Dr]`` -> ``(out [B, T, H], present [B, P+T, R+Dr])``."""
        b, t, _ = x.shape
        heads = self.num_heads
        # 1. queries: [B, T, heads, qk] split into the no-rope and rope parts
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, t, heads, self.qk_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        # rows of cos/sin are (batch, token) pairs: rope sees x as [B*T, heads, Dr]
        q_pe = rotary_embedding(q_pe.reshape(b * t, heads, self.rope_dim), cos, sin, True)
        q = torch.cat((q_nope, q_pe.view(b, t, heads, self.rope_dim)), dim=-1)

        # 2. this step's cache entries, appended to the past
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], -1)
        latent = self.kv_a_layernorm(latent)
        k_pe = rotary_embedding(k_pe.reshape(b * t, 1, self.rope_dim), cos, sin, True)
        present = torch.cat((past, torch.cat((latent, k_pe.view(b, t, self.rope_dim)), -1)), 1)

        # 3. keys and values of every cached token: [B, heads, S, *]
        s = present.shape[1]
        latent_all, k_pe_all = present.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(latent_all).view(b, s, heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope_dim, self.v_dim], dim=-1)
        k_pe_all = k_pe_all.unsqueeze(1).expand(b, heads, s, self.rope_dim)
        k = torch.cat((k_nope, k_pe_all), dim=-1)

        # 4. attention and output projection
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=mask, scale=self.softmax_scale
        )
        out = out.transpose(1, 2).reshape(b, t, heads * self.v_dim)
        return self.o_proj(out), present


class DeepseekV2MLP(nn.Module):
    """SwiGLU MLP (dense layers and shared experts); ``intermediate`` is this rank's shard."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DeepseekV2Router(nn.Module):
    """Top-k expert choice per row. Kept in fp32 whatever the model dtype, as transformers and
    DeepSeek do: bf16 scores would flip near-tied experts."""

    def __init__(self, config: DeepseekV2Config) -> None:
        super().__init__()
        assert config.n_routed_experts is not None and config.num_experts_per_tok is not None
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.method = config.topk_method
        self.n_group = config.n_group or 1
        self.topk_group = config.topk_group or 1
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x [N, H]`` -> ``(expert ids [N, k] int64, weights [N, k] fp32)``."""
        scores = F.linear(x.float(), self.weight.float()).softmax(dim=-1)
        if self.method == "group_limited_greedy":
            n = scores.shape[0]
            per_group = self.num_experts // self.n_group
            group_best = scores.view(n, self.n_group, per_group).amax(dim=-1)  # [N, G]
            chosen = torch.topk(group_best, self.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_best).scatter(1, chosen, 1.0)
            expert_mask = group_mask.unsqueeze(-1).expand(n, self.n_group, per_group)
            scores = scores.masked_fill(expert_mask.reshape(n, self.num_experts) == 0, 0.0)
        weights, ids = torch.topk(scores, self.top_k, dim=-1)
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            weights = weights * self.routed_scaling_factor
        return ids, weights


def _experts_grouped(
    x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor
) -> Tensor:
    """Eager face: one pair of matmuls per expert that got rows, over just those rows.

    Every selected expert's weights are read once, in place: the fastest form in eager PyTorch
    at every batch size (see DeepseekV2Experts). Data-dependent (a Python loop over the hit
    experts), so it is never traced.
    """
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    rows = order // k  # token row of each (sorted) assignment
    slot_weights = weights.reshape(-1)[order]
    out = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        idx = rows[start:start + count]
        gate, up = F.linear(x[idx], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert])
        out.index_add_(0, idx, y.float() * slot_weights[start:start + count, None])
        start += count
    return out.to(x.dtype)


def _experts_gather(
    x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor
) -> Tensor:
    """Graph face for small batches: gather each (row, slot)'s expert weights, batched matmul.

    Cost ``N*k`` weight copies: grows with top-k, not with the expert count.
    """
    n, k = ids.shape
    flat = ids.reshape(-1)
    xk = x.unsqueeze(1).expand(n, k, x.shape[1]).reshape(n * k, 1, x.shape[1])
    gate, up = torch.matmul(xk, gate_up.index_select(0, flat).transpose(1, 2)).chunk(2, -1)
    y = torch.matmul(F.silu(gate) * up, down.index_select(0, flat).transpose(1, 2))
    y = y.reshape(n, k, x.shape[1]).float() * weights.unsqueeze(-1)
    return y.sum(dim=1).to(x.dtype)


def _experts_dense(
    x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor
) -> Tensor:
    """Graph face for large batches: every expert on every row, unselected ones weighted 0.

    Reads each expert's weights once (no copies), so it beats the gather when ``N*k`` exceeds
    the expert count; costs ``E`` expert passes per row.
    """
    n = x.shape[0]
    e = gate_up.shape[0]
    routing = torch.zeros(n, e, dtype=torch.float32, device=x.device).scatter(1, ids, weights)
    xe = x.unsqueeze(0).expand(e, n, x.shape[1])  # explicit: OpenVINO mis-runs the broadcast
    gate, up = torch.matmul(xe, gate_up.transpose(1, 2)).chunk(2, dim=-1)
    y = torch.matmul(F.silu(gate) * up, down.transpose(1, 2))  # [E, N, H]
    y = y.float() * routing.transpose(0, 1).unsqueeze(-1)
    return y.sum(dim=0).to(x.dtype)


def _experts_graph(
    x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor
) -> Tensor:
    # The branch is chosen at run time from the row count (ONNX If), not while tracing.
    small = x.shape[0] * ids.shape[1] <= gate_up.shape[0]
    return torch.cond(small, _experts_gather, _experts_dense, (x, ids, weights, gate_up, down))


EXPERT_IMPLS: dict[str, Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]] = {
    "grouped": _experts_grouped,
    "gather": _experts_gather,
    "dense": _experts_dense,
    "graph": _experts_graph,
}


class DeepseekV2Experts(nn.Module):
    """The routed experts as weight stacks: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``
    (``I`` is this rank's shard of ``moe_intermediate_size``; gate rows first, then up).

    The expert compute has two faces, like numaov's custom ops:

    - eager (``impl="auto"`` outside export): :func:`_experts_grouped`, a loop over the experts
      that got rows, each running its matmuls on its own rows;
    - graph (``impl="auto"`` while ``torch.export`` / ``torch.onnx.export`` traces):
      :func:`_experts_graph`, no Python control flow at all. ``torch.cond`` on the row count
      (an ONNX ``If``, decided at run time) picks the per-row weight gather + batched matmul
      when ``N*k <= E`` (decode: cost grows with top-k, not with E) and the dense all-experts
      form otherwise (prefill: each weight read once, no per-row copies).

    Measured (2026-11-29, 2-core AVX-512 Xeon, 2 threads, fp32, H=1024, I=704, E=64, k=6; one
    MoE call for N rows):

    ==============================  =======  =======  ========  =========
    form                             N=1      N=8      N=64      N=256
    ==============================  =======  =======  ========  =========
    torch grouped loop (eager)       4.2 ms   19 ms    64 ms     92 ms
    torch gather + bmm               21 ms    211 ms   1671 ms   12584 ms
    torch gather + einsum            27 ms    251 ms   1852 ms   10905 ms
    torch dense all-experts          29 ms    74 ms    136 ms    —
    OpenVINO gather (E=32)           19 ms    54 ms*   954 ms    5731 ms
    OpenVINO dense (E=64)            77 ms    126 ms*  426 ms    1883 ms
    ==============================  =======  =======  ========  =========

    (* N=4. The gather's cost does not depend on E, so its OpenVINO row was taken at E=32.)
    Weight copies dominate the gather form: ``N*k`` experts' weights are copied per
    call, so beyond ``N*k ~ E`` reading every expert once (dense) is cheaper, and per-row
    gathers at prefill sizes would need ``N*k*3*I*H`` elements of scratch. Neither graph form
    reaches the eager loop: a fused MoE op (grouped GEMM) for the graph is the real fix.
    OpenVINO 2026.4's CPU plugin carries a ``GatherMatmul`` node fed by a tiled-MoE pattern
    matcher, but hand-built tiled patterns (f32, u8 and i8 weights) did not trigger it.

    ``impl`` forces one form (``"grouped"``, ``"gather"``, ``"dense"``, ``"graph"``) for tests
    and benchmarks; ``"auto"`` is the default described above.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.impl = "auto"

    def forward(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        impl = self.impl
        if impl == "auto":
            impl = "graph" if torch.compiler.is_exporting() else "grouped"
        return EXPERT_IMPLS[impl](x, ids, weights, self.gate_up_proj, self.down_proj)


class DeepseekV2MoE(nn.Module):
    """Router (replicated), routed experts and shared experts (both sharded by intermediate)."""

    def __init__(self, config: DeepseekV2Config, world_size: int) -> None:
        super().__init__()
        assert config.n_routed_experts is not None
        hidden = config.hidden_size
        self.gate = DeepseekV2Router(config)
        self.experts = DeepseekV2Experts(
            config.n_routed_experts, hidden, config.moe_intermediate_size // world_size
        )
        self.shared_experts = (
            DeepseekV2MLP(hidden, config.shared_intermediate_size // world_size)
            if config.shared_intermediate_size
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        """``x [N, H]`` -> this rank's partial sum ``[N, H]``."""
        ids, weights = self.gate(x)
        out = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, config: DeepseekV2Config, layer: int, dp: DataParallelGroup | None) -> None:
        super().__init__()
        world = dp.world_size if dp is not None else 1
        self.dp = dp if world > 1 else None
        # 1. attention (replicated: each rank runs it on its own sequences)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DeepseekV2Attention(config)
        # 2. MoE or dense MLP (sharded: every rank runs its part on every rank's rows)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = (
            DeepseekV2MoE(config, world)
            if config.is_moe_layer(layer)
            else DeepseekV2MLP(config.hidden_size, config.intermediate_size // world)
        )

    def forward(
        self,
        hidden: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
        past: Tensor,
        padded_rows: int,
    ) -> tuple[Tensor, Tensor]:
        # 1. attention
        attn, present = self.self_attn(self.input_layernorm(hidden), cos, sin, mask, past)
        hidden = hidden + attn
        # 2. MoE or dense MLP, over the rows of all ranks
        rows = self.post_attention_layernorm(hidden).reshape(-1, hidden.shape[-1])
        return hidden + self._mlp_all_ranks(rows, padded_rows).view_as(hidden), present

    def _mlp_all_ranks(self, rows: Tensor, padded_rows: int) -> Tensor:
        """``rows [n, H]`` of this rank -> the finished MLP output of the same rows."""
        if self.dp is None:
            return self.mlp(rows)
        group, world = self.dp.group, self.dp.world_size
        n = rows.shape[0]
        padded = F.pad(rows, (0, 0, 0, padded_rows - n))  # [M, H]
        everyone = all_gather_into_tensor(padded, group, world)  # [world*M, H], rank-major
        partial = self.mlp(everyone)  # this rank's shard of the sum, for every rank's rows
        mine = reduce_scatter_tensor(partial, group, world)  # [M, H]: summed, rows of this rank
        return mine[:n]


class DeepseekV2Model(nn.Module):
    def __init__(self, config: DeepseekV2Config, dp: DataParallelGroup | None) -> None:
        super().__init__()
        self.config = config
        self.dp = dp if dp is not None and dp.world_size > 1 else None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV2DecoderLayer(config, i, dp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)

    def forward(
        self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor, past: Tensor
    ) -> tuple[Tensor, Tensor]:
        b, t = input_ids.shape
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary(position_ids)
        mask = _attention_mask(attention_mask, t)
        padded_rows = self._agree_padded_rows(b * t)
        presents = []
        for i, layer in enumerate(self.layers):
            hidden, present = layer(hidden, cos, sin, mask, past[i], padded_rows)
            presents.append(present)
        return self.norm(hidden), torch.stack(presents)

    def _agree_padded_rows(self, rows: int) -> int:
        """The largest row count of any rank this step (at least 1): the MAX_LEN padding.

        One tiny all-gather per forward, shared by every layer's exchange.
        """
        if self.dp is None:
            return rows
        count = torch.full((1,), rows, dtype=torch.float32)  # exact below 2**24 rows
        counts = all_gather_into_tensor(count, self.dp.group, self.dp.world_size)
        # Integer conversion on the tensor side: while exporting, .item() of an int tensor is
        # a symbolic size the graph computes at run time.
        padded = counts.max().clamp(min=1).to(torch.int64).item()
        torch._check(padded >= 1)  # a size: tells torch.export it is non-negative
        torch._check(padded >= rows)
        return padded


def _attention_mask(attention_mask: Tensor, t: int) -> Tensor:
    """``attention_mask [B, S]`` (1 = real token, past and current) -> bool ``[B, 1, T, S]``.

    Query ``i`` (cache slot ``S-T+i``) sees the real tokens at slots ``<= S-T+i``, and always
    itself, so a padding query has one finite score instead of a NaN row that would leak into
    the cache of the real tokens through ``0 * NaN``.
    """
    s = attention_mask.shape[1]
    query_slot = torch.arange(t, device=attention_mask.device).unsqueeze(1) + (s - t)  # [T, 1]
    key_slot = torch.arange(s, device=attention_mask.device).unsqueeze(0)  # [1, S]
    causal = key_slot <= query_slot
    real = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, S]
    return (causal & real) | (key_slot == query_slot)


# ---------------------------------------------------------------------------------------------
# The causal LM
# ---------------------------------------------------------------------------------------------


class DeepseekV2(nn.Module):
    """DeepSeek-V2 causal LM with Hugging Face parameter names.

    ``forward(input_ids [B, T]) -> logits [B, T, V]`` for a whole sequence;
    :meth:`step` is the cached form the engines and the exporter use. With ``dp`` the instance
    is one rank of a DP group and holds that rank's MLP/expert shard (see the module docstring).
    """

    def __init__(self, config: DeepseekV2Config, dp: DataParallelGroup | None = None) -> None:
        super().__init__()
        if dp is not None:
            check_dp_divides(config, dp.world_size)
        self.config = config
        self.dp = dp
        self.model = DeepseekV2Model(config, dp)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # -- loading -----------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        dtype: torch.dtype | str = torch.float32,
        dp: DataParallelGroup | None = None,
    ) -> DeepseekV2:
        """Load a Hugging Face ``deepseek_v2`` checkpoint directory (single or sharded
        safetensors).

        ``dtype`` is a torch dtype or ``"auto"`` (the checkpoint's ``torch_dtype``, fp32 when
        absent); the router stays fp32 either way. With ``dp`` only this rank's shard is kept:
        the checkpoint is memory-mapped and only the rank's slices are copied out of it.
        """
        what = f"DeepSeek-V2 checkpoint {str(directory)!r}"
        values = read_config(directory, what=what)
        config = DeepseekV2Config.from_dict(values, what)
        dtype = _resolve_dtype(dtype, values, what)
        world = dp.world_size if dp is not None else 1
        check_dp_divides(config, world)
        state = load_safetensors_state_dict(directory, WEIGHTS_NAME, WEIGHTS_INDEX_NAME, what)
        shard = (dp.rank, world) if dp is not None else None
        state = checkpoint_to_model_state_dict(state, config, what, shard)
        model = cls.empty(config, dtype, dp)
        load_into_module(model, state, what)
        return model.eval()

    @classmethod
    def empty(
        cls, config: DeepseekV2Config, dtype: torch.dtype = torch.float32,
        dp: DataParallelGroup | None = None,
    ) -> DeepseekV2:
        """An uninitialised model (memory allocated, not filled): the target of a load.

        Built on the meta device so a large model is not first filled with random numbers.
        The router stays fp32.
        """
        with torch.device("meta"):
            model = cls(config, dp)
        model.to_empty(device="cpu")
        _cast_keep_router(model, dtype)
        return model

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``config.json`` + ``model.safetensors`` in DeepSeek's per-expert layout, the
        layout transformers' ``DeepseekV2ForCausalLM.from_pretrained`` reads."""
        if self.dp is not None and self.dp.world_size > 1:
            raise ShardError(
                f"this model holds rank {self.dp.rank}'s shard of a dp={self.dp.world_size} "
                "group; expected an unsharded model (dp=None) to save a checkpoint"
            )
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        config = self.config.to_dict()
        config["torch_dtype"] = str(self.lm_head.weight.dtype).removeprefix("torch.")
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        tensors = model_to_checkpoint_state_dict(self.state_dict(), self.config)
        save_file(tensors, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
        return path

    # -- running -----------------------------------------------------------------------------

    def empty_cache(self, batch_size: int) -> Tensor:
        """A zero-length KV cache ``[layers, B, 0, kv_lora_rank + qk_rope_head_dim]``."""
        c = self.config
        return torch.zeros(
            c.num_hidden_layers, batch_size, 0, c.kv_cache_dim, dtype=self.lm_head.weight.dtype
        )

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """``input_ids [B, T]`` (``attention_mask [B, T]``, 1 = real, for left padding) ->
        ``logits [B, T, V]``."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        positions = _positions_from_mask(attention_mask)
        logits, _ = self.step(input_ids, positions, attention_mask, self.empty_cache(len(input_ids)))
        return logits

    def step(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        attention_mask: Tensor,
        past_key_values: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """One step with an explicit cache.

        ``input_ids``, ``position_ids``: ``[B, T]`` int64; ``attention_mask``: ``[B, P+T]``
        (1 = real token; covers the cached and the new tokens); ``past_key_values``:
        ``[layers, B, P, kv_lora_rank + qk_rope_head_dim]``. Returns ``(logits [B, T, V],
        present_key_values [layers, B, P+T, ...])``.
        """
        hidden, present = self.model(input_ids, position_ids, attention_mask, past_key_values)
        return self.lm_head(hidden), present


class DeepseekV2Step(nn.Module):
    """:meth:`DeepseekV2.step` as a module's forward: what the exporter traces."""

    def __init__(self, model: DeepseekV2) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor,
        past_key_values: Tensor,
    ) -> tuple[Tensor, Tensor]:
        return self.model.step(input_ids, position_ids, attention_mask, past_key_values)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve_dtype(dtype: torch.dtype | str, config: Mapping[str, Any], what: str) -> torch.dtype:
    if dtype == "auto":
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in _DTYPES:
            raise DeepseekConfigError(
                f"{what}: dtype {dtype!r} is not supported; expected one of "
                f"{', '.join(_DTYPES)} or 'auto'"
            )
        return _DTYPES[dtype.removeprefix("torch.")]
    if dtype not in _DTYPES.values():
        raise DeepseekConfigError(
            f"{what}: dtype {dtype} is not supported; expected torch.float32, torch.bfloat16 "
            "or torch.float16"
        )
    return dtype


def _positions_from_mask(attention_mask: Tensor) -> Tensor:
    """Left-padded rows count positions from their first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _cast_keep_router(model: nn.Module, dtype: torch.dtype) -> None:
    for module in model.modules():
        if isinstance(module, DeepseekV2Router):
            module.float()
            continue
        for name, param in module.named_parameters(recurse=False):
            if param.dtype != dtype:
                setattr(module, name, nn.Parameter(param.to(dtype), requires_grad=False))
    for param in model.parameters():
        param.requires_grad_(False)
    if getattr(model, "config", None) is not None and model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


# ---------------------------------------------------------------------------------------------
# Checkpoint layout
# ---------------------------------------------------------------------------------------------

_STACK = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def _checkpoint_shapes(config: DeepseekV2Config, per_expert: bool) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a full checkpoint, per-expert or stacked layout."""
    with torch.device("meta"):
        model = DeepseekV2(config)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in model.state_dict().items():
        match = _STACK.match(name)
        if match is None or not per_expert:
            shapes[name] = tuple(tensor.shape)
            continue
        prefix, kind = match.groups()
        e, rows, cols = tensor.shape
        for i in range(e):
            if kind == "gate_up_proj":
                shapes[f"{prefix}.{i}.gate_proj.weight"] = (rows // 2, cols)
                shapes[f"{prefix}.{i}.up_proj.weight"] = (rows // 2, cols)
            else:
                shapes[f"{prefix}.{i}.down_proj.weight"] = (rows, cols)
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def checkpoint_to_model_state_dict(
    state_dict: Mapping[str, Tensor], config: DeepseekV2Config, what: str = "checkpoint",
    shard: tuple[int, int] | None = None,
) -> dict[str, Tensor]:
    """A full checkpoint's tensors (per-expert DeepSeek layout, or transformers' stacked one)
    in the model's layout, after checking every name and shape against ``config``; with
    ``shard=(rank, world_size)``, only that rank's slices (as :func:`shard_state_dict`).

    Sharding here rather than after matters for memory: the per-expert tensors are stacked
    from slices of the (memory-mapped) checkpoint, so only the rank's share of the experts is
    ever copied, not every expert of every layer.

    Raises CheckpointError naming the missing, unexpected and mis-shaped tensors.
    """
    per_expert = not any(_STACK.match(name) for name in state_dict)
    state = dict(state_dict)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: the embedding is the head
    check_state_dict(_checkpoint_shapes(config, per_expert), state, what)
    if shard is not None:
        check_dp_divides(config, shard[1])
    presharded = []
    if per_expert:
        rows = slice(None)
        if shard is not None:
            step = int(config.moe_intermediate_size) // shard[1]
            rows = slice(shard[0] * step, (shard[0] + 1) * step)
        for layer in range(config.num_hidden_layers):
            if not config.is_moe_layer(layer):
                continue
            prefix = f"model.layers.{layer}.mlp.experts"
            experts = range(config.n_routed_experts or 0)
            gate = [state.pop(f"{prefix}.{e}.gate_proj.weight")[rows] for e in experts]
            up = [state.pop(f"{prefix}.{e}.up_proj.weight")[rows] for e in experts]
            down = [state.pop(f"{prefix}.{e}.down_proj.weight")[:, rows] for e in experts]
            state[f"{prefix}.gate_up_proj"] = torch.cat((torch.stack(gate), torch.stack(up)), 1)
            state[f"{prefix}.down_proj"] = torch.stack(down)
            presharded += [f"{prefix}.gate_up_proj", f"{prefix}.down_proj"]
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    if shard is not None:
        state = shard_state_dict(state, config, shard[0], shard[1],
                                 presharded if shard[1] > 1 else ())
    return state


def model_to_checkpoint_state_dict(
    state_dict: Mapping[str, Tensor], config: DeepseekV2Config
) -> dict[str, Tensor]:
    """The inverse of :func:`checkpoint_to_model_state_dict`: DeepSeek's per-expert layout
    (what transformers' ``save_pretrained`` writes), contiguous tensors ready for safetensors."""
    out: dict[str, Tensor] = {}
    for name, tensor in state_dict.items():
        match = _STACK.match(name)
        if match is None:
            out[name] = tensor.contiguous()
            continue
        prefix, kind = match.groups()
        if kind == "gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = gate[e].contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = up[e].contiguous()
        else:
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e].contiguous()
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


# ---------------------------------------------------------------------------------------------
# Greedy generation
# ---------------------------------------------------------------------------------------------


@dataclass
class GreedyOutput:
    """``tokens[i]``: the new tokens of prompt ``i``; ``logits [B, steps, V]`` (fp32): the
    logits each token was chosen from."""

    tokens: list[list[int]]
    logits: Tensor


def generate_greedy(
    model: DeepseekV2,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    pad_token_id: int = 0,
    progress: Callable[[str], None] | None = None,
) -> GreedyOutput:
    """Greedy decoding of a batch of prompts (left-padded) with the explicit KV cache.

    Exactly ``max_new_tokens`` steps run, whatever the tokens: under DP every rank must run
    the same number of forwards (the collectives need everyone), so a rank with no prompts
    calls this with ``prompts=[]`` and takes part with empty batches.
    """
    config = model.config
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ModelInputError(f"max_new_tokens is {max_new_tokens!r}; expected a positive integer")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ModelInputError(f"prompt {i} is empty; expected at least one token id")
        bad = [t for t in prompt if not 0 <= int(t) < config.vocab_size]
        if bad:
            raise ModelInputError(
                f"prompt {i} holds token id(s) {bad[:8]} outside the vocabulary; expected ids "
                f"in 0 .. {config.vocab_size - 1}"
            )
    longest = max((len(p) for p in prompts), default=1)
    if longest + max_new_tokens > config.max_position_embeddings:
        raise ModelInputError(
            f"a prompt of {longest} tokens plus {max_new_tokens} new tokens exceeds "
            f"max_position_embeddings={config.max_position_embeddings}; expected at most "
            f"{config.max_position_embeddings} positions"
        )
    b = len(prompts)
    ids = torch.full((b, longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros((b, longest), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, longest - len(prompt):] = torch.tensor([int(t) for t in prompt])
        mask[i, longest - len(prompt):] = 1
    positions = _positions_from_mask(mask)
    past = model.empty_cache(b)
    chosen: list[Tensor] = []
    step_logits: list[Tensor] = []
    with torch.inference_mode():
        for step in range(max_new_tokens):
            logits, past = model.step(ids, positions, mask, past)
            last = logits[:, -1].float()
            token = last.argmax(dim=-1)
            chosen.append(token)
            step_logits.append(last)
            # next step: one new token per row, at the next position
            positions = mask.sum(dim=-1, keepdim=True)
            ids = token.unsqueeze(1)
            mask = torch.cat((mask, torch.ones((b, 1), dtype=mask.dtype)), dim=1)
            if progress is not None:
                progress(f"generated token {step + 1}/{max_new_tokens}")
    tokens = torch.stack(chosen, dim=1) if b else torch.zeros((0, max_new_tokens), dtype=torch.long)
    logits_all = (
        torch.stack(step_logits, dim=1) if b
        else torch.zeros((0, max_new_tokens, config.vocab_size))
    )
    return GreedyOutput(tokens=tokens.tolist(), logits=logits_all)


"""The Hugging Face ``qwen3_moe`` / ``qwen2_moe`` config the model reads.

Both spellings are read: transformers 4's (``num_experts``, ``rope_theta`` / ``rope_scaling``)
and transformers 5's (``num_local_experts`` for Qwen3-MoE, ``rope_parameters``);
:meth:`QwenMoeConfig.to_dict` writes the classic form, which transformers 5 reads too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from numaov import NumaovError
from numaov.models.checkpoint import read_config
from numaov.models.layers.config_keys import (
    check_positive,
    check_silu,
    config_from_keys,
    config_to_keys,
    is_int,
)
from numaov.models.layers.rope import read_rope_keys

MODEL_TYPES = ("qwen3_moe", "qwen2_moe")
_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


class QwenMoeConfigError(NumaovError):
    """A Qwen-MoE config is malformed or asks for something the model does not support."""


# Keys a config.json must state: transformers' defaults for them describe one specific large
# model, and building that when a key is missing would only fail later, at the shapes.
_REQUIRED_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "moe_intermediate_size",
    "num_experts_per_tok",
)


@dataclass(frozen=True)
class QwenMoeConfig:
    """The Hugging Face Qwen-MoE config keys the model reads (defaults: transformers').

    ``model_type`` picks the variant: ``qwen3_moe`` (per-head q/k RMSNorm, ``attention_bias``
    on all four projections, no shared expert) or ``qwen2_moe`` (``qkv_bias`` on q/k/v, a
    shared expert of ``shared_expert_intermediate_size`` behind a sigmoid gate).
    ``rope_scaling`` is None (plain rope) or a Hugging Face dict of a kind
    ``layers.rope.RotaryEmbedding`` computes (linear, yarn, llama3).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    head_dim: int | None = None
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    shared_expert_intermediate_size: int = 0
    attention_bias: bool = False
    qkv_bias: bool = True
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    use_sliding_window: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], what: str = "Qwen-MoE config") -> QwenMoeConfig:
        """Build from a ``config.json`` mapping; keys the model does not read go to ``extra``."""
        model_type = values.get("model_type")
        if model_type not in MODEL_TYPES:
            raise QwenMoeConfigError(f"{what}: model_type is {model_type!r}; expected one of "
                                     f"{', '.join(MODEL_TYPES)}")
        required = (*_REQUIRED_KEYS, *(("shared_expert_intermediate_size",)
                                       if model_type == "qwen2_moe" else ()))
        missing = [k for k in required if values.get(k) is None]
        experts = values.get("num_experts", values.get("num_local_experts"))
        if experts is None:
            missing.append("num_experts (or num_local_experts)")
        if missing:
            raise QwenMoeConfigError(f"{what}: missing required key(s) {', '.join(missing)}; "
                                     f"expected a Hugging Face {model_type} config.json")
        if values.get("use_sliding_window"):
            raise QwenMoeConfigError(
                f"{what}: use_sliding_window is true; expected false (sliding-window attention "
                "is not supported: every layer attends to the whole context)")
        layer_types = values.get("layer_types") or []
        if any(kind != "full_attention" for kind in layer_types):
            raise QwenMoeConfigError(
                f"{what}: layer_types holds {sorted(set(layer_types) - {'full_attention'})}; "
                "expected only 'full_attention' (sliding-window attention is not supported)")
        theta, scaling = read_rope_keys(values, what, QwenMoeConfigError)
        return config_from_keys(
            cls, values, what, QwenMoeConfigError,
            derived={"num_experts": experts, "rope_theta": theta, "rope_scaling": scaling},
            also_read=("num_local_experts",), null_is_default=True)

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> QwenMoeConfig:
        what = f"Qwen-MoE checkpoint {str(directory)!r}"
        return cls.from_dict(read_config(directory, what=what), what)

    def to_dict(self) -> dict[str, Any]:
        """The config.json form (Hugging Face keys; rope in the classic rope_theta /
        rope_scaling form, which transformers 5 reads too)."""
        return config_to_keys(self, _ARCHITECTURES[self.model_type], head_dim=self.kv_head_dim)

    # -- derived sizes -----------------------------------------------------------------------

    @property
    def kv_head_dim(self) -> int:
        """``head_dim``, or ``hidden_size // num_attention_heads`` when the config has none."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def kv_cache_dim(self) -> int:
        """Per-token, per-layer cache width: the rotated K heads then the V heads."""
        return 2 * self.num_key_value_heads * self.kv_head_dim

    @property
    def qk_norm(self) -> bool:
        """Qwen3-MoE normalises every query and key head (RMSNorm over ``head_dim``)."""
        return self.model_type == "qwen3_moe"

    @property
    def has_qkv_bias(self) -> bool:
        return self.attention_bias if self.model_type == "qwen3_moe" else self.qkv_bias

    @property
    def has_o_bias(self) -> bool:
        return self.model_type == "qwen3_moe" and self.attention_bias

    @property
    def shared_expert_size(self) -> int:
        """The shared expert's intermediate size (Qwen2-MoE), 0 without one (Qwen3-MoE)."""
        return self.shared_expert_intermediate_size if self.model_type == "qwen2_moe" else 0

    def is_moe_layer(self, layer: int) -> bool:
        """As transformers: sparse unless listed in ``mlp_only_layers``, every
        ``decoder_sparse_step``-th layer (1-based)."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    # -- checks ------------------------------------------------------------------------------

    def _validate(self) -> None:
        def fail(message: str) -> NoReturn:
            raise QwenMoeConfigError(f"Qwen-MoE config: {message}")

        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "moe_intermediate_size",
                    "num_experts", "num_experts_per_tok", "decoder_sparse_step",
                    "max_position_embeddings")
        check_positive(self, positive, fail)
        check_positive(self, ("head_dim",), fail, null_ok=True)
        if self.kv_head_dim % 2:
            fail(f"head_dim is {self.kv_head_dim}; expected an even number (rope rotates pairs)")
        if self.num_attention_heads % self.num_key_value_heads:
            fail(f"num_key_value_heads is {self.num_key_value_heads}; expected a divisor of "
                 f"num_attention_heads ({self.num_attention_heads})")
        if self.num_experts_per_tok > self.num_experts:
            fail(f"num_experts_per_tok is {self.num_experts_per_tok}; expected 1 .. "
                 f"num_experts ({self.num_experts})")
        if not isinstance(self.mlp_only_layers, list) or any(
                not is_int(i) for i in self.mlp_only_layers):
            fail(f"mlp_only_layers is {self.mlp_only_layers!r}; expected a list of layer indices")
        if self.model_type == "qwen2_moe" and (
                not is_int(self.shared_expert_intermediate_size)
                or self.shared_expert_intermediate_size < 1):
            fail(f"shared_expert_intermediate_size is {self.shared_expert_intermediate_size!r}; "
                 "expected a positive integer (Qwen2-MoE has a shared expert)")
        check_silu(self, fail)
        if self.use_sliding_window:
            fail("use_sliding_window is true; expected false (sliding-window attention is not "
                 "supported)")

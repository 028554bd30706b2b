"""The Hugging Face ``deepseek_v2`` config the model reads, with its rope (plain or yarn) keys.

Both spellings of rope are read: the classic ``rope_theta`` / ``rope_scaling`` keys and
transformers 5's ``rope_parameters``; :meth:`DeepseekV2Config.to_dict` writes the classic form,
which transformers 5 reads too.
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
from numaov.models.layers.mla import MlaConfig
from numaov.models.layers.rope import read_rope_keys


class DeepseekConfigError(NumaovError):
    """A DeepSeek-V2 config is malformed or asks for something the model does not support."""


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
#: Plain rope or yarn: the rope DeepSeek-V2 was trained with.
ROPE_KINDS = ("default", "yarn")


@dataclass(frozen=True)
class DeepseekV2Config(MlaConfig):
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
        theta, scaling = read_rope_keys(values, what, DeepseekConfigError, kinds=ROPE_KINDS,
                                        kind_key="type")
        return config_from_keys(cls, values, what, DeepseekConfigError,
                                derived={"rope_theta": theta, "rope_scaling": scaling})

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> DeepseekV2Config:
        return cls.from_dict(read_config(directory, what="DeepSeek-V2 checkpoint"))

    def to_dict(self) -> dict[str, Any]:
        """The config.json form (Hugging Face keys; rope in the classic rope_theta/rope_scaling
        form, which transformers 5 reads too)."""
        return config_to_keys(self, "DeepseekV2ForCausalLM", model_type="deepseek_v2")

    # -- derived sizes -----------------------------------------------------------------------

    @property
    def shared_intermediate_size(self) -> int:
        return (self.n_shared_experts or 0) * self.moe_intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.n_routed_experts is not None
            and layer >= self.first_k_dense_replace
        )

    # -- checks ------------------------------------------------------------------------------

    def _validate(self) -> None:
        def fail(message: str) -> NoReturn:
            raise DeepseekConfigError(f"DeepSeek-V2 config: {message}")

        positive = (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
            "v_head_dim", "moe_intermediate_size", "max_position_embeddings",
        )
        check_positive(self, positive, fail)
        check_positive(self, ("q_lora_rank", "n_routed_experts", "num_experts_per_tok",
                              "n_group", "topk_group", "num_key_value_heads"), fail, null_ok=True)
        if self.n_shared_experts is not None and (not is_int(self.n_shared_experts)
                                                  or self.n_shared_experts < 0):
            fail(f"n_shared_experts is {self.n_shared_experts!r}; expected a non-negative integer")
        if self.first_k_dense_replace < 0:
            fail(f"first_k_dense_replace is {self.first_k_dense_replace}; expected >= 0")
        self.check_mla(fail)
        check_silu(self, fail)
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

"""The Hugging Face ``deepseek_v3`` (and ``kimi_k2``) config the model reads: keys as
transformers' ``DeepseekV3Config``, plus DeepSeek's own ``scoring_func``, ``topk_method``,
``num_nextn_predict_layers`` and the FP8 ``quantization_config``.

Both spellings of rope are read: the classic ``rope_theta`` / ``rope_scaling`` keys and
transformers 5's ``rope_parameters``; :meth:`DeepseekV3Config.to_dict` writes the classic form,
which transformers 5 reads too. What the family does not run is refused with one line:
DeepSeek-V3.2's sparse attention (its lightning indexer) and DeepSeek-V4.
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

MODEL_TYPES = ("deepseek_v3", "kimi_k2")


class DeepseekV3ConfigError(NumaovError):
    """A DeepSeek-V3 config is malformed or asks for something the model does not support."""


# As for DeepSeek-V2: transformers' defaults for these describe one specific large model.
_REQUIRED_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
    "v_head_dim", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
)
# DeepSeek-V3.2's sparse attention: a lightning indexer picks index_topk cached tokens per
# query. Its keys in config.json (and in transformers' DeepseekV32Config).
_INDEXER_KEYS = ("index_topk", "index_n_heads", "index_head_dim")
#: Plain rope or yarn: the rope DeepSeek-V3 was trained with.
ROPE_KINDS = ("default", "yarn")
_NEWER = {"deepseek_v32": "DeepSeek-V3.2", "deepseek_v4": "DeepSeek-V4"}


@dataclass(frozen=True)
class Fp8Format:
    """A released FP8 checkpoint's ``quantization_config``: float8_e4m3fn weights with one
    float32 ``weight_scale_inv`` per ``block`` (rows, cols)."""

    block: tuple[int, int]


@dataclass(frozen=True)
class DeepseekV3Config(MlaConfig):
    """The ``deepseek_v3`` config keys the model reads (defaults: transformers').

    ``rope_scaling`` is None (plain rope) or the yarn dict (``factor``,
    ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``mscale``,
    ``mscale_all_dim``); yarn scales cos/sin by ``mscale(factor, mscale) /
    mscale(factor, mscale_all_dim)`` and the softmax scale by ``mscale(factor,
    mscale_all_dim) ** 2``, as transformers' DeepSeek-V3 does.
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
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    q_lora_rank: int | None = 1536
    num_key_value_heads: int | None = None
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 3
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    num_nextn_predict_layers: int = 0
    hidden_act: str = "silu"
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    quantization_config: dict[str, Any] | None = None
    model_type: str = "deepseek_v3"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, values: Mapping[str, Any],
                  what: str = "DeepSeek-V3 config") -> DeepseekV3Config:
        """Build from a ``config.json`` mapping; keys the model does not read go to ``extra``."""
        model_type = values.get("model_type")
        if model_type in _NEWER:
            raise DeepseekV3ConfigError(
                f"{what}: model_type {model_type!r} ({_NEWER[model_type]}) is not supported: "
                "its sparse attention (lightning indexer) is not implemented; expected one of "
                f"{', '.join(MODEL_TYPES)}")
        indexer = [k for k in _INDEXER_KEYS if k in values]
        if indexer:
            raise DeepseekV3ConfigError(
                f"{what}: {', '.join(f'{k}={values[k]!r}' for k in indexer)} ask for "
                "DeepSeek-V3.2's sparse attention, whose lightning indexer numaov does not "
                "implement; expected a dense-MLA DeepSeek-V3 config without index_* keys")
        if model_type not in (None, *MODEL_TYPES):
            raise DeepseekV3ConfigError(
                f"{what}: model_type is {model_type!r}; expected one of {', '.join(MODEL_TYPES)}")
        missing = [k for k in _REQUIRED_KEYS if values.get(k) is None]
        if missing:
            raise DeepseekV3ConfigError(
                f"{what}: missing required key(s) {', '.join(missing)}; expected a Hugging Face "
                "deepseek_v3 config.json")
        theta, scaling = read_rope_keys(values, what, DeepseekV3ConfigError, kinds=ROPE_KINDS,
                                        kind_key="type")
        return config_from_keys(cls, values, what, DeepseekV3ConfigError, derived={
            "model_type": model_type or "deepseek_v3", "rope_theta": theta,
            "rope_scaling": scaling})

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> DeepseekV3Config:
        what = f"DeepSeek-V3 checkpoint {str(directory)!r}"
        return cls.from_dict(read_config(directory, what=what), what)

    def to_dict(self) -> dict[str, Any]:
        """The config.json form (Hugging Face keys; rope in the classic form)."""
        out = config_to_keys(self, "DeepseekV3ForCausalLM")
        if out["quantization_config"] is None:
            del out["quantization_config"]  # plain weights: no key, as released configs
        return out

    # -- derived sizes -----------------------------------------------------------------------

    @property
    def shared_intermediate_size(self) -> int:
        return self.n_shared_experts * self.moe_intermediate_size

    @property
    def fp8(self) -> Fp8Format | None:
        """The FP8 weight format of a released checkpoint, None for plain weights."""
        if self.quantization_config is None:
            return None
        block = self.quantization_config["weight_block_size"]
        return Fp8Format((int(block[0]), int(block[1])))

    def is_moe_layer(self, layer: int) -> bool:
        # As transformers: moe_layer_freq (DeepSeek's own code: dense where layer % freq != 0;
        # 1 in every published checkpoint) is not read.
        return layer >= self.first_k_dense_replace

    # -- checks ------------------------------------------------------------------------------

    def _validate(self) -> None:
        def fail(message: str) -> NoReturn:
            raise DeepseekV3ConfigError(f"DeepSeek-V3 config: {message}")

        positive = (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
            "v_head_dim", "moe_intermediate_size", "max_position_embeddings",
            "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
        )
        check_positive(self, positive, fail)
        check_positive(self, ("q_lora_rank", "num_key_value_heads"), fail, null_ok=True)
        for name in ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                fail(f"{name} is {value!r}; expected a non-negative integer")
        self.check_mla(fail)
        check_silu(self, fail)
        if self.scoring_func != "sigmoid":
            fail(f"scoring_func is {self.scoring_func!r}; expected 'sigmoid' (DeepSeek-V3)")
        if self.topk_method != "noaux_tc":
            fail(f"topk_method is {self.topk_method!r}; expected 'noaux_tc' (DeepSeek-V3)")
        e, g, tg, k = (self.n_routed_experts, self.n_group, self.topk_group,
                       self.num_experts_per_tok)
        if e % g:
            fail(f"n_routed_experts={e} is not a multiple of n_group={g}; expected the experts "
                 "split into equal groups")
        if tg > g:
            fail(f"topk_group={tg} is more than n_group={g}; expected 1 <= topk_group <= n_group")
        if k > tg * (e // g):
            fail(f"topk_group={tg} groups of {e // g} experts hold fewer than "
                 f"num_experts_per_tok={k} experts")
        if self.quantization_config is not None:
            _check_fp8(self.quantization_config, fail)


def _check_fp8(quant: Any, fail: Any) -> None:
    """Only the released FP8 layout: fp8, e4m3, two positive block dims."""
    if not isinstance(quant, Mapping):
        fail(f"quantization_config is {quant!r}; expected an object")
    method, fmt, block = quant.get("quant_method"), quant.get("fmt", "e4m3"), quant.get(
        "weight_block_size")
    if method != "fp8":
        fail(f"quantization_config.quant_method is {method!r}; expected 'fp8' (block-scaled "
             "float8 weights) or no quantization_config")
    if fmt != "e4m3":
        fail(f"quantization_config.fmt is {fmt!r}; expected 'e4m3'")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        fail(f"quantization_config.weight_block_size is {block!r}; expected two positive "
             "integers, e.g. [128, 128]")

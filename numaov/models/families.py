"""The seam between numaov and its language-model families.

A family lives in ``numaov/models/<family>/`` and describes itself to the rest of numaov
through one :class:`LMFamily` object (its ``family.py``): the config read from a Hugging Face
``config.json``, the per-layer KV-cache entry layout, how it shards across DP ranks, which
tensors are routed experts, and how to build the model whose pooled step the exporter traces
and the PyTorch backend runs. :data:`FAMILIES` maps a family's name to its module and
:func:`family_for_checkpoint` picks one by the checkpoint's ``model_type``. Nothing outside
``numaov/models/<family>/`` names a family or reads its config keys; the manifest records the
family's name and its cache layout, so the runtime reads both from an export.

Every family's step has the same graph inputs and outputs (``STEP_INPUTS`` / ``STEP_OUTPUTS``):
the cache pool is ``[layers, cache_tokens, width]`` whatever the attention design, and the
layout says what the ``width`` values of one token's entry are (MLA: the normalised latent and
the rotated rope key; GQA: the K and V heads).

Importing this module imports neither torch nor a family: ``doctor`` and the runtime's
OpenVINO path stay light, and a family is imported when it is asked for.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from numaov import NumaovError
from numaov.manifest import CacheLayout

#: Family name -> the module whose ``FAMILY`` describes it.
FAMILIES: dict[str, str] = {
    "deepseek_v2": "numaov.models.deepseek_v2.family",
    "deepseek_v3": "numaov.models.deepseek_v3.family",
    "qwen_moe": "numaov.models.qwen_moe.family",
}
#: The graph inputs and outputs of every family's pooled step, in order.
STEP_INPUTS = ("input_ids", "position_ids", "attention_mask", "kv_cache", "past_slots")
STEP_OUTPUTS = ("logits", "new_key_values")


class FamilyError(NumaovError):
    """A checkpoint or export names a model family numaov does not serve."""


@dataclass(frozen=True)
class ExpertShape:
    """The routed experts of one rank: ``num_experts`` stacks of ``hidden`` x ``intermediate``
    (the rank's shard of each expert)."""

    num_experts: int
    hidden: int
    intermediate: int


class LMFamily:
    """What a language-model family tells numaov. Subclasses set ``name``, ``title`` and
    ``model_types`` and implement every method; configs are the family's own objects, which
    only the family reads."""

    name: str = ""
    title: str = ""
    model_types: tuple[str, ...] = ()
    #: How the family's chat models write tool calls: the ``numaov serve`` tool-call parser
    #: (vLLM's name) used when ``--tool-call-parser`` is not given; None: no default.
    tool_call_parser: str | None = None

    def read_config(self, checkpoint_dir: str | Path) -> Any:
        """The family's config from ``checkpoint_dir/config.json``, checked."""
        raise NotImplementedError

    def config_from_dict(self, values: Mapping[str, Any]) -> Any:
        """The family's config from a ``config.json`` mapping (e.g. a manifest's ``config``)."""
        raise NotImplementedError

    def config_dict(self, config: Any) -> dict[str, Any]:
        """``config`` as the ``config.json`` mapping the manifest records."""
        raise NotImplementedError

    def check_dp(self, config: Any, dp: int) -> None:
        """Raise ``ShardError`` naming the dims ``dp`` does not divide."""
        raise NotImplementedError

    def cache_layout(self, config: Any) -> CacheLayout:
        raise NotImplementedError

    def expert_shape(self, config: Any, dp: int) -> ExpertShape | None:
        """One rank's routed experts at ``dp`` ranks, or None for a model without them."""
        raise NotImplementedError

    def kept_aside(self, config: Any, names: list[str]) -> dict[str, list[str]]:
        """Of the checkpoint's tensor ``names``, the ones the model does not run but an export
        keeps for a later use, by that use's name (e.g. DeepSeek-V3's multi-token-prediction
        layers, a draft model for speculative decoding); the exporter copies each group as
        stored into ``<use>.safetensors``. None by default."""
        return {}

    def load(self, checkpoint_dir: str | Path, dtype: Any, dp: Any = None,
             experts: Any = None) -> Any:
        """The causal LM (a torch module) of ``checkpoint_dir`` at ``dtype``, holding rank
        ``dp.rank``'s shard when ``dp`` (a ``layers.data_parallel.DataParallelGroup``) is given;
        with ``experts``, MoE layer ``l``'s routed experts are the module ``experts(l)`` and
        the checkpoint's are not read (``layers.causal_lm.CausalLM.from_pretrained``)."""
        raise NotImplementedError

    def step_module(self, model: Any) -> Any:
        """A module whose forward is ``model``'s pooled step (``STEP_INPUTS`` ->
        ``STEP_OUTPUTS``): what the exporter traces."""
        raise NotImplementedError

    def step_pooled(self, model: Any, *inputs: Any) -> Any:
        """``model``'s pooled step on torch tensors (``STEP_INPUTS`` order) -> ``(logits,
        new_key_values)``: what the PyTorch backend runs."""
        return self.step_module(model)(*inputs)


class CausalLMFamily(LMFamily):
    """An :class:`LMFamily` whose model is a ``layers.causal_lm.CausalLM`` subclass: config,
    DP check, loading and the step come from that class, imported when first asked for.
    Subclasses set ``model_class`` and ``step_class`` (``"module:Name"``) and implement
    ``cache_layout`` and ``expert_shape``."""

    model_class: str = ""
    step_class: str = ""

    def read_config(self, checkpoint_dir: str | Path) -> Any:
        return self._model().config_class.from_pretrained(checkpoint_dir)

    def config_from_dict(self, values: Mapping[str, Any]) -> Any:
        return self._model().config_class.from_dict(values)

    def config_dict(self, config: Any) -> dict[str, Any]:
        return config.to_dict()

    def check_dp(self, config: Any, dp: int) -> None:
        self._model().check_dp_divides(config, dp)

    def load(self, checkpoint_dir: str | Path, dtype: Any, dp: Any = None,
             experts: Any = None) -> Any:
        return self._model().from_pretrained(checkpoint_dir, dtype=dtype, dp=dp,
                                             experts=experts)

    def step_module(self, model: Any) -> Any:
        return _imported(self.step_class)(model)

    def step_pooled(self, model: Any, *inputs: Any) -> Any:
        return model.step_pooled(*inputs)

    def _model(self) -> Any:
        return _imported(self.model_class)


def _imported(name: str) -> Any:
    """The object ``"module:Name"`` names (importing the module: families are imported when
    asked for)."""
    module, _, attribute = name.partition(":")
    return getattr(importlib.import_module(module), attribute)


def supported_model_types() -> list[str]:
    return sorted(t for name in FAMILIES for t in family_named(name).model_types)


def family_named(name: str) -> LMFamily:
    """The family called ``name`` (as a manifest records it)."""
    if name not in FAMILIES:
        raise FamilyError(f"model family {name!r} is not one numaov serves; expected one of "
                          f"{sorted(FAMILIES)} (re-export the model with this numaov)")
    family = importlib.import_module(FAMILIES[name]).FAMILY
    assert isinstance(family, LMFamily) and family.name == name
    return family


def family_for_model_type(model_type: object, where: str) -> LMFamily:
    for name in FAMILIES:
        family = family_named(name)
        if model_type in family.model_types:
            return family
    raise FamilyError(f"{where}: model_type {model_type!r} is not supported; expected one of "
                      f"{supported_model_types()}")


def family_for_checkpoint(checkpoint_dir: str | Path) -> LMFamily:
    """The family of a Hugging Face checkpoint directory, by its ``config.json``'s
    ``model_type``."""
    directory = Path(checkpoint_dir)
    path = directory / "config.json"
    if not directory.is_dir():
        raise FamilyError(f"checkpoint {str(directory)!r} is not a directory; expected a Hugging "
                          "Face model directory (config.json + safetensors)", parameter="checkpoint")
    if not path.is_file():
        raise FamilyError(f"checkpoint {str(directory)!r} has no config.json; expected a Hugging "
                          "Face model directory (config.json + safetensors)", parameter="checkpoint")
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FamilyError(f"cannot read {str(path)!r} as JSON ({exc})",
                          parameter="checkpoint") from None
    if not isinstance(values, dict):
        raise FamilyError(f"{str(path)!r} holds a JSON {type(values).__name__}; expected an "
                          "object", parameter="checkpoint")
    return family_for_model_type(values.get("model_type"), str(path))

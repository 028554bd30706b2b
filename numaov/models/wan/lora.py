"""LoRA adapters merged into a Wan transformer's weights, read as diffusers reads them.

A LoRA file is read through diffusers' own Wan LoRA loader, not a copy of it:
``WanLoraLoaderMixin.lora_state_dict`` converts the original Wan / lightx2v keys
(``diffusion_model.blocks.0.self_attn.q.lora_down.weight`` with ``.alpha``, ``.diff_b``, ...)
and musubi-tuner's kohya-style keys (``lora_unet_blocks_0_self_attn_q.lora_down.weight``) to
diffusers' PEFT keys (``transformer.blocks.0.attn1.to_q.lora_A.weight``), folding each
``alpha / rank`` into the tensors as it goes; a file already in diffusers' layout passes
through, its ``lora_adapter_metadata`` (PEFT's ``LoraConfig``: ``lora_alpha``, ``r``,
``rank_pattern``, ``alpha_pattern``, ``use_rslora``) read by diffusers'
``_load_sft_state_dict_metadata``. Then, as ``load_lora_adapter`` does: only keys under
``transformer.`` are the transformer's, and keys not in PEFT's ``lora_A`` / ``lora_B`` naming
go through diffusers' ``convert_unet_state_dict_to_peft``.

Each adapted linear layer ``m`` is merged as PEFT's ``merge`` does under diffusers'
``fuse_lora(lora_scale=s)``, in f32::

    W_m += (lora_B @ lora_A) * (alpha_m / r_m * s)        b_m += lora_B.bias * (alpha_m / r_m * s)

with ``alpha_m / r_m`` PEFT's scaling (``alpha_m / sqrt(r_m)`` with ``use_rslora``; 1 when the
file has no metadata, as diffusers' ``get_peft_kwargs`` sets ``lora_alpha = r`` then). Several
LoRAs merge one after the other, as ``fuse_lora`` after each ``load_lora_weights``. The merge
works on the checkpoint's state dict, one layer at a time (its weight made f32, the update
added): no second copy of the transformer is made.

A file is refused, with the count of keys that matched, when any of its keys names no linear
layer of the transformer or has a shape that does not fit it; DoRA and LoKr adapters are
refused too (diffusers drops DoRA's scales; a LoKr is not a low-rank product).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from numaov import NumaovError

logger = logging.getLogger(__name__)

PREFIX = "transformer."  # diffusers' Wan LoRA keys of the transformer (load_lora_adapter's)
_PARTS = ("lora_A.weight", "lora_B.weight", "lora_B.bias")
# Keys shown in a refusal: enough to see the pattern.
_SHOWN = 3


class LoraError(NumaovError):
    """A LoRA file or setting that cannot be merged into the transformer."""


@dataclass(frozen=True)
class LoraSpec:
    """One ``--lora FILE[:SCALE]``: the file and diffusers' ``fuse_lora(lora_scale=...)``."""

    path: Path
    scale: float = 1.0

    @classmethod
    def parse(cls, text: str, parameter: str = "loras") -> LoraSpec:
        """``FILE`` or ``FILE:SCALE`` (the part after the last colon, when it is a number)."""
        path, scale = text, 1.0
        head, sep, tail = text.rpartition(":")
        if sep and head:
            try:
                scale = float(tail)
            except ValueError:
                pass  # a colon in the file name
            else:
                path = head
        spec = cls(Path(path), scale)
        spec.check(parameter)
        return spec

    def check(self, parameter: str = "loras") -> None:
        if not math.isfinite(self.scale):
            raise LoraError(f"LoRA {str(self.path)!r} scale {self.scale}; expected a finite "
                            "number (FILE:SCALE, e.g. 0.8; default 1)", parameter=parameter)


@dataclass(frozen=True)
class LayerUpdate:
    """One linear layer's low-rank update: ``up @ down`` times ``scaling``, plus ``bias``."""

    down: torch.Tensor  # lora_A [r, in]
    up: torch.Tensor  # lora_B [out, r]
    bias: torch.Tensor | None  # lora_B.bias [out] (lightx2v's diff_b)
    scaling: float  # PEFT's alpha / r (already in the tensors for converted formats)


@dataclass(frozen=True)
class WanLora:
    """A LoRA file read through diffusers, with its scale: what merging it changes."""

    path: Path
    scale: float
    digest: str
    keys: int  # tensors after diffusers' conversion
    layers: dict[str, LayerUpdate]  # diffusers' module name -> update

    def record(self) -> dict[str, Any]:
        """What the manifest keeps: the file (name, absolute path, xxh3-128) and the scale."""
        return {"file": self.path.name, "path": str(self.path.resolve()),
                "xxh3_128": self.digest, "scale": self.scale, "layers": len(self.layers)}

    def check_fits(self, shapes: Mapping[str, Sequence[int]], what: str) -> None:
        """Refuse the LoRA unless every layer it adapts is a linear layer of ``shapes`` (the
        transformer's state-dict shapes) with matching sizes."""
        unmatched = [m for m in self.layers if len(shapes.get(f"{m}.weight", ())) != 2]
        misfits = []
        for module, update in self.layers.items():
            weight = shapes.get(f"{module}.weight")
            if weight is None or len(weight) != 2:
                continue
            out, inner = tuple(weight)
            bias = shapes.get(f"{module}.bias")
            if (tuple(update.up.shape[:1]) != (out,) or update.down.shape[1] != inner
                    or (update.bias is not None
                        and (bias is None or tuple(update.bias.shape) != tuple(bias)))):
                misfits.append(f"{module} (lora_B {list(update.up.shape)} @ lora_A "
                               f"{list(update.down.shape)}"
                               + ("" if update.bias is None else
                                  f", bias {list(update.bias.shape)}")
                               + f"; the layer is [{out}, {inner}])")
        if not unmatched and not misfits:
            return
        bad = len(unmatched) + len(misfits)
        matched = len(self.layers) - bad
        problem = (f"{len(unmatched)} name no linear layer of it (e.g. "
                   f"{', '.join(unmatched[:_SHOWN])})" if unmatched else "")
        if misfits:
            problem += ("; " if problem else "") + (
                f"{len(misfits)} do not fit its shapes (e.g. {'; '.join(misfits[:_SHOWN])})")
        raise LoraError(
            f"LoRA {str(self.path)!r}: {matched} of {len(self.layers)} adapted layers "
            f"({self.keys} keys after diffusers' Wan LoRA conversion) match {what}, {bad} do "
            f"not: {problem}; expected a LoRA trained for this Wan transformer", parameter="loras")

    def merged(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Checkpoint tensor ``name`` with this LoRA's update added in f32 (diffusers'
        names), or ``tensor`` itself when the LoRA does not adapt it."""
        module, _, kind = name.rpartition(".")
        update = self.layers.get(module)
        if update is None or kind not in ("weight", "bias"):
            return tensor
        factor = update.scaling * self.scale  # PEFT: scaling, then scale_layer(lora_scale)
        if kind == "weight":
            return tensor.float() + (update.up.float() @ update.down.float()) * factor
        if update.bias is None:
            return tensor
        return tensor.float() + update.bias.float() * factor


def check_loras_fit(loras: Sequence[WanLora], shapes: Mapping[str, Sequence[int]],
                    what: str) -> None:
    """Refuse, before anything is read, a LoRA that does not fit the checkpoint's shapes."""
    for lora in loras:
        lora.check_fits(shapes, what)


def merge_loras(name: str, tensor: torch.Tensor, loras: Sequence[WanLora]) -> torch.Tensor:
    """Checkpoint tensor ``name`` with every LoRA's update merged in f32, in order (diffusers'
    ``fuse_lora``); a tensor no LoRA adapts comes back as it is."""
    for lora in loras:
        tensor = lora.merged(name, tensor)
    return tensor


# -- reading ----------------------------------------------------------------------------------


def read_lora(spec: LoraSpec) -> WanLora:
    """Read ``spec.path`` as diffusers' ``WanPipeline.load_lora_weights`` reads it."""
    from numaov.manifest import digest_file

    path = spec.path
    spec.check()
    if not path.is_file():
        raise LoraError(f"LoRA file {str(path)!r} not found; expected a .safetensors LoRA "
                        "file", parameter="loras")
    state_dict = _read_safetensors(path)
    metadata = _adapter_metadata(path)
    converted = _diffusers_lora_state_dict(path, state_dict)
    keys = len(converted)
    not_lora = [k for k in converted if "lora" not in k]
    if not_lora:  # diffusers: "Invalid LoRA checkpoint"
        raise LoraError(
            f"LoRA {str(path)!r}: 0 of {keys} keys merged: {len(not_lora)} are not LoRA weights "
            f"(e.g. {', '.join(not_lora[:_SHOWN])}); expected keys with lora_A / lora_B, "
            "lora_down / lora_up", parameter="loras")
    ours = {k.removeprefix(PREFIX): v for k, v in converted.items() if k.startswith(PREFIX)}
    others = [k for k in converted if not k.startswith(PREFIX)]
    if others:
        raise LoraError(
            f"LoRA {str(path)!r}: {len(ours)} of {keys} keys (after diffusers' Wan LoRA "
            f"conversion) are the transformer's, {len(others)} are not (e.g. "
            f"{', '.join(others[:_SHOWN])}); expected diffusers' '{PREFIX}...' keys, the "
            "original Wan 'diffusion_model.' keys or musubi-tuner's 'lora_unet_' keys",
            parameter="loras")
    if any(".lokr_" in k for k in ours):
        raise LoraError(f"LoRA {str(path)!r} is a LoKr adapter; expected a LoRA (lora_A / "
                        "lora_B): a Kronecker product is not merged", parameter="loras")
    if any("lora_magnitude_vector" in k for k in ours):
        raise LoraError(f"LoRA {str(path)!r} is a DoRA adapter (lora_magnitude_vector); "
                        "expected a plain LoRA", parameter="loras")
    if ours and "lora_A" not in next(iter(ours)):
        from diffusers.utils.state_dict_utils import convert_unet_state_dict_to_peft

        ours = convert_unet_state_dict_to_peft(ours)
    config = _peft_config(metadata, path)
    layers = _layer_updates(ours, config, path, keys)
    return WanLora(path=path, scale=float(spec.scale), digest=digest_file(path).xxh3_128,
                   keys=keys, layers=layers)


def read_loras(specs: Sequence[LoraSpec]) -> list[WanLora]:
    return [read_lora(spec) for spec in specs]


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    import safetensors.torch

    try:
        return safetensors.torch.load_file(str(path), device="cpu")
    except Exception as exc:  # safetensors raises its own error types and OSError
        raise LoraError(f"LoRA file {str(path)!r} is not a safetensors file ({exc}); expected "
                        "a LoRA in safetensors format", parameter="loras") from exc


def _adapter_metadata(path: Path) -> dict[str, Any] | None:
    """diffusers' ``lora_adapter_metadata`` of the file, its transformer part (keys without
    ``transformer.``, as ``load_lora_adapter`` filters them); None when there is none."""
    from diffusers.utils.state_dict_utils import _load_sft_state_dict_metadata

    try:
        metadata = _load_sft_state_dict_metadata(str(path))
    except ValueError as exc:
        raise LoraError(f"LoRA {str(path)!r}: its lora_adapter_metadata is not JSON ({exc})",
                        parameter="loras") from exc
    if not metadata:
        return None
    ours = {k.removeprefix(PREFIX): v for k, v in metadata.items() if k.startswith(PREFIX)}
    return ours or None


def _diffusers_lora_state_dict(path: Path, state_dict: dict[str, torch.Tensor]
                               ) -> dict[str, torch.Tensor]:
    """``WanLoraLoaderMixin.lora_state_dict``: diffusers' conversions of every Wan format."""
    from diffusers.loaders.lora_pipeline import WanLoraLoaderMixin

    if not state_dict:
        raise LoraError(f"LoRA {str(path)!r} holds no tensors; expected LoRA weights",
                        parameter="loras")
    try:
        return dict(WanLoraLoaderMixin.lora_state_dict(state_dict))
    except (ValueError, KeyError, IndexError, AttributeError, RuntimeError) as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise LoraError(
            f"LoRA {str(path)!r}: diffusers' Wan LoRA loader cannot convert its "
            f"{len(state_dict)} keys ({detail[:200]}); expected diffusers / PEFT, original Wan "
            "(diffusion_model.) or musubi-tuner (lora_unet_) keys", parameter="loras") from exc


@dataclass(frozen=True)
class _PeftConfig:
    """The parts of PEFT's ``LoraConfig`` that set a layer's scaling."""

    lora_alpha: float | None  # None: no metadata, alpha = r for every layer (scaling 1)
    r: int | None = None
    rank_pattern: dict[str, int] | None = None
    alpha_pattern: dict[str, float] | None = None
    use_rslora: bool = False

    def scaling(self, module: str, rank: int) -> float:
        if self.lora_alpha is None:
            return 1.0
        expected = _pattern_value(self.rank_pattern or {}, module, self.r)
        if expected is not None and int(expected) != rank:
            raise ValueError(f"{module}: the metadata says rank {expected}, lora_A has {rank}")
        alpha = _pattern_value(self.alpha_pattern or {}, module, self.lora_alpha)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's ``get_pattern_key``: the first pattern that matches the end of ``module``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _peft_config(metadata: dict[str, Any] | None, path: Path) -> _PeftConfig:
    if metadata is None:
        return _PeftConfig(lora_alpha=None)
    if metadata.get("use_dora"):
        raise LoraError(f"LoRA {str(path)!r} is a DoRA adapter (use_dora in its metadata); "
                        "expected a plain LoRA", parameter="loras")
    try:
        return _PeftConfig(lora_alpha=float(metadata.get("lora_alpha", 8)),
                           r=int(metadata.get("r", 8)),
                           rank_pattern=dict(metadata.get("rank_pattern") or {}),
                           alpha_pattern=dict(metadata.get("alpha_pattern") or {}),
                           use_rslora=bool(metadata.get("use_rslora", False)))
    except (TypeError, ValueError) as exc:
        raise LoraError(f"LoRA {str(path)!r}: its lora_adapter_metadata is malformed ({exc}); "
                        "expected PEFT's LoraConfig fields", parameter="loras") from exc


def _layer_updates(state_dict: Mapping[str, torch.Tensor], config: _PeftConfig, path: Path,
                   keys: int) -> dict[str, LayerUpdate]:
    """Group the PEFT keys by layer, checking each layer's parts and ranks."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    unknown = []
    for key, tensor in state_dict.items():
        module, sep, part = key.partition(".lora_")
        part = f"lora_{part}"
        if not sep or part not in _PARTS:
            unknown.append(key)
            continue
        parts.setdefault(module, {})[part] = tensor
    if unknown:
        raise LoraError(
            f"LoRA {str(path)!r}: {keys - len(unknown)} of {keys} keys are LoRA weights numaov "
            f"merges, {len(unknown)} are not (e.g. {', '.join(unknown[:_SHOWN])}); expected "
            f"<layer>.{', <layer>.'.join(_PARTS)}", parameter="loras")
    layers = {}
    for module, found in parts.items():
        down, up = found.get("lora_A.weight"), found.get("lora_B.weight")
        if down is None or up is None:
            raise LoraError(f"LoRA {str(path)!r}: layer {module!r} has "
                            f"{' and '.join(sorted(found))} only; expected both lora_A.weight "
                            "and lora_B.weight", parameter="loras")
        if down.dim() != 2 or up.dim() != 2 or up.shape[1] != down.shape[0]:
            raise LoraError(f"LoRA {str(path)!r}: layer {module!r} has lora_A "
                            f"{list(down.shape)} and lora_B {list(up.shape)}; expected "
                            "[rank, in] and [out, rank] (a linear layer's LoRA)",
                            parameter="loras")
        for part, tensor in found.items():
            if not torch.is_floating_point(tensor) or not torch.isfinite(tensor).all():
                raise LoraError(f"LoRA {str(path)!r}: {module}.{part} is not finite floats; "
                                "expected finite LoRA weights", parameter="loras")
        try:
            scaling = config.scaling(module, int(down.shape[0]))
        except ValueError as exc:
            raise LoraError(f"LoRA {str(path)!r}: {exc}; expected the ranks its metadata "
                            "names", parameter="loras") from exc
        layers[module] = LayerUpdate(down=down, up=up, bias=found.get("lora_B.bias"),
                                     scaling=scaling)
    if not layers:
        raise LoraError(f"LoRA {str(path)!r}: 0 of {keys} keys are LoRA layers of the "
                        "transformer; expected LoRA weights", parameter="loras")
    return layers

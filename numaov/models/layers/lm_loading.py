"""What every language-model family does around loading and running its causal LM: the
torch dtypes it computes in, keeping the router fp32, freezing, positions of left-padded
rows, and the past rows of a pooled step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from numaov import NumaovError
from numaov.models.layers.router import Router

#: The dtypes a model computes in, by their config.json names.
MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: torch.dtype | str, config: Mapping[str, Any], what: str,
                  error: type[NumaovError] = NumaovError, *,
                  config_keys: tuple[str, ...] = ("torch_dtype", "dtype"),
                  parameter: str | None = None) -> torch.dtype:
    """A torch dtype, or ``"auto"``: the checkpoint's dtype, read from the first of
    ``config_keys`` that is set (fp32 when none is). An unsupported one raises ``error``
    (with ``parameter``, see :class:`numaov.NumaovError`)."""
    if dtype == "auto":
        dtype = str(next((config[k] for k in config_keys if config.get(k)), "float32"))
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in MODEL_DTYPES:
            raise error(f"{what}: dtype {dtype!r} is not supported; expected one of "
                        f"{', '.join(MODEL_DTYPES)} or 'auto'", parameter=parameter)
        return MODEL_DTYPES[dtype.removeprefix("torch.")]
    if dtype not in MODEL_DTYPES.values():
        raise error(f"{what}: dtype {dtype} is not supported; expected torch.float32, "
                    "torch.bfloat16 or torch.float16", parameter=parameter)
    return dtype


def positions_from_mask(attention_mask: Tensor) -> Tensor:
    """Left-padded rows count positions from their first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def cast_keep_router(model: nn.Module, dtype: torch.dtype) -> None:
    """Every parameter to ``dtype`` except the routers' (fp32), then :func:`freeze`."""
    for module in model.modules():
        if isinstance(module, Router):
            module.float()
            continue
        for name, param in module.named_parameters(recurse=False):
            if param.dtype != dtype:
                setattr(module, name, nn.Parameter(param.to(dtype), requires_grad=False))
    freeze(model)


def freeze(model: nn.Module) -> None:
    """Inference only: no gradients; a tied head is the embedding itself again (a load by
    assignment gives each name its own parameter), unless a rank holds only its slice."""
    for param in model.parameters():
        param.requires_grad_(False)
    if getattr(model, "head_is_embedding", False):
        model.lm_head.weight = model.model.embed_tokens.weight


def pooled_past(kv_cache: Tensor, past_slots: Tensor, dtype: torch.dtype) -> Tensor:
    """``kv_cache [layers, C, W]`` and ``past_slots [B, P]`` -> the rows' past ``[layers, B,
    P, W]`` in ``dtype``.

    index_select on dim 1 exports as one Gather(axis=1) of the rows named; indexing
    (kv_cache[:, past_slots]) exports a transpose of the whole pool around the gather.
    """
    b, p = past_slots.shape
    past = torch.index_select(kv_cache, 1, past_slots.reshape(-1))
    return past.view(kv_cache.shape[0], b, p, kv_cache.shape[2]).to(dtype)



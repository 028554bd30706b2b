"""The causal LM: loading, saving and the cached step the engines and the exporter run."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from numaov.models.checkpoint import (
    load_into_module,
    open_safetensors_checkpoint,
    read_config,
)
from numaov.models.deepseek_v2.checkpoint_layout import (
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    checkpoint_to_model_state_dict,
    model_to_checkpoint_state_dict,
)
from numaov.models.deepseek_v2.config import DeepseekConfigError, DeepseekV2Config
from numaov.models.deepseek_v2.decoder import DeepseekV2Model
from numaov.models.deepseek_v2.sharding import check_dp_divides
from numaov.models.layers.data_parallel import DataParallelGroup, ShardError
from numaov.models.layers.router import Router


class DeepseekV2(nn.Module):
    """DeepSeek-V2 causal LM with Hugging Face parameter names.

    ``forward(input_ids [B, T]) -> logits [B, T, V]`` for a whole sequence;
    :meth:`step` is the cached form the engines and the exporter use. With ``dp`` the instance
    is one rank of a DP group and holds that rank's MLP/expert shard (see the package docstring).
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
        checkpoint = open_safetensors_checkpoint(directory, WEIGHTS_NAME, WEIGHTS_INDEX_NAME, what)
        shard = (dp.rank, world) if dp is not None else None
        state = checkpoint_to_model_state_dict(checkpoint, config, what, shard)
        # Built on the meta device and given the loaded tensors themselves (cast where the
        # model's dtype differs): the weights are held once, not once read and once copied.
        with torch.device("meta"):
            model = cls(config, dp)
        _cast_keep_router(model, dtype)
        dtypes = {name: tensor.dtype for name, tensor in model.state_dict().items()}
        load_into_module(model, state, what, assign=True, dtype_of=dtypes.__getitem__)
        del state
        _freeze(model)
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

    def step_pooled(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        attention_mask: Tensor,
        kv_cache: Tensor,
        past_slots: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """One step over a token pool the caller owns and updates (the exported step).

        ``kv_cache [layers, C, kv_lora_rank + qk_rope_head_dim]`` holds the cache entries of
        every sequence of the rank, one row per token slot; ``past_slots [B, P]`` (int64) names
        the slots of row b's cached tokens in order (slots under a 0 of ``attention_mask`` are
        not read for the result). ``input_ids``, ``position_ids`` ``[B, T]``,
        ``attention_mask [B, P+T]`` as in :meth:`step`. Returns ``(logits [B, V]`` of the last
        new token of each row, ``new_key_values [layers, B, T, ...])``: only this step's
        entries, which the caller writes into its pool; the pool is read, never returned.
        """
        b, p = past_slots.shape
        # index_select on dim 1 exports as one Gather(axis=1) of the rows named; indexing
        # (kv_cache[:, past_slots]) exports a transpose of the whole pool around the gather
        past = torch.index_select(kv_cache, 1, past_slots.reshape(-1))
        past = past.view(kv_cache.shape[0], b, p, kv_cache.shape[2]).to(self.lm_head.weight.dtype)
        hidden, present = self.model(input_ids, position_ids, attention_mask, past)
        new = present[:, :, p:]
        return self.lm_head(hidden[:, -1]), new.to(kv_cache.dtype)


class DeepseekV2Step(nn.Module):
    """:meth:`DeepseekV2.step_pooled` as a module's forward: what the exporter traces."""

    def __init__(self, model: DeepseekV2) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor,
        kv_cache: Tensor, past_slots: Tensor,
    ) -> tuple[Tensor, Tensor]:
        return self.model.step_pooled(input_ids, position_ids, attention_mask, kv_cache,
                                      past_slots)


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
        if isinstance(module, Router):
            module.float()
            continue
        for name, param in module.named_parameters(recurse=False):
            if param.dtype != dtype:
                setattr(module, name, nn.Parameter(param.to(dtype), requires_grad=False))
    _freeze(model)


def _freeze(model: nn.Module) -> None:
    """Inference only: no gradients; a tied head is the embedding itself again (a load by
    assignment gives each name its own parameter)."""
    for param in model.parameters():
        param.requires_grad_(False)
    if getattr(model, "config", None) is not None and model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight

"""The causal LM every language-model family is: its decoder stack and ``lm_head``, loading
and saving Hugging Face checkpoints, the cached step and the pooled step the exporter traces.

A family subclasses :class:`CausalLM` and says what is its own: its name in messages, its
config class and error, which dims DP splits, how its checkpoint maps to the model's state
dict and back, and its decoder stack (:meth:`CausalLM.build_decoder`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from numaov import NumaovError
from numaov.models.checkpoint import (
    SafetensorsCheckpoint,
    load_into_module,
    open_safetensors_checkpoint,
    read_config,
)
from numaov.models.layers.data_parallel import (
    DataParallelGroup,
    ShardError,
    logits_from_vocab_shards,
)
from numaov.models.layers.expert_layout import (
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    TensorSource,
    checkpoint_to_stacked,
)
from numaov.models.layers.experts import replace_experts
from numaov.models.layers.lm_loading import (
    cast_keep_router,
    freeze,
    pooled_past,
    positions_from_mask,
    resolve_dtype,
)
from numaov.models.layers.sharding import head_rows


class CausalLM(nn.Module):
    """A causal LM with Hugging Face parameter names (``model.*``, ``lm_head``).

    ``forward(input_ids [B, T]) -> logits [B, T, V]`` for a whole sequence; :meth:`step` is
    the cached form the engines use, :meth:`step_pooled` the one the exporter traces. With
    ``dp`` the instance is one rank of a DP group and holds that rank's MLP / expert shard.
    """

    #: The linear layers an export may run on numaov's DenseLinear op
    #: (``exporter.dense_projections``; a head tied to the embedding stays).
    PROJECTIONS = ("lm_head",)
    #: The family's name in messages ("DeepSeek-V2 checkpoint '...'").
    title: ClassVar[str]
    #: The family's config class (``from_dict(values, what)``, ``to_dict()``).
    config_class: ClassVar[Any]
    #: What a malformed config or an unsupported dtype raises.
    config_error: ClassVar[type[NumaovError]]
    #: The config keys that name the checkpoint's dtype, first found wins, and the parameter
    #: an unsupported dtype is blamed on (see ``lm_loading.resolve_dtype``).
    dtype_keys: ClassVar[tuple[str, ...]] = ("torch_dtype", "dtype")
    dtype_parameter: ClassVar[str | None] = None

    def __init__(self, config: Any, dp: DataParallelGroup | None = None) -> None:
        super().__init__()
        if dp is not None:
            self.check_dp_divides(config, dp.world_size)
        self.config = config
        self.dp = dp
        self.model = self.build_decoder(config, dp)
        # this rank's vocabulary slice (data_parallel.logits_from_vocab_shards): a head tied
        # to the embedding is tied only where it is the whole table
        self.vocab_shards = dp.world_size if dp is not None else 1
        self.lm_head = nn.Linear(config.hidden_size,
                                 head_rows(config.vocab_size, self.vocab_shards), bias=False)
        if self.head_is_embedding:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def head_is_embedding(self) -> bool:
        """Whether ``lm_head`` is the embedding table itself (tied, and not split by rank)."""
        return bool(self.config.tie_word_embeddings) and self.vocab_shards == 1

    # -- what a family says ------------------------------------------------------------------

    @staticmethod
    def build_decoder(config: Any, dp: DataParallelGroup | None) -> nn.Module:
        """The family's ``layers.decoder.DecoderStack``."""
        raise NotImplementedError

    @staticmethod
    def check_dp_divides(config: Any, world_size: int) -> None:
        """Raise ShardError unless ``world_size`` divides every dim the MLPs are split along."""
        raise NotImplementedError

    @staticmethod
    def checkpoint_state(checkpoint: SafetensorsCheckpoint, config: Any, dtype: torch.dtype,
                         what: str, shard: tuple[int, int] | None) -> dict[str, Tensor]:
        """The checkpoint's tensors in the model's layout (this rank's slices with ``shard``),
        checked; ``dtype`` is what the model computes in."""
        raise NotImplementedError

    @staticmethod
    def checkpoint_tensors(state_dict: Mapping[str, Tensor], config: Any) -> dict[str, Tensor]:
        """The model's state dict in the checkpoint's layout (the inverse of
        :meth:`checkpoint_state`)."""
        raise NotImplementedError

    @classmethod
    def tensor_shapes(cls, config: Any) -> dict[str, tuple[int, ...]]:
        """The unsharded model's tensor names and shapes (the model is their one source)."""
        with torch.device("meta"):
            model = cls(config)
        return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}

    @classmethod
    def stacked_state(cls, source: TensorSource, config: Any, what: str,
                      shard: tuple[int, int] | None, *, num_experts: int,
                      ignore: Collection[str] = (), read_experts: bool = True
                      ) -> dict[str, Tensor]:
        """A full checkpoint's tensors (one per expert, or transformers' stacks) in the
        model's layout, every name and shape checked against the model's; with ``shard=(rank,
        world_size)`` only that rank's slices (``layers.expert_layout.checkpoint_to_stacked``).

        Raises CheckpointError naming the missing, unexpected and mis-shaped tensors.
        """
        world = shard[1] if shard is not None else 1
        cls.check_dp_divides(config, world)
        return checkpoint_to_stacked(
            source, cls.tensor_shapes(config),
            moe_layers=[i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)],
            num_experts=num_experts, moe_intermediate_size=config.moe_intermediate_size,
            tie_word_embeddings=config.tie_word_embeddings, what=what, shard=shard,
            ignore=ignore, read_experts=read_experts,
        )

    def checkpoint_config(self) -> dict[str, Any]:
        """The ``config.json`` :meth:`save_pretrained` writes."""
        config: dict[str, Any] = self.config.to_dict()
        config["torch_dtype"] = str(self.lm_head.weight.dtype).removeprefix("torch.")
        return config

    # -- loading -----------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype | str = torch.float32,
                        dp: DataParallelGroup | None = None,
                        experts: Callable[[int], nn.Module] | None = None) -> Any:
        """Load a Hugging Face checkpoint directory of the family (single or sharded
        safetensors).

        ``dtype`` is a torch dtype or ``"auto"`` (the checkpoint's, fp32 when it names none);
        the router stays fp32 either way. With ``dp`` only this rank's shard is kept: the
        checkpoint is memory-mapped and only the rank's slices are copied out of it. With
        ``experts``, the routed experts of MoE layer ``l`` are the module ``experts(l)`` (one
        that reads an expert store, or the checkpoint as rows need them): the checkpoint's
        expert tensors are checked but not read.
        """
        what = f"{cls.title} checkpoint {str(directory)!r}"
        values = read_config(directory, what=what)
        config = cls.config_class.from_dict(values, what)
        dtype = resolve_dtype(dtype, values, what, cls.config_error, config_keys=cls.dtype_keys,
                              parameter=cls.dtype_parameter)
        world = dp.world_size if dp is not None else 1
        cls.check_dp_divides(config, world)
        checkpoint = open_safetensors_checkpoint(directory, WEIGHTS_NAME, WEIGHTS_INDEX_NAME, what)
        shard = (dp.rank, world) if dp is not None else None
        state = cls.checkpoint_state(checkpoint, config, dtype, what, shard, experts is None)
        # Built on the meta device and given the loaded tensors themselves (cast where the
        # model's dtype differs): the weights are held once, not once read and once copied.
        with torch.device("meta"):
            model = cls(config, dp)
        if experts is not None:
            replace_experts(model, experts)
        cast_keep_router(model, dtype)
        dtypes = {name: tensor.dtype for name, tensor in model.state_dict().items()}
        load_into_module(model, state, what, assign=True, dtype_of=dtypes.__getitem__)
        del state
        freeze(model)
        return model.eval()

    @classmethod
    def empty(cls, config: Any, dtype: torch.dtype = torch.float32,
              dp: DataParallelGroup | None = None) -> Any:
        """An uninitialised model (memory allocated, not filled): the target of a load.

        Built on the meta device so a large model is not first filled with random numbers.
        The router stays fp32.
        """
        with torch.device("meta"):
            model = cls(config, dp)
        model.to_empty(device="cpu")
        cast_keep_router(model, dtype)
        return model

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``config.json`` + ``model.safetensors`` in the checkpoint's layout (one tensor
        per expert), the layout transformers' ``from_pretrained`` reads."""
        if self.dp is not None and self.dp.world_size > 1:
            raise ShardError(
                f"this model holds rank {self.dp.rank}'s shard of a dp={self.dp.world_size} "
                "group; expected an unsharded model (dp=None) to save a checkpoint"
            )
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        config = self.checkpoint_config()
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        tensors = self.checkpoint_tensors(self.state_dict(), self.config)
        save_file(tensors, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
        return path

    # -- running -----------------------------------------------------------------------------

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the model computes in: its final norm's (f32 once ``compute_in_f32`` widens
        the weights, which an export's head on numaov's op, a bf16 or fp8 buffer, is not)."""
        return self.model.norm.weight.dtype

    def empty_cache(self, batch_size: int) -> Tensor:
        """A zero-length KV cache ``[layers, B, 0, kv_cache_dim]``."""
        return torch.zeros(self.config.num_hidden_layers, batch_size, 0,
                           self.config.kv_cache_dim, dtype=self.compute_dtype)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """``input_ids [B, T]`` (``attention_mask [B, T]``, 1 = real, for left padding) ->
        ``logits [B, T, V]``."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        positions = positions_from_mask(attention_mask)
        logits, _ = self.step(input_ids, positions, attention_mask,
                              self.empty_cache(len(input_ids)))
        return logits

    def step(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor,
             past_key_values: Tensor) -> tuple[Tensor, Tensor]:
        """One step with an explicit cache.

        ``input_ids``, ``position_ids``: ``[B, T]`` int64; ``attention_mask``: ``[B, P+T]``
        (1 = real token; covers the cached and the new tokens); ``past_key_values``:
        ``[layers, B, P, kv_cache_dim]``. Returns ``(logits [B, T, V], present_key_values
        [layers, B, P+T, kv_cache_dim])``.
        """
        hidden, new = self.model(input_ids, position_ids, attention_mask, past_key_values)
        logits = self.logits(hidden.reshape(-1, hidden.shape[-1]))
        return (logits.view(*hidden.shape[:2], self.config.vocab_size),
                torch.cat((past_key_values, new), 2))

    def step_pooled(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor,
                    kv_cache: Tensor, past_slots: Tensor) -> tuple[Tensor, Tensor]:
        """One step over a token pool the caller owns and updates (the exported step,
        ``families.STEP_INPUTS`` -> ``STEP_OUTPUTS``).

        ``kv_cache [layers, C, kv_cache_dim]`` holds the cache entries of every sequence of
        the rank, one row per token slot; ``past_slots [B, P]`` (int64) names the slots of row
        b's cached tokens in order (slots under a 0 of ``attention_mask`` are not read for the
        result). ``input_ids``, ``position_ids`` ``[B, T]``, ``attention_mask [B, P+T]`` as in
        :meth:`step`. Returns ``(logits [B, V]`` of the last new token of each row,
        ``new_key_values [layers, B, T, kv_cache_dim])``: only this step's entries, which the
        caller writes into its pool; the pool is read, never returned.
        """
        past = pooled_past(kv_cache, past_slots, self.compute_dtype)
        hidden, new = self.model(input_ids, position_ids, attention_mask, past)
        return self.logits(hidden[:, -1]), new.to(kv_cache.dtype)

    def logits(self, rows: Tensor) -> Tensor:
        """``rows [n, H]`` (final-normed) -> ``logits [n, vocab_size]``; with DP every rank
        calls at once and each applies its slice of the vocabulary to the rows of all."""
        return logits_from_vocab_shards(self.lm_head, rows, self.dp, self.config.vocab_size)


class CausalLMStep(nn.Module):
    """:meth:`CausalLM.step_pooled` as a module's forward: what the exporter traces."""

    def __init__(self, model: CausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor,
                kv_cache: Tensor, past_slots: Tensor) -> tuple[Tensor, Tensor]:
        return self.model.step_pooled(input_ids, position_ids, attention_mask, kv_cache,
                                      past_slots)

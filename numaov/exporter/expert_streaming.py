"""A checkpoint's routed experts streamed into each rank's expert store
(``custom_ops.expert_store``), one expert at a time.

Each expert of each MoE layer is read from the safetensors (only the rank's rows of gate and
up; down's columns), put in the export's weight format and written into its place in the
store, then let go: the export never holds a layer's experts, never builds them as torch
modules, never writes them to ONNX. What memory it takes is one expert's tensors, whatever
the number of experts or layers.

Formats (``--weights``): ``f32`` / ``bf16`` cast; ``int8`` / ``int4`` quantized as
``moe_ops.quantize_experts`` does (symmetric, per output channel / per group); ``fp8``: a
released block-FP8 checkpoint's experts are kept as released (the float8_e4m3fn bytes, and
each row's scales taken from its 128 x 128 block's ``weight_scale_inv``: no requantization,
one byte per weight), any other checkpoint's are quantized in 128 x 128 blocks as DeepSeek's
released ones are. A block-FP8 checkpoint stored in another format is dequantized block by
block as it is read (``checkpoint.BlockFp8Checkpoint``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from numaov.custom_ops.expert_store import LayerPlan, StoreWriter
from numaov.custom_ops.moe_ops import fp8_row_scales, quantize_experts
from numaov.models.checkpoint import (
    FLOAT8_DTYPES,
    SCALE_SUFFIX,
    BlockFp8Checkpoint,
    CheckpointError,
    SafetensorsCheckpoint,
    open_safetensors_checkpoint,
)
from numaov.models.families import ExpertShape
from numaov.models.layers.expert_layout import (
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    TensorSource,
    read_expert,
    split_expert,
)

#: The block DeepSeek's quantizer uses when numaov writes fp8 experts itself.
FP8_BLOCK = (128, 128)


@dataclass(frozen=True)
class StoresWritten:
    """What writing every rank's store took."""

    store_ids: list[str]
    bytes: int  # all stores together
    read_bytes: int
    seconds: float

    def describe(self) -> str:
        rate = self.read_bytes / max(self.seconds, 1e-9) / 1e6
        return (f"{len(self.store_ids)} store(s), {self.bytes / 1e9:.2f} GB written, "
                f"{self.read_bytes / 1e9:.2f} GB read from the checkpoint in "
                f"{self.seconds:.1f} s ({rate:.0f} MB/s)")


def moe_layers(config: Any) -> list[int]:
    return [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]


def fp8_block(config: Any) -> tuple[int, int] | None:
    """The weight block of a released block-FP8 checkpoint (its ``quantization_config``),
    None for plain weights."""
    fp8 = getattr(config, "fp8", None)
    return tuple(fp8.block) if fp8 is not None else None


def open_checkpoint(checkpoint_dir: Path, what: str) -> SafetensorsCheckpoint:
    return open_safetensors_checkpoint(checkpoint_dir, WEIGHTS_NAME, WEIGHTS_INDEX_NAME, what)


def expert_source(checkpoint: SafetensorsCheckpoint, config: Any, what: str) -> TensorSource:
    """The checkpoint as plain f32 tensors (block-FP8 weights dequantized as they are read)."""
    block = fp8_block(config)
    if block is None:
        return checkpoint
    return BlockFp8Checkpoint(checkpoint, block, torch.float32, what)


def reference_experts(checkpoint_dir: Path, config: Any) -> Callable[[int], Any]:
    """``experts(layer)`` for ``LMFamily.load``: the unsharded routed experts of ``layer`` as a
    ``layers.experts.CheckpointExperts``, which reads each expert (in f32) when rows reach it:
    the parity reference computes with the checkpoint's own weights and holds none of them."""
    from numaov.models.layers.experts import CheckpointExperts

    what = f"checkpoint {str(checkpoint_dir)!r}"
    source = expert_source(open_checkpoint(checkpoint_dir, what), config, what)

    def experts(layer: int) -> CheckpointExperts:
        prefix = f"model.layers.{layer}.mlp.experts"
        return CheckpointExperts(
            lambda e: read_expert(source, prefix, e, config.moe_intermediate_size, 0, 1),
            _num_experts(config))
    return experts


def _num_experts(config: Any) -> int:
    return int(getattr(config, "n_routed_experts", None) or config.num_experts)


class ExpertConverter:
    """Every rank's share of the experts in one format: the plan of a layer (the same for
    every rank) and each expert's regions per rank, from one read of the expert."""

    def __init__(self, checkpoint: SafetensorsCheckpoint, source: TensorSource, config: Any,
                 shape: ExpertShape, weights: str, group_size: int | None, world: int) -> None:
        self.checkpoint, self.source = checkpoint, source
        self.shape, self.weights, self.group_size = shape, weights, group_size
        self.intermediate = config.moe_intermediate_size
        self.world = world
        self.block = fp8_block(config)

    def _released_fp8(self, name: str) -> bool:
        return (self.weights == "fp8" and self.block is not None
                and self.checkpoint.dtype(name) in FLOAT8_DTYPES)

    def plans(self, layer: int) -> list[LayerPlan]:
        """Each rank's plan of ``layer``: the scale groups may differ between ranks (an fp8
        rank whose columns of down cross a block edge has more groups per row)."""
        e, h, i = self.shape.num_experts, self.shape.hidden, self.shape.intermediate
        if self.weights in ("f32", "bf16"):
            return [LayerPlan(layer, self.weights, e, h, i)] * self.world
        # the groups of one expert's regions, from expert 0 (every expert has the same)
        return [LayerPlan(layer, self.weights, e, h, i, regions["gate_up_scale"].shape[1],
                          regions["down_scale"].shape[1])
                for regions in self.expert(layer, 0)]

    def expert(self, layer: int, expert: int) -> list[dict[str, Tensor]]:
        """Expert ``expert``'s regions for each rank: ``gate_up``, ``down`` (and their
        scales). The expert is read once, whole, and split: at dp > 1 each rank needs a slice
        of every one of down_proj's rows, so reading per rank read down_proj once per rank."""
        prefix = f"model.layers.{layer}.mlp.experts.{expert}"
        if self._released_fp8(f"{prefix}.gate_proj.weight"):
            return self._released_fp8_expert(prefix)
        gate_up, down = read_expert(self.source, f"model.layers.{layer}.mlp.experts", expert,
                                    self.intermediate, 0, 1)
        return [self._convert(*split_expert(gate_up, down, self.intermediate, rank, self.world))
                for rank in range(self.world)]

    def _convert(self, gate_up: Tensor, down: Tensor) -> dict[str, Tensor]:
        if self.weights == "f32":
            return {"gate_up": gate_up.float(), "down": down.float()}
        if self.weights == "bf16":
            return {"gate_up": gate_up.bfloat16(), "down": down.bfloat16()}
        out = {}
        for name, stack in (("gate_up", gate_up), ("down", down)):
            stored, scales = quantize_experts(stack[None].float(), self.weights, self.group_size)
            out[name], out[f"{name}_scale"] = stored[0], scales[0]
        return out

    def _released_fp8_expert(self, prefix: str) -> list[dict[str, Tensor]]:
        """The float8 bytes as released and each row's scales from its block's
        ``weight_scale_inv``, per rank: its rows of gate and up, its columns of down."""
        parts = {part: self.checkpoint.read_float8(f"{prefix}.{part}.weight")
                 for part in ("gate_proj", "up_proj", "down_proj")}
        block_scales = {part: self.checkpoint.read(f"{prefix}.{part}.weight" + SCALE_SUFFIX)
                        .float() for part in parts}
        step = self.intermediate // self.world
        out = []
        for rank in range(self.world):
            first = rank * step
            rows = slice(first, first + step)
            scales = [fp8_row_scales(block_scales[part], first, step, 0, self.shape.hidden,
                                     self.block) for part in ("gate_proj", "up_proj")]
            down_scales = fp8_row_scales(block_scales["down_proj"], 0, self.shape.hidden, first,
                                         step, self.block)
            out.append({"gate_up": torch.cat([parts["gate_proj"][rows], parts["up_proj"][rows]]),
                        "down": parts["down_proj"][:, rows].contiguous(),
                        "gate_up_scale": torch.cat(scales).contiguous(),
                        "down_scale": down_scales})
        return out


def write_rank_stores(paths: list[Path], checkpoint_dir: Path, config: Any, shape: ExpertShape,
                      weights: str, group_size: int | None,
                      report: Callable[[str], None]) -> StoresWritten:
    """Stream every rank's routed experts of every MoE layer from ``checkpoint_dir`` into the
    stores at ``paths`` (rank r's at ``paths[r]``) in format ``weights``: each expert is read
    once and written into every rank's store."""
    start = time.perf_counter()
    what = f"checkpoint {str(checkpoint_dir)!r}"
    checkpoint = open_checkpoint(checkpoint_dir, what)
    world = len(paths)
    converter = ExpertConverter(checkpoint, expert_source(checkpoint, config, what), config,
                                 shape, weights, group_size, world)
    layers = moe_layers(config)
    plans = [converter.plans(layer) for layer in layers]
    writers = [StoreWriter(path, [per_rank[rank] for per_rank in plans])
               for rank, path in enumerate(paths)]
    read_bytes = 0
    for count, layer in enumerate(layers, 1):
        for expert in range(shape.num_experts):
            try:
                for writer, regions in zip(writers, converter.expert(layer, expert),
                                           strict=True):
                    for name, values in regions.items():
                        writer.write(layer, name, expert, values)
            except ValueError as exc:  # a tensor of another shape than the config's
                raise CheckpointError(f"{what}: routed expert {expert} of layer {layer} does "
                                      f"not match the model config: {exc}") from None
            read_bytes += _checkpoint_bytes(checkpoint, layer, expert)
        report(f"experts of layer {layer} stored as {weights} for {world} rank(s) "
               f"({count}/{len(layers)} MoE layers)")
    store_ids = [writer.close() for writer in writers]
    return StoresWritten(store_ids, sum(writer.size for writer in writers), read_bytes,
                         time.perf_counter() - start)


def _checkpoint_bytes(checkpoint: SafetensorsCheckpoint, layer: int, expert: int) -> int:
    """The bytes one expert takes in the checkpoint (for the read rate)."""
    prefix = f"model.layers.{layer}.mlp.experts"
    names = [f"{prefix}.{expert}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    if names[0] not in checkpoint:  # transformers' stacks: one expert's share of them
        names = [f"{prefix}.gate_up_proj", f"{prefix}.down_proj"]
        return sum(math.prod(checkpoint.shape(n)) * checkpoint.dtype(n).itemsize
                   for n in names) // checkpoint.shape(names[0])[0]
    return sum(math.prod(checkpoint.shape(n)) * checkpoint.dtype(n).itemsize for n in names)


def store_path(rank_dir: Path) -> Path:
    from numaov.custom_ops.expert_store import STORE_NAME

    return rank_dir / STORE_NAME

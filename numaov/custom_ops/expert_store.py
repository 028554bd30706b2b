"""The expert store: one file per rank holding the routed experts of every MoE layer, in
the layout numaov's MoE kernel reads, which the ``MoeExperts`` op maps instead of taking the
experts as graph constants.

Why: more than 95% of a released MoE model's parameters are routed experts. Kept out of the
graph, they never go through torch modules, ONNX or OpenVINO's conversion at export (the
exporter streams them from the checkpoint into the store one tensor at a time), and at run
time a rank maps its store read-only: the pages are the page cache's, loaded on first use,
shared by every process that maps the file, and not copied again by the CPU plugin.

The file (format version ``STORE_VERSION``; the byte layout is drawn in
``csrc/store/expert_store.hpp``, whose reader the op and :func:`open_store` share): a header
with the store's random id, then one table entry per MoE layer (its format, shapes, scale
groups, offsets and the xxh3-128 digest of its bytes), then per layer the regions
``gate_up [E, 2I, H]``, ``down [E, H, I]`` and, for int8 / int4 / fp8, the f32 scales
``[E, 2I, G]`` and ``[E, H, G]``, each at a multiple of ``ALIGNMENT``. The formats are the
op's (``moe_ops.WEIGHT_FORMATS``): the bytes are exactly what the op takes as constants, so a
graph reading the store computes what a graph holding the same stacks computes, bit for bit.

This module writes stores (:class:`StoreWriter`), opens them for a process
(:func:`open_store`: the header checked by the native reader, every layer's digest checked
here, once per file per process) and holds the op's face that names a store instead of taking
weights: ``moe_experts_stored(x, ids, weights, store_id, layer)``. Eagerly it runs the grouped
loop of ``moe_ops`` on the mapped stacks (only the pages of experts that get rows are read);
under export it is the ``numaov.moe::MoeExperts`` node with three inputs and the attributes
``store`` (the file's name), ``store_id`` and ``layer``.
"""

from __future__ import annotations

import os
import secrets
import struct
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from numaov import NumaovError
from numaov.custom_ops.moe_ops import (
    MOE_DOMAIN,
    MOE_DOMAIN_VERSION,
    moe_experts,
    quantize_experts,
)

#: The name of a rank's store, beside its IR.
STORE_NAME = "experts.nxs"
STORE_MAGIC = b"NUMAOVXS"
STORE_VERSION = 1
#: Every region starts at a multiple of this (a page: the mapping's pages hold one region).
ALIGNMENT = 4096
HEADER_BYTES = 64
ENTRY_BYTES = 128
FORMAT_CODES = {"f32": 0, "bf16": 1, "int8": 2, "int4": 3, "fp8": 4}
#: Bytes per stored value (int4: two per byte) and the torch dtype the op takes them as.
_ELEMENT = {"f32": (4, torch.float32), "bf16": (2, torch.bfloat16), "int8": (1, torch.int8),
            "int4": (0.5, torch.uint8), "fp8": (1, torch.float8_e4m3fn)}
_HASH_CHUNK = 64 << 20
# The header and a table entry (``csrc/store/expert_store.hpp`` draws them field by field).
_HEADER = "<8sIIQ16s24x"
_ENTRY = "<qII10Q16s16x"
assert struct.calcsize(_HEADER) == HEADER_BYTES and struct.calcsize(_ENTRY) == ENTRY_BYTES


class ExpertStoreError(NumaovError):
    """An expert store is missing, malformed, truncated or altered."""


@dataclass(frozen=True)
class LayerPlan:
    """One MoE layer's entry in a store: its format and sizes (``inter`` is the rank's
    shard); ``gate_up_groups`` / ``down_groups`` are the scale groups per row (0 for f32 and
    bf16)."""

    layer: int
    weight_format: str
    experts: int
    hidden: int
    inter: int
    gate_up_groups: int = 0
    down_groups: int = 0

    def regions(self) -> dict[str, tuple[tuple[int, ...], torch.dtype, int]]:
        """``{region: (shape as the op takes it, torch dtype, bytes)}`` in file order."""
        per_value, dtype = _ELEMENT[self.weight_format]
        e, h, i = self.experts, self.hidden, self.inter
        packed = 2 if self.weight_format == "int4" else 1
        out = {
            "gate_up": ((e, 2 * i, h // packed), dtype, int(e * 2 * i * h * per_value)),
            "down": ((e, h, i // packed), dtype, int(e * h * i * per_value)),
        }
        if self.gate_up_groups:
            out["gate_up_scale"] = ((e, 2 * i, self.gate_up_groups), torch.float32,
                                    e * 2 * i * self.gate_up_groups * 4)
            out["down_scale"] = ((e, h, self.down_groups), torch.float32,
                                 e * h * self.down_groups * 4)
        return out

    def expert_bytes(self) -> int:
        """What one expert takes in the store: its weights and scales (all regions over the
        experts)."""
        return sum(size for _, _, size in self.regions().values()) // self.experts


def _align(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


class StoreWriter:
    """Writes one store: the layout is fixed up front from the layers' plans, each expert's
    rows are written into place as they come (any order, one expert at a time, so the caller
    never holds a layer), and :meth:`close` writes the header last, so an interrupted write
    leaves no valid store.

    A layer's digest is computed from the file the moment its last part is written, while
    its pages are still in the page cache: computed at close, a store larger than the page
    cache (a DeepSeek-V3 rank's is hundreds of GB) would be read back from disk whole. A part
    written again after that digests its layer again; close digests a layer never completed
    (its unwritten parts read as zeros)."""

    def __init__(self, path: str | Path, layers: Sequence[LayerPlan]) -> None:
        self.path = Path(path)
        self.plans = {plan.layer: plan for plan in layers}
        if len(self.plans) != len(layers):
            raise ValueError("a store holds each layer once")
        self.store_id = secrets.token_bytes(16)
        offset = _align(HEADER_BYTES + ENTRY_BYTES * len(layers))
        self.offsets: dict[int, dict[str, int]] = {}
        self.spans: dict[int, tuple[int, int]] = {}
        for layer in sorted(self.plans):
            start = offset
            regions: dict[str, int] = {}
            for name, (_, _, size) in self.plans[layer].regions().items():
                regions[name] = offset
                offset = _align(offset + size)
            self.offsets[layer] = regions
            last = list(regions)[-1]
            end = regions[last] + self.plans[layer].regions()[last][2]
            self.spans[layer] = (start, end - start)
        self.size = max((s + n for s, n in self.spans.values()), default=offset)
        # per layer: the (region, expert) parts written so far, and its digest once all are
        self._written: dict[int, set[tuple[str, int]]] = {layer: set() for layer in self.plans}
        self._parts = {layer: sum(shape[0] for shape, _, _ in plan.regions().values())
                       for layer, plan in self.plans.items()}
        self._digests: dict[int, bytes] = {}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self._fd, self.size)  # sparse until written; the gaps read as zeros

    @property
    def store_id_hex(self) -> str:
        return self.store_id.hex()

    def write(self, layer: int, region: str, expert: int, values: Tensor) -> None:
        """Expert ``expert``'s part of ``region`` (``gate_up``, ``down``, ``gate_up_scale``,
        ``down_scale``) of ``layer``: ``values`` of the region's per-expert shape and dtype."""
        shape, dtype, size = self.plans[layer].regions()[region]
        if tuple(values.shape) != shape[1:] or values.dtype != dtype:
            raise ValueError(f"layer {layer} {region}[{expert}] is {values.dtype} "
                             f"{list(values.shape)}; expected {dtype} {list(shape[1:])}")
        per_expert = size // shape[0]
        data = memoryview(values.contiguous().view(torch.uint8).numpy().reshape(-1))
        assert data.nbytes == per_expert
        at = self.offsets[layer][region] + expert * per_expert
        while data.nbytes:  # pwrite may write less than asked
            written = os.pwrite(self._fd, data, at)
            data, at = data[written:], at + written
        self._written[layer].add((region, expert))
        if len(self._written[layer]) == self._parts[layer]:
            self._digests[layer] = self._digest(layer)

    def _digest(self, layer: int) -> bytes:
        """xxh3-128 of the layer's span as the file holds it."""
        import xxhash

        start, span = self.spans[layer]
        digest = xxhash.xxh3_128()
        for at in range(start, start + span, _HASH_CHUNK):
            digest.update(os.pread(self._fd, min(_HASH_CHUNK, start + span - at), at))
        return digest.digest()

    def close(self) -> str:
        """Write the header and table (the digest of each layer not yet digested computed
        now); returns the store id (hex)."""
        table = bytearray()
        for layer in sorted(self.plans):
            plan, regions = self.plans[layer], self.offsets[layer]
            _, span = self.spans[layer]
            digest = self._digests.get(layer) or self._digest(layer)
            table += struct.pack(
                _ENTRY, layer, FORMAT_CODES[plan.weight_format], 0, plan.experts, plan.hidden,
                plan.inter, plan.gate_up_groups, plan.down_groups, regions["gate_up"],
                regions["down"], regions.get("gate_up_scale", 0), regions.get("down_scale", 0),
                span, digest,
            )
        header = struct.pack(_HEADER, STORE_MAGIC, STORE_VERSION, len(self.plans),
                             self.size, self.store_id)
        os.pwrite(self._fd, header + bytes(table), 0)
        os.fsync(self._fd)
        os.close(self._fd)
        return self.store_id_hex


def write_stacks(path: str | Path, layers: Mapping[int, tuple[Tensor, Tensor]],
                 weight_format: str, group_size: int | None = None) -> str:
    """A store of in-memory stacks: ``layers[l] = (gate_up [E, 2I, H], down [E, H, I])``, each
    expert put in ``weight_format`` (``moe_ops.quantize_experts``) as it is written; returns
    the store id. For a model held in memory (benchmarks, tests); an export streams its
    checkpoint instead (``exporter.expert_streaming``)."""
    def expert(gate_up: Tensor, down: Tensor, e: int) -> dict[str, Tensor]:
        out = {}
        for name, stack in (("gate_up", gate_up[e:e + 1]), ("down", down[e:e + 1])):
            stored, scales = quantize_experts(stack.detach(), weight_format, group_size)
            out[name] = stored[0]
            if scales is not None:
                out[f"{name}_scale"] = scales[0]
        return out

    plans = []
    for layer, (gate_up, down) in layers.items():
        first = expert(gate_up, down, 0)
        groups = ((first["gate_up_scale"].shape[1], first["down_scale"].shape[1])
                  if "gate_up_scale" in first else (0, 0))
        plans.append(LayerPlan(layer, weight_format, down.shape[0], down.shape[1],
                               down.shape[2], *groups))
    writer = StoreWriter(path, plans)
    for layer, (gate_up, down) in layers.items():
        for e in range(down.shape[0]):
            for name, values in expert(gate_up, down, e).items():
                writer.write(layer, name, e, values)
    return writer.close()


# ---------------------------------------------------------------------------------------------
# Opening a store: the native reader checks the header, the digests are checked here.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreLayer:
    """One layer's stacks as tensors over the store's mapping (read-only, zero-copy)."""

    plan: LayerPlan
    gate_up: Tensor
    down: Tensor
    gate_up_scale: Tensor | None
    down_scale: Tensor | None


@dataclass(frozen=True)
class ExpertStore:
    """An open store: where it is, its id, its size and its layers by model layer index."""

    path: Path
    store_id: str
    bytes: int
    layers: dict[int, StoreLayer]


_OPEN: dict[str, ExpertStore] = {}
_VERIFIED: set[tuple[str, int, int, str]] = set()
_LOCK = threading.Lock()


def _file_key(path: Path, store_id: str) -> tuple[str, int, int, str]:
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns, store_id


def _check_digests(path: Path, layers: Iterable[dict[str, Any]]) -> None:
    import xxhash

    with path.open("rb") as handle:
        for entry in layers:
            digest = xxhash.xxh3_128()
            handle.seek(entry["gate_up_offset"])
            left = entry["bytes"]
            while left:
                chunk = handle.read(min(_HASH_CHUNK, left))
                if not chunk:
                    break
                digest.update(chunk)
                left -= len(chunk)
            if digest.hexdigest() != entry["digest"]:
                raise ExpertStoreError(
                    f"expert store {str(path)!r}: layer {entry['layer']}'s experts do not hold "
                    "what the export wrote (their xxh3-128 digest differs: corrupt or "
                    "replaced); expected the exported file: re-export the model or restore it"
                )


def open_store(path: str | Path) -> ExpertStore:
    """Open the store at ``path`` for this process: the native reader checks its header and
    maps it for the ``MoeExperts`` op, every layer's digest is checked (once per file per
    process), and the layers are mapped again here, read-only, for the eager face. Raises
    ExpertStoreError naming the file."""
    from numaov.native import native_module

    path = Path(path)
    if not path.is_file():
        raise ExpertStoreError(f"expert store {str(path)!r} does not exist; expected the file "
                               "the export wrote beside the rank's IR: re-export the model")
    try:
        info = native_module().open_expert_store(str(path))
    except ValueError as exc:
        raise ExpertStoreError(str(exc)) from None
    store_id = info["id"]
    with _LOCK:
        key = _file_key(path, store_id)
        if key not in _VERIFIED:
            _check_digests(path, info["layers"])
            _VERIFIED.add(key)
        if store_id in _OPEN and _OPEN[store_id].bytes == info["bytes"]:
            return _OPEN[store_id]
        store = ExpertStore(path, store_id, int(info["bytes"]),
                            {e["layer"]: _mapped_layer(path, e) for e in info["layers"]})
        _OPEN[store_id] = store
        return store


def _mapped_layer(path: Path, entry: dict[str, Any]) -> StoreLayer:
    import warnings

    plan = LayerPlan(entry["layer"], entry["format"], entry["experts"], entry["hidden"],
                     entry["inter"], entry["gate_up_groups"], entry["down_groups"])
    tensors: dict[str, Tensor] = {}
    for name, (shape, dtype, size) in plan.regions().items():
        array = np.memmap(path, dtype=np.uint8, mode="r", offset=entry[f"{name}_offset"],
                          shape=(size,))
        with warnings.catch_warnings():  # read-only on purpose: the op never writes weights
            warnings.simplefilter("ignore", UserWarning)
            tensors[name] = torch.from_numpy(array).view(dtype).view(shape)
    return StoreLayer(plan, tensors["gate_up"], tensors["down"], tensors.get("gate_up_scale"),
                      tensors.get("down_scale"))


def opened(store_id: str) -> ExpertStore:
    """The store this process opened with id ``store_id``."""
    store = _OPEN.get(store_id)
    if store is None:
        raise ExpertStoreError(f"expert store {store_id} is not open in this process; expected "
                               "it opened (open_store) before a model that names it runs")
    return store


def open_stores_of(model: Any, directory: Path) -> list[ExpertStore]:
    """Open every store the ``MoeExperts`` nodes of ``model`` (an ``openvino.Model`` read from
    ``directory``) name, from ``directory``."""
    names = set()
    for op in model.get_ops():
        if op.get_type_name() == "MoeExperts":
            store = op.get_attributes().get("store")
            if store:
                names.add(store)
    return [open_store(directory / name) for name in sorted(names)]


def store_nodes(store: ExpertStore, sample_pages: int = 256) -> dict[int, int]:
    """On which NUMA node the store's pages are: ``{node: pages}`` over ``sample_pages`` pages
    spread across the file (-1: pages whose node could not be read)."""
    from numaov.native import native_module

    return dict(native_module().expert_store_nodes(store.store_id, sample_pages))


# ---------------------------------------------------------------------------------------------
# The op's face that names a store: eager on the mapped stacks, ONNX node with attributes.
# ---------------------------------------------------------------------------------------------


def _stored_layer(store_id: str, layer: int) -> StoreLayer:
    store = opened(store_id)
    if layer not in store.layers:
        raise ExpertStoreError(f"expert store {str(store.path)!r} has no layer {layer}; it holds "
                               f"layers {sorted(store.layers)}")
    return store.layers[layer]


@torch.library.custom_op("numaov::moe_experts_stored", mutates_args=())
def _moe_experts_stored_op(x: Tensor, ids: Tensor, weights: Tensor, store_id: str,
                           layer: int) -> Tensor:
    stacks = _stored_layer(store_id, layer)
    return moe_experts(x, ids, weights, stacks.gate_up, stacks.down, stacks.gate_up_scale,
                       stacks.down_scale)


@_moe_experts_stored_op.register_fake
def _(x: Tensor, ids: Tensor, weights: Tensor, store_id: str, layer: int) -> Tensor:
    return x.new_empty(x.shape)


def moe_experts_stored(x: Tensor, ids: Tensor, weights: Tensor, store_id: str,
                       layer: int) -> Tensor:
    """``moe_experts`` on layer ``layer`` of the open store ``store_id``: ``[N, H]`` in x's
    dtype. Under ``torch.onnx.export`` the ``MoeExperts`` node with the store's attributes."""
    if torch.onnx.is_in_onnx_export():
        return torch.onnx.ops.symbolic(
            f"{MOE_DOMAIN}::MoeExperts", (x, ids, weights),
            {"store": opened(store_id).path.name, "store_id": store_id, "layer": layer},
            dtype=x.dtype, shape=x.shape, version=MOE_DOMAIN_VERSION,
        )
    return torch.ops.numaov.moe_experts_stored(x, ids, weights, store_id, layer)


def stored_translation_table() -> dict[Any, Any]:
    """``{torch op overload: onnxscript function}`` writing the ``MoeExperts`` node that names
    a store (three inputs; attributes ``store``, ``store_id``, ``layer``), for a program
    captured with ``torch.export`` (see ``moe_ops.moe_translation_table``)."""
    from onnx.defs import OpSchema
    from onnxscript.values import Op, Opset

    schema = OpSchema(
        "MoeExperts", MOE_DOMAIN, MOE_DOMAIN_VERSION,
        inputs=[OpSchema.FormalParameter("x", "T"), OpSchema.FormalParameter("ids", "I"),
                OpSchema.FormalParameter("weights", "tensor(float)")],
        outputs=[OpSchema.FormalParameter("y", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(bfloat16)"], "activations"),
                          ("I", ["tensor(int64)", "tensor(int32)"], "expert ids")],
        attributes=[OpSchema.Attribute("store", OpSchema.AttrType.STRING, "store file name"),
                    OpSchema.Attribute("store_id", OpSchema.AttrType.STRING, "store id (hex)"),
                    OpSchema.Attribute("layer", OpSchema.AttrType.INT, "model layer index")],
    )
    node = Op(Opset(MOE_DOMAIN, MOE_DOMAIN_VERSION), "MoeExperts", schema)

    def moe_experts_stored_onnx(x, ids, weights, store_id: str, layer: int):
        return node(x, ids, weights, store=opened(store_id).path.name, store_id=store_id,
                    layer=layer)

    return {torch.ops.numaov.moe_experts_stored.default: moe_experts_stored_onnx}

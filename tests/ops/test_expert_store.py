"""The expert store (numaov/custom_ops/expert_store.py): what is written is what is read, in
every format and at odd sizes; the op reading the store computes what it computes on the same
stacks as tensors, bit for bit; a truncated or altered store is one line naming the file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from numaov.custom_ops import moe_experts
from numaov.custom_ops.expert_store import (
    ALIGNMENT,
    ExpertStoreError,
    LayerPlan,
    StoreWriter,
    moe_experts_stored,
    open_store,
)
from numaov.custom_ops.moe_ops import quantize_experts

# (format, experts, hidden, intermediate): odd sizes where the format allows them (int4 reads
# 32 values per step, so its rows are multiples of 32)
CASES = [("f32", 3, 48, 20), ("bf16", 3, 48, 20), ("int8", 3, 48, 20), ("int4", 3, 64, 32),
         ("fp8", 3, 48, 20)]


def _stacks(weight_format: str, experts: int, hidden: int, inter: int, seed: int
            ) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    out = {}
    for name, stack in (("gate_up", gate_up), ("down", down)):
        stored, scales = quantize_experts(stack, weight_format)
        out[name] = stored
        if scales is not None:
            out[f"{name}_scale"] = scales
    return out


def _write(path: Path, layers: dict[int, tuple[str, dict[str, torch.Tensor]]]) -> StoreWriter:
    plans = []
    for layer, (weight_format, stacks) in layers.items():
        e, h = stacks["down"].shape[:2]
        inter = stacks["gate_up"].shape[1] // 2
        groups = (stacks["gate_up_scale"].shape[2], stacks["down_scale"].shape[2]) \
            if "gate_up_scale" in stacks else (0, 0)
        plans.append(LayerPlan(layer, weight_format, e, h, inter, *groups))
    writer = StoreWriter(path, plans)
    for layer, (_, stacks) in reversed(list(layers.items())):  # any order, expert by expert
        for name, stack in stacks.items():
            for expert in reversed(range(stack.shape[0])):
                writer.write(layer, name, expert, stack[expert])
    writer.close()
    return writer


@pytest.mark.parametrize(("weight_format", "experts", "hidden", "inter"), CASES)
def test_what_is_written_is_read_and_the_op_on_it_equals_the_op_on_tensors(
        tmp_path: Path, weight_format: str, experts: int, hidden: int, inter: int) -> None:
    first = _stacks(weight_format, experts, hidden, inter, seed=1)
    second = _stacks(weight_format, experts, hidden, inter, seed=2)
    writer = _write(tmp_path / "experts.nxs", {5: (weight_format, first), 2: (weight_format, second)})
    store = open_store(tmp_path / "experts.nxs")
    assert store.store_id == writer.store_id_hex and sorted(store.layers) == [2, 5]
    assert store.bytes == (tmp_path / "experts.nxs").stat().st_size
    for layer, stacks in ((5, first), (2, second)):
        mapped = store.layers[layer]
        assert mapped.plan.weight_format == weight_format
        for name, stack in stacks.items():
            got = getattr(mapped, name)
            assert got.dtype == stack.dtype and got.shape == stack.shape
            assert torch.equal(got.view(torch.uint8), stack.view(torch.uint8)), name
        # every region starts a page: the kernel's loads never straddle two regions
        assert all(writer.offsets[layer][name] % ALIGNMENT == 0 for name in stacks)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, hidden, generator=g)
    weights, ids = torch.topk(torch.rand(7, experts, generator=g), 2, dim=-1)
    got = moe_experts_stored(x, ids, weights, store.store_id, 5)
    expected = moe_experts(x, ids, weights, first["gate_up"], first["down"],
                           first.get("gate_up_scale"), first.get("down_scale"))
    assert torch.equal(got, expected)


def test_an_altered_store_is_refused_naming_the_file_and_the_layer(tmp_path: Path) -> None:
    stacks = _stacks("int8", 2, 48, 20, seed=1)
    writer = _write(tmp_path / "experts.nxs", {1: ("int8", stacks), 3: ("int8", stacks)})
    at = writer.offsets[3]["down"] + 5
    with (tmp_path / "experts.nxs").open("r+b") as handle:
        handle.seek(at)
        byte = handle.read(1)
        handle.seek(at)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ExpertStoreError) as info:
        open_store(tmp_path / "experts.nxs")
    message = str(info.value)
    assert "\n" not in message and str(tmp_path / "experts.nxs") in message
    assert "layer 3" in message and "digest" in message


def test_layers_are_digested_as_they_complete_and_close_reads_only_the_rest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer's digest is taken when its last part is written (its pages still cached) and
    again when a part is written again, so close reads back only a layer never completed."""
    stacks, other = _stacks("bf16", 2, 48, 20, seed=1), _stacks("bf16", 2, 48, 20, seed=2)
    path = tmp_path / "experts.nxs"
    writer = StoreWriter(path, [LayerPlan(layer, "bf16", 2, 48, 20) for layer in (0, 1, 2)])
    for layer in (0, 1, 2):
        for name, stack in stacks.items():
            for expert in range(2):
                if (layer, name, expert) != (2, "down", 1):  # layer 2 never completes
                    writer.write(layer, name, expert, stack[expert])
    writer.write(1, "down", 0, other["down"][0])  # layer 1 written again after its digest
    spans = {layer: writer.spans[layer] for layer in (0, 1, 2)}
    read: list[int] = []
    pread = os.pread

    def counted(fd: int, size: int, at: int) -> bytes:
        read.append(next(layer for layer, (s, n) in spans.items() if s <= at < s + n))
        return pread(fd, size, at)

    monkeypatch.setattr(os, "pread", counted)
    writer.close()
    monkeypatch.setattr(os, "pread", pread)
    assert set(read) == {2}  # layers 0 and 1 were digested as they completed
    store = open_store(path)  # every digest checked against the file
    assert torch.equal(store.layers[1].down[0], other["down"][0])
    assert torch.equal(store.layers[0].down[1], stacks["down"][1])
    assert not store.layers[2].down[1].any()  # never written: zeros, digested at close


def test_a_truncated_or_foreign_file_is_refused_in_one_line(tmp_path: Path) -> None:
    stacks = _stacks("bf16", 2, 48, 20, seed=1)
    path = tmp_path / "experts.nxs"
    _write(path, {0: ("bf16", stacks)})
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(ExpertStoreError, match="truncated") as info:
        open_store(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    (tmp_path / "other.nxs").write_bytes(b"not a store" * 20)
    with pytest.raises(ExpertStoreError, match="not a numaov expert store"):
        open_store(tmp_path / "other.nxs")
    with pytest.raises(ExpertStoreError, match="does not exist"):
        open_store(tmp_path / "missing.nxs")


def test_a_layer_the_store_lacks_is_named(tmp_path: Path) -> None:
    stacks = _stacks("f32", 2, 48, 20, seed=1)
    _write(tmp_path / "experts.nxs", {4: ("f32", stacks)})
    store = open_store(tmp_path / "experts.nxs")
    x = torch.randn(2, 48)
    with pytest.raises(ExpertStoreError, match=r"has no layer 7; it holds layers \[4\]"):
        moe_experts_stored(x, torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1),
                           store.store_id, 7)

"""The expert store's C++ reader and the MoeExperts op's store face (csrc/store/, csrc/ops/
moe_op.cpp): a store file written here by a small struct-based writer (the format of
csrc/store/expert_store.hpp, independent of numaov's own writer) opens, describes itself, and
the op reading it computes bit for bit what the constant face computes on the same bytes, in
every weight format at odd sizes; a bad file is one line naming it; an op naming a store that
is not open, or a layer the store lacks, says so at inference."""

from __future__ import annotations

import os
import re
import secrets
import struct
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
import torch
import xxhash
from support.moe_kernel import needs_kernel

from numaov.custom_ops import compile_ir
from numaov.custom_ops.moe_ops import (
    quantize_experts,
    write_moe_onnx,
    write_store_moe_onnx,
)
from numaov.exporter.openvino_convert import convert_to_ir
from numaov.native import add_extension, native_module

CODES = {"f32": 0, "bf16": 1, "int8": 2, "int4": 3, "fp8": 4}
# (format, experts, hidden, inter): odd sizes where the format allows (int4 reads 32 values a step)
CASES = [("f32", 3, 48, 20), ("bf16", 3, 48, 20), ("int8", 3, 48, 20), ("int4", 3, 64, 32),
         ("fp8", 3, 48, 20)]


def _align(offset: int, to: int = 4096) -> int:
    return -(-offset // to) * to


def _raw(t: torch.Tensor | None) -> bytes:
    return b"" if t is None else t.contiguous().view(torch.uint8).numpy().tobytes()


def write_store(path: Path, layers: list[dict], store_id: bytes | None = None,
                version: int = 1) -> str:
    """A store file of `layers` (dicts: layer, format, gate_up, down, and for int8 / int4 /
    fp8 gate_up_scale and down_scale, as the op's tensors); returns the store id's hex."""
    store_id = store_id or secrets.token_bytes(16)
    table_end = 64 + 128 * len(layers)
    offset = _align(table_end)
    entries, blobs = [], []
    for spec in layers:
        gate_up, down = spec["gate_up"], spec["down"]
        experts, hidden = down.shape[0], down.shape[1]
        inter = gate_up.shape[1] // 2
        regions = [_raw(gate_up), _raw(down), _raw(spec.get("gate_up_scale")),
                   _raw(spec.get("down_scale"))]
        offsets, start = [], offset
        for region in regions:
            if region:
                offsets.append(offset)
                blobs.append((offset, region))
                offset = _align(offset + len(region))
            else:
                offsets.append(0)
        span_end = max(o + len(r) for o, r in zip(offsets, regions, strict=True) if r)
        groups = [spec["gate_up_scale"].shape[2], spec["down_scale"].shape[2]] \
            if "gate_up_scale" in spec else [0, 0]
        entries.append([spec["layer"], CODES[spec["format"]], experts, hidden, inter, *groups,
                        *offsets, span_end - start, start, span_end])
    size = offset if blobs else table_end
    data = bytearray(size)
    for at, blob in blobs:
        data[at:at + len(blob)] = blob
    data[0:64] = struct.pack("<8sIIQ16s24x", b"NUMAOVXS", version, len(layers), size, store_id)
    for i, e in enumerate(entries):
        digest = xxhash.xxh3_128_digest(bytes(data[e[-2]:e[-1]]))
        data[64 + 128 * i:64 + 128 * (i + 1)] = struct.pack(
            "<qII10Q16s16x", e[0], e[1], 0, *e[2:12], digest)
    path.write_bytes(bytes(data))
    return store_id.hex()


def _stacks(weight_format: str, experts: int, hidden: int, inter: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    if weight_format in ("f32", "bf16"):
        return {"format": weight_format, "gate_up": quantize_experts(gate_up, weight_format)[0],
                "down": quantize_experts(down, weight_format)[0]}
    group = 32 if weight_format == "int4" else None
    (qg, sg), (qd, sd) = (quantize_experts(w, weight_format, group) for w in (gate_up, down))
    return {"format": weight_format, "gate_up": qg, "down": qd, "gate_up_scale": sg,
            "down_scale": sd}


def _inputs(rows: int, experts: int, hidden: int, top_k: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g)
    weights, ids = torch.topk(torch.rand(rows, experts, generator=g), top_k, dim=-1)
    return {"x": x.numpy(), "ids": ids.numpy(), "weights": weights.numpy()}


def _store_onnx(path: Path, store: str, store_id: str, layer: int, hidden: int,
                top_k: int = 2) -> Path:
    return write_store_moe_onnx(path, store, store_id, layer, hidden, top_k)


def _read(path: Path):
    core = ov.Core()
    add_extension(core)
    return core.read_model(str(path))


def _constant_face(tmp_path: Path, spec: dict, precision: str, top_k: int = 2):
    gate_up, down = spec["gate_up"], spec["down"]
    if spec["format"] == "bf16":  # f32 values a bf16 IR stores exactly as these bytes
        gate_up, down = gate_up.float(), down.float()
    scales = (spec["gate_up_scale"], spec["down_scale"]) if "gate_up_scale" in spec else None
    onnx_path = write_moe_onnx(tmp_path / "constant.onnx", gate_up, down, top_k, scales)
    xml = convert_to_ir(onnx_path, tmp_path / "constant.xml", precision)
    return compile_ir(xml, precision).runner()


# ---------------------------------------------------------------------------------------------
# opening a store
# ---------------------------------------------------------------------------------------------


def test_open_describes_the_header_and_every_layer(tmp_path: Path) -> None:
    layers = [{"layer": 3, **_stacks("int8", 3, 48, 20)}, {"layer": 5, **_stacks("f32", 2, 48, 16)}]
    path = tmp_path / "rank0.experts"
    store_id = write_store(path, layers)
    info = native_module().open_expert_store(str(path))
    assert info["id"] == store_id and info["path"] == str(path)
    assert info["bytes"] == path.stat().st_size and info["version"] == 1
    first, second = info["layers"]
    assert (first["layer"], first["format"], first["experts"], first["hidden"], first["inter"],
            first["gate_up_groups"], first["down_groups"]) == (3, "int8", 3, 48, 20, 1, 1)
    assert (second["layer"], second["format"], second["gate_up_groups"],
            second["gate_up_scale_offset"]) == (5, "f32", 0, 0)
    data = path.read_bytes()
    for entry in info["layers"]:
        assert entry["gate_up_offset"] % 4096 == 0 and entry["down_offset"] > entry["gate_up_offset"]
        span = data[entry["gate_up_offset"]:entry["gate_up_offset"] + entry["bytes"]]
        assert entry["digest"] == xxhash.xxh3_128_hexdigest(span)
    # opening it again (or a copy: same id) finds the open store
    copy = tmp_path / "copy.experts"
    copy.write_bytes(data)
    assert native_module().open_expert_store(str(copy))["path"] == str(path)


def test_expert_store_nodes_counts_the_sampled_pages(tmp_path: Path) -> None:
    path = tmp_path / "nodes.experts"
    store_id = write_store(path, [{"layer": 0, **_stacks("f32", 3, 48, 20)}])
    native_module().open_expert_store(str(path))
    pages = -(-path.stat().st_size // os.sysconf("SC_PAGE_SIZE"))
    nodes = native_module().expert_store_nodes(store_id)
    assert sum(nodes.values()) == min(256, pages)
    known = {int(n.name[4:]) for n in Path("/sys/devices/system/node").glob("node[0-9]*")}
    assert set(nodes) <= known | {-1}
    if known == {0}:  # this one-node machine: every page on node 0
        assert nodes == {0: min(256, pages)}
    assert sum(native_module().expert_store_nodes(store_id, sample_pages=2).values()) == 2
    with pytest.raises(ValueError, match="expert store id 'ab' is not open"):
        native_module().expert_store_nodes("ab")


def _corrupt(tmp_path: Path, name: str, change) -> Path:
    path = tmp_path / name
    write_store(path, [{"layer": 0, **_stacks("int8", 3, 48, 20)}])
    path.write_bytes(change(bytearray(path.read_bytes())))
    return path


@pytest.mark.parametrize(("name", "change", "message"), [
    ("magic", lambda d: b"NOTASTOR" + d[8:], "is not a numaov expert store"),
    ("version", lambda d: d[:8] + struct.pack("<I", 2) + d[12:],
     "was written with format version 2; this numaov reads version 1: re-export the model"),
    ("truncated", lambda d: d[:-100], r"is truncated or extended: \d+ bytes, the header says \d+"),
    ("short", lambda d: d[:40], "shorter than the 64-byte header"),
    ("format", lambda d: d[:72] + struct.pack("<I", 9) + d[76:], "has weight format code 9"),
    ("groups", lambda d: d[:104] + struct.pack("<Q", 5) + d[112:],
     "5 scale groups over rows of 48 values"),
    ("order", lambda d: d[:128] + struct.pack("<Q", 64) + d[136:], "down at bytes"),
])
def test_a_bad_store_is_one_line_naming_the_file(tmp_path: Path, name: str, change,
                                                 message: str) -> None:
    path = _corrupt(tmp_path, f"{name}.experts", change)
    with pytest.raises(ValueError, match=message) as info:
        native_module().open_expert_store(str(path))
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"expert store '{path}': ")
    assert "expected" in text or "re-export" in text


def test_a_missing_file_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot be opened \(No such file"):
        native_module().open_expert_store(str(tmp_path / "none.experts"))


# ---------------------------------------------------------------------------------------------
# the op's store face against its constant face
# ---------------------------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize(("weight_format", "experts", "hidden", "inter"), CASES)
def test_store_face_equals_constant_face_bit_for_bit(tmp_path: Path, weight_format: str,
                                                     experts: int, hidden: int,
                                                     inter: int) -> None:
    spec = _stacks(weight_format, experts, hidden, inter)
    other = _stacks("f32", 2, hidden, 16, seed=7)  # another layer before it in the file
    path = tmp_path / f"{weight_format}.experts"
    store_id = write_store(path, [{"layer": 1, **other}, {"layer": 4, **spec}])
    native_module().open_expert_store(str(path))
    precision = "bf16" if weight_format == "bf16" else "f32"
    constant = _constant_face(tmp_path, spec, precision)
    # converted as the constant face is (a bf16 IR gives the op bf16 activations)
    xml = convert_to_ir(_store_onnx(tmp_path / "store.onnx", path.name, store_id, 4, hidden),
                        tmp_path / "store.xml", precision)
    model = _read(xml)
    (op,) = [n for n in model.get_ordered_ops() if n.get_type_name() == "MoeExperts"]
    assert op.get_input_size() == 3
    stored = compile_ir(model, precision).runner()
    # the IR keeps the attributes
    text = xml.read_text()
    assert f'store_id="{store_id}"' in text and 'layer="4"' in text
    from_ir = compile_ir(xml, precision).runner()
    for rows in (0, 1, 5, 64):
        feeds = _inputs(rows, experts, hidden, seed=rows)
        (expected,) = constant(feeds)
        (got,) = stored(feeds)
        (again,) = from_ir(feeds)
        assert got.shape == (rows, hidden)
        assert np.array_equal(got, expected), (weight_format, rows)
        assert np.array_equal(again, expected), (weight_format, rows)


@needs_kernel
def test_an_ir_without_store_attributes_still_runs_the_constant_face(tmp_path: Path) -> None:
    """IRs written before the store have no store / store_id / layer on MoeExperts."""
    spec = _stacks("int8", 3, 48, 20)
    run = _constant_face(tmp_path, spec, "f32")
    xml = tmp_path / "constant.xml"
    text = xml.read_text()
    layer = re.search(r'<layer [^>]*type="MoeExperts"[^>]*>\s*<data [^>]*/>', text)
    assert layer is not None
    old = tmp_path / "old.xml"
    old.write_text(text.replace(layer.group(0), re.sub(r"<data [^>]*/>", "", layer.group(0))))
    (old.with_suffix(".bin")).write_bytes(xml.with_suffix(".bin").read_bytes())
    assert "store_id" not in old.read_text()
    feeds = _inputs(7, 3, 48)
    assert np.array_equal(compile_ir(old, "f32").runner()(feeds)[0], run(feeds)[0])


@needs_kernel
def test_a_store_that_is_not_open_is_named_at_inference(tmp_path: Path) -> None:
    never_opened = secrets.token_hex(16)
    model = _read(_store_onnx(tmp_path / "store.onnx", "rank3.experts", never_opened, 2, 48))
    run = compile_ir(model, "f32").runner()
    with pytest.raises(RuntimeError, match=(
            rf"expert store 'rank3.experts' \(id {never_opened}\) is not open; expected numaov "
            r"to open it before running the model \(load the export with numaov\)")):
        run(_inputs(3, 3, 48))


@needs_kernel
def test_a_layer_the_store_lacks_is_named(tmp_path: Path) -> None:
    path = tmp_path / "layers.experts"
    store_id = write_store(path, [{"layer": 0, **_stacks("f32", 3, 48, 20)},
                                  {"layer": 1, **_stacks("f32", 3, 48, 20, seed=2)}])
    onnx_path = _store_onnx(tmp_path / "store.onnx", path.name, store_id, 7, 48)
    # compiled before the store is open: found by evaluate()
    run = compile_ir(_read(onnx_path), "f32").runner()
    native_module().open_expert_store(str(path))
    message = r"has no layer 7; expected one of the layers it holds: 0, 1"
    with pytest.raises(RuntimeError, match=message):
        run(_inputs(3, 3, 48))
    # read after it is open: found when the model is read
    with pytest.raises(Exception, match=message):
        _read(onnx_path)
    # and a hidden size that differs from the layer's
    wrong = _store_onnx(tmp_path / "wrong.onnx", path.name, store_id, 1, 64)
    with pytest.raises(Exception, match=r"differ in hidden size; expected x \[N, 48\]"):
        _read(wrong)


def test_the_store_face_needs_a_store_id(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="expected 32 lowercase hex characters"):
        _read(_store_onnx(tmp_path / "store.onnx", "x.experts", "ABC", 0, 48))

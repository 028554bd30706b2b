"""The generic exporter on small modules: ONNX with external data, IR, parity, manifest."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import openvino as ov
import pytest
import torch

from numaov.custom_ops import CompileError, compile_ir
from numaov.custom_ops.flash_attention import amx_unavailable_reason, attention_kernel
from numaov.exporter.onnx_export import ExportError, export_onnx
from numaov.exporter.openvino_convert import ConversionError, convert_to_ir
from numaov.exporter.output_dir import library_versions
from numaov.exporter.parity import TOLERANCES, ParityError, check_parity, measure, torch_reference
from numaov.manifest import ExportManifest, ModelDirError, RankFiles, digest_files
from numaov.runtime.manifest_reader import read_manifest

SEED = 1234


class SmallBlock(torch.nn.Module):
    """Linear, LayerNorm, attention and a per-sample scale: the op kinds a DiT block has."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(dim, 3 * dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(self.norm(x)).chunk(3, dim=-1)
        attn = torch.nn.functional.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])
        return x + self.out(attn[:, 0]) * t[:, None, None]


def _block(seed: int) -> SmallBlock:
    torch.manual_seed(seed)
    return SmallBlock().eval()


def _inputs(batch: int, seq: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "x": rng.standard_normal((batch, seq, 64), dtype=np.float32),
        "t": rng.uniform(0.5, 1.5, size=(batch,)).astype(np.float32),
    }


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One export shared by the tests: ONNX, f32 IR and bf16 IR of SmallBlock."""
    print(f"seed {SEED}")
    out = tmp_path_factory.mktemp("small")
    module = _block(SEED)
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=1, max=4096)
    example = _inputs(2, 7, np.random.default_rng(SEED))
    messages: list[str] = []
    graph = export_onnx(
        module,
        (torch.from_numpy(example["x"]), torch.from_numpy(example["t"])),
        None,
        {"x": {0: batch, 1: seq}, "t": {0: batch}},
        out / "model.onnx",
        "decomposed",
        messages.append,
        output_names=["y"],
    )
    xml_f32 = convert_to_ir(graph.path, out / "model.xml", "f32", messages.append)
    xml_bf16 = convert_to_ir(graph.path, out / "bf16" / "model.xml", "bf16", messages.append)
    # Parity at shapes other than the example (2, 7) on both dynamic axes.
    rng = np.random.default_rng(SEED + 1)
    input_sets = [_inputs(1, 3, rng), _inputs(3, 20, rng)]
    return {
        "dir": out,
        "module": module,
        "graph": graph,
        "xml_f32": xml_f32,
        "xml_bf16": xml_bf16,
        "input_sets": input_sets,
        "reference": torch_reference(module, input_sets),
        "messages": messages,
    }


def test_onnx_has_external_weights_and_dynamic_axes(exported: dict) -> None:
    graph = exported["graph"]
    assert graph.path.is_file() and graph.data_path is not None and graph.data_path.is_file()
    model = onnx.load(str(graph.path), load_external_data=False)
    external = [
        i.name for i in model.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL
    ]
    # The two projection weights (64x192 and 64x64 f32) are far above the 1 KiB threshold.
    assert len(external) >= 2
    assert graph.data_path.stat().st_size >= (64 * 192 + 64 * 64) * 4
    assert [(s.name, s.shape) for s in graph.inputs] == [
        ("x", ["batch", "seq", 64]),
        ("t", ["batch"]),
    ]
    assert [(s.name, s.shape) for s in graph.outputs] == [("y", ["batch", "seq", 64])]
    assert any("weight tensors" in m and "model.onnx.data" in m for m in exported["messages"])


def test_ir_is_written_with_dynamic_inputs(exported: dict) -> None:
    xml = exported["xml_f32"]
    assert xml.is_file() and xml.with_suffix(".bin").is_file()
    model = ov.Core().read_model(str(xml))
    assert [str(i.get_partial_shape()) for i in model.inputs] == ["[?,?,64]", "[?]"]


def test_bf16_ir_stores_half_size_weights(exported: dict) -> None:
    f32_bin = exported["xml_f32"].with_suffix(".bin").stat().st_size
    bf16_bin = exported["xml_bf16"].with_suffix(".bin").stat().st_size
    # Weights are ~65 KB of the f32 file; bf16 halves them, the small constants stay f32.
    assert bf16_bin < 0.6 * f32_bin
    assert any("as bf16" in m for m in exported["messages"])
    # each bf16 weight's Convert is marked as a decompression, so the CPU plugin keeps the
    # weight bf16 when it compiles instead of an f32 copy
    import openvino as ov

    model = ov.Core().read_model(str(exported["xml_bf16"]))
    converts = [n for n in model.get_ordered_ops() if n.get_type_name() == "Convert"
                and n.input_value(0).get_node().get_type_name() == "Constant"
                and n.get_input_element_type(0).get_type_name() == "bf16"]
    assert converts and all("decompression_0" in n.get_rt_info() for n in converts)


def test_bf16_storage_rounds_as_torch_does() -> None:
    """Each weight is stored as the bf16 value torch's ``.bfloat16()`` gives (round to nearest,
    ties to even), including ties, the largest finite values, denormals and -0, across the
    conversion's chunk boundary."""
    import numpy as np
    import torch

    from numaov.exporter import openvino_convert

    values = torch.randn(3, openvino_convert._BF16_CHUNK // 2 + 7, generator=torch.Generator()
                         .manual_seed(0)).numpy()
    values[0, :8] = [1.00390625, 1.01171875, -3.38e38, 1e-40, -0.0, 65504.0, 3.0000002, 2.0**-130]
    constant = openvino_convert._bf16_constant(values)
    assert constant.get_element_type().get_type_name() == "bf16"
    stored = np.frombuffer(bytes(memoryview(constant.get_tensor_view().data.view(np.uint16))),
                           dtype=np.uint16).reshape(values.shape)
    expected = torch.from_numpy(values).bfloat16().view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(stored, expected)


def _f32_figures(exported: dict) -> list:
    """ONNX Runtime and OpenVINO (f32) against PyTorch on the shared input sets."""
    return check_parity(
        exported["input_sets"], exported["reference"], ["y"], exported["graph"].path,
        exported["xml_f32"], "f32",
    )  # fmt: skip


def test_parity_figures_at_other_shapes(exported: dict) -> None:
    figures = _f32_figures(exported)
    assert {(f.backend, f.precision) for f in figures} == {
        ("onnxruntime", "f32"),
        ("openvino", "f32"),
    }
    assert len(figures) == 4 and all(f.passed for f in figures)
    assert {tuple(f.shapes["x"]) for f in figures} == {(1, 3, 64), (3, 20, 64)}
    # f32 tolerance (1e-4 relative, see parity.TOLERANCES): reordered f32 math only.
    assert max(f.rel_error for f in figures) < TOLERANCES["f32"].max_rel_error
    bf16 = check_parity(
        exported["input_sets"], exported["reference"], ["y"], None, exported["xml_bf16"], "bf16"
    )
    # bf16 tolerance (0.1 relative): bf16 weights and activations; it must really be bf16,
    # so the error is above f32 noise.
    assert all(f.passed and f.rel_error > 1e-5 for f in bf16)
    # The bf16 parity compiles as the runtime does: numaov's attention kernel where AMX is.
    expected = "numaov" if attention_kernel("bf16") == "numaov" else "openvino"
    assert {f.attention for f in bf16} == {expected}
    assert {f.attention for f in figures if f.backend == "openvino"} == {"openvino"}


def test_parity_error_on_a_wrong_reference(exported: dict) -> None:
    # A module with other weights stands in for an export that computes the wrong thing.
    wrong = torch_reference(_block(SEED + 99), exported["input_sets"])
    with pytest.raises(
        ParityError, match=r"onnxruntime \(f32\) output 'y' at x=\[1, 3, 64\]"
    ) as info:
        check_parity(
            exported["input_sets"], wrong, ["y"], exported["graph"].path, exported["xml_f32"], "f32"
        )
    assert len(info.value.figures) == 4 and not any(f.passed for f in info.value.figures)


def test_measure_flags_shape_mismatch_and_nan() -> None:
    ref = np.ones((2, 3), dtype=np.float32)
    with pytest.raises(ParityError, match=r"shape \[3, 2\]; expected \[2, 3\]"):
        measure(ref, np.ones((3, 2)), "openvino", "f32", "y", {})
    figure = measure(ref, np.full((2, 3), np.nan), "openvino", "f32", "y", {})
    assert not figure.passed


def _manifest(exported: dict) -> ExportManifest:
    figures = _f32_figures(exported)
    return ExportManifest(
        kind="small",
        config={"dim": 64},
        inputs=exported["graph"].inputs,
        outputs=exported["graph"].outputs,
        precision="f32",
        inference_precision="f32",
        lowering="decomposed",
        ranks=[RankFiles(0, "model.onnx", "model.xml", "model.bin")],
        versions=library_versions(),
        parity=[f.as_dict() for f in figures],
        files=digest_files(exported["dir"], ["model.onnx", "model.xml", "model.bin"]),
    )


def test_manifest_round_trip(exported: dict) -> None:
    manifest = _manifest(exported)
    path = manifest.write(exported["dir"])
    assert ExportManifest.read(exported["dir"]) == manifest
    data = json.loads(path.read_text())
    assert data["inputs"][0] == {"name": "x", "dtype": "float32", "shape": ["batch", "seq", 64]}
    assert set(data["versions"]) == {"numaov", "torch", "onnx", "onnxruntime", "openvino"}
    assert all(p["passed"] and p["rel_error"] < 1e-4 for p in data["parity"])
    # The runtime's reader sees the same directory without importing the exporter.
    read = read_manifest(exported["dir"], expected_kind="small")
    assert read.rank(0).ir_xml == exported["xml_f32"].resolve()
    assert read.inputs["x"] == ["batch", "seq", 64] and read.inference_precision == "f32"


def test_model_dir_errors(exported: dict, tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match="does not exist"):
        read_manifest(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelDirError, match="is a file"):
        read_manifest(tmp_path / "file")
    with pytest.raises(ModelDirError, match="has no manifest.json"):
        read_manifest(tmp_path)

    model_dir = tmp_path / "model"
    shutil.copytree(exported["dir"], model_dir, ignore=shutil.ignore_patterns("bf16"))
    _manifest(exported).write(model_dir)
    with pytest.raises(ModelDirError, match="holds a 'small' model; expected a 'wan' model"):
        read_manifest(model_dir, expected_kind="wan")

    manifest_path = model_dir / "manifest.json"
    good = json.loads(manifest_path.read_text())
    for change, message in [
        ({"format_version": 99}, "format_version 99"),
        ({"precision": "f16"}, "precision 'f16' is not one of"),
        ({"world_size": 2}, r"ranks \[0\] do not cover world_size 2"),
        ({"inputs": "x"}, "field 'inputs' is malformed"),
    ]:
        manifest_path.write_text(json.dumps({**good, **change}))
        with pytest.raises(ModelDirError, match=message):
            read_manifest(model_dir)
    manifest_path.write_text("{not json")
    with pytest.raises(ModelDirError, match="cannot read .* as JSON"):
        read_manifest(model_dir)
    with pytest.raises(ModelDirError, match="cannot read .* as JSON"):
        ExportManifest.read(model_dir)

    manifest_path.write_text(json.dumps(good))
    (model_dir / "model.bin").unlink()
    with pytest.raises(
        ModelDirError, match=r"incomplete: 'model.bin' \(rank 0 ir_bin\) is missing"
    ):
        read_manifest(model_dir)


def test_export_request_errors(exported: dict, tmp_path: Path) -> None:
    module = exported["module"]
    x, t = torch.zeros(2, 7, 64), torch.ones(2)
    with pytest.raises(
        ExportError, match="unknown ops lowering 'fast'; expected one of decomposed, opset23"
    ):
        export_onnx(module, (x, t), None, None, tmp_path / "m.onnx", "fast")
    with pytest.raises(ExportError, match="must end in .onnx"):
        export_onnx(module, (x, t), None, None, tmp_path / "m.bin")
    # The precision is checked once, by the export entry points (export_wan, export_lm; see
    # test_wan_export's test_export_request_errors); convert_to_ir trusts its caller and
    # only asserts it.
    with pytest.raises(AssertionError, match="unknown precision 'f16'"):
        convert_to_ir(exported["graph"].path, tmp_path / "m.xml", "f16")
    with pytest.raises(ConversionError, match="not found"):
        convert_to_ir(tmp_path / "missing.onnx", tmp_path / "m.xml")


class FixedBatch(torch.nn.Module):
    """Adds a [2, 3] tensor: broadcasting pins the batch axis to 2."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.ones(2, 3)


def test_a_specialised_dynamic_axis_is_an_export_error(tmp_path: Path) -> None:
    batch = torch.export.Dim("batch", min=1, max=64)
    with pytest.raises(
        ExportError,
        match="torch.export of FixedBatch cannot keep the requested dynamic axes.*batch",
    ):
        export_onnx(
            FixedBatch(), (torch.zeros(2, 3),), None, {"x": {0: batch}}, tmp_path / "m.onnx"
        )


def test_bf16_storage_reaches_weights_inside_if_branches(tmp_path) -> None:
    """Weights inside If branches are stored as bf16 too."""
    import openvino as ov
    from openvino import opset13 as ops

    from numaov.exporter.openvino_convert import _store_weights_as_bf16

    x = ops.parameter([4, 2048], np.float32, name="x")
    cond = ops.parameter([], np.bool_, name="c")

    def branch(value: float):
        p = ops.parameter([4, 2048], np.float32)
        w = ops.constant(np.full((2048, 8), value, np.float32))
        return ov.Model([ops.result(ops.matmul(p, w, False, False))], [p]), p

    then_body, then_in = branch(1.0)
    else_body, else_in = branch(2.0)
    if_node = ops.if_op(cond)
    if_node.set_then_body(then_body)
    if_node.set_else_body(else_body)
    if_node.set_input(x.output(0), then_in, else_in)
    out = if_node.set_output(then_body.get_results()[0], else_body.get_results()[0])
    model = ov.Model([out], [x, cond])
    assert _store_weights_as_bf16(model) == 2
    ov.save_model(model, str(tmp_path / "if.xml"), compress_to_fp16=False)
    # Two 2048x8 weights in bf16, nothing left in f32.
    assert (tmp_path / "if.bin").stat().st_size == 2 * 2048 * 8 * 2
    compiled = ov.Core().compile_model(str(tmp_path / "if.xml"), "CPU")
    result = compiled({"x": np.ones((4, 2048), np.float32), "c": np.array(False)})[0]
    # Exact: 2048 * 2.0 in bf16 weights, summed in f32.
    np.testing.assert_array_equal(result, np.full((4, 8), 4096.0, np.float32))


def _model_copy(exported: dict, tmp_path: Path) -> Path:
    """A model directory of the f32 export with its manifest (sizes and digests recorded)."""
    model_dir = tmp_path / "model"
    shutil.copytree(exported["dir"], model_dir, ignore=shutil.ignore_patterns("bf16"))
    _manifest(exported).write(model_dir)
    return model_dir


def test_truncated_ir_is_named_before_compiling(exported: dict, tmp_path: Path) -> None:
    model_dir = _model_copy(exported, tmp_path)
    bin_path = model_dir / "model.bin"
    size = bin_path.stat().st_size
    with bin_path.open("r+b") as handle:
        handle.truncate(size - 100)
    with pytest.raises(ModelDirError, match=rf"model.bin' is {size - 100:,} bytes; the export "
                       rf"wrote {size:,} bytes \(truncated"):
        read_manifest(model_dir)


def test_corrupt_ir_is_named_before_compiling(exported: dict, tmp_path: Path) -> None:
    model_dir = _model_copy(exported, tmp_path)
    bin_path = model_dir / "model.bin"
    data = bytearray(bin_path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other content: only the digest tells
    bin_path.write_bytes(bytes(data))
    manifest = read_manifest(model_dir)  # sizes agree: reading is cheap and passes
    with pytest.raises(ModelDirError, match=r"model.bin' does not hold what the export wrote"):
        manifest.compile_rank(0)
    # An intact copy compiles through the same path.
    intact = read_manifest(_model_copy(exported, tmp_path / "intact"))
    assert intact.compile_rank(0).attention == "openvino"  # f32: OpenVINO's own attention


def test_compile_ir_errors_are_one_line_naming_the_file(tmp_path: Path) -> None:
    broken = tmp_path / "broken.xml"
    broken.write_text("<net name='x'><layers><layer id='0'")  # cut off mid-element
    with pytest.raises(CompileError, match=r"OpenVINO cannot read '.*broken.xml' \(corrupt") as info:
        compile_ir(broken, "f32")
    assert "\n" not in str(info.value)
    with pytest.raises(CompileError, match=r"'.*absent.xml' does not exist"):
        compile_ir(tmp_path / "absent.xml", "f32")
    with pytest.raises(CompileError, match=r"inference precision 'f16'; expected one of f32, bf16"):
        compile_ir(broken, "f16")


@pytest.mark.skipif(bool(amx_unavailable_reason()), reason=f"needs AMX: {amx_unavailable_reason()}")
def test_compile_ir_swaps_attention_at_bf16_only(exported: dict, monkeypatch) -> None:
    monkeypatch.delenv("NUMAOV_ATTENTION", raising=False)
    bf16 = compile_ir(exported["xml_bf16"], "bf16")
    assert (bf16.attention, bf16.swapped) == ("numaov", 1)
    # The precision hint among the properties wins over the precision argument.
    assert compile_ir(exported["xml_bf16"], "bf16", {"INFERENCE_PRECISION_HINT": "f32"}
                      ).attention == "openvino"
    monkeypatch.setenv("NUMAOV_ATTENTION", "openvino")
    assert compile_ir(exported["xml_bf16"], "bf16").attention == "openvino"


def _cpu_computes_bf16() -> bool:
    return "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


@pytest.mark.skipif(not _cpu_computes_bf16(), reason="the CPU plugin computes no bf16 here")
def test_a_batched_bf16_weight_is_read_bf16_at_bf16() -> None:
    """MLA's absorbed weights: a MatMul of a rank-3 weight stored bf16 (widened, reshaped and
    sliced on its way, as the exporter writes kv_b_proj's halves), here against a 4-D batch of
    rows (the exporter's own [heads, B*T, .] rows run as a batched FullyConnected). At bf16 the CPU plugin left
    such a MatMul in f32 on an f32 copy of the weight; compile_ir makes it a bf16 MatMul
    (results within bf16 inference's tolerance), and leaves it f32 at f32 and the caller's model
    as it was. A batched f32 weight, or a bf16 one converted through integers on its way, is
    not a bf16 one and stays as the plugin runs it."""
    from openvino import opset13 as ops

    heads, nope, value, rank = 4, 16, 8, 32
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((heads * (nope + value), rank)).astype(np.float32)
    stored = torch.from_numpy(weight).bfloat16()

    def model(weight_type: ov.Type, through: ov.Type | None = None) -> ov.Model:
        x = ops.parameter([-1, heads, -1, nope], ov.Type.f32, name="x")
        w = ops.constant(stored.float().numpy(), weight_type)
        if through is not None:  # values rounded to another type on the way
            w = ops.convert(w, through)
        if w.get_output_element_type(0) != ov.Type.f32:
            w = ops.convert(w, ov.Type.f32)
        w = ops.reshape(w, ops.concat([ops.constant(np.array([heads], np.int64)),
                                       ops.constant(np.array([nope + value, rank], np.int64))],
                                      0), False)
        w = ops.slice(w, np.array([0]), np.array([nope]), np.array([1]), np.array([1]))
        return ov.Model([ops.matmul(x, w, False, False)], [x])

    def matmul_types(compiled) -> list[str]:
        return [[str(n.get_input_element_type(i).get_type_name()) for i in (0, 1)]
                for n in compiled.model.get_runtime_model().get_ordered_ops()
                if n.get_rt_info()["layerType"].astype(str) == "MatMul"]

    source = model(ov.Type.bf16)
    x = rng.standard_normal((2, heads, 3, nope)).astype(np.float32)
    expected = x @ stored.float().numpy().reshape(heads, nope + value, rank)[:, :nope]
    bf16 = compile_ir(source, "bf16")
    assert matmul_types(bf16) == [["bf16", "bf16"]]
    (got,) = bf16.runner()({"x": x})
    assert np.abs(got - expected).max() / np.abs(expected).max() < TOLERANCES["bf16"].max_rel_error
    assert [n.get_type_name() for n in source.get_ordered_ops()].count("Convert") == 1
    f32 = compile_ir(source, "f32")
    assert matmul_types(f32) == [["f32", "f32"]]
    np.testing.assert_allclose(f32.runner()({"x": x})[0], expected, rtol=1e-5, atol=1e-5)
    assert matmul_types(compile_ir(model(ov.Type.f32), "bf16")) == [["f32", "f32"]]
    assert matmul_types(compile_ir(model(ov.Type.bf16, ov.Type.i32), "bf16")) == [["f32", "f32"]]
    # an input of unknown rank is not a batched weight: the plugin's own refusal, one line
    a, b = (ops.parameter(ov.PartialShape.dynamic(), ov.Type.f32, name=n) for n in "ab")
    with pytest.raises(CompileError, match="dynamic rank"):
        compile_ir(ov.Model([ops.matmul(a, b, False, False)], [a, b]), "bf16")

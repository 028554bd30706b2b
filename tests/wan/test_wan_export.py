"""Exporting the tiny builtin Wan: the CLI export with dynamic shapes, its manifest and
parity, per-frame timesteps, request errors, and an export that is all or nothing."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from support.wan_harness import SEED, cli_in_process, rel_error

from numaov.custom_ops import compile_ir
from numaov.custom_ops.flash_attention import amx_unavailable_reason
from numaov.exporter.onnx_export import ExportError
from numaov.exporter.openvino_convert import ConversionError
from numaov.exporter.output_dir import OutputDirError
from numaov.exporter.parity import TOLERANCES
from numaov.exporter.wan_export import WanExportError, export_wan
from numaov.models.wan.transformer import WanTransformer
from numaov.runtime.manifest_reader import ModelDirError, read_manifest

pytestmark = pytest.mark.slow  # exports the tiny Wan (wan_harness) and checks what the export wrote


def test_cli_export_writes_a_complete_model_dir(wan: dict) -> None:
    model_dir = wan["model_dir"]
    names = ("model.onnx", "model.onnx.data", "model.xml", "model.bin", "reference_sample.npz")
    for name in (*names, "manifest.json"):
        assert (model_dir / name).is_file(), name
    manifest = json.loads((model_dir / "manifest.json").read_text())
    assert manifest["kind"] == "wan" and manifest["precision"] == "f32"
    assert manifest["inference_precision"] == "f32" and manifest["lowering"] == "decomposed"
    shapes = {spec["name"]: spec["shape"] for spec in manifest["inputs"]}
    assert shapes["hidden_states"][:2] == ["batch", 16]
    assert all(isinstance(d, str) for d in shapes["hidden_states"][2:])  # frames, height, width
    assert shapes["timestep"] == ["batch"] and shapes["encoder_hidden_states"][2] == 64
    assert isinstance(shapes["encoder_hidden_states"][1], str)
    assert manifest["config"]["num_layers"] == 2 and manifest["source_checkpoint"]
    figures = manifest["parity"]
    assert {(f["backend"], f["precision"]) for f in figures} == {
        ("onnxruntime", "f32"),
        ("openvino", "f32"),
    }
    # f32 tolerance 1e-4 of the output scale (numaov.exporter.parity.TOLERANCES).
    assert len(figures) == 4 and all(f["passed"] and f["rel_error"] < 1e-4 for f in figures)
    print(
        "export parity:",
        [(f["backend"], f["shapes"]["hidden_states"], f["rel_error"]) for f in figures],
    )
    print("export seconds:", manifest["export_seconds"])
    stderr = wan["export"].stderr
    assert "numaov: translating WanTransformer to ONNX" in stderr and "numaov: parity ok" in stderr
    assert wan["export"].stdout.startswith(f"exported wan (f32, decomposed ops) to {model_dir}")


def test_ir_runs_at_shapes_other_than_the_export(wan: dict) -> None:
    rng = np.random.default_rng(SEED + 1)
    feeds = {
        "hidden_states": rng.standard_normal((3, 16, 4, 2, 10), dtype=np.float32),
        "timestep": np.array([999.0, 500.0, 3.0], dtype=np.float32),
        "encoder_hidden_states": rng.standard_normal((3, 30, 64), dtype=np.float32),
    }
    # f32 explicitly: this CPU has AVX512-BF16 and OpenVINO would otherwise run bf16.
    got = compile_ir(wan["model_dir"] / "model.xml", "f32").model(feeds)[0]
    model = WanTransformer.from_pretrained(wan["checkpoint"])
    with torch.no_grad():
        expected = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).numpy()
    # Same f32 tolerance as the export's parity check (1e-4 of the output scale).
    assert rel_error(got, expected) < 1e-4


def test_export_request_errors(wan: dict, tmp_path: Path) -> None:
    with pytest.raises(WanExportError, match="'.*none' is not a directory; expected a diffusers"):
        export_wan(tmp_path / "none", tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing is created for a request that cannot work
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputDirError, match="is a file; expected a directory"):
        export_wan(wan["checkpoint"], tmp_path / "file")
    with pytest.raises(ConversionError, match="unknown precision 'f16'; expected one of f32, bf16"):
        export_wan(wan["checkpoint"], tmp_path / "out", "f16")
    with pytest.raises(ExportError, match="unknown ops lowering 'fast'"):
        export_wan(wan["checkpoint"], tmp_path / "out", "f32", "fast")


@pytest.mark.skipif(bool(amx_unavailable_reason()), reason=f"needs AMX: {amx_unavailable_reason()}")
def test_bf16_export_parity_runs_numaov_attention(wan: dict, tmp_path: Path, monkeypatch) -> None:
    """A bf16 export's parity compiles through the runtime's one path, so on AMX it measures
    numaov's flash-attention kernel, and the manifest says so."""
    monkeypatch.delenv("NUMAOV_ATTENTION", raising=False)
    manifest = export_wan(wan["checkpoint"], tmp_path / "bf16", "bf16")
    assert manifest.parity_attention == "numaov"
    openvino = [f for f in manifest.parity if f["backend"] == "openvino"]
    assert openvino and all(f["attention"] == "numaov" and f["passed"] for f in openvino)
    # bf16 tolerance (0.1 of the output scale, parity.TOLERANCES): bf16 weights/activations.
    assert max(f["rel_error"] for f in openvino) < TOLERANCES["bf16"].max_rel_error
    assert "(numaov attention)" in manifest.summary(tmp_path / "bf16")
    assert read_manifest(tmp_path / "bf16").record.parity_attention == "numaov"


def _leftovers(parent: Path) -> list[str]:
    """Staging or set-aside directories an export left beside its output."""
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name)


def test_export_is_all_or_nothing(wan: dict, tmp_path: Path, monkeypatch) -> None:
    """A failed export leaves --out as it was, a good one replaces it whole; a directory that
    is not an export is only replaced with force."""
    from numaov.exporter import parity

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file")
    with pytest.raises(OutputDirError, match=r"'.*out' is not empty and holds no numaov export"):
        export_wan(wan["checkpoint"], out)
    code, _, err = cli_in_process("export", "wan", "--checkpoint", str(wan["checkpoint"]),
                                   "--out", str(out), "--quiet")
    assert code == 1 and "holds no numaov export" in err and "Traceback" not in err
    # a manifest.json that is not numaov's (a web app's) does not make it an export
    (out / "manifest.json").write_text('{"name": "my app"}')
    with pytest.raises(OutputDirError, match="holds no numaov export"):
        export_wan(wan["checkpoint"], out)
    (out / "manifest.json").unlink()

    # Parity that cannot pass (tolerance 0) fails the export late, after every file is written.
    strict = {**parity.TOLERANCES, "f32": parity.Tolerance(0.0, "nothing passes")}
    with monkeypatch.context() as patch:
        patch.setattr(parity, "TOLERANCES", strict)
        with pytest.raises(parity.ParityError):
            export_wan(wan["checkpoint"], out, force=True)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and not _leftovers(tmp_path)

    # (the graph taken from the shared export: what is tested here is the publishing)
    manifest = export_wan(wan["checkpoint"], out, force=True, reuse=wan["model_dir"])
    assert "notes.txt" not in {p.name for p in out.iterdir()} and not _leftovers(tmp_path)
    assert read_manifest(out).record == manifest
    assert set(manifest.files) == {"model.onnx", "model.onnx.data", "model.xml", "model.bin",
                                   "reference_sample.npz"}

    # A re-export that fails keeps the previous export intact and readable.
    with monkeypatch.context() as patch:
        patch.setattr(parity, "TOLERANCES", strict)
        with pytest.raises(parity.ParityError):
            export_wan(wan["checkpoint"], out)
    assert read_manifest(out).record == manifest and not _leftovers(tmp_path)


def test_reuse_takes_a_graph_only_when_nothing_it_comes_from_changed(
        wan: dict, tmp_path: Path, monkeypatch) -> None:
    from numaov.exporter import wan_export
    from numaov.exporter.reuse import source_digest

    previous = wan["model_dir"]
    progress: list[str] = []
    manifest = export_wan(wan["checkpoint"], tmp_path / "again", reuse=previous,
                          progress=progress.append)
    assert [line for line in progress if "reused" in line] == [
        f"transformer: reused from {previous} (same checkpoint files and options)"]
    assert not any("ONNX" in line for line in progress), progress  # nothing was exported
    assert manifest == read_manifest(previous).record and manifest.source_digest
    for name in manifest.files:  # hard links to the earlier export's files
        assert os.path.samefile(tmp_path / "again" / name, previous / name), name

    # The digest covers the options and the checkpoint's contents, not where it lies.
    options = {"graph": "wan", "precision": "f32"}
    digest = source_digest(wan["checkpoint"], options)
    copy = Path(shutil.copytree(wan["checkpoint"], tmp_path / "copy"))
    assert source_digest(copy, options) == digest
    assert source_digest(copy, {**options, "precision": "bf16"}) != digest
    # the same files elsewhere: taken, and the manifest names where they are now
    moved = export_wan(copy, tmp_path / "moved", reuse=previous)
    assert moved.source_checkpoint == str(copy.resolve()) != manifest.source_checkpoint
    assert moved.files == manifest.files
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(data)
    assert source_digest(copy, options) != digest

    # An earlier export whose IR changed since is not taken: the export runs, and says why.
    altered = Path(shutil.copytree(previous, tmp_path / "altered"))
    data = bytearray((altered / "model.bin").read_bytes())
    data[0] ^= 1
    (altered / "model.bin").write_bytes(data)

    def exported(*args, **kwargs):
        raise RuntimeError("exported")

    monkeypatch.setattr(wan_export, "_export_into", exported)
    progress.clear()
    with pytest.raises(RuntimeError, match="exported"):
        export_wan(wan["checkpoint"], tmp_path / "third", reuse=altered, progress=progress.append)
    assert any(line.startswith("transformer: not reused") and "model.bin" in line
               for line in progress), progress

    code, _, err = cli_in_process("export", "wan", "--checkpoint", str(wan["checkpoint"]),
                                  "--out", str(tmp_path / "fourth"), "--reuse", str(copy))
    assert code == 1 and err.count("\n") == 1 and "holds no manifest.json" in err, err


def test_per_frame_export_manifest(ti2v: dict) -> None:
    manifest = json.loads((ti2v["model_dir"] / "manifest.json").read_text())
    assert manifest["timestep"] == "per-frame"
    shapes = {spec["name"]: spec["shape"] for spec in manifest["inputs"]}
    # The timestep's frame axis is the video's frame axis (patch_t = 1), both dynamic.
    assert shapes["timestep"] == ["batch", shapes["hidden_states"][2]]
    assert isinstance(shapes["hidden_states"][2], str)
    figures = manifest["parity"]
    # Parity ran at [batch, F'] timesteps other than the export example's [2, 3].
    assert {tuple(f["shapes"]["timestep"]) for f in figures} == {(1, 1), (2, 2)}
    # f32 tolerance 1e-4 of the output scale (numaov.exporter.parity.TOLERANCES).
    assert len(figures) == 4 and all(f["passed"] and f["rel_error"] < 1e-4 for f in figures)
    assert "per-frame timestep" in ti2v["stdout"]


def test_manifest_timestep_must_match_the_graph(wan: dict, ti2v: dict, tmp_path: Path) -> None:
    """A manifest claiming per-frame for a [batch] timestep input is refused, not misfed."""
    from numaov.runtime.manifest_reader import read_manifest

    for path in wan["model_dir"].iterdir():
        if path.name != "manifest.json":
            os.symlink(path, tmp_path / path.name)
    manifest = json.loads((wan["model_dir"] / "manifest.json").read_text())
    manifest["timestep"] = "per-frame"
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelDirError, match=r"timestep is 'per-frame' but .* shape \['batch'\]"):
        read_manifest(tmp_path)
    # Exports from before the field existed read as scalar.
    del manifest["timestep"]  # a Wan manifest must say which form its graph takes
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelDirError, match=r"timestep None is not one of \('scalar'"):
        read_manifest(tmp_path)
    assert read_manifest(ti2v["model_dir"]).timestep == "per-frame"

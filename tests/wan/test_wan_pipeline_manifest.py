"""The pipeline manifest's schema rules (kind wan-pipeline, components), without an export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from numaov.manifest import PIPELINE_KIND, ExportManifest, ModelDirError


def _pipeline(**fields) -> dict:
    manifest = ExportManifest(
        kind=PIPELINE_KIND, config={}, inputs=[], outputs=[], precision="f32",
        inference_precision="f32", lowering="decomposed", ranks=[], versions={},
        components=["text_encoder", "transformer"],
    )
    return {**json.loads(manifest.to_json()), **fields}


def test_a_pipeline_manifest_round_trips_and_needs_its_components(tmp_path: Path) -> None:
    data = _pipeline()
    assert ExportManifest.from_dict(data).components == ["text_encoder", "transformer"]
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    (tmp_path / "text_encoder").mkdir()
    (tmp_path / "text_encoder" / "manifest.json").write_text("{}")
    with pytest.raises(ModelDirError, match=r"'transformer/manifest.json' \(component manifest\) "
                       "is missing"):
        ExportManifest.read(tmp_path)


@pytest.mark.parametrize(("fields", "message"), [
    ({"components": []}, "expected components exactly for kind 'wan-pipeline'"),
    ({"components": ["../elsewhere"]}, "are not subdirectories"),
    ({"components": ["/abs"]}, "are not subdirectories"),
    ({"ranks": [{"rank": 0, "onnx": "a", "ir_xml": "b", "ir_bin": "c"}]}, "lists ranks"),
    ({"kind": "wan", "timestep": "scalar"}, "expected components exactly"),
])
def test_malformed_pipeline_manifests_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ModelDirError, match=message):
        ExportManifest.from_dict(_pipeline(**fields))

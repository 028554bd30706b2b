"""The export manifest: what an exported model directory holds and how it was made.

``manifest.json`` is the contract between the exporter and the runtime. The runtime
reads it as plain JSON (``numaov.runtime.manifest_reader``), never through this module,
so the fields below are the schema both sides agree on:

- ``format_version``: bumped when a field changes meaning; readers refuse other versions.
- ``kind``: the model family (``"wan"``, ``"deepseek"``), which picks the runtime pipeline.
- ``config``: the model's configuration (diffusers / Hugging Face key names).
- ``inputs`` / ``outputs``: name, dtype and shape of every graph tensor; a shape entry is an
  int for a static axis or a string naming a dynamic axis (the ``torch.export.Dim`` name or
  an expression of it such as ``"2*height_patches"``).
- ``precision``: ``"f32"`` or ``"bf16"``; ``inference_precision`` is the OpenVINO
  ``INFERENCE_PRECISION_HINT`` the runtime must compile the IR with.
- ``lowering``: how the fallback ops were written into ONNX (``"decomposed"`` / ``"opset23"``).
- ``timestep``: for a Wan model, ``"scalar"`` (input ``timestep [batch]``) or ``"per-frame"``
  (``[batch, frame_patches]``, Wan 2.2 TI2V); the sampler feeds that form. Absent (null) for
  other kinds; readers take an absent field on a Wan model as ``"scalar"``, which is what
  every Wan export before the field existed was.
- ``world_size`` and ``ranks``: one entry per rank with the ONNX and IR paths relative to the
  model directory (a single-rank model has one entry, rank 0).
- ``versions``: torch / onnx / onnxruntime / openvino / numaov at export time.
- ``parity``: the figures of the export-time parity check.
- ``source_checkpoint``: absolute path of the checkpoint exported, for the PyTorch backend.
- ``export_seconds``: how long each export stage took (load, ONNX export, conversion, parity).
- ``reference_sample``: an ``.npz`` (relative path) with one parity input set (``input.<name>``)
  and PyTorch's output on it (``output.<name>``): a model directory can re-check any backend
  against the export, and the PyTorch backend checks that the source checkpoint is unchanged.
- ``collective_group``: for a model exported for several ranks, the group name written into its
  ``numaov.collective`` nodes; the runtime creates its communicators under that name.
- ``notes``: what the export did not check and why (e.g. ONNX Runtime cannot run collectives).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from numaov import NumaovError

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1


class ManifestError(NumaovError):
    """A manifest.json that cannot be written or read back."""


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output; ``shape`` holds ints (static) or axis names (dynamic)."""

    name: str
    dtype: str
    shape: list[int | str]


@dataclass(frozen=True)
class RankFiles:
    """The files of one rank, relative to the model directory."""

    rank: int
    onnx: str
    ir_xml: str
    ir_bin: str


@dataclass
class ExportManifest:
    """Everything the runtime needs to know about an exported model directory."""

    kind: str
    config: dict[str, Any]
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    precision: str
    inference_precision: str
    lowering: str
    ranks: list[RankFiles]
    versions: dict[str, str]
    parity: list[dict[str, Any]] = field(default_factory=list)
    source_checkpoint: str | None = None
    export_seconds: dict[str, float] = field(default_factory=dict)
    reference_sample: str | None = None
    collective_group: str | None = None
    timestep: str | None = None
    notes: list[str] = field(default_factory=list)
    world_size: int = 1
    format_version: int = FORMAT_VERSION

    def summary(self, model_dir: str | Path) -> str:
        """One line for the CLI: what was written and the worst parity figure per backend."""
        worst: dict[str, float] = {}
        for figure in self.parity:
            key = f"{figure['backend']} {figure['precision']}"
            worst[key] = max(worst.get(key, 0.0), float(figure["rel_error"]))
        parity = ", ".join(f"{k} {v:.2g}" for k, v in worst.items()) or "not checked"
        # Only the non-default timestep is named, so scalar exports read as they always did.
        timestep = ", per-frame timestep" if self.timestep == "per-frame" else ""
        return (
            f"exported {self.kind} ({self.precision}, {self.lowering} ops{timestep}) to "
            f"{model_dir}; parity vs torch (max rel error): {parity}"
        )

    def write_and_report(
        self, model_dir: str | Path, timings: dict[str, float], report: Callable[[str], None]
    ) -> None:
        """Write the manifest (the last file of an export) and report the stage timings."""
        self.write(model_dir)
        report(
            f"exported to {model_dir} in {sum(timings.values()):.1f} s ("
            + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items())
            + ")"
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False) + "\n"

    def write(self, model_dir: str | Path) -> Path:
        """Write ``model_dir/manifest.json`` (atomically, so a crash never leaves half a file)."""
        path = Path(model_dir) / MANIFEST_NAME
        tmp = path.with_suffix(".json.tmp")
        try:
            tmp.write_text(self.to_json(), encoding="utf-8")
            tmp.replace(path)
        except OSError as exc:
            raise ManifestError(f"cannot write {str(path)!r} ({exc})") from exc
        logger.info("wrote %s", path)
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExportManifest:
        """Rebuild a manifest from its JSON object (the inverse of ``to_json``)."""
        try:
            version = data["format_version"]
            if version != FORMAT_VERSION:
                raise ManifestError(
                    f"manifest format_version {version} is not supported; expected "
                    f"{FORMAT_VERSION}: re-export the model with this numaov"
                )
            fields = dict(data)
            fields["inputs"] = [TensorSpec(**t) for t in data["inputs"]]
            fields["outputs"] = [TensorSpec(**t) for t in data["outputs"]]
            fields["ranks"] = [RankFiles(**r) for r in data["ranks"]]
            return cls(**fields)
        except (KeyError, TypeError) as exc:
            raise ManifestError(
                f"manifest is missing or has a malformed field ({exc!r}); expected the fields "
                "written by numaov's exporter"
            ) from exc

    @classmethod
    def read(cls, model_dir: str | Path) -> ExportManifest:
        path = Path(model_dir) / MANIFEST_NAME
        if not path.is_file():
            raise ManifestError(f"{MANIFEST_NAME} not found in {str(Path(model_dir))!r}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ManifestError(f"cannot read {str(path)!r} as JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise ManifestError(
                f"{str(path)!r} holds a JSON {type(data).__name__}; expected an object"
            )
        return cls.from_dict(data)


def write_reference_sample(
    path: str | Path, inputs: dict[str, Any], outputs: dict[str, Any]
) -> Path:
    """Save one input set and PyTorch's outputs on it (see ``reference_sample`` above)."""
    import numpy as np

    path = Path(path)
    arrays = {f"input.{k}": v for k, v in inputs.items()}
    arrays.update({f"output.{k}": v for k, v in outputs.items()})
    try:
        with path.open("wb") as handle:
            np.savez(handle, **arrays)
    except OSError as exc:
        raise ManifestError(f"cannot write {str(path)!r} ({exc})") from exc
    return path


def library_versions() -> dict[str, str]:
    """Versions of the libraries an export depends on, recorded so a mismatch can be diagnosed."""
    import onnx
    import onnxruntime
    import openvino
    import torch

    import numaov

    return {
        "numaov": numaov.__version__,
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "openvino": openvino.get_version(),
    }

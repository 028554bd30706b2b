"""Read an exported model directory's ``manifest.json`` for the runtime.

The runtime never imports the exporter (DESIGN.md), so this is a small, strict reader of
the JSON the exporter writes (schema in ``numaov/exporter/manifest.py``): it checks the
fields the runtime relies on and that the files they name exist, and turns every way a
model directory can be wrong into one ``ModelDirError`` saying what was expected.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from numaov import NumaovError

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
SUPPORTED_FORMAT_VERSION = 1
_PRECISIONS = ("f32", "bf16")


class ModelDirError(NumaovError):
    """A model directory that is missing, incomplete, or not what the command expects."""


@dataclass(frozen=True)
class RankModel:
    """Absolute paths of one rank's exported graphs."""

    rank: int
    onnx: Path
    ir_xml: Path


@dataclass(frozen=True)
class ModelManifest:
    """The parts of ``manifest.json`` the runtime uses."""

    directory: Path
    kind: str
    config: dict[str, Any]
    inputs: dict[str, list[int | str]]
    precision: str
    inference_precision: str
    lowering: str
    world_size: int
    ranks: list[RankModel]
    versions: dict[str, str]
    source_checkpoint: Path | None
    # One parity input set and PyTorch's output on it (an .npz), and the tolerance the
    # export's parity check used at this model's inference precision.
    reference_sample: Path | None = None
    reference_tolerance: float | None = None
    # The group name in a multi-rank model's collective nodes (None for a single rank).
    collective_group: str | None = None
    # How a Wan graph takes its timestep: "scalar" [batch] or "per-frame" [batch, F'];
    # None for other kinds.
    timestep: str | None = None

    def rank(self, rank: int = 0) -> RankModel:
        for entry in self.ranks:
            if entry.rank == rank:
                return entry
        raise ModelDirError(
            f"model directory {str(self.directory)!r} has no rank {rank}; it was exported for "
            f"ranks {[r.rank for r in self.ranks]}"
        )

    def compile_rank(self, rank: int = 0, config: Mapping[str, Any] | None = None) -> Any:
        """Compile rank `rank`'s IR on the CPU with numaov's extension ops loaded.

        The export's precision decides the inference precision: an f32 export must say so,
        or OpenVINO runs it in bf16 on CPUs with AVX512-BF16 / AMX. At bf16, plain attention
        runs on numaov's AMX flash-attention kernel when ``NUMAOV_ATTENTION`` allows it (see
        `numaov.custom_ops.flash_attention`); at f32 it stays OpenVINO's, since the kernel
        rounds its operands to bf16.
        """
        import openvino as ov

        from numaov.custom_ops import add_extension
        from numaov.custom_ops.flash_attention import swap_attention

        core = ov.Core()
        add_extension(core)
        properties = {"INFERENCE_PRECISION_HINT": self.inference_precision, **(config or {})}
        model = core.read_model(str(self.rank(rank).ir_xml))
        if self.attention_kernel(config) == "numaov":
            swap_attention(model)
        return core.compile_model(model, "CPU", properties)

    def attention_kernel(self, config: Mapping[str, Any] | None = None) -> str:
        """Which kernel `compile_rank` gives plain attention under ``config``: ``"numaov"``
        (bf16 and NUMAOV_ATTENTION allows it) or ``"openvino"``."""
        from numaov.custom_ops.flash_attention import attention_kernel

        return attention_kernel(
            (config or {}).get("INFERENCE_PRECISION_HINT", self.inference_precision)
        )

    def source_checkpoint_dir(self, other_backends: str) -> Path:
        """The checkpoint the model was exported from, for the PyTorch backend."""
        source = self.source_checkpoint
        if source is None or not source.is_dir():
            raise ModelDirError(
                f"the torch backend loads the checkpoint the model was exported from, but "
                f"{str(source)!r} (source_checkpoint in {str(self.directory)!r}) is not a "
                f"directory; use --backend {other_backends}"
            )
        return source


def _field(data: dict[str, Any], key: str, kind: type | tuple[type, ...], where: Path) -> Any:
    if key not in data:
        raise ModelDirError(f"{str(where)!r} has no {key!r} field; re-export the model with numaov")
    value = data[key]
    if not isinstance(value, kind):
        raise ModelDirError(f"{str(where)!r}: field {key!r} is malformed ({value!r})")
    return value


def read_manifest(model_dir: str | Path, expected_kind: str | None = None) -> ModelManifest:
    """Validate ``model_dir`` and its ``manifest.json``; ``expected_kind`` e.g. ``"wan"``."""
    directory = Path(model_dir)
    if not directory.exists():
        raise ModelDirError(
            f"model directory {str(directory)!r} does not exist; expected the --out directory "
            "of `numaov export`"
        )
    if not directory.is_dir():
        raise ModelDirError(f"model directory {str(directory)!r} is a file; expected a directory")
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise ModelDirError(
            f"{str(directory)!r} has no {MANIFEST_NAME}; expected a directory written by "
            "`numaov export` (an export that failed part-way writes no manifest)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelDirError(f"cannot read {str(path)!r} as JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelDirError(f"{str(path)!r} holds a JSON {type(data).__name__}; expected an object")

    version = _field(data, "format_version", int, path)
    if version != SUPPORTED_FORMAT_VERSION:
        raise ModelDirError(
            f"{str(path)!r} has format_version {version}; this numaov reads version "
            f"{SUPPORTED_FORMAT_VERSION}: re-export the model"
        )
    kind = _field(data, "kind", str, path)
    if expected_kind is not None and kind != expected_kind:
        raise ModelDirError(
            f"{str(directory)!r} holds a {kind!r} model; expected a {expected_kind!r} model"
        )
    precision = _field(data, "precision", str, path)
    inference_precision = _field(data, "inference_precision", str, path)
    for key, value in (("precision", precision), ("inference_precision", inference_precision)):
        if value not in _PRECISIONS:
            raise ModelDirError(f"{str(path)!r}: {key} {value!r} is not one of {_PRECISIONS}")

    ranks = []
    for entry in _field(data, "ranks", list, path):
        if not isinstance(entry, dict) or not {"rank", "onnx", "ir_xml", "ir_bin"} <= entry.keys():
            raise ModelDirError(f"{str(path)!r}: malformed ranks entry {entry!r}")
        for key in ("onnx", "ir_xml", "ir_bin"):
            if not (directory / entry[key]).is_file():
                raise ModelDirError(
                    f"{str(directory)!r} is incomplete: {entry[key]!r} (rank {entry['rank']} "
                    f"{key}) is missing; re-export the model"
                )
        ranks.append(
            RankModel(
                rank=int(entry["rank"]),
                onnx=directory / entry["onnx"],
                ir_xml=directory / entry["ir_xml"],
            )
        )
    world_size = _field(data, "world_size", int, path)
    if sorted(r.rank for r in ranks) != list(range(world_size)):
        raise ModelDirError(
            f"{str(path)!r}: ranks {[r.rank for r in ranks]} do not cover world_size {world_size}"
        )

    inputs = {}
    for spec in _field(data, "inputs", list, path):
        if (
            not isinstance(spec, dict)
            or "name" not in spec
            or not isinstance(spec.get("shape"), list)
        ):
            raise ModelDirError(f"{str(path)!r}: malformed inputs entry {spec!r}")
        inputs[spec["name"]] = spec["shape"]

    versions = _field(data, "versions", dict, path)
    _warn_on_version_change(versions)
    source = data.get("source_checkpoint")
    reference_sample = None
    if isinstance(data.get("reference_sample"), str):
        reference_sample = directory / data["reference_sample"]
        if not reference_sample.is_file():
            raise ModelDirError(
                f"{str(directory)!r} is incomplete: {data['reference_sample']!r} (reference "
                "sample) is missing; re-export the model"
            )
    tolerances = [
        float(f["tolerance"])
        for f in data.get("parity", [])
        if isinstance(f, dict) and f.get("precision") == inference_precision and "tolerance" in f
    ]
    return ModelManifest(
        directory=directory.resolve(),
        kind=kind,
        config=_field(data, "config", dict, path),
        inputs=inputs,
        precision=precision,
        inference_precision=inference_precision,
        lowering=_field(data, "lowering", str, path),
        world_size=world_size,
        ranks=ranks,
        versions={str(k): str(v) for k, v in versions.items()},
        source_checkpoint=Path(source) if isinstance(source, str) else None,
        reference_sample=reference_sample,
        reference_tolerance=max(tolerances) if tolerances else None,
        collective_group=_collective_group(data, world_size, path),
        timestep=_timestep(data, kind, inputs, path),
    )


def _collective_group(data: dict[str, Any], world_size: int, where: Path) -> str | None:
    """A multi-rank model must name the group its collective nodes look up."""
    group = data.get("collective_group")
    if world_size > 1 and (not isinstance(group, str) or not group):
        raise ModelDirError(
            f"{str(where)!r} is exported for {world_size} ranks but names no collective_group; "
            "re-export the model with numaov"
        )
    return group if isinstance(group, str) else None


def _timestep(
    data: dict[str, Any], kind: str, inputs: dict[str, list[int | str]], where: Path
) -> str | None:
    """A Wan model's timestep form; it must agree with the rank of its ``timestep`` input."""
    if kind != "wan":
        return None
    # Wan exports written before the field existed all took timestep [batch].
    timestep = data.get("timestep") or "scalar"
    rank = {"scalar": 1, "per-frame": 2}.get(timestep)
    if rank is None:
        raise ModelDirError(
            f"{str(where)!r}: timestep {timestep!r} is not one of ('scalar', 'per-frame')"
        )
    shape = inputs.get("timestep")
    if shape is not None and len(shape) != rank:
        raise ModelDirError(
            f"{str(where)!r}: timestep is {timestep!r} but the graph's timestep input has shape "
            f"{shape}; expected {rank} axes: re-export the model"
        )
    return timestep


def _warn_on_version_change(versions: dict[str, Any]) -> None:
    """An IR from another OpenVINO release usually loads; say so in the log when it might not."""
    import openvino

    exported = str(versions.get("openvino", "")).split("-")[0]
    running = openvino.get_version().split("-")[0]
    if exported and exported.split(".")[:2] != running.split(".")[:2]:
        logger.warning(
            "model was exported with OpenVINO %s and is run with %s; re-export if loading fails",
            exported,
            running,
        )

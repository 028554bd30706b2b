"""An exported model directory as the runtime sees it.

The runtime never imports the exporter (docs/architecture.md): the schema of
``manifest.json`` lives in the leaf module ``numaov.manifest``, which both import.
`read_manifest` checks the manifest and the files it names (``numaov.manifest.ExportManifest.read``)
and turns it into a `ModelManifest`: absolute paths, inputs by name, the tolerance at this
model's inference precision. Every way a model directory can be wrong is one ``ModelDirError``
saying what was expected.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from numaov.manifest import MANIFEST_NAME, ExportManifest, ModelDirError

logger = logging.getLogger(__name__)

__all__ = ["MANIFEST_NAME", "ModelDirError", "ModelManifest", "RankModel", "read_manifest"]


@dataclass(frozen=True)
class RankModel:
    """Absolute paths of one rank's exported graphs."""

    rank: int
    onnx: Path | None  # None: an IR-only graph (``RankFiles.onnx``)
    ir_xml: Path
    # The rank's expert store (None: no routed experts, or an export holding them in its IR).
    experts: Path | None = None


@dataclass(frozen=True)
class ModelManifest:
    """The parts of ``manifest.json`` the runtime uses (``record`` holds all of it)."""

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
    record: ExportManifest
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

    def checked_ir(self, rank: int = 0) -> Path:
        """Rank ``rank``'s IR ``.xml`` after checking its ``.xml`` and ``.bin`` against the
        sizes and digests the export recorded (a truncated or corrupt file is named here,
        not inside OpenVINO)."""
        self.rank(rank)  # an unknown rank is refused with the ranks there are
        files = next(r for r in self.record.ranks if r.rank == rank)
        self.record.verify_file(self.directory, files.ir_bin)
        return self.record.verify_file(self.directory, files.ir_xml)

    @property
    def output_names(self) -> list[str]:
        return [spec.name for spec in self.record.outputs]

    def compile_rank(self, rank: int = 0, config: Mapping[str, Any] | None = None,
                     bf16_io: tuple[str, ...] = (), part: Any = None) -> Any:
        """Rank ``rank``'s IR, checked and compiled the one way numaov compiles
        (``numaov.custom_ops.compile_ir``) at this export's inference precision, with
        ``config``'s OpenVINO properties on top and ``bf16_io`` and ``part`` (a
        ``GraphPart``) as there; returns a ``CompiledIR``."""
        from numaov.custom_ops import compile_ir

        def compiled() -> Any:
            return compile_ir(self.checked_ir(rank), self.inference_precision, config,
                              bf16_io=bf16_io, part=part)

        kept = _KEPT_COMPILED.get()
        if kept is None:
            return compiled()
        key = (str(self.rank(rank).ir_xml), self.inference_precision,
               tuple(sorted((str(k), str(v)) for k, v in (config or {}).items())), bf16_io,
               part)
        if key not in kept:
            kept[key] = compiled()
        return kept[key]

    def attention_kernel(self, config: Mapping[str, Any] | None = None) -> str:
        """Which kernel `compile_rank` gives plain attention under ``config``: ``"numaov"``
        (bf16 and NUMAOV_ATTENTION allows it) or ``"openvino"``."""
        from numaov.custom_ops.flash_attention import attention_kernel
        from numaov.custom_ops.openvino_compile import effective_precision

        return attention_kernel(effective_precision(self.inference_precision, config))

    def source_checkpoint_dir(self, other_backends: str) -> Path:
        """The checkpoint the model was exported from, for the PyTorch backend."""
        source = self.source_checkpoint
        if source is None or not source.is_dir():
            raise ModelDirError(
                f"the torch backend loads the checkpoint the model was exported from, but "
                f"{str(source)!r} (source_checkpoint in {str(self.directory)!r}) is not a "
                f"directory; expected it there, or another backend ({other_backends})",
                parameter="backend",
            )
        return source


# The compiled graphs kept by ``keep_compiled`` (None: compile_rank compiles every time).
_KEPT_COMPILED: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "numaov_kept_compiled", default=None)


@contextlib.contextmanager
def keep_compiled(store: dict) -> Iterator[dict]:
    """Within it, ``compile_rank`` compiles each IR (per precision and properties) once into
    ``store`` and returns that compiled model again after: a long-lived server runs many
    generations on the same graphs, and compiling is most of a small one's time. The caller
    owns ``store`` (and the memory its compiled models hold); outside it nothing is kept."""
    token = _KEPT_COMPILED.set(store)
    try:
        yield store
    finally:
        _KEPT_COMPILED.reset(token)


def read_manifest(model_dir: str | Path, expected_kind: str | None = None) -> ModelManifest:
    """Validate ``model_dir`` and its ``manifest.json``; ``expected_kind`` e.g. ``"wan"``."""
    record = ExportManifest.read(model_dir, expected_kind)
    directory = Path(model_dir).resolve()
    _warn_on_version_change(record.versions)
    tolerances = [
        float(f["tolerance"])
        for f in record.parity
        if isinstance(f, dict) and f.get("precision") == record.inference_precision
        and "tolerance" in f
    ]
    return ModelManifest(
        directory=directory,
        kind=record.kind,
        config=record.config,
        inputs={spec.name: spec.shape for spec in record.inputs},
        precision=record.precision,
        inference_precision=record.inference_precision,
        lowering=record.lowering,
        world_size=record.world_size,
        ranks=[RankModel(r.rank, directory / r.onnx if r.onnx else None, directory / r.ir_xml,
                         directory / r.experts if r.experts else None)
               for r in sorted(record.ranks, key=lambda r: r.rank)],
        versions={str(k): str(v) for k, v in record.versions.items()},
        source_checkpoint=(Path(record.source_checkpoint)
                           if isinstance(record.source_checkpoint, str) else None),
        record=record,
        reference_sample=(directory / record.reference_sample
                          if record.reference_sample is not None else None),
        reference_tolerance=max(tolerances) if tolerances else None,
        collective_group=record.collective_group,
        timestep=record.timestep,
    )


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

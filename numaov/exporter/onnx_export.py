"""torch -> ONNX through the dynamo exporter, with numaov's ops and external weights.

Every numaov model goes through here (the Wan DiT once, a language model once per rank), so
the three things that must always hold are in one place:

- the exporter gets numaov's ``custom_translation_table``, so the fallback ops become
  standard ONNX subgraphs (or opset-23 ops) and the collectives become
  ``numaov.collective`` nodes instead of failing or being traced through;
- dynamic axes are declared with ``torch.export.Dim``, so the graph is checked to stay
  symbolic on them (``torch.export`` raises if the model specialises an axis);
- weights larger than ``EXTERNAL_DATA_THRESHOLD`` go to ``<name>.onnx.data`` beside the
  graph: protobuf caps a file at 2 GiB and a 1.3B-parameter DiT is 5 GiB in f32.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from numaov import NumaovError
from numaov.manifest import LOWERINGS, TensorSpec

logger = logging.getLogger(__name__)

# Tensors at or above this size are written to the external data file; smaller ones
# (shape constants, scalars) stay inline, where ONNX tools expect to see them.
EXTERNAL_DATA_THRESHOLD = 1024
# How much of a failing exporter's message goes into ours: enough for torch.export's
# "suggested fixes" for a specialised dynamic axis, not a page of traceback.
_MAX_CAUSE_CHARS = 2000
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class ExportError(NumaovError):
    """The model could not be exported to ONNX (or the request was malformed)."""


@dataclass(frozen=True)
class OnnxGraph:
    """What ``export_onnx`` wrote: the graph file, its external data file, its tensors."""

    path: Path
    data_path: Path | None
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


def check_lowering(lowering: str) -> str:
    if lowering not in LOWERINGS:
        raise ExportError(
            f"unknown ops lowering {lowering!r}; expected one of {', '.join(LOWERINGS)}",
            parameter="lowering",
        )
    return lowering


def _tensor_specs(values: Any) -> list[TensorSpec]:
    """Name, dtype and shape of ONNX graph values; symbolic axes keep their names."""
    specs = []
    for value in values:
        dims: list[int | str] = []
        for dim in value.shape:
            dims.append(
                dim if isinstance(dim, int) else str(dim.value if hasattr(dim, "value") else dim)
            )
        dtype = value.dtype
        try:
            dtype_name = str(dtype.numpy())
        except (TypeError, ValueError, AttributeError):  # e.g. bfloat16 has no numpy dtype
            dtype_name = str(dtype).lower()
        specs.append(TensorSpec(name=value.name, dtype=dtype_name, shape=dims))
    return specs


def _cause(exc: BaseException) -> str:
    """The useful part of an exporter error, without terminal colours or the "next steps"."""
    text = _ANSI.sub("", f"{type(exc).__name__}: {exc}").strip()
    # torch.onnx's ConversionError puts the chain of real causes under this heading.
    head, marker, summary = text.partition("## Exception summary")
    if marker:
        first = head.splitlines()[0].split(" This is step")[0]
        text = first + " " + summary.split("(Refer to the full stack trace")[0]
        text = text.replace("⬆️", " ")
    text = " ".join(text.split())  # one line: the CLI prints errors as a single line
    if len(text) > _MAX_CAUSE_CHARS:
        text = text[:_MAX_CAUSE_CHARS] + " ..."
    return text


def _capture(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    dynamic_shapes: dict[str, Any] | tuple[Any, ...] | None,
    name: str,
) -> torch.export.ExportedProgram:
    """``torch.export`` ourselves, so a dynamic axis the model specialises is an error.

    Given a module, ``torch.onnx.export`` would instead apply torch.export's "suggested
    fixes" and quietly export that axis as a constant.
    """
    # As torch.onnx does: reason about sizes 0/1 like any other size, so an axis stays
    # dynamic even where the model broadcasts over it.
    oblivious = torch.fx.experimental._config.patch(backed_size_oblivious=True)
    try:
        with oblivious:
            return torch.export.export(
                module, args, kwargs=kwargs, dynamic_shapes=dynamic_shapes, strict=False
            )
    except torch._dynamo.exc.UserError as exc:
        raise ExportError(
            f"torch.export of {name} cannot keep the requested dynamic axes; expected a model "
            f"that works for any size on them: {_cause(exc)}"
        ) from exc
    except Exception as exc:  # tracing failures come in many types; name the model and why
        raise ExportError(f"torch.export of {name} failed: {_cause(exc)}") from exc


def _check_dynamic_axes(
    inputs: list[TensorSpec], dynamic_shapes: dict[str, Any] | tuple[Any, ...] | None, name: str
) -> None:
    """Every axis declared dynamic must be symbolic in the ONNX graph's inputs."""
    if not isinstance(dynamic_shapes, dict):
        return
    specs = {spec.name: spec for spec in inputs}
    for input_name, axes in dynamic_shapes.items():
        spec = specs.get(input_name)
        if spec is None or not isinstance(axes, dict):
            continue
        fixed = [axis for axis in axes if isinstance(spec.shape[axis], int)]
        if fixed:
            raise ExportError(
                f"ONNX graph of {name}: input {input_name!r} axes {fixed} were declared dynamic "
                f"but are fixed ({spec.shape}); expected them symbolic"
            )


@contextlib.contextmanager
def _quiet_torch_exporter() -> Iterator[None]:
    """Silence the exporter's notices that say nothing about the user's model.

    torch.onnx logs a line per missing torchvision op and warns about deprecated
    pytree internals and renamed axes on every export; real problems still raise.
    """
    noisy = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = noisy.level
    noisy.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.|copyreg")
            warnings.filterwarnings("ignore", message=r".*axis name: .* will not be used")
            yield
    finally:
        noisy.setLevel(level)


def export_onnx(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    dynamic_shapes: dict[str, Any] | tuple[Any, ...] | None,
    path: str | Path,
    lowering: str = "decomposed",
    progress: Callable[[str], None] | None = None,
    *,
    output_names: list[str] | None = None,
) -> OnnxGraph:
    """Export ``module(*args, **kwargs)`` to ``path`` (ONNX) with external weight data.

    ``dynamic_shapes`` follows ``torch.export``: per input, a dict from axis to
    ``torch.export.Dim`` (or an expression such as ``2 * Dim("h")`` when an axis must
    stay a multiple of a patch size). The example inputs should use sizes other than
    0 and 1 on dynamic axes, which ``torch.export`` would otherwise specialise.
    """
    from numaov.custom_ops import onnx_opset_version, onnx_translation_table  # ONNX face

    check_lowering(lowering)
    path = Path(path)
    if path.suffix != ".onnx":
        raise ExportError(f"ONNX output path {str(path)!r} must end in .onnx")
    path.parent.mkdir(parents=True, exist_ok=True)
    report = progress or (lambda _msg: None)
    name = type(module).__name__

    was_training = module.training
    module.eval()
    try:
        with torch.no_grad(), _quiet_torch_exporter():
            report(f"capturing {name} with torch.export")
            exported = _capture(module, args, kwargs, dynamic_shapes, name)
            report(f"translating {name} to ONNX (lowering={lowering})")
            try:
                program = torch.onnx.export(
                    exported,
                    args,
                    None,
                    kwargs=kwargs,
                    dynamo=True,
                    # Only names the symbolic axes after the Dims here; the program is fixed.
                    dynamic_shapes=dynamic_shapes,
                    custom_translation_table=onnx_translation_table(lowering),
                    opset_version=onnx_opset_version(lowering),
                    output_names=output_names,
                    # onnxscript's optimizer matches its rewrite rules at every node (a third
                    # of a 4-block Wan 1.3B-width export's time, growing with the blocks) for
                    # fusions OpenVINO makes itself when it compiles: measured the same OpenVINO
                    # outputs and speed without it.
                    optimize=False,
                    verbose=False,
                )
            except NumaovError:
                raise
            except Exception as exc:  # the translator raises many unrelated types
                raise ExportError(f"torch.onnx.export of {name} failed: {_cause(exc)}") from exc
    finally:
        module.train(was_training)
        # Dynamo's caches hold the traced module (through its guards) after torch.export
        # returns, so a caller's `del module` would free nothing: a whole rank's weights
        # stayed alive through conversion and parity. Nothing reuses those caches.
        torch._dynamo.reset()

    model = program.model
    inputs = _tensor_specs(model.graph.inputs)
    _check_dynamic_axes(inputs, dynamic_shapes, name)
    data_name = f"{path.name}.data"
    initializers = list(model.graph.initializers.values())
    external = [
        v
        for v in initializers
        if v.const_value is not None and v.const_value.nbytes >= EXTERNAL_DATA_THRESHOLD
    ]
    total_mb = sum(v.const_value.nbytes for v in external) / 1e6
    report(f"writing {path.name}: {len(external)} weight tensors, {total_mb:.1f} MB to {data_name}")
    import onnx_ir

    try:
        onnx_ir.save(
            model,
            path,
            external_data=data_name,
            size_threshold_bytes=EXTERNAL_DATA_THRESHOLD,
        )
    except OSError as exc:
        raise ExportError(f"cannot write ONNX model to {str(path)!r} ({exc})") from exc
    # Drop the in-memory graph's hold on the module's weights once they are on disk:
    # onnxscript's rewrite rules are module-level objects that keep the last graph they
    # matched, and through it every weight, which kept a whole rank's weights alive (1x
    # the shard) through conversion and parity.
    for value in initializers:
        value.const_value = None
    data_path = path.with_name(data_name)
    graph = OnnxGraph(
        path=path,
        data_path=data_path if data_path.is_file() else None,
        inputs=inputs,
        outputs=_tensor_specs(model.graph.outputs),
    )
    logger.info(
        "exported %s to %s (%d inputs, %d outputs)",
        name,
        path,
        len(graph.inputs),
        len(graph.outputs),
    )
    return graph

"""Parity check of an export: PyTorch versus ONNX Runtime versus OpenVINO.

The exported graphs are run on the same random inputs as the PyTorch module, at shapes
chosen to differ from the export's example shapes (so a dynamic axis that was silently
baked in shows up as an error here). Each comparison gives a ``ParityFigure``; any figure
outside its tolerance raises ``ParityError`` naming the backend, shapes and numbers.

The measure is the largest absolute difference divided by the largest absolute value of
the PyTorch output: a scale-free "how far off, relative to the output's magnitude" that
neither blows up on near-zero elements (as an element-wise relative error would) nor
depends on the model's output scale (as an absolute tolerance would).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from numaov import NumaovError
from numaov.exporter.openvino_convert import check_precision

logger = logging.getLogger(__name__)

BACKENDS = ("onnxruntime", "openvino")


class ParityError(NumaovError):
    """An exported graph's output differs from PyTorch's by more than the tolerance."""

    def __init__(self, message: str, figures: Sequence[ParityFigure] = ()) -> None:
        super().__init__(message)
        # Every figure measured, passing or not, for whoever wants to report them.
        self.figures = list(figures)


@dataclass(frozen=True)
class Tolerance:
    max_rel_error: float
    reason: str


# Tolerances per compute precision, as max |candidate - torch| / max |torch|.
TOLERANCES: dict[str, Tolerance] = {
    # f32: the exported graph computes the same math in another order (MatMul+Add fused
    # into FullyConnected, LayerNorm as MVN, attention as one SDPA kernel, other blockings),
    # which moves each op's result by a few ulps (~1e-7); through a network of a few dozen
    # ops in sequence that grows to about 1e-6 (measured on the tiny Wan model). 1e-4 leaves
    # two orders of magnitude of margin, while a real lowering mistake (wrong axis, missing
    # term, wrong epsilon) shows up at 1e-2 or more.
    "f32": Tolerance(1e-4, "f32 reassociation across the graph: ~1e-6 expected, errors >= 1e-2"),
    # bf16: an 8-bit significand, so every rounding of an activation or weight is off by up
    # to 2^-8 (~4e-3) relative; matmul inputs, weights and attention probabilities are all
    # rounded, layer after layer, and the largest element error reaches a few percent of the
    # output scale (measured: 0.032 on the tiny Wan model, 0.048 on 2 blocks of Wan-1.3B
    # width with random weights). 0.1 leaves a 2x margin; a wrong graph is off by O(1).
    "bf16": Tolerance(1e-1, "bf16 rounding of weights and activations: 3e-2..5e-2 measured"),
}


@dataclass(frozen=True)
class ParityFigure:
    """One comparison: one backend, one compute precision, one input set, one output."""

    backend: str
    precision: str
    output: str
    shapes: dict[str, list[int]]
    max_abs_error: float
    max_abs_reference: float
    rel_error: float
    mean_abs_error: float
    tolerance: float
    # OpenVINO's figures: the attention kernel the graph ran on ("numaov" / "openvino").
    attention: str | None = None

    @property
    def passed(self) -> bool:
        return bool(self.rel_error <= self.tolerance)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}

    def describe(self) -> str:
        shapes = ", ".join(f"{k}={v}" for k, v in self.shapes.items())
        return (
            f"{self.backend} ({self.precision}) output {self.output!r} at {shapes}: max abs error "
            f"{self.max_abs_error:.3g} over max |torch| {self.max_abs_reference:.3g} = "
            f"{self.rel_error:.3g} (tolerance {self.tolerance:g})"
        )


def measure(
    reference: np.ndarray,
    candidate: np.ndarray,
    backend: str,
    precision: str,
    output: str,
    shapes: Mapping[str, Sequence[int]],
    tolerance: float | None = None,
    attention: str | None = None,
) -> ParityFigure:
    """Compare one output of a backend with the PyTorch reference."""
    reference = np.asarray(reference, dtype=np.float64)
    candidate = np.asarray(candidate, dtype=np.float64)
    if reference.shape != candidate.shape:
        raise ParityError(
            f"{backend} ({precision}) output {output!r} has shape {list(candidate.shape)}; "
            f"expected {list(reference.shape)} as from PyTorch"
        )
    if not np.all(np.isfinite(candidate)):
        max_err = float("inf")
    else:
        max_err = float(np.max(np.abs(candidate - reference))) if reference.size else 0.0
    scale = float(np.max(np.abs(reference))) if reference.size else 0.0
    mean_err = float(np.mean(np.abs(candidate - reference))) if reference.size else 0.0
    return ParityFigure(
        backend=backend,
        precision=precision,
        output=output,
        shapes={k: [int(d) for d in v] for k, v in shapes.items()},
        max_abs_error=max_err,
        max_abs_reference=scale,
        # A tiny floor keeps an all-zero reference from dividing by zero; any difference
        # from an all-zero output then counts as a (huge) failure, as it should.
        rel_error=max_err / max(scale, 1e-12),
        mean_abs_error=mean_err,
        tolerance=TOLERANCES[precision].max_rel_error if tolerance is None else tolerance,
        attention=attention,
    )


def parity_attention(figures: Sequence[ParityFigure]) -> str | None:
    """The attention kernel OpenVINO ran in the parity check (the manifest's
    ``parity_attention``); None when OpenVINO was not checked."""
    kernels = {f.attention for f in figures if f.attention is not None}
    if len(kernels) > 1:  # ranks compiled alike cannot differ; say so if they ever do
        raise ParityError(f"the parity check ran on several attention kernels: {sorted(kernels)}")
    return kernels.pop() if kernels else None


Runner = Callable[[dict[str, np.ndarray]], list[np.ndarray]]


def _onnxruntime_runner(onnx_path: Path) -> tuple[Runner, None]:
    import onnxruntime as ort

    from numaov.custom_ops import check_onnxruntime_can_run

    # A graph with numaov.collective nodes gets a clear refusal, not ORT's load error.
    check_onnxruntime_can_run(onnx_path)
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    return (lambda feeds: list(session.run(None, feeds))), None


def openvino_runner(
    xml_path: str | Path, precision: str, properties: Mapping[str, Any] | None = None
) -> tuple[Runner, str]:
    """Compile ``xml_path`` as the runtime does (`numaov.custom_ops.compile_ir`); returns a
    function running one input set, and the attention kernel it runs on."""
    from numaov.custom_ops import compile_ir

    compiled = compile_ir(xml_path, precision, properties)
    return compiled.runner(), compiled.attention


def torch_reference(
    module: Any, input_sets: Sequence[dict[str, np.ndarray]]
) -> list[list[np.ndarray]]:
    """PyTorch's outputs for every input set (``module(**feeds)`` as f32 numpy arrays).

    Computed before any exported graph is loaded, so a big model can be freed before ONNX
    Runtime and OpenVINO each hold their own copy of the weights.
    """
    import torch

    outputs = []
    with torch.no_grad():
        for feeds in input_sets:
            result = module(**{name: torch.from_numpy(array) for name, array in feeds.items()})
            results = result if isinstance(result, (tuple, list)) else (result,)
            outputs.append([r.detach().float().numpy() for r in results])
    return outputs


def check_parity(
    input_sets: Sequence[dict[str, np.ndarray]],
    reference_outputs: Sequence[Sequence[np.ndarray]],
    output_names: Sequence[str],
    onnx_path: str | Path | None,
    xml_path: str | Path | None,
    openvino_precision: str = "f32",
    progress: Callable[[str], None] | None = None,
    tolerances: Mapping[str, float] | None = None,
) -> list[ParityFigure]:
    """Compare ONNX Runtime and OpenVINO with PyTorch's ``reference_outputs`` on ``input_sets``.

    ONNX Runtime runs the ONNX file in f32 (it has no bf16 kernels for these graphs) and is
    skipped when ``onnx_path`` is None (e.g. a graph with numaov collective nodes, which only
    OpenVINO with numaov's extension can run). OpenVINO compiles ``xml_path`` with
    ``INFERENCE_PRECISION_HINT=openvino_precision`` through the runtime's own compile path, so
    at bf16 the figures measure the attention kernel that runs. One backend is loaded at a time.
    ``tolerances`` overrides the per-precision defaults (``{"f32": ..., "bf16": ...}``).
    Returns every figure; raises ``ParityError`` listing the ones outside tolerance.
    """
    check_precision(openvino_precision)
    if len(reference_outputs) != len(input_sets):
        raise ParityError(
            f"{len(reference_outputs)} reference outputs for {len(input_sets)} input sets; "
            "expected one per input set"
        )
    report = progress or (lambda _msg: None)
    backends: list[tuple[str, str, Callable[[], tuple[Runner, str | None]]]] = []
    if onnx_path is not None:
        backends.append(("onnxruntime", "f32", lambda: _onnxruntime_runner(Path(onnx_path))))
    if xml_path is not None:
        backends.append(
            (
                "openvino",
                openvino_precision,
                lambda: openvino_runner(xml_path, openvino_precision),
            )
        )
    overrides = dict(tolerances or {})

    figures: list[ParityFigure] = []
    for backend, precision, load in backends:
        report(f"parity check on {backend} ({precision}), {len(input_sets)} input sets")
        run, attention = load()
        for feeds, expected in zip(input_sets, reference_outputs, strict=True):
            shapes = {name: list(array.shape) for name, array in feeds.items()}
            got = run(feeds)
            if len(got) != len(expected):
                raise ParityError(
                    f"{backend} returned {len(got)} outputs; expected {len(expected)} "
                    "as from PyTorch"
                )
            for name, ref, out in zip(output_names, expected, got, strict=True):
                figure = measure(
                    ref, out, backend, precision, name, shapes, overrides.get(precision), attention
                )
                logger.info("parity: %s", figure.describe())
                figures.append(figure)
        del run  # free this backend's copy of the weights before loading the next

    failed = [f for f in figures if not f.passed]
    if failed:
        raise ParityError(
            "exported model does not match PyTorch: " + "; ".join(f.describe() for f in failed),
            figures,
        )
    worst = max((f.rel_error for f in figures), default=0.0)
    report(f"parity ok: {len(figures)} comparisons, worst relative error {worst:.3g}")
    return figures

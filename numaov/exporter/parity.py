"""Parity check of an export: PyTorch versus ONNX Runtime versus OpenVINO.

The exported graphs are run on the same random inputs as the PyTorch module, at shapes
chosen to differ from the export's example shapes (so a dynamic axis that was silently
baked in shows up as an error here). Each comparison gives a ``ParityFigure``; any figure
outside its tolerance raises ``ParityError`` naming the backend, shapes and numbers.

The measure is the largest absolute difference divided by the largest absolute value of
the PyTorch output: a scale-free "how far off, relative to the output's magnitude" that
neither blows up on near-zero elements (as an element-wise relative error would) nor
depends on the model's output scale (as an absolute tolerance would).

A language-model export that rounds (int8 / int4 / fp8 / bf16 weights, or bf16 inference:
``weight_formats.row_criterion``) is checked per row instead (``min_row_share``):
the same scale-free error is taken for every row (the last axis: one position's logits, one
cached token's vector), and the share of rows within the tolerance, over every input set,
must reach ``min_row_share``; for logits, the share of rows whose argmax (the greedy token)
equals PyTorch's must reach ``min_token_share``. Each phase (``manifest.row_phase``: prefill,
decode with a cache) must also keep ``manifest.PHASE_MIN_ROW_SHARE`` of its own rows within, so
the few rows of one cannot all be wrong under the other's many. Rounding (of the weights, or of the
activations the f32 router reads) can flip a near-tied router choice, which moves a few
positions far while every other position moves a little; a wrong scale, layout, group size
or expert moves every position that reaches it by O(1), so the share falls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from numaov import NumaovError
from numaov.exporter.release import release_freed_memory
from numaov.manifest import PRECISIONS, RowShare
from numaov.manifest import row_shares as pooled_row_shares

logger = logging.getLogger(__name__)

BACKENDS = ("onnxruntime", "openvino")
# Outputs (the last part of a figure's output name) whose rows are scores over tokens: the
# per-row criterion also counts the rows whose argmax agrees.
TOKEN_SCORE_OUTPUTS = ("logits",)


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

# A deep bf16 graph judged stage by stage (``check_stages``): each stage (a Wan block) runs on
# PyTorch's own input to it, and its output is compared with PyTorch's as a relative RMS error,
# ||candidate - torch|| / ||torch|| over the whole state. One stage's bf16 roundings stay the
# same whatever the depth, where the whole output's largest element error grows with it
# (0.045 after 4 blocks of Wan 1.3B width, 0.058 after its 30, toward the 0.1 bound at 40).
# Measured per stage (random weights, Wan 1.3B width and narrower): 0.14-0.4%. A block whose
# weights are all 25% too large moves its own output by 4-25% (more where the block's update
# is large beside its input), a wrong lowering by O(1). 2% leaves a 5x margin above the noise.
STAGE_TOLERANCE = Tolerance(
    2e-2, "one stage's bf16 rounding, on PyTorch's input to it: 0.14-0.4% RMS measured")


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
    # "max": rel_error is the largest element error over the largest |torch|; "rms": the
    # relative RMS error of one stage run on PyTorch's input to it (``check_stages``).
    criterion: str = "max"
    # False for a figure kept for the record only: a bf16 graph judged stage by stage keeps
    # its whole output's figure, which grows with the depth (``check_stages``).
    judged: bool = True
    # The per-row criterion (an export that rounds; see the module docstring): this input
    # set's counts, and the verdict on this output's rows over every input set (``judge``).
    min_row_share: float | None = None
    rows: int | None = None
    rows_within: int | None = None
    # Rows whose argmax equals PyTorch's (TOKEN_SCORE_OUTPUTS only; None otherwise), and the
    # share of them required.
    rows_same_argmax: int | None = None
    min_token_share: float | None = None
    rows_passed: bool | None = None

    @property
    def passed(self) -> bool:
        if self.min_row_share is None:
            return bool(self.rel_error <= self.tolerance)
        return bool(np.isfinite(self.max_abs_error)) and self.rows_passed is not False

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}

    def describe(self) -> str:
        shapes = ", ".join(f"{k}={v}" for k, v in self.shapes.items())
        whole = (f"max abs error {self.max_abs_error:.3g} over max |torch| "
                 f"{self.max_abs_reference:.3g} = {self.rel_error:.3g}")
        if self.criterion == "rms":
            whole = (f"relative RMS error {self.rel_error:.3g} on PyTorch's input to this stage "
                     f"(max abs error {self.max_abs_error:.3g})")
        head = f"{self.backend} ({self.precision}) output {self.output!r} at {shapes}: "
        if self.min_row_share is None:
            return f"{head}{whole} (tolerance {self.tolerance:g})"
        argmax = ("" if self.rows_same_argmax is None
                  else f", same argmax on {self.rows_same_argmax}")
        return f"{head}{self.rows_within} of {self.rows} rows within {self.tolerance:g}{argmax}; {whole}"


def row_shares(figures: Sequence[ParityFigure]) -> list[RowShare]:
    """The per-row figures pooled per (backend, output) over the input sets
    (``manifest.row_shares``, which reads them as the manifest records them)."""
    return pooled_row_shares([f.as_dict() for f in figures])


def judge(figures: Sequence[ParityFigure], mismatch: str) -> list[ParityFigure]:
    """The figures with the per-row verdicts filled in; raises ``ParityError`` (its message
    ``mismatch`` and every failure) when any figure or row share fails."""
    shares = row_shares(figures)
    verdicts = {(s.backend, s.output): s.passed for s in shares}
    judged = [f if f.min_row_share is None
              else replace(f, rows_passed=verdicts[(f.backend, f.output)]) for f in figures]
    failed = [f.describe() for f in judged
              if f.judged and not f.passed
              and (f.min_row_share is None or not np.isfinite(f.max_abs_error))]
    failed += [s.describe() for s in shares if not s.passed]
    if failed:
        raise ParityError(f"{mismatch}: " + "; ".join(failed), judged)
    return judged


def measure(
    reference: np.ndarray,
    candidate: np.ndarray,
    backend: str,
    precision: str,
    output: str,
    shapes: Mapping[str, Sequence[int]],
    tolerance: float | None = None,
    attention: str | None = None,
    min_row_share: float | None = None,
    min_token_share: float | None = None,
    criterion: str = "max",
) -> ParityFigure:
    """Compare one output of a backend with the PyTorch reference; with ``min_row_share``,
    row by row (the module docstring); ``criterion="rms"``: as a relative RMS error."""
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
    limit = TOLERANCES[precision].max_rel_error if tolerance is None else tolerance
    rows = within = same_argmax = None
    if min_row_share is not None:
        width = reference.shape[-1] if reference.ndim else 1
        ref_rows = reference.reshape(-1, width)
        diff = np.abs(candidate.reshape(-1, width) - ref_rows)
        row_err = diff.max(axis=1) if width else np.zeros(len(ref_rows))
        rows = len(ref_rows)
        within = int(np.sum(row_err / max(scale, 1e-12) <= limit))
        if output.split(".")[-1] in TOKEN_SCORE_OUTPUTS and width:
            same_argmax = int(np.sum(candidate.reshape(-1, width).argmax(axis=1)
                                     == ref_rows.argmax(axis=1)))
    # A tiny floor keeps an all-zero reference from dividing by zero; any difference
    # from an all-zero output then counts as a (huge) failure, as it should.
    rel_error = max_err / max(scale, 1e-12)
    if criterion == "rms" and np.isfinite(max_err):
        rel_error = float(np.linalg.norm(candidate - reference)
                          / max(float(np.linalg.norm(reference)), 1e-12))
    return ParityFigure(
        backend=backend,
        precision=precision,
        output=output,
        shapes={k: [int(d) for d in v] for k, v in shapes.items()},
        max_abs_error=max_err,
        max_abs_reference=scale,
        rel_error=rel_error,
        mean_abs_error=mean_err,
        tolerance=limit,
        attention=attention,
        min_row_share=min_row_share,
        min_token_share=min_row_share if min_token_share is None else min_token_share,
        rows=rows,
        rows_within=within,
        rows_same_argmax=same_argmax,
        criterion=criterion,
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
    # Without constant folding: ORT maps the external weights as they are, where folding
    # a bf16 weight's Cast made an f32 copy of every weight (a 4-block Wan 1.3B-width bf16
    # export: 1.6 GiB loaded against 38 MiB); the parity inputs are small, speed is moot.
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"],
                                   disabled_optimizers=["ConstantFolding"])
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

    from numaov.arrays import to_torch

    outputs = []
    with torch.no_grad():
        for feeds in input_sets:
            result = module(**{name: to_torch(array) for name, array in feeds.items()})
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
    min_row_share: float | None = None,
    min_token_share: float | None = None,
    measured_outputs: Sequence[str] | None = None,
    judged_backends: Sequence[str] = BACKENDS,
) -> list[ParityFigure]:
    """Compare ONNX Runtime and OpenVINO with PyTorch's ``reference_outputs`` on ``input_sets``.

    ONNX Runtime runs the ONNX file in f32 (it has no bf16 kernels for these graphs) and is
    skipped when ``onnx_path`` is None (e.g. a graph with numaov collective nodes, which only
    OpenVINO with numaov's extension can run). OpenVINO compiles ``xml_path`` with
    ``INFERENCE_PRECISION_HINT=openvino_precision`` through the runtime's own compile path, so
    at bf16 the figures measure the attention kernel that runs. One backend is loaded at a time.
    ``tolerances`` overrides the per-precision defaults (``{"f32": ..., "bf16": ...}``);
    ``min_row_share`` checks each output row by row, ``min_token_share`` (default: the same)
    the logits rows keeping PyTorch's argmax (the module docstring). ``measured_outputs`` names the
    outputs measured (default: all; the Wan transformer's block states are intermediate
    values of its sample, which is measured). The figures of backends not in
    ``judged_backends`` are kept for the record but not judged (a bf16 Wan transformer's
    OpenVINO figures, judged stage by stage instead: ``check_stages``).
    Returns every figure; raises ``ParityError`` listing the ones outside tolerance.
    ``openvino_precision`` comes from an export entry point, which checked it.
    """
    assert openvino_precision in PRECISIONS, openvino_precision
    if len(reference_outputs) != len(input_sets):
        raise ParityError(
            f"{len(reference_outputs)} reference outputs for {len(input_sets)} input sets; "
            "expected one per input set"
        )
    report = progress or (lambda _msg: None)
    # OpenVINO first: what ONNX Runtime leaves in the process after its session is gone
    # (~0.6x the bf16 weights, its arena's f32 Casts) then never sits under OpenVINO's copy.
    backends: list[tuple[str, str, Callable[[], tuple[Runner, str | None]]]] = []
    if xml_path is not None:
        backends.append(
            (
                "openvino",
                openvino_precision,
                lambda: openvino_runner(xml_path, openvino_precision),
            )
        )
    if onnx_path is not None:
        backends.append(("onnxruntime", "f32", lambda: _onnxruntime_runner(Path(onnx_path))))
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
                if measured_outputs is not None and name not in measured_outputs:
                    continue
                figure = measure(
                    ref, out, backend, precision, name, shapes, overrides.get(precision), attention,
                    min_row_share, min_token_share,
                )
                if backend not in judged_backends:
                    figure = replace(figure, judged=False)
                logger.info("parity: %s", figure.describe())
                figures.append(figure)
        del run  # free this backend's copy of the weights before loading the next
        release_freed_memory()

    figures = judge(figures, "exported model does not match PyTorch")
    report(summary(figures))
    return figures


def check_stages(
    xml_path: str | Path,
    precision: str,
    input_sets: Sequence[dict[str, np.ndarray]],
    reference_outputs: Sequence[Sequence[np.ndarray]],
    output_names: Sequence[str],
    states: Sequence[str],
    final: str,
    progress: Callable[[str], None] | None = None,
) -> list[ParityFigure]:
    """OpenVINO's parity for a deep graph, stage by stage (``STAGE_TOLERANCE``).

    ``states`` are graph outputs along the graph in order (a Wan transformer's token states
    into its first block and out of each block) and ``final`` the output computed from the
    last. One part of the graph is compiled with every state both an output and an input
    (``GraphPart``): each state is computed from the graph inputs (the first) or from PyTorch's
    value of the state before it, ``final`` from PyTorch's last state. So every stage is
    judged on its own error, which does not add up with depth. Returns the figures (not
    judged: ``judge`` them with the others).
    """
    from numaov.custom_ops import compile_ir
    from numaov.custom_ops.openvino_compile import GraphPart

    report = progress or (lambda _msg: None)
    index = {name: i for i, name in enumerate(output_names)}
    part = GraphPart(outputs=(*states, final), feeds=tuple(states))
    report(f"parity check on openvino ({precision}) stage by stage: {len(states)} states, "
           f"each from PyTorch's state before it")
    compiled = compile_ir(xml_path, precision, part=part)
    run = compiled.runner()
    figures = []
    for feeds, expected in zip(input_sets, reference_outputs, strict=True):
        shapes = {name: list(array.shape) for name, array in feeds.items()}
        stage_feeds = {**feeds, **{name: expected[index[name]] for name in states}}
        got = run(stage_feeds)
        for name, out in zip((*states, final), got, strict=True):
            figure = measure(expected[index[name]], out, "openvino", precision, name, shapes,
                             STAGE_TOLERANCE.max_rel_error, compiled.attention,
                             criterion="rms")
            logger.info("parity: %s", figure.describe())
            figures.append(figure)
    return figures


def summary(figures: Sequence[ParityFigure]) -> str:
    """The export's report line for figures that passed: the worst whole-output error and,
    for the per-row criterion, each output's rows and greedy tokens within it."""
    worst = max((f.rel_error for f in figures if f.judged), default=0.0)
    line = f"parity ok: {len(figures)} comparisons, worst relative error {worst:.3g}"
    if any(f.criterion == "rms" for f in figures):
        stages = max(f.rel_error for f in figures if f.criterion == "rms")
        whole = max((f.rel_error for f in figures if not f.judged), default=None)
        line += (f" (stage by stage, worst relative RMS error {stages:.3g}"
                 + ("" if whole is None else f"; the whole output, not judged: {whole:.3g}")
                 + ")")
    shares = row_shares(figures)
    if shares:
        line += "; checked per row: " + "; ".join(s.describe() for s in shares)
    return line

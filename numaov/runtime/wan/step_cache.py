"""Step caching for the Wan transformer: diffusers' First Block Cache and MagCache on an
exported graph.

**First Block Cache** (diffusers' ``transformer.enable_cache(FirstBlockCacheConfig(threshold))``)
runs the first transformer block at every step and compares its residual (its output minus its
input) with the one of the last step that ran every block: when the mean absolute difference,
relative to the mean absolute value of that earlier residual, is at most ``threshold``, the
other blocks are skipped and their last residual (the last block's output minus the first
block's) is added to the first block's output instead; the output norm and projection run as
always.

**MagCache** (diffusers' ``MagCacheConfig``) decides before running anything, from the
checkpoint's magnitude ratios (per step, the mean over tokens of how much the residual of all
blocks, last block's output minus first block's input, grew since the step before): after the
first ``retention`` share of the steps, each step multiplies an accumulated ratio by its own and
adds ``|1 - accumulated ratio|`` to an accumulated error; while that error is at most
``threshold`` and at most ``max_skip`` steps in a row were skipped, every block is skipped and
the last residual is added to the blocks' input; otherwise every block runs and the
accumulators start again. The ratios are measured once per checkpoint (``magcache:calibrate``,
which skips nothing and writes them beside the transformer's manifest, ``RATIOS_FILE``) and
stretched to the run's step count by nearest neighbour, as diffusers does.

Each guidance branch keeps its own state (diffusers' ``cache_context("cond")`` /
``("uncond")``), and so does each transformer of a two-expert pipeline (for MagCache, a
transformer's steps are the evaluations it runs).

An export (``numaov export wan``) returns the token states into the first block, out of it and
out of the last (``BLOCK_OUTPUTS``) beside its sample, so the runtime compiles parts of one IR
(``GraphPart``): the head (the patch embedding, with the first block for First Block Cache),
the whole step (sample and the block states a cache keeps) and the output head fed a last
block state. A skipped evaluation then costs the head and the output head instead of every
block. The parts share the IR file; batched guidance rows that decide differently run as two
calls of one row each.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from numaov.models.wan import BLOCK_OUTPUTS
from numaov.runtime.manifest_reader import ModelManifest
from numaov.runtime.wan.denoisers import Denoiser
from numaov.runtime.wan.request import SamplerInputError, WanSampleRequest

FIRST_BLOCK, MAGCACHE = "first-block", "magcache"
CACHE_KINDS = (FIRST_BLOCK, MAGCACHE)
# diffusers' FirstBlockCacheConfig and MagCacheConfig defaults.
DEFAULT_THRESHOLD = {FIRST_BLOCK: 0.05, MAGCACHE: 0.06}
DEFAULT_MAX_SKIP = 3
DEFAULT_RETENTION = 0.2
CALIBRATE = "calibrate"
# The magnitude ratios of a transformer's export, beside its manifest.
RATIOS_FILE = "magcache.json"
RATIOS_FORMAT = "numaov-magcache/1"
SETTING_FORMS = (f"{FIRST_BLOCK}[:THRESHOLD], {MAGCACHE}[:THRESHOLD[:MAX_SKIP[:RETENTION]]] "
                 f"or {MAGCACHE}:{CALIBRATE}")


@dataclass(frozen=True)
class StepCacheSetting:
    """``--cache``: ``first-block[:THRESHOLD]``, ``magcache[:THRESHOLD[:MAX_SKIP[:RETENTION]]]``
    or ``magcache:calibrate`` (every block runs; the magnitude ratios are measured)."""

    kind: str
    threshold: float
    max_skip: int = DEFAULT_MAX_SKIP  # MagCache: consecutive skipped steps at most
    retention: float = DEFAULT_RETENTION  # MagCache: the share of first steps never skipped
    calibrate: bool = False

    @classmethod
    def parse(cls, text: str) -> StepCacheSetting:
        kind, *values = str(text).split(":")
        if kind not in CACHE_KINDS or len(values) > (1 if kind == FIRST_BLOCK else 3):
            raise SamplerInputError(f"step cache {text!r}; expected {SETTING_FORMS}, e.g. "
                                    f"{FIRST_BLOCK}:{DEFAULT_THRESHOLD[FIRST_BLOCK]}",
                                    parameter="cache")
        if kind == MAGCACHE and values == [CALIBRATE]:
            return cls(kind, DEFAULT_THRESHOLD[kind], calibrate=True)
        threshold = _number(values[0], text, "threshold", "a number >= 0 (diffusers' default "
                            f"{DEFAULT_THRESHOLD[kind]}; higher skips more)") \
            if values and values[0] else DEFAULT_THRESHOLD[kind]
        max_skip = DEFAULT_MAX_SKIP
        if len(values) > 1:
            max_skip = _number(values[1], text, "max skip", "a whole number >= 0 (default "
                               f"{DEFAULT_MAX_SKIP}: steps skipped in a row at most)")
            if max_skip != int(max_skip):
                raise SamplerInputError(
                    f"step cache max skip {values[1]!r} in {text!r}; expected a whole number "
                    f">= 0 (default {DEFAULT_MAX_SKIP})", parameter="cache")
        retention = DEFAULT_RETENTION
        if len(values) > 2:
            retention = _number(values[2], text, "retention", "a number in [0, 1] (default "
                                f"{DEFAULT_RETENTION}: the share of first steps never skipped)")
            if retention > 1:
                raise SamplerInputError(
                    f"step cache retention {values[2]!r} in {text!r}; expected a number in "
                    f"[0, 1] (default {DEFAULT_RETENTION})", parameter="cache")
        return cls(kind, threshold, int(max_skip), retention)

    def __str__(self) -> str:
        if self.calibrate:
            return f"{self.kind}:{CALIBRATE}"
        text = f"{self.kind}:{self.threshold!r}"  # every digit: the service keeps this text
        if (self.max_skip, self.retention) != (DEFAULT_MAX_SKIP, DEFAULT_RETENTION):
            text += f":{self.max_skip}:{self.retention!r}"
        return text

    @property
    def skipped_work(self) -> str:
        """What a skipped evaluation still runs."""
        return ("the first block and the output head" if self.kind == FIRST_BLOCK else
                "the patch embedding and the output head")


def _number(value: str, text: str, what: str, expected: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and number >= 0):
        raise SamplerInputError(f"step cache {what} {value!r} in {text!r}; expected {expected}",
                                parameter="cache")
    return number


class _GraphParts(Denoiser):
    """An OpenVINO Wan transformer compiled as parts of its one IR. Rows of a batch are
    guidance branches (row 0 conditional, row 1 unconditional), as in ``BatchedGuidance`` and
    ``GatheredGuidance``; ``_decide`` says per row whether every block runs."""

    name = "openvino"
    HEAD: tuple[str, ...] = ()  # the head part's outputs
    # The whole step's outputs, the sample first: one part for both caches, so a server that
    # runs both keeps one compiled copy of the whole step.
    WHOLE = ("sample", "embedded", "first_block", "last_block")

    def __init__(self, manifest: ModelManifest, setting: StepCacheSetting,
                 config: dict[str, Any] | None = None) -> None:
        from numaov.custom_ops.openvino_compile import GraphPart, WeightPages

        check_block_outputs(manifest, setting)
        # the IR's mapped weights, dropped after each part's first run has packed them
        self._weight_pages = WeightPages(manifest.rank(0).ir_xml.with_suffix(".bin"))
        self.setting = setting
        whole = manifest.compile_rank(0, config, part=GraphPart(self.WHOLE))
        self.attention = whole.attention
        self._whole = whole.create_infer_request()
        self._head = self._out = None
        if not setting.calibrate:  # a calibrating run skips nothing
            self._head = manifest.compile_rank(
                0, config, part=GraphPart(self.HEAD)).create_infer_request()
            self._out = manifest.compile_rank(
                0, config, part=GraphPart(("sample",), feeds=("last_block",))
            ).create_infer_request()
        self._computed: list[list[bool]] = []  # per row, per evaluation: every block ran

    @property
    def decisions(self) -> list[str]:
        """Per branch, per evaluation: "C" where every block ran, "." where they were
        skipped."""
        return ["".join("C" if c else "." for c in row) for row in self._computed]

    def _run(self, request: Any, feeds: dict[str, np.ndarray], outputs: int) -> list[np.ndarray]:
        from numaov.custom_ops.openvino_compile import infer

        names = {name for port in request.model_inputs for name in port.get_names()}
        infer(request, {name: array for name, array in feeds.items() if name in names})
        self._weight_pages.after_run(id(request))
        return [np.array(request.get_output_tensor(i).data, dtype=np.float32)
                for i in range(outputs)]

    def _decide(self, rows: int, feeds: dict[str, np.ndarray]) -> tuple[list[bool], Any]:
        """Per row, whether every block runs; and what ``_skip`` needs."""
        raise NotImplementedError

    def _keep_whole(self, chosen: list[int], outputs: list[np.ndarray], head: Any) -> None:
        """Keep what the chosen rows' whole step gave (``WHOLE``'s block states)."""
        raise NotImplementedError

    def _skip(self, chosen: list[int], part: dict[str, np.ndarray], head: Any) -> np.ndarray:
        """The last block's state for the chosen rows (their inputs ``part``), which skip the
        blocks."""
        raise NotImplementedError

    def _evaluated(self, rows: int) -> None:
        """After each evaluation of ``rows`` rows."""

    def predict(self, hidden_states: np.ndarray, timestep: np.ndarray,
                text: np.ndarray) -> np.ndarray:
        rows = hidden_states.shape[0]
        while len(self._computed) < rows:
            self._computed.append([])
        feeds = {"hidden_states": hidden_states, "timestep": timestep,
                 "encoder_hidden_states": text}
        compute, head = self._decide(rows, feeds)
        out: np.ndarray | None = None
        for decision in (True, False):
            chosen = [r for r in range(rows) if compute[r] == decision]
            if not chosen:
                continue
            part = {name: _rows(array, chosen, rows) for name, array in feeds.items()}
            if decision:
                sample, *states = self._run(self._whole, part, len(self.WHOLE))
                self._keep_whole(chosen, states, head)
            else:
                part["last_block"] = self._skip(chosen, part, head)
                (sample,) = self._run(self._out, part, 1)
            if out is None:
                out = np.empty((rows, *sample.shape[1:]), np.float32)
            out[chosen] = sample
        for r in range(rows):
            self._computed[r].append(compute[r])
        self._evaluated(rows)
        assert out is not None
        return out

    def close(self) -> None:
        self._head = self._whole = self._out = None


class FirstBlockCacheDenoiser(_GraphParts):
    """An OpenVINO Wan transformer run as diffusers' First Block Cache runs one."""

    HEAD = ("embedded", "first_block")

    def __init__(self, manifest: ModelManifest, setting: StepCacheSetting,
                 config: dict[str, Any] | None = None) -> None:
        super().__init__(manifest, setting, config)
        # per row (diffusers' ``FBCSharedBlockState``): the first block's residual and the
        # other blocks' residual at the last evaluation that ran every block
        self._head_residual: list[np.ndarray | None] = []
        self._tail_residual: list[np.ndarray | None] = []

    def _decide(self, rows: int, feeds: dict[str, np.ndarray]) -> tuple[list[bool], Any]:
        while len(self._head_residual) < rows:
            self._head_residual.append(None)
            self._tail_residual.append(None)
        embedded, first = self._run(self._head, feeds, 2)
        residual = first - embedded
        compute = []
        for r in range(rows):
            previous = self._head_residual[r]
            if previous is None or self._tail_residual[r] is None:
                compute.append(True)
                continue
            change = float(np.abs(residual[r] - previous).mean()) / float(np.abs(previous).mean())
            compute.append(change > self.setting.threshold)
        return compute, (first, residual)

    def _keep_whole(self, chosen: list[int], outputs: list[np.ndarray], head: Any) -> None:
        _, first_run, last = outputs
        for k, r in enumerate(chosen):
            self._head_residual[r] = head[1][r]
            self._tail_residual[r] = last[k] - first_run[k]

    def _skip(self, chosen: list[int], part: dict[str, np.ndarray], head: Any) -> np.ndarray:
        return head[0][chosen] + np.stack([self._tail_residual[r] for r in chosen])


@dataclass
class _MagState:
    """One guidance branch's MagCache state (diffusers' ``MagCacheState``); the accumulators
    are float32 as diffusers' (its ratios are a float32 tensor)."""

    step: int = 0
    ratio: np.float32 = field(default_factory=lambda: np.float32(1.0))
    error: np.float32 = field(default_factory=lambda: np.float32(0.0))
    skipped: int = 0
    residual: np.ndarray | None = None  # the last block's output minus the first's input
    measured: list[float] = field(default_factory=list)  # calibration: a ratio per step

    def should_compute(self, setting: StepCacheSetting, ratios: np.ndarray | None,
                       evaluations: int) -> bool:
        if ratios is None:  # calibration runs every block
            return True
        if self.step < int(setting.retention * evaluations + 0.5):
            return True
        scale = ratios[self.step] if self.step < len(ratios) else np.float32(1.0)
        self.ratio = np.float32(self.ratio * scale)
        self.skipped += 1
        self.error = np.float32(self.error + abs(np.float32(1.0) - self.ratio))
        # in float32, as torch compares diffusers' float32 error with the threshold
        if (self.residual is not None and self.error <= np.float32(setting.threshold)
                and self.skipped <= setting.max_skip):
            return False
        self.ratio, self.error, self.skipped = np.float32(1.0), np.float32(0.0), 0
        return True

    def advance(self, evaluations: int) -> None:
        """After each evaluation; the state starts again after the last (diffusers' reset at
        ``num_inference_steps``), the measured ratios kept."""
        self.step += 1
        if self.step >= evaluations:
            self.step, self.skipped, self.residual = 0, 0, None
            self.ratio, self.error = np.float32(1.0), np.float32(0.0)


class MagCacheDenoiser(_GraphParts):
    """An OpenVINO Wan transformer run as diffusers' MagCache runs one. ``evaluations``: the
    steps this transformer runs per branch (diffusers' ``num_inference_steps``)."""

    HEAD = ("embedded",)

    def __init__(self, manifest: ModelManifest, setting: StepCacheSetting, evaluations: int,
                 config: dict[str, Any] | None = None) -> None:
        self.evaluations = evaluations
        # (a second expert that runs no step needs none)
        self.ratios = (None if setting.calibrate or not evaluations else
                       read_ratios(manifest.directory, evaluations))
        self._directory = manifest.directory
        super().__init__(manifest, setting, config)
        self._states: list[_MagState] = []

    def _decide(self, rows: int, feeds: dict[str, np.ndarray]) -> tuple[list[bool], Any]:
        while len(self._states) < rows:
            self._states.append(_MagState())
        compute = [s.should_compute(self.setting, self.ratios, self.evaluations)
                   for s in self._states[:rows]]
        return compute, None

    def _keep_whole(self, chosen: list[int], outputs: list[np.ndarray], head: Any) -> None:
        embedded, _, last = outputs
        for k, r in enumerate(chosen):
            state = self._states[r]
            residual = last[k] - embedded[k]
            if self.setting.calibrate:
                state.measured.append(_magnitude_ratio(residual, state.residual))
            state.residual = residual

    def _skip(self, chosen: list[int], part: dict[str, np.ndarray], head: Any) -> np.ndarray:
        # the blocks' input (the patch embedding) plus their last residual
        (embedded,) = self._run(self._head, part, 1)
        return embedded + np.stack([self._states[r].residual for r in chosen])

    def _evaluated(self, rows: int) -> None:
        for state in self._states[:rows]:
            state.advance(self.evaluations)

    def save_ratios(self, settings: dict[str, Any]) -> Path | None:
        """After a calibrating run: the conditional branch's ratios (row 0; diffusers applies
        one list to every branch) in ``RATIOS_FILE`` beside the manifest, with the run's
        ``settings``; None when no full run was measured."""
        if not self.setting.calibrate or not self._states:
            return None
        measured = self._states[0].measured
        if not self.evaluations or len(measured) < self.evaluations:
            return None  # a second expert that ran no step, or a run cut short
        path = self._directory / RATIOS_FILE
        record = {"format": RATIOS_FORMAT, "ratios": measured[-self.evaluations:], **settings}
        # written beside and renamed into place: a reader never sees half a file, and a
        # hard-linked copy of the export keeps its own
        partial = path.with_name(f".{RATIOS_FILE}.{os.getpid()}")
        try:
            partial.write_text(json.dumps(record, indent=1) + "\n")
            os.replace(partial, path)
        except OSError as exc:
            raise SamplerInputError(
                f"cannot write the magnitude ratios to {str(path)!r}: {exc.strerror}; expected "
                "a writable export directory", parameter="cache") from None
        return path


def _magnitude_ratio(residual: np.ndarray, previous: np.ndarray | None) -> float:
    """diffusers' calibration: the mean over tokens of the residual's norm over the earlier
    one's (1.0 at the first step)."""
    if previous is None:
        return 1.0
    current = np.linalg.norm(residual.astype(np.float32), axis=-1)
    before = np.linalg.norm(previous.astype(np.float32), axis=-1)
    return float((current / (before + np.float32(1e-8))).mean())


def nearest_ratios(ratios: np.ndarray, count: int) -> np.ndarray:
    """``ratios`` stretched to ``count`` steps by nearest neighbour (diffusers'
    ``nearest_interp``, rounding half to even in float32 as torch does)."""
    if len(ratios) == count:
        return ratios
    if count == 1:
        return ratios[-1:]
    scale = np.float32((len(ratios) - 1) / (count - 1))
    return ratios[np.round(np.arange(count, dtype=np.float32) * scale).astype(np.int64)]


def read_ratios(directory: Path, evaluations: int) -> np.ndarray:
    """The transformer's magnitude ratios (``RATIOS_FILE``) for ``evaluations`` steps."""
    path = Path(directory) / RATIOS_FILE
    if not path.is_file():
        raise SamplerInputError(
            f"magcache needs the transformer's magnitude ratios in {str(path)!r}, which is "
            f"missing; expected one run with cache {MAGCACHE}:{CALIBRATE} first (or the file "
            "written by hand: {\"ratios\": [one per step of one branch]})", parameter="cache")
    try:
        ratios = json.loads(path.read_text())["ratios"]
        array = np.asarray(ratios, dtype=np.float32)
        valid = array.ndim == 1 and len(array) > 0 and bool(np.isfinite(array).all())
    except (OSError, ValueError, TypeError, KeyError):
        valid = False
    if not valid:
        raise SamplerInputError(
            f"magnitude ratios in {str(path)!r} are not readable; expected JSON with "
            "\"ratios\": a non-empty list of finite numbers (re-run with cache "
            f"{MAGCACHE}:{CALIBRATE})", parameter="cache")
    return nearest_ratios(array, evaluations)


def _rows(array: np.ndarray, chosen: list[int], rows: int) -> np.ndarray:
    """The chosen rows of a batch input (a timestep of one row serves every row)."""
    if array.shape[0] != rows or len(chosen) == rows:
        return array
    return np.ascontiguousarray(array[chosen])


def check_block_outputs(manifest: ModelManifest, setting: StepCacheSetting | str) -> None:
    """Refuse a transformer export that cannot run in parts (made before its graph returned
    the block states)."""
    missing = [name for name in BLOCK_OUTPUTS if name not in manifest.output_names]
    if missing:
        raise SamplerInputError(
            f"{setting} runs the transformer in parts, but the export in "
            f"{str(manifest.directory)!r} has no block outputs ({', '.join(missing)}): it was "
            "made by an older numaov; expected a re-export", parameter="cache")


def check_cache_export(manifest: ModelManifest, text: str, evaluations: int = 1) -> None:
    """Before any work: ``manifest``'s transformer, which runs ``evaluations`` steps per
    branch, can run the cache ``text`` names (its block outputs; for MagCache, its magnitude
    ratios, or a writable directory to calibrate into)."""
    setting = StepCacheSetting.parse(text)
    check_block_outputs(manifest, setting)
    if setting.calibrate and not os.access(manifest.directory, os.W_OK):
        raise SamplerInputError(
            f"{setting} writes the measured ratios into {str(manifest.directory)!r}, which is "
            "not writable; expected a writable export directory", parameter="cache")
    if setting.kind == MAGCACHE and not setting.calibrate and evaluations:
        read_ratios(manifest.directory, 1)


def check_cache(text: str, backend: str) -> StepCacheSetting:
    """The setting ``text`` names, on a backend that can run it; one-line errors otherwise."""
    setting = StepCacheSetting.parse(text)
    if backend != "openvino":
        raise SamplerInputError(
            f"{setting} runs on the openvino backend (its graph parts); expected "
            f"backend openvino, not {backend}", parameter="cache")
    return setting


def open_cached_denoiser(manifest: ModelManifest, backend: str, text: str, evaluations: int,
                         config: dict[str, Any] | None = None) -> _GraphParts:
    """The step cache ``text`` names on ``manifest``'s transformer, which runs
    ``evaluations`` steps per branch."""
    setting = check_cache(text, backend)
    if setting.kind == MAGCACHE:
        return MagCacheDenoiser(manifest, setting, evaluations, config)
    return FirstBlockCacheDenoiser(manifest, setting, config)


def save_measured_ratios(denoisers: Sequence[Denoiser], request: WanSampleRequest,
                         ) -> list[Path]:
    """After a ``magcache:calibrate`` run of ``request``: each transformer's measured ratios
    written beside its manifest, with the run's settings (``MagCacheDenoiser.save_ratios``);
    nothing for any other run."""
    settings = {"steps": request.steps, "guidance": request.guidance,
                "sampler": request.sampler, "shift": request.shift,
                "size": [request.frames, request.height, request.width]}
    saved = [d.save_ratios(settings) for d in denoisers if isinstance(d, MagCacheDenoiser)]
    return [path for path in saved if path is not None]


__all__ = ["CACHE_KINDS", "DEFAULT_THRESHOLD", "FirstBlockCacheDenoiser", "MagCacheDenoiser",
           "RATIOS_FILE", "StepCacheSetting", "check_block_outputs", "check_cache",
           "check_cache_export",
           "nearest_ratios", "open_cached_denoiser", "read_ratios", "save_measured_ratios"]

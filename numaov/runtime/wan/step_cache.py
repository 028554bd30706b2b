"""Step caching for the Wan transformer: diffusers' First Block Cache on an exported graph.

diffusers' ``transformer.enable_cache(FirstBlockCacheConfig(threshold))`` runs the first
transformer block at every step and compares its residual (its output minus its input) with
the one of the last step that ran every block: when the mean absolute difference, relative
to the mean absolute value of that earlier residual, is at most ``threshold``, the other
blocks are skipped and their last residual (the last block's output minus the first block's)
is added to the first block's output instead; the output norm and projection run as always.
Each guidance branch keeps its own state (diffusers' ``cache_context("cond")`` /
``("uncond")``), and so does each transformer of a two-expert pipeline.

An export (``numaov export wan``) returns the token states into the first block, out of it and
out of the last (``BLOCK_OUTPUTS``) beside its sample, so the runtime compiles three parts of
one IR (``GraphPart``): the head (embedding and first block), the whole step (sample, first
and last block states) and the output head fed a last block state. A skipped evaluation then
costs the first block and the output head instead of every block. The parts share the IR
file; batched guidance rows that decide differently run as two calls of one row each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from numaov.models.wan import BLOCK_OUTPUTS
from numaov.runtime.manifest_reader import ModelManifest
from numaov.runtime.wan.denoisers import Denoiser
from numaov.runtime.wan.request import SamplerInputError

CACHE_KINDS = ("first-block",)
# diffusers' FirstBlockCacheConfig default.
DEFAULT_THRESHOLD = 0.05


@dataclass(frozen=True)
class StepCacheSetting:
    """``--cache first-block[:THRESHOLD]``: which cache and its threshold."""

    kind: str
    threshold: float

    @classmethod
    def parse(cls, text: str) -> StepCacheSetting:
        kind, _, value = str(text).partition(":")
        if kind not in CACHE_KINDS:
            raise SamplerInputError(
                f"step cache {text!r}; expected {' or '.join(CACHE_KINDS)}[:THRESHOLD], e.g. "
                f"first-block:{DEFAULT_THRESHOLD}", parameter="cache")
        try:
            threshold = float(value) if value else DEFAULT_THRESHOLD
        except ValueError:
            threshold = math.nan
        if not (math.isfinite(threshold) and threshold >= 0):
            raise SamplerInputError(
                f"step cache threshold {value!r} in {text!r}; expected a number >= 0 (diffusers' "
                f"default {DEFAULT_THRESHOLD}; higher skips more)", parameter="cache")
        return cls(kind, threshold)

    def __str__(self) -> str:
        return f"{self.kind}:{self.threshold:g}"


@dataclass
class _BranchState:
    """One guidance branch's cache (diffusers' ``FBCSharedBlockState``)."""

    head_residual: np.ndarray | None = None
    tail_residual: np.ndarray | None = None
    computed: list[bool] = field(default_factory=list)  # per evaluation: every block ran

    def should_compute(self, residual: np.ndarray, threshold: float) -> bool:
        if self.head_residual is None or self.tail_residual is None:
            return True
        previous = self.head_residual
        change = float(np.abs(residual - previous).mean()) / float(np.abs(previous).mean())
        return change > threshold


class FirstBlockCacheDenoiser(Denoiser):
    """An OpenVINO Wan transformer run as diffusers' First Block Cache runs one. Rows of a
    batch are guidance branches (row 0 conditional, row 1 unconditional), each with its own
    state, as in ``BatchedGuidance`` and ``GatheredGuidance``."""

    name = "openvino"

    def __init__(self, manifest: ModelManifest, setting: StepCacheSetting,
                 config: dict[str, Any] | None = None) -> None:
        from numaov.custom_ops.openvino_compile import GraphPart, WeightPages

        check_block_outputs(manifest, setting)
        # the IR's mapped weights, dropped after each part's first run has packed them
        self._weight_pages = WeightPages(manifest.rank(0).ir_xml.with_suffix(".bin"))
        self.setting = setting
        head = manifest.compile_rank(0, config, part=GraphPart(("embedded", "first_block")))
        self.attention = head.attention
        self._head = head.create_infer_request()
        self._whole = manifest.compile_rank(
            0, config, part=GraphPart(("sample", "first_block", "last_block"))
        ).create_infer_request()
        self._out = manifest.compile_rank(
            0, config, part=GraphPart(("sample",), feeds=("last_block",))
        ).create_infer_request()
        self._branches: list[_BranchState] = []

    @property
    def decisions(self) -> list[str]:
        """Per branch, per evaluation: "C" where every block ran, "." where they were
        skipped."""
        return ["".join("C" if c else "." for c in branch.computed) for branch in self._branches]

    def _run(self, request: Any, feeds: dict[str, np.ndarray], outputs: int) -> list[np.ndarray]:
        names = {name for port in request.model_inputs for name in port.get_names()}
        request.infer({name: array for name, array in feeds.items() if name in names})
        self._weight_pages.after_run(id(request))
        return [np.array(request.get_output_tensor(i).data, dtype=np.float32)
                for i in range(outputs)]

    def predict(self, hidden_states: np.ndarray, timestep: np.ndarray,
                text: np.ndarray) -> np.ndarray:
        rows = hidden_states.shape[0]
        while len(self._branches) < rows:
            self._branches.append(_BranchState())
        feeds = {"hidden_states": hidden_states, "timestep": timestep,
                 "encoder_hidden_states": text}
        embedded, first = self._run(self._head, feeds, 2)
        residual = first - embedded
        threshold = self.setting.threshold
        compute = [self._branches[r].should_compute(residual[r], threshold) for r in range(rows)]
        out: np.ndarray | None = None
        for decision in (True, False):
            chosen = [r for r in range(rows) if compute[r] == decision]
            if not chosen:
                continue
            part = {name: _rows(array, chosen, rows) for name, array in feeds.items()}
            if decision:
                sample, first_run, last = self._run(self._whole, part, 3)
                for k, r in enumerate(chosen):
                    branch = self._branches[r]
                    branch.head_residual = residual[r]
                    branch.tail_residual = last[k] - first_run[k]
            else:
                tails = np.stack([self._branches[r].tail_residual for r in chosen])
                part["last_block"] = first[chosen] + tails
                (sample,) = self._run(self._out, part, 1)
            if out is None:
                out = np.empty((rows, *sample.shape[1:]), np.float32)
            out[chosen] = sample
        for r in range(rows):
            self._branches[r].computed.append(compute[r])
        assert out is not None
        return out

    def close(self) -> None:
        self._head = self._whole = self._out = None


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


def check_cache(text: str, backend: str) -> StepCacheSetting:
    """The setting ``text`` names, on a backend that can run it; one-line errors otherwise."""
    setting = StepCacheSetting.parse(text)
    if backend != "openvino":
        raise SamplerInputError(
            f"{setting} runs on the openvino backend (its graph parts); expected "
            f"--backend openvino, not {backend}", parameter="cache")
    return setting


def open_cached_denoiser(manifest: ModelManifest, backend: str, text: str,
                         config: dict[str, Any] | None = None) -> FirstBlockCacheDenoiser:
    return FirstBlockCacheDenoiser(manifest, check_cache(text, backend), config)


__all__ = ["CACHE_KINDS", "DEFAULT_THRESHOLD", "FirstBlockCacheDenoiser", "StepCacheSetting",
           "check_block_outputs", "check_cache", "open_cached_denoiser"]

"""`numaov bench`: the backends side by side on an exported model, on this machine.

- ``bench_wan``: one transformer forward at a chosen video size, every backend once per round,
  round-robin (so load from other processes hits them alike); best and median seconds per
  backend, speed-up against the first backend listed, and each backend's largest difference
  from the first one's output (relative to its largest magnitude).
- ``bench_lm``: greedy generation of a batch of seeded random prompts (each its full
  length) with each backend on the LM engine's long-lived rank workers (``numaov serve``'s),
  after a warm-up generation: prefill and decode time per step of the fastest round, tokens/s, and whether the
  backends generated the same tokens.

Model loading and compiling are not timed. The repository's ``benchmarks/`` compare numaov
against other systems; this command measures an exported model where it will run.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from numaov import NumaovError
from numaov.runtime.comparison import max_rel_error
from numaov.runtime.manifest_reader import read_manifest
from numaov.runtime.placement.binding import check_bind_string

SEED = 0


class BenchInputError(NumaovError):
    """A bench request that cannot run (size, backend list, rounds)."""


@dataclass
class BenchRow:
    backend: str
    seconds: list[float] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return float(np.median(self.seconds))


@dataclass
class BenchReport:
    """Rows in the order the backends were given; the first is the baseline of the ratios."""

    what: str
    rows: list[BenchRow]
    notes: list[str] = field(default_factory=list)
    # The request as data (sizes, rounds), for the JSON.
    settings: dict[str, Any] = field(default_factory=dict)

    def speedup(self, row: BenchRow) -> float:
        return self.rows[0].best / row.best

    def summary(self) -> str:
        lines = [self.what]
        for row in self.rows:
            extra = "".join(f"  {k} {v}" for k, v in row.figures.items())
            lines.append(f"  {row.backend:12s} best {row.best:9.4f} s  median {row.median:9.4f} s"
                         f"  x{self.speedup(row):5.2f} vs {self.rows[0].backend}{extra}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "what": self.what,
            "settings": self.settings,
            "baseline": self.rows[0].backend,
            "rows": [{"backend": r.backend, "best_s": r.best, "median_s": r.median,
                      "seconds": r.seconds, "speedup_vs_baseline": self.speedup(r), **r.figures}
                     for r in self.rows],
            "notes": self.notes,
        }


def _check_backends(backends: Sequence[str], known: Sequence[str]) -> list[str]:
    chosen = [b.strip() for b in backends]
    unknown = [b for b in chosen if b not in known]
    if not chosen or unknown or len(set(chosen)) != len(chosen):
        problem = (f"unknown backend(s) {', '.join(map(repr, unknown))}" if unknown
                   else "a backend is named twice" if chosen else "no backend given")
        raise BenchInputError(
            f"backends {','.join(chosen)!r}: {problem}; expected distinct names from "
            f"{', '.join(known)}", parameter="backends")
    return chosen


def _check_positive(**values: Any) -> None:
    """Each value a positive integer; the keyword is the parameter's name."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BenchInputError(f"{name}={value!r}; expected a positive integer",
                                  parameter=name)


def bench_wan(model_dir: str | Path, frames: int, height: int, width: int,
              backends: Sequence[str] = ("torch", "openvino"), *, rounds: int = 3,
              batch: int = 2, text_length: int = 64, progress: Any = None) -> BenchReport:
    """One Wan forward per backend and round at ``frames`` x ``height`` x ``width`` pixels
    (batch 2 = a guidance pair by default)."""
    from numaov.runtime.wan.denoisers import BACKENDS, open_denoiser
    from numaov.runtime.wan.request import latent_shape, video_tokens

    report = progress or (lambda _msg: None)
    chosen = _check_backends(backends, BACKENDS)
    _check_positive(rounds=rounds, batch=batch, text_length=text_length)
    check_bind_string("the Wan benchmark")
    manifest = read_manifest(model_dir, expected_kind="wan")
    # Checked before anything loads (NUMAOV_ATTENTION), and reported with the figures.
    attention = manifest.attention_kernel() if "openvino" in chosen else None
    config = manifest.config
    shape = (batch, *latent_shape(config, frames, height, width)[1:])
    rng = np.random.default_rng(SEED)
    hidden = rng.standard_normal(shape, dtype=np.float32)
    timestep = np.full((batch,) if manifest.timestep != "per-frame" else (batch, shape[2]),
                       700.0, dtype=np.float32)
    text = rng.standard_normal((batch, text_length, int(config["text_dim"])), dtype=np.float32)
    tokens = video_tokens(config, shape)
    what = (f"Wan forward, latents {list(shape)} ({tokens} video token"
            f"{'' if tokens == 1 else 's'} per sample), text "
            f"{text_length} tokens, {manifest.precision} export, best of {rounds} round(s)"
            + (f", OpenVINO attention: {attention}'s" if attention else ""))
    denoisers = {}
    try:
        for backend in chosen:
            report(f"loading {backend}")
            denoisers[backend] = open_denoiser(manifest, backend)
        rows = {b: BenchRow(b) for b in chosen}
        outputs: dict[str, np.ndarray] = {}
        for backend, denoiser in denoisers.items():  # warm-up: first-run allocations
            outputs[backend] = denoiser.predict(hidden, timestep, text)
        for i in range(rounds):
            for backend, denoiser in denoisers.items():
                start = time.perf_counter()
                denoiser.predict(hidden, timestep, text)
                rows[backend].seconds.append(time.perf_counter() - start)
            report(f"round {i + 1}/{rounds}: " + ", ".join(
                f"{b} {rows[b].seconds[-1]:.3f} s" for b in chosen))
    finally:
        for denoiser in denoisers.values():
            denoiser.close()
    for backend in chosen[1:]:
        rows[backend].figures["max_rel_diff"] = float(
            f"{max_rel_error(outputs[backend], outputs[chosen[0]]):.3g}")
    settings = {"frames": frames, "height": height, "width": width, "batch": batch,
                "text_length": text_length, "rounds": rounds, "latents": list(shape),
                "video_tokens_per_sample": tokens, "precision": manifest.precision}
    if attention:
        settings["openvino_attention"] = attention
    return BenchReport(what, [rows[b] for b in chosen], settings=settings)


def bench_lm(model_dir: str | Path, backends: Sequence[str] = ("torch", "openvino"), *,
                   batch: int = 4, prompt_length: int = 32, max_new_tokens: int = 8,
                   rounds: int = 2, progress: Any = None) -> BenchReport:
    """Greedy generation of ``batch`` seeded prompts per backend on long-lived rank workers
    (``numaov serve``'s): one untimed warm-up generation, then ``rounds`` timed ones. The
    backends run one after the other, so only one backend's workers hold the model at a
    time."""
    from numaov.runtime.lm.engine import BACKENDS, SamplingParams, open_lm_manifest
    from numaov.runtime.service.lm_service import LMService

    if "onnxruntime" in [b.strip() for b in backends]:
        raise BenchInputError("onnxruntime cannot run the LM rank graphs (they hold "
                              f"numaov.moe and numaov.collective nodes); expected backends from "
                              f"{', '.join(BACKENDS)}", parameter="backends")
    chosen = _check_backends(backends, BACKENDS)
    _check_positive(rounds=rounds, batch=batch, prompt_length=prompt_length,
                    max_new_tokens=max_new_tokens)
    manifest = open_lm_manifest(model_dir, chosen[0])
    vocab = int(manifest.config["vocab_size"])
    rng = np.random.default_rng(SEED)
    prompts = rng.integers(0, vocab, size=(batch, prompt_length)).tolist()
    rows = {b: BenchRow(b) for b in chosen}
    tokens: dict[str, list[list[int]]] = {}
    # every prompt runs its full length, end-of-sequence tokens or not
    params = SamplingParams(max_new_tokens, ignore_eos=True)
    for backend in chosen:
        with LMService(model_dir, backend, progress=progress) as service:
            tokens[backend] = service.generate(prompts, max_new_tokens, params).tokens  # warm-up
            results = [service.generate(prompts, max_new_tokens, params) for _ in range(rounds)]
        row = rows[backend]
        row.seconds = [sum(r.step_seconds) for r in results]
        fastest = min(results, key=lambda r: sum(r.step_seconds))
        row.figures["prefill_ms"] = round(fastest.prefill_seconds * 1e3, 2)
        if fastest.decode_seconds:
            row.figures["decode_ms_per_step"] = round(
                float(np.median(fastest.decode_seconds)) * 1e3, 2)
        row.figures["tokens_per_s"] = round(batch * max_new_tokens / row.best, 1)
    what = (f"{manifest.record.family} generation, {batch} prompt(s) x {prompt_length} tokens + "
            f"{max_new_tokens} new, dp={manifest.world_size}, {manifest.precision} export, "
            f"best of {rounds} round(s) after a warm-up (time = prefill + all decode steps, "
            "figures from the fastest round)")
    notes = []
    for backend in chosen[1:]:
        same = tokens[backend] == tokens[chosen[0]]
        rows[backend].figures["same_tokens"] = same
        if not same:
            notes.append(f"{backend} generated other tokens than {chosen[0]} (near-tied logits "
                         "at this precision can do that; compare with `numaov export`'s parity)")
    settings = {"batch": batch, "prompt_length": prompt_length,
                "max_new_tokens": max_new_tokens, "rounds": rounds,
                "dp": manifest.world_size, "precision": manifest.precision}
    return BenchReport(what, [rows[b] for b in chosen], notes, settings)

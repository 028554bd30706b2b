"""The tiny builtin Wan exported once per session for the Wan export, sampler, denoiser,
CLI and bench tests (test_wan_{export,sampler,denoisers,cli,bench}.py), and their helpers.

``conftest.py`` turns ``export_tiny_wan`` and ``export_per_frame`` into the session fixtures
``wan`` and ``ti2v``; ``sample_latents`` keeps each (backend, workers) sample in them, so a
sample one test made is reused by the others.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from numaov.models.builtin import build_tiny_wan
from numaov.runtime.wan.request import WanSampleRequest
from numaov.runtime.wan.sampler import run_wan

SEED = 7
# The tiny model is 2 blocks of width 96; a clip of 5 frames at 32x48 pixels is 2 latent
# frames of 4x6 latents, i.e. 2 x 2 x 3 = 12 tokens: a different shape on every axis from
# the export example (3 x 4 x 5 patches) and from the export's parity shapes.
REQUEST = WanSampleRequest(frames=5, height=32, width=48, steps=3, guidance=5.0, seed=SEED,
                           shift=5.0)
# Image-to-video: 9 frames are 3 latent frames, the conditioned frame 0 and two at timestep
# t, so a per-frame graph that used one frame's timestep for all of them would show.
TI2V_REQUEST = dataclasses.replace(REQUEST, frames=9)
TEXT_LENGTH = 12
# Backends compute the same f32 math in different orders; per forward that is ~1e-6 of the
# output scale (the export's own parity figures), and three Euler steps add three such
# errors scaled by |dt| < 1. 1e-4 of the latents' scale leaves a wide margin, while a wrong
# schedule, guidance or batch layout changes the latents by O(1).
F32_SAMPLE_TOL = 1e-4
CLI = [sys.executable, "-m", "numaov.cli"]


def rel_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def export_tiny_wan(root: Path) -> dict:
    """The tiny Wan exported into ``root`` (f32, through the CLI), plus text embedding files."""
    print(f"seed {SEED}")
    checkpoint = build_tiny_wan(root / "checkpoint", seed=SEED)
    model_dir = root / "model"
    proc = subprocess.run(
        [*CLI, "export", "wan", "--checkpoint", str(checkpoint), "--out", str(model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rng = np.random.default_rng(SEED)
    text_dim = json.loads((checkpoint / "config.json").read_text())["text_dim"]
    text = root / "text.npy"
    np.save(text, rng.standard_normal((1, TEXT_LENGTH, text_dim), dtype=np.float32))
    negative = root / "negative.npy"
    np.save(negative, 0.1 * rng.standard_normal((TEXT_LENGTH, text_dim), dtype=np.float32))
    return {
        "root": root,
        "checkpoint": checkpoint,
        "model_dir": model_dir,
        "text": text,
        "negative": negative,
        "export": proc,
        "results": {},
    }


def export_per_frame(wan: dict) -> dict:
    """The same checkpoint exported with --timestep per-frame, and first-frame latents."""
    model_dir = wan["root"] / "model_per_frame"
    code, out, err = cli_in_process(
        "export", "wan", "--checkpoint", str(wan["checkpoint"]), "--out", str(model_dir),
        "--timestep", "per-frame",
    )  # fmt: skip
    assert code == 0, err
    first_frame = wan["root"] / "first_frame.npy"
    # [C, 1, H/8, W/8] for TI2V_REQUEST's 32x48 pixels, the layout without a batch axis.
    rng = np.random.default_rng(SEED + 2)
    np.save(first_frame, rng.standard_normal((16, 1, 4, 6), dtype=np.float32))
    return {"model_dir": model_dir, "first_frame": first_frame, "stdout": out, "results": {}}


def sample_latents(wan: dict, backend: str, workers: int = 1,
                   ti2v: dict | None = None) -> np.ndarray:
    """Sample once per (backend, workers) and keep it for the other tests; with ``ti2v``, on
    the per-frame model at TI2V_REQUEST, conditioned on its first-frame latents."""
    store = wan if ti2v is None else ti2v
    key = (backend, workers)
    if key not in store["results"]:
        result = run_wan(
            store["model_dir"],
            REQUEST if ti2v is None else TI2V_REQUEST,
            wan["text"],
            None,
            negative_embeddings=wan["negative"],
            first_frame_latents=None if ti2v is None else ti2v["first_frame"],
            backend=backend,
            workers=workers,
        )
        frames = 2 if ti2v is None else 3
        assert result.latents.shape == (1, 16, frames, 4, 6) and len(result.step_seconds) == 3
        store["results"][key] = result.latents
    return store["results"][key]


def run_cli(wan: dict, out: Path, frames: int, *extra: str) -> subprocess.CompletedProcess:
    """`numaov run wan` on the tiny model at REQUEST's size, steps, guidance and seed."""
    args = {
        "--model-dir": wan["model_dir"], "--frames": frames, "--height": REQUEST.height,
        "--width": REQUEST.width, "--steps": REQUEST.steps, "--guidance": REQUEST.guidance,
        "--seed": REQUEST.seed, "--text-embeddings": wan["text"], "--out": out,
    }  # fmt: skip
    command = [*CLI, "run", "wan", *(str(x) for item in args.items() for x in item), *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def cli_in_process(*argv: str) -> tuple[int, str, str]:
    """`numaov ...` in this process (no interpreter start-up): exit code, stdout, stderr."""
    import contextlib
    import io

    from numaov.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse's own refusals exit
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def cli_refusal(*argv: str) -> subprocess.CompletedProcess:
    """``cli_in_process`` as a finished process, for ``one_line_error``: a refusal needs no
    interpreter of its own (each costs seconds of start-up)."""
    code, out, err = cli_in_process(*argv)
    return subprocess.CompletedProcess(list(argv), code, out, err)

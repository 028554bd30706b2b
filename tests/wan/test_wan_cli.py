"""`numaov run wan` on the tiny builtin Wan: the latents it writes, first-frame latents,
and one-line errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.wan_harness import (
    REQUEST,
    TI2V_REQUEST,
    cli_in_process,
    rel_error,
    run_cli,
    sample_latents,
)

pytestmark = pytest.mark.slow  # exports the tiny Wan (wan_harness) and runs the CLI on it


def test_cli_run_writes_the_latents(wan: dict) -> None:
    out = wan["root"] / "latents.npy"
    proc = run_cli(
        wan, out, REQUEST.frames, "--negative-embeddings", str(wan["negative"]), "--quiet"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # --quiet: no progress
    assert proc.stdout.startswith(f"wrote {out}: latents [1, 16, 2, 4, 6] from 3 steps on openvino")
    # Same compiled model, same inputs, same threads' worth of work: OpenVINO f32 is
    # deterministic here, but allow f32 noise in case the CPU plugin picks other kernels.
    assert rel_error(np.load(out), sample_latents(wan, "openvino")) < 1e-6


def test_truncated_ir_is_one_line_naming_the_file(wan: dict, tmp_path: Path) -> None:
    import shutil

    moved = {**wan, "model_dir": tmp_path / "model"}
    shutil.copytree(wan["model_dir"], moved["model_dir"])
    bin_path = moved["model_dir"] / "model.bin"
    size = bin_path.stat().st_size
    bin_path.write_bytes(bin_path.read_bytes()[: size // 2])  # a copy cut off half-way
    for workers in ("1", "2"):
        proc = run_cli(moved, tmp_path / "x.npy", REQUEST.frames, "--workers", workers,
                        "--quiet")
        # Two workers on a one-node machine also get the warning that the CPUs are split.
        lines = [line for line in proc.stderr.strip().splitlines()
                 if not line.startswith("WARNING numaov.runtime.placement.binding")]
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr
        assert f"model.bin' is {size // 2:,} bytes; the export wrote {size:,} bytes" in lines[0]
    assert not (tmp_path / "x.npy").exists()


def test_cli_errors_are_one_line(wan: dict) -> None:
    proc = run_cli(wan, wan["root"] / "x.npy", 6)
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0
    assert "frames=6; expected 4k+1 video frames" in proc.stderr


def test_cli_run_with_first_frame_latents(wan: dict, ti2v: dict) -> None:
    out = wan["root"] / "ti2v_latents.npy"
    args = {
        "--model-dir": ti2v["model_dir"], "--frames": TI2V_REQUEST.frames,
        "--height": TI2V_REQUEST.height, "--width": TI2V_REQUEST.width,
        "--steps": TI2V_REQUEST.steps, "--guidance": TI2V_REQUEST.guidance,
        "--seed": TI2V_REQUEST.seed, "--text-embeddings": wan["text"],
        "--negative-embeddings": wan["negative"], "--first-frame-latents": ti2v["first_frame"],
        "--out": out,
    }  # fmt: skip
    code, stdout, err = cli_in_process(
        "run", "wan", *(str(x) for item in args.items() for x in item), "--quiet"
    )
    assert code == 0, err
    assert stdout.startswith(f"wrote {out}: latents [1, 16, 3, 4, 6] from 3 steps on openvino")
    # The same computation as the library call on the same compiled graph: f32 noise at most.
    assert rel_error(np.load(out), sample_latents(wan, "openvino", ti2v=ti2v)) < 1e-6

    # A scalar-timestep model refuses the conditioning with one line.
    args["--model-dir"] = wan["model_dir"]
    code, _, err = cli_in_process("run", "wan", *(str(x) for i in args.items() for x in i))
    assert code == 1 and err.strip().count("\n") == 0
    assert ("--first-frame-latents: first-frame latents need a model exported with per-frame "
            "timesteps") in err

"""`numaov bench wan` on the tiny builtin Wan: every backend timed and compared, and
one-line errors for bad arguments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.wan_harness import cli_in_process

pytestmark = pytest.mark.slow  # exports the tiny Wan (wan_harness) and benchmarks it


@pytest.mark.parametrize("export", ["wan", "ti2v"])
def test_bench_wan_times_every_backend_and_compares_outputs(
    export: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    model_dir = request.getfixturevalue(export)["model_dir"]  # scalar / per-frame timestep
    out = tmp_path / "bench.json"
    code, stdout, err = cli_in_process(
        "bench", "wan", "--model-dir", str(model_dir), "--frames", "5", "--height", "32",
        "--width", "48", "--backends", "torch,openvino,onnxruntime", "--rounds", "2",
        "--json", str(out), "--quiet",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out.read_text())
    assert report["baseline"] == "torch"
    assert [r["backend"] for r in report["rows"]] == ["torch", "openvino", "onnxruntime"]
    # latents [2, C, 2, 4, 6] with patch (1, 2, 2): 2 x 2 x 3 = 12 video tokens per sample
    assert "latents [2, 16, 2, 4, 6] (12 video tokens per sample)" in report["what"]
    for row in report["rows"]:
        assert len(row["seconds"]) == 2 and row["best_s"] == min(row["seconds"])
        assert row["speedup_vs_baseline"] == pytest.approx(
            report["rows"][0]["best_s"] / row["best_s"])
    # f32 everywhere: the backends agree to float32 rounding (the export's f32 tolerance)
    assert all(r["max_rel_diff"] < 1e-4 for r in report["rows"][1:])
    assert report["settings"]["openvino_attention"] == "openvino"  # an f32 export keeps its own
    assert "x 1.00 vs torch" in stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--frames", "4"], "frames=4; expected 4k+1 video frames"),
    (["--backends", "torch,tensorrt"], "expected distinct names from openvino, onnxruntime"),
    (["--rounds", "0"], "--rounds: rounds=0; expected a positive integer"),
])
def test_bench_wan_bad_arguments_are_one_line_errors(wan: dict, args: list[str],
                                                     message: str) -> None:
    base = {"--frames": "5", "--height": "32", "--width": "48"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    code, _, err = cli_in_process("bench", "wan", "--model-dir", str(wan["model_dir"]),
                                   *[x for kv in base.items() for x in kv], "--quiet")
    assert code != 0 and message in err and "Traceback" not in err

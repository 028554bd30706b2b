"""The `numaov` command line: bind strings checked whenever set and named by entry, one
binding rule for every command, library errors shown with the flag of their parameter,
choices taken from the library, and worker errors as one line. The usage errors, the bind
checks of `bench wan` and the workers run the real command (a subprocess each); the
parametrized variants of a rule run its `main` in this process (`numaov_here`), which prints
and exits the same way without an interpreter's start-up each."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from numaov.console import QUIET_ENVIRONMENT, ProgressLine
from numaov.manifest import LOWERINGS
from numaov.runtime.lm import engine as lm_engine
from numaov.runtime.placement.topology import read_topology
from numaov.runtime.wan import denoisers as wan_denoisers

CLI = [sys.executable, "-m", "numaov.cli"]
TIMEOUT_S = 300
# A CPU id this machine does not have.
ABSENT_CPU = read_topology().online_cpus[-1] + 1


def numaov(*args: str, bind: str | None = None, **env: str) -> subprocess.CompletedProcess:
    """`numaov ARGS` with NUMAOV_CPU_BIND set to `bind` (None: unset) and `env` added."""
    environ = {k: v for k, v in os.environ.items() if k != "NUMAOV_CPU_BIND"}
    if bind is not None:
        environ["NUMAOV_CPU_BIND"] = bind
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=TIMEOUT_S,
                          env={**environ, **env})


def numaov_here(*args: str, bind: str | None = None) -> subprocess.CompletedProcess:
    """`numaov ARGS` run by `numaov.cli.main` in this process, NUMAOV_CPU_BIND set to `bind`
    (None: unset) while it runs; the result as a finished process."""
    from support.wan_harness import cli_in_process

    saved = os.environ.pop("NUMAOV_CPU_BIND", None)
    if bind is not None:
        os.environ["NUMAOV_CPU_BIND"] = bind
    try:
        code, out, err = cli_in_process(*args)
    finally:
        os.environ.pop("NUMAOV_CPU_BIND", None)
        if saved is not None:
            os.environ["NUMAOV_CPU_BIND"] = saved
    return subprocess.CompletedProcess(list(args), code, out, err)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The single `numaov: error:` line of a failed command (exit code 1, no traceback)."""
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("numaov: error: "), proc.stderr
    return lines[0]


def run_wan(model_dir: str | Path, *extra: str, text: str | Path = "text.npy",
            out: str | Path = "out.npy", bind: str | None = None, here: bool = False,
            **env: str) -> subprocess.CompletedProcess:
    """`numaov run wan` on small settings; ``here``: in this process (``numaov_here``)."""
    args = ("run", "wan", "--model-dir", str(model_dir), "--frames", "5", "--height", "32",
            "--width", "32", "--steps", "2", "--guidance", "5", "--seed", "0",
            "--text-embeddings", str(text), "--out", str(out), "--quiet", *extra)
    return numaov_here(*args, bind=bind) if here else numaov(*args, bind=bind, **env)


# -- bind strings: checked whenever set, before any file is read, the bad entry named ---------


@pytest.mark.parametrize(("bind", "message"), [
    (str(ABSENT_CPU), rf"entry 0 \('{ABSENT_CPU}'\): CPU {ABSENT_CPU} is not an online CPU of "
                      r"this machine; expected CPUs from \S+"),
    ("a-b", r"entry 0 \('a-b'\): 'a-b' is not a CPU id or a range of them; expected CPU ids "
            "and ranges"),
])
@pytest.mark.parametrize("workers", ["1", "2"])
def test_run_wan_names_the_bad_bind_entry(tmp_path: Path, bind: str, message: str,
                                          workers: str) -> None:
    # The model directory does not exist: the bind string is checked first.
    line = one_error_line(run_wan(tmp_path / "missing", "--workers", workers, bind=bind,
                                  here=True))
    assert re.search(f"NUMAOV_CPU_BIND {message}", line), line
    assert "CPU list(s)" not in line  # not the entry count


def test_bench_wan_checks_a_bind_string_it_does_not_use(tmp_path: Path) -> None:
    cpu = sorted(os.sched_getaffinity(0))[0]
    line = one_error_line(numaov("bench", "wan", "--model-dir", str(tmp_path / "missing"),
                                 "--frames", "5", "--height", "32", "--width", "32",
                                 bind=f"{cpu}|a-b"))
    assert "NUMAOV_CPU_BIND entry 1 ('a-b'): 'a-b' is not a CPU id" in line


def test_the_entry_count_is_its_own_message(tmp_path: Path) -> None:
    cpu = sorted(os.sched_getaffinity(0))[0]
    line = one_error_line(run_wan(tmp_path / "missing", "--workers", "2", bind=str(cpu)))
    assert f"NUMAOV_CPU_BIND='{cpu}' has 1 CPU list(s) but 2 rank(s) were asked for" in line


# -- library errors carry their parameter; the CLI names its flag --------------------------


@pytest.mark.parametrize(("args", "line"), [
    (["bench", "wan", "--model-dir", "m", "--frames", "5", "--height", "32", "--width", "32",
      "--rounds", "0"], "numaov: error: --rounds: rounds=0; expected a positive integer"),
    (["bench", "deepseek", "--model-dir", "m", "--backends", "torch,onnxruntime"],
     "numaov: error: --backends: onnxruntime cannot run the LM rank graphs"),
    (["run", "deepseek", "--model-dir", "m", "--max-new-tokens", "2", "--prompt-ids", "1;;2"],
     "numaov: error: --prompt-ids: prompt ids '1;;2': prompt 1 is empty"),
    (["run", "deepseek", "--model-dir", "m", "--max-new-tokens", "2", "--tokenizer",
      "no-such-dir", "--prompt", "hi"],
     "numaov: error: --tokenizer: tokenizer 'no-such-dir' is not a directory"),
    (["run", "lm", "--model-dir", "no-such-model", "--max-new-tokens", "2", "--prompt", "hi"],
     "numaov: error: model directory 'no-such-model' does not exist"),
])
def test_library_errors_are_shown_with_the_flag_of_their_parameter(
    tmp_path: Path, args: list[str], line: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    proc = numaov_here(*args)
    assert one_error_line(proc).startswith(line), proc.stderr


# -- choices from the library's tuples ------------------------------------------------------


@pytest.mark.parametrize(("args", "names"), [
    (["run", "wan", "--backend", "tensorrt"], wan_denoisers.BACKENDS),
    (["run", "deepseek", "--backend", "onnxruntime"], lm_engine.BACKENDS),
    (["serve", "--backend", "tensorrt"], lm_engine.BACKENDS),
    (["export", "wan", "--ops", "opset99"], LOWERINGS),
])
def test_choices_are_the_library_tuples(args: list[str], names: tuple[str, ...]) -> None:
    proc = numaov_here(*args)
    line = one_error_line(proc)  # one line and exit code 1, as every other error
    assert f"(choose from {', '.join(map(repr, names))})" in line, proc.stderr


@pytest.mark.parametrize("args", [[], ["export"], ["run", "lm"], ["run", "mamba"]])
def test_usage_errors_are_one_line_and_exit_1(args: list[str]) -> None:
    line = one_error_line(numaov(*args))
    assert line.startswith("numaov: error: ") and "usage:" not in line


@pytest.mark.parametrize(("command", "backends"), [
    ("wan", wan_denoisers.BACKENDS), ("deepseek", lm_engine.BACKENDS)])
def test_bench_backends_help_lists_the_library_tuple(command: str,
                                                     backends: tuple[str, ...]) -> None:
    proc = numaov_here("bench", command, "--help")
    assert proc.returncode == 0
    assert f"comma-separated from {', '.join(backends)}" in " ".join(proc.stdout.split())


@pytest.mark.parametrize("model", ["wan", "deepseek"])
def test_export_takes_force(model: str) -> None:
    proc = numaov_here("export", model, "--help")
    assert proc.returncode == 0
    assert "replace an existing --out that is not a numaov export" in " ".join(
        proc.stdout.split())


# -- on an exported model: the binding rule and errors inside workers -----------------------


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny builtin Wan exported (f32), and zero text embeddings."""
    from numaov.exporter.wan_export import export_wan
    from numaov.models.builtin import build_tiny_wan

    root = tmp_path_factory.mktemp("tiny_wan")
    model_dir = root / "model"
    export_wan(build_tiny_wan(root / "checkpoint", seed=0), model_dir)
    text_dim = json.loads((model_dir / "manifest.json").read_text())["config"]["text_dim"]
    np.save(root / "text.npy", np.zeros((4, text_dim), dtype=np.float32))
    return {"root": root, "model_dir": model_dir, "text": root / "text.npy"}


@pytest.mark.slow  # exports the tiny Wan, spawns workers
def test_two_workers_without_a_bind_string_follow_the_binding_rule(tiny_wan) -> None:
    out = tiny_wan["root"] / "rule.npy"
    proc = run_wan(tiny_wan["model_dir"], "--workers", "2", text=tiny_wan["text"], out=out)
    assert proc.returncode == 0, proc.stderr
    assert "with 2 worker(s)" in proc.stdout and out.is_file()
    splits = len(read_topology().usable_nodes()) < 2
    # Fewer NUMA nodes than ranks: the allowed CPUs are split, and stderr says so.
    assert ("the allowed CPUs are split between the ranks" in proc.stderr) == splits, proc.stderr


@pytest.mark.slow  # exports the tiny Wan, spawns workers
def test_one_worker_says_a_valid_bind_string_does_not_apply(tiny_wan) -> None:
    cpu = sorted(os.sched_getaffinity(0))[0]
    proc = run_wan(tiny_wan["model_dir"], text=tiny_wan["text"],
                   out=tiny_wan["root"] / "one.npy", bind=str(cpu))
    assert proc.returncode == 0, proc.stderr
    assert f"not pinned: NUMAOV_CPU_BIND='{cpu}' applies to worker processes only" in proc.stderr


@pytest.mark.slow  # exports the tiny Wan, spawns workers
def test_an_error_inside_a_worker_is_one_line(tiny_wan, two_cpus) -> None:
    # NUMAOV_ATTENTION is read where the graph is compiled: in each worker process.
    proc = run_wan(tiny_wan["model_dir"], "--workers", "2", text=tiny_wan["text"],
                   out=tiny_wan["root"] / "never.npy", bind=f"{two_cpus[0]}|{two_cpus[1]}",
                   NUMAOV_ATTENTION="flash")
    line = one_error_line(proc)
    assert re.fullmatch(r"numaov: error: rank \d failed: NUMAOV_ATTENTION='flash' is not a "
                        r"known setting.*", line), line
    assert not (tiny_wan["root"] / "never.npy").exists()


# -- what the terminal shows: one progress line per phase, no other library's noise ---------


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_phase_is_one_line_rewritten_in_place_on_a_terminal() -> None:
    stream = FakeTerminal()
    with ProgressLine(stream).phase("tiny-moe: export") as phase:
        phase("translating to ONNX")
        phase("parity check\non openvino")  # a newline would break the rewrite
        phase.finish("exported to out")
    text = stream.getvalue()
    # Each message rewrites the line; only the outcome ends it.
    assert text.count("\n") == 1 and text.endswith("\n"), repr(text)
    assert re.fullmatch(
        r"(\r\x1b\[K[^\r\n]*){3}\r\x1b\[Knumaov: tiny-moe: export: exported to out \(\d+\.\d s\)\n",
        text), repr(text)
    assert "\r\x1b[Knumaov: tiny-moe: export: parity check on openvino" in text


def test_a_phase_is_one_plain_line_elsewhere_and_nothing_when_quiet() -> None:
    stream = io.StringIO()
    line = ProgressLine(stream)
    for name in ("one", "two"):
        with line.phase(name) as phase:
            phase("news")
    assert re.fullmatch(r"numaov: one: done \(\d+\.\d s\)\nnumaov: two: done \(\d+\.\d s\)\n",
                        stream.getvalue()), repr(stream.getvalue())
    with pytest.raises(ValueError), ProgressLine(stream).phase("three"):
        raise ValueError("boom")
    assert re.search(r"numaov: three: failed after \d+\.\d s\n$", stream.getvalue())
    with ProgressLine(None).phase("quiet") as phase:
        phase("news")  # --quiet: no stream, nothing to write to


# What the first `make demo` showed: diffusers' advice, transformers' weight-loading bar.
LIBRARY_NOISE = """
import warnings
from transformers.utils import logging
logging.get_logger("transformers.modeling_utils").warning("Cannot initialize model (noise)")
for _ in logging.tqdm(range(3), desc="Loading weights"):
    pass
warnings.warn_explicit("noise", UserWarning, "x.py", 1, module="diffusers.models")
"""


@pytest.mark.parametrize("log_level", ["WARNING", "DEBUG"])
def test_library_noise_is_silenced_unless_debugging(log_level: str) -> None:
    environ = {k: v for k, v in os.environ.items() if k not in QUIET_ENVIRONMENT}
    setup = ("import logging; from numaov.console import quiet_libraries; "  # as cli.main()
             f"logging.basicConfig(level={log_level!r}); quiet_libraries({log_level!r})")
    proc = subprocess.run([sys.executable, "-c", setup + LIBRARY_NOISE], capture_output=True,
                          text=True, timeout=TIMEOUT_S, env=environ)
    assert proc.returncode == 0, proc.stderr
    if log_level == "DEBUG":  # the noise is there to silence
        assert "Cannot initialize" in proc.stderr and "Loading weights" in proc.stderr
        assert "noise" in proc.stderr.replace("Cannot initialize model (noise)", "")
    else:
        assert proc.stderr == ""


# NNCF writes its bit-width table and progress bar to stdout, where the command's results go.
NNCF_NOISE = """
import numpy as np
import openvino as ov
import openvino.opset13 as ops
from numaov.exporter.weight_formats import compress_other_weights
x = ops.parameter([1, 64], np.float32)
weight = ops.constant(np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32))
model = ov.Model([ops.matmul(x, weight, False, True)], [x])
compress_other_weights(model, "int8", None, None)
assert any(op.get_type_name() == "Constant" and op.get_element_type() == ov.Type.i8
           for op in model.get_ordered_ops())
"""


@pytest.mark.parametrize("log_level", ["WARNING", "DEBUG"])
def test_nncf_compresses_without_writing_to_stdout_and_speaks_when_debugging(log_level: str) -> None:
    setup = f"import logging; logging.basicConfig(level={log_level!r})\n"
    proc = subprocess.run([sys.executable, "-c", setup + NNCF_NOISE], capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "", proc.stdout
    if log_level == "DEBUG":  # the noise is there to silence: on stderr, with the log
        assert "Weight compression mode" in proc.stderr

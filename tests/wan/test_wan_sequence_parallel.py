"""One video across workers by token shares (Ulysses sequence parallelism): the split model in
eager rank processes against the unsplit one, its export with ``--sequence-parallel``, and
``run wan --workers N --parallel sequence|both`` against one worker, with the refusals and a
killed worker."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from support.collectives_harness import shm_leftovers
from support.wan_harness import F32_SAMPLE_TOL, cli_in_process, cli_refusal, rel_error
from support.wan_pipeline_harness import one_line_error

from numaov.distributed.rank_group import run_rank_group
from numaov.models.builtin.wan_tiny import TINY_WAN_CONFIG, build_tiny_wan
from numaov.models.wan import SEQUENCE_GROUP
from numaov.models.wan.sequence_parallel import SequenceSplitError, token_share
from numaov.models.wan.transformer import WanInputError, WanTransformer

pytestmark = pytest.mark.slow  # exports and runs rank processes

# 6 heads: shares of 2, 3 and 6 ranks; 4 and 5 are refused.
CONFIG = dataclasses.replace(TINY_WAN_CONFIG, num_attention_heads=6, attention_head_dim=16)
SEED = 11
TEXT_LENGTH = 7
CLI = [sys.executable, "-m", "numaov.cli"]
# 1 frame at 48x80 pixels: 1 x 3 x 5 = 15 tokens, which 2 and 4 ranks share unevenly.
RUN = ["--frames", "1", "--height", "48", "--width", "80", "--steps", "3", "--guidance", "5",
       "--seed", "3"]


def _model() -> WanTransformer:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return WanTransformer(CONFIG).eval()


def _inputs(frames: int, height: int, width: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(SEED)
    return (torch.randn(2, 16, frames, height, width, generator=generator),
            torch.tensor([900.0, 35.0]),
            torch.randn(2, TEXT_LENGTH, CONFIG.text_dim, generator=generator))


def _split_rank(context, shape):
    model = _model().split_sequence(context.world_size)
    with torch.no_grad():
        return model(*_inputs(*shape), sequence_rank=torch.tensor([context.rank])).numpy()


@pytest.mark.parametrize("ranks", [3])  # 2 ranks: the export's parity and the runs
def test_split_model_equals_the_whole_one_in_rank_processes(ranks: int) -> None:
    # 9 tokens (one frame of 3x3 patches) and 12 (2 frames of 2x3): padded and even shares
    for shape in ((1, 6, 6), (2, 4, 6)):
        with torch.no_grad():
            whole = _model()(*_inputs(*shape)).numpy()
        outputs = run_rank_group(ranks, _split_rank, [shape] * ranks, group=SEQUENCE_GROUP)
        for got in outputs:
            # f32, the same math in rank-local pieces: ~1e-7 measured
            assert rel_error(got, whole) < 1e-5, (shape, ranks)
            assert np.array_equal(got, outputs[0])  # every rank holds the whole prediction


def test_split_model_refusals() -> None:
    assert [token_share(15, n) for n in (2, 3, 4)] == [8, 5, 4]
    with pytest.raises(SequenceSplitError, match=r"6 attention heads.*expected a number of "
                       r"ranks dividing 6 \(2, 3, 6\)"):
        _model().split_sequence(4)
    model = _model().split_sequence(2)
    hidden, _, text = _inputs(1, 4, 4)
    with pytest.raises(WanInputError, match="one timestep per sample"):
        model(hidden, torch.zeros(2, 1), text, sequence_rank=torch.tensor([0]))
    with pytest.raises(WanInputError, match="sequence_rank 2; expected 0 to 1"):
        model(hidden, torch.zeros(2), text, sequence_rank=torch.tensor([2]))
    with pytest.raises(WanInputError, match="not split"):
        _model()(hidden, torch.zeros(2), text, sequence_rank=torch.tensor([0]))


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("wan_sequence")
    checkpoint = build_tiny_wan(root / "checkpoint", seed=SEED, config=CONFIG)
    code, out, err = cli_in_process("export", "wan", "--checkpoint", str(checkpoint), "--out",
                                    str(root / "model"), "--sequence-parallel", "3,2")
    assert code == 0, err
    rng = np.random.default_rng(SEED)
    np.save(root / "text.npy", rng.standard_normal((TEXT_LENGTH, CONFIG.text_dim),
                                                   dtype=np.float32))
    np.save(root / "negative.npy", 0.1 * rng.standard_normal((TEXT_LENGTH, CONFIG.text_dim),
                                                              dtype=np.float32))
    return {"root": root, "checkpoint": checkpoint, "model": root / "model", "progress": err}


def _run_args(exported: dict, out: Path, *extra: str) -> list[str]:
    return ["run", "wan", "--model-dir", str(exported["model"]), "--text-embeddings",
            str(exported["root"] / "text.npy"), "--negative-embeddings",
            str(exported["root"] / "negative.npy"), *RUN, "--out", str(out), *extra]


def test_export_writes_one_graph_per_rank_count_checked_rank_by_rank(exported: dict) -> None:
    model = exported["model"]
    whole = json.loads((model / "manifest.json").read_text())
    for ranks in (2, 3):
        directory = model / f"sequence_{ranks}"
        manifest = json.loads((directory / "manifest.json").read_text())
        assert manifest["world_size"] == ranks and manifest["collective_group"] == SEQUENCE_GROUP
        # one IR every rank compiles, not a copy of the weights per rank, and no ONNX
        assert {r["ir_xml"] for r in manifest["ranks"]} == {"model.xml"}
        assert {r["onnx"] for r in manifest["ranks"]} == {None}
        assert not list(directory.glob("*.onnx*"))
        assert [r["rank"] for r in manifest["ranks"]] == list(range(ranks))
        assert "sequence_rank" in {i["name"] for i in manifest["inputs"]}
        figures = manifest["parity"]
        # every rank on each input set, the padded one (7 tokens) included
        assert len(figures) == ranks * 3
        assert {f["output"] for f in figures} == {f"rank{r}.sample" for r in range(ranks)}
        assert any(f["shapes"]["hidden_states"][3:] == [2, 14] for f in figures)
        assert max(f["rel_error"] for f in figures) < 1e-4
        # the transformer's own manifest digests the split graph's files too
        assert {f"sequence_{ranks}/model.bin", f"sequence_{ranks}/manifest.json"} <= set(
            whole["files"])
    assert "parity check of the 2-rank sequence split" in exported["progress"]


def test_workers_split_by_tokens_give_one_workers_latents(exported: dict, tmp_path: Path,
                                                        deepseek_bind: str) -> None:
    code, _, err = cli_in_process(*_run_args(exported, tmp_path / "one.npy"))
    assert code == 0, err
    one = np.load(tmp_path / "one.npy")
    # two emulated nodes; 3 and 4 workers split the two CPUs (this machine has no more)
    runs = {"two": (("--workers", "2", "--parallel", "sequence"), {"NUMAOV_CPU_BIND": deepseek_bind}),
            "three": (("--workers", "3"), {}),  # the default for more than 2 workers
            "both": (("--workers", "4", "--parallel", "both"), {})}
    for name, (flags, env) in runs.items():
        proc = subprocess.run([*CLI, *_run_args(exported, tmp_path / f"{name}.npy", *flags)],
                              capture_output=True, text=True, timeout=600,
                              env={**os.environ, **env})
        assert proc.returncode == 0, proc.stderr
        # f32: the split graph's math is the whole one's, row by row
        assert rel_error(np.load(tmp_path / f"{name}.npy"), one) < F32_SAMPLE_TOL, name
        assert f"with {flags[1]} worker(s)" in proc.stderr
    # the progress line says which worker runs which tokens and branch
    assert "both split: worker 0" in proc.stderr and "conditional, tokens 0-7" in proc.stderr
    assert "worker 3" in proc.stderr and "unconditional, tokens 8-14" in proc.stderr


def test_split_refusals_are_one_line(exported: dict, wan: dict, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch, deepseek_bind: str) -> None:
    out = tmp_path / "x.npy"
    one_line_error(cli_refusal(*_run_args(exported, out, "--workers", "4", "--parallel",
                                          "guidance")), "expected 2 workers")
    one_line_error(cli_refusal(*_run_args(exported, out, "--workers", "3", "--parallel",
                                          "both")), "an even number of at least 4")
    one_line_error(cli_refusal(*_run_args(exported, out, "--workers", "2", "--parallel",
                                          "sequence", "--cache", "first-block")),
                   "--cache:", "parallel=guidance")
    one_line_error(cli_refusal(*_run_args(exported, out, "--workers", "2", "--parallel",
                                          "sequence", "--backend", "torch")),
                   "--backend:", "openvino")
    one_line_error(cli_refusal(*_run_args(exported, out, "--parallel", "sequence")),
                   "workers of at least 2")
    monkeypatch.setenv("NUMAOV_CPU_BIND", deepseek_bind)  # two emulated nodes
    # an export without the split graph names what it has and the option that adds it
    one_line_error(cli_refusal("run", "wan", "--model-dir", str(wan["model_dir"]),
                               "--text-embeddings", str(wan["text"]), *RUN, "--out", str(out),
                               "--workers", "2", "--parallel", "sequence"),
                   "no graph for 2 sequence-parallel workers (it has: none)",
                   "--sequence-parallel 2")
    # heads that 4 ranks cannot share, and per-frame timesteps, are refused at export
    one_line_error(cli_refusal("export", "wan", "--checkpoint", str(exported["checkpoint"]),
                               "--out", str(tmp_path / "e"), "--sequence-parallel", "4"),
                   "6 attention heads", "(2, 3, 6)")
    one_line_error(cli_refusal("export", "wan", "--checkpoint", str(exported["checkpoint"]),
                               "--out", str(tmp_path / "e"), "--sequence-parallel", "2",
                               "--timestep", "per-frame"), "one timestep per sample")
    one_line_error(cli_refusal("export", "wan", "--checkpoint", str(exported["checkpoint"]),
                               "--out", str(tmp_path / "e"), "--sequence-parallel", "1"),
                   "at least 2")
    assert not (tmp_path / "e").exists()


def _rank_processes(parent: int) -> list[int]:
    """The spawned worker processes of ``parent`` (not multiprocessing's resource tracker)."""
    import psutil

    return [child.pid for child in psutil.Process(parent).children()
            if "spawn_main" in " ".join(child.cmdline())]


def test_a_killed_worker_fails_the_run_in_one_line_and_leaves_no_shared_memory(
        exported: dict, tmp_path: Path) -> None:
    """The peers of a killed worker fail inside the split graph's collectives (OpenVINO's
    error, made one line) or the parent notices the death: either way one line. (The
    groups' segments are unlinked once every worker has joined, or by the parent once the
    workers have exited when one died before that; the check guards both.)"""
    job = f"sp-kill-{uuid.uuid4().hex[:8]}"
    args = _run_args(exported, tmp_path / "x.npy", "--workers", "3", "--parallel", "sequence")
    args[args.index("--steps") + 1] = "100000"  # runs until killed
    proc = subprocess.Popen([*CLI, *args], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "NUMAOV_JOB_ID": job})
    try:
        # the workers print nothing per step: kill one once all four have been sampling a while
        deadline = time.monotonic() + 120
        while len(victims := _rank_processes(proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(victims) == 3
        time.sleep(5)
        assert proc.poll() is None
        os.kill(victims[2], 9)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    errors = [line for line in err.splitlines() if line.startswith("numaov: error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "rank" in errors[0], errors[0]
    deadline = time.monotonic() + 10
    while shm_leftovers(job) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert shm_leftovers(job) == []


def test_pipeline_split_by_tokens_and_doctor(wan_pipeline_exported: dict, tmp_path: Path) -> None:
    """A pipeline export with its transformer split for 2 workers (the text encoder and VAE
    taken from the shared export): a prompt's latents on 2 sequence workers equal one
    worker's, and doctor says which worker would run what."""
    root = wan_pipeline_exported["root"]
    export = tmp_path / "export"
    code, _, err = cli_in_process("export", "wan", "--checkpoint", str(root / "pipeline"),
                                  "--out", str(export), "--reuse",
                                  str(wan_pipeline_exported["export"]), "--sequence-parallel", "2")
    assert code == 0, err
    assert "text_encoder: reused from" in err  # only the transformer was exported
    # exported again from the same files: the transformer is taken, its split graph with it
    again = tmp_path / "again"
    code, _, err = cli_in_process("export", "wan", "--checkpoint", str(root / "pipeline"),
                                  "--out", str(again), "--reuse", str(export),
                                  "--sequence-parallel", "2")
    assert code == 0, err
    assert "transformer: reused from" in err
    export = again
    run = ["run", "wan", "--model-dir", str(export), "--prompt", "a w1 w2", "--frames", "5",
           "--height", "48", "--width", "48", "--steps", "3", "--guidance", "4", "--seed", "2"]
    code, _, err = cli_in_process(*run, "--out", str(tmp_path / "one.npy"))
    assert code == 0, err
    proc = subprocess.run([*CLI, *run, "--out", str(tmp_path / "two.npy"), "--workers", "2",
                           "--parallel", "sequence"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "sequence split: worker 0" in proc.stderr and "tokens 0-8" in proc.stderr
    assert rel_error(np.load(tmp_path / "two.npy"), np.load(tmp_path / "one.npy")) < F32_SAMPLE_TOL

    code, out, err = cli_in_process("doctor", str(export), "--json")
    assert code == 0, err
    splits = json.loads(out)["wan_splits"]
    assert splits["sequence_graphs"] == [2]
    assert [(s["workers"], s["parallel"]) for s in splits["splits"]] == [
        (2, "guidance"), (2, "sequence"), (4, "both")]
    assert "worker 1 (CPUs" in splits["splits"][1]["placement"]
    assert "token share 2 of 2" in splits["splits"][1]["placement"]

"""Peak memory of `numaov export deepseek` against the checkpoint's f32 weight bytes.

The export runs as its own process (the CLI), and a sampler reads `/proc` every 10 ms for it
and every process under it (at dp > 1 the parity check runs one worker process per rank), so
the peak is the whole tree's. Two sums are kept per sample:

- **anonymous** (`Pss_Anon`): the private memory the export itself allocates: the model, the
  ONNX Runtime session, OpenVINO's compiled model, activations. This is what a machine must
  have free;
- **resident** (`Pss`): anonymous plus the file pages mapped into the processes (OpenVINO
  maps the IR's `.bin`; the libraries' code). File pages are reclaimable page cache, but
  `top` and `time -v` count them.

Both are proportional set sizes (`/proc/<pid>/smaps_rollup`), so pages processes share
(copy-on-write after a fork, the same library) count once in the sum.

Each figure is also given as a ratio to the checkpoint's f32 weight bytes, and the fixed cost
of the imports (a process that imports what the export imports and exits) is printed beside
it, since it does not grow with the model. The checkpoint is `benchmarks/lm_engine.py`'s
537 MB one. Figures go to `benchmarks/out/export_memory.json`.

    .venv/bin/python benchmarks/export_memory.py [--dp 1,2] [--precision f32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from lm_engine import build_checkpoint, cpu_model  # benchmarks/lm_engine.py, beside this file

HERE = Path(__file__).resolve().parent
OUT = HERE / "out" / "export_memory.json"
NUMAOV = [sys.executable, "-m", "numaov.cli"]
IMPORTS = (
    "import torch, onnxruntime, openvino, numaov.exporter.lm_export, "
    "numaov.models.deepseek_v2"
)


def _status_kib(pid: int) -> tuple[int, int]:
    """(Pss_Anon, Pss) of one process in KiB; (0, 0) when it has gone.

    Proportional sizes: a page shared by n processes counts 1/n in each, so the sum over the
    tree counts it once (the export forks short-lived helpers whose copy-on-write pages
    would otherwise count in full in every one of them).
    """
    anon = pss = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss_Anon:"):
                anon = int(line.split()[1])
            elif line.startswith("Pss:"):
                pss = int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return anon, pss


def _tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def peak_memory(command: list[str], env: dict[str, str]) -> dict[str, float]:
    """Run ``command``; the peak of its process tree's anonymous and resident sums, in MiB."""
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    peaks = {"anon": 0, "rss": 0}

    def sample() -> None:
        while proc.poll() is None:
            sums = [_status_kib(pid) for pid in _tree(proc.pid)]
            peaks["anon"] = max(peaks["anon"], sum(a for a, _ in sums))
            peaks["rss"] = max(peaks["rss"], sum(r for _, r in sums))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output, _ = proc.communicate()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{output.decode(errors='replace')}")
    return {"anon_mib": peaks["anon"] / 1024, "rss_mib": peaks["rss"] / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", default="1,2", help="comma-separated DP degrees (default 1,2)")
    parser.add_argument("--precision", default="f32", choices=("f32", "bf16"))
    args = parser.parse_args()

    checkpoint = build_checkpoint()
    weights = (checkpoint / "model.safetensors").stat().st_size / 2**20
    env = dict(os.environ)
    imports = peak_memory([sys.executable, "-c", IMPORTS], env)
    figures: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_model(),
        "checkpoint_mib": round(weights, 1),
        "imports": imports,
        "exports": {},
    }
    print(f"checkpoint: {weights:.0f} MiB of f32 weights; imports alone: anonymous "
          f"{imports['anon_mib']:.0f} MiB, resident {imports['rss_mib']:.0f} MiB")
    for dp in (int(d) for d in args.dp.split(",")):
        with tempfile.TemporaryDirectory() as out:
            env["NUMAOV_CPU_BIND"] = "0|1" if dp == 2 else "0-1"
            peak = peak_memory(
                [*NUMAOV, "export", "deepseek", "--checkpoint", str(checkpoint), "--out",
                 f"{out}/model", "--dp", str(dp), "--precision", args.precision, "--quiet"],
                env,
            )
        row = {
            **peak,
            "anon_x_weights": peak["anon_mib"] / weights,
            "rss_x_weights": peak["rss_mib"] / weights,
            "anon_above_imports_x_weights": (peak["anon_mib"] - imports["anon_mib"])
            / weights,
        }
        figures["exports"][f"dp{dp}_{args.precision}"] = row  # type: ignore[index]
        print(f"dp={dp} {args.precision}: peak anonymous {peak['anon_mib']:.0f} MiB "
              f"({row['anon_x_weights']:.2f}x the weights; "
              f"{row['anon_above_imports_x_weights']:.2f}x above the imports), peak resident "
              f"{peak['rss_mib']:.0f} MiB ({row['rss_x_weights']:.2f}x)")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

"""Peak memory of `numaov export lm` and of loading its export, against the checkpoint's bytes.

Two checkpoint sources (``--checkpoints``):

- ``lite-1gb``, ``lite-3gb``, ``lite-10gb``: bf16 checkpoints of DeepSeek-V2-Lite's published
  shape (vocab 102,400, hidden 2,048, MLA with kv_lora_rank 512 and no q LoRA, 16 heads, one
  dense layer of 10,944 then MoE layers of 64 routed experts of 1,408 + 2 shared, top-6), cut to
  2 layers and 8 experts (~1.2 GB), 3 layers (~3.3 GB: the cut the export used to take 21.5 GB
  for) and 9 layers (~10.4 GB). They are written one layer per safetensors shard (the
  per-expert layout numaov reads, ``model.layers.{l}.mlp.experts.{e}.gate_proj.weight``) from
  a pool of seeded normals, so building the 10 GB one holds ~1.3 GB at a time; they are cached
  under ``benchmarks/out/export_memory/`` and not rebuilt when present. Exported at ``--precision``
  (default bf16).
- ``engine``: ``benchmarks/lm_engine.py``'s 537 MB f32 checkpoint (the figures of the
  2026-12-01 run), exported at f32.

The export runs as its own process (the CLI), and a sampler reads the memory of it and of every
process under it (at dp > 1 the parity check runs one worker process per rank), so the peak is
the whole tree's:

- every 25 ms, the kernel's resident counters (``/proc/<pid>/status``): **anonymous**
  (``RssAnon``: the private memory the export allocates: the models, ONNX, OpenVINO's compiled
  model, activations; what a machine must have free) and **file** (``RssFile``: file pages
  mapped into the processes: the expert store, the IR's ``.bin``, the checkpoint while it is
  read, library code; reclaimable page cache); **resident** is the two together (``top``'s);
- every 0.5 s, the proportional sums (``smaps_rollup``: a page shared by n processes counts
  1/n in each, so the forked workers' copy-on-write pages count once): ``Pss_Anon``,
  ``Pss_File``, ``Pss``. Reading ``smaps_rollup`` walks every page table (tens of ms on a 10 GB
  process): sampled every 10-25 ms it took half a core from the export it measured.

For each export the table gives the checkpoint's bytes, its routed-expert bytes (tensors named
``*.mlp.experts.*``) and its other bytes at bf16 (from the safetensors headers), and the ratio
of the peak anonymous memory to the target ``1.5 x non-expert bf16 bytes + 1 GiB`` (target
<= 1.0), the wall time, the manifest's ``export_seconds`` and the expert store's rate (the
export's "expert store ... MB/s" line). The fixed cost of the imports (a process that imports
what the export imports and exits) is printed beside them.

Then, for each dp=1 export, a fresh process loads rank 0 as the runtime does
(``read_manifest(dir).compile_rank(0, {"INFERENCE_NUM_THREADS": 2})``) and runs the export's
reference sample (one prefill step): load time, its peak, and its settled memory after the load
and after the step, anonymous and file-backed apart, against the store's and the IR ``.bin``'s
bytes; and ``numaov run lm --prompt-ids 1,2,3 --max-new-tokens 4`` as a process tree (peak).
The store was just written, so its pages are in the page cache: the load times are warm ones.
Figures go to ``benchmarks/out/export_memory.json``.

``--family wan`` measures ``numaov export wan --precision bf16`` instead, on bf16 checkpoints
of Wan 2.1 T2V 1.3B's published transformer width cut to ``--wan-blocks`` blocks (figures to
``benchmarks/out/export_memory_wan.json``). ``--family wan-components`` exports a pipeline
whose text encoder is UMT5-XXL at its published width (layers cut to ``--umt5-layers``) and
whose VAE is the published one, measuring the peak while each was exported and what each held
in a ``numaov run wan`` of a small video (``benchmarks/out/export_memory_wan_components.json``).

    .venv/bin/python benchmarks/export_memory.py [--checkpoints lite-1gb,lite-3gb,lite-10gb]
        [--dp 1] [--dp-for lite-3gb:1,2] [--precision bf16] [--no-runtime]
    .venv/bin/python benchmarks/export_memory.py --family wan [--wan-blocks 4,12]
    .venv/bin/python benchmarks/export_memory.py --family wan-components [--umt5-layers 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from machine import cpu_model  # benchmarks/machine.py, beside this file

HERE = Path(__file__).resolve().parent
WORK = HERE / "out" / "export_memory"
OUT = HERE / "out" / "export_memory.json"
NUMAOV = [sys.executable, "-m", "numaov.cli"]
IMPORTS = (
    "import torch, onnxruntime, openvino, numaov.exporter.lm_export, "
    "numaov.models.deepseek_v2"
)
GIB = 2**30
SEED = 0

# DeepSeek-V2-Lite's published config.json, but for the layers and routed experts
LITE = {
    "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_attention_heads": 16, "num_key_value_heads": 16,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "n_shared_experts": 2, "num_experts_per_tok": 6,
    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
    "norm_topk_prob": False, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "scoring_func": "softmax", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "max_position_embeddings": 163840, "tie_word_embeddings": False,
    "bos_token_id": 100000, "eos_token_id": 100001,
}
# name: (layers, routed experts)
SIZES = {"lite-1gb": (2, 8), "lite-3gb": (3, 64), "lite-10gb": (9, 64)}


def log(message: str) -> None:
    print(f"[export_memory] {message}", file=sys.stderr, flush=True)


# -- the checkpoints --------------------------------------------------------------------------


def build_lite_checkpoint(name: str) -> Path:
    """The ``name`` checkpoint (``SIZES``), bf16, one safetensors shard per layer; cached."""
    import torch
    from safetensors.torch import save_file

    from numaov.models.deepseek_v2 import DeepseekV2, DeepseekV2Config
    from numaov.models.layers.expert_layout import WEIGHTS_INDEX_NAME, checkpoint_shapes

    directory = WORK / name
    if (directory / WEIGHTS_INDEX_NAME).is_file():
        return directory
    layers, experts = SIZES[name]
    config = DeepseekV2Config.from_dict(
        {**LITE, "model_type": "deepseek_v2", "num_hidden_layers": layers,
         "n_routed_experts": experts}, name)
    shapes = checkpoint_shapes(DeepseekV2.tensor_shapes(config), per_expert=True,
                               tie_word_embeddings=False)
    groups: dict[str, list[str]] = {}
    for tensor in shapes:
        match = re.match(r"model\.layers\.(\d+)\.", tensor)
        groups.setdefault(f"layer{int(match.group(1)):03d}" if match else "other",
                          []).append(tensor)
    log(f"building {name}: {layers} layers, {experts} routed experts, "
        f"{sum(math.prod(s) for s in shapes.values()) * 2 / 1e9:.2f} GB at bf16")
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(SEED)
    # a pool of normals, each tensor a slice of it at a random offset (tiled past its end):
    # random enough to route and to check parity, and fast (10 GB of fresh normals take
    # minutes on two cores)
    pool = torch.randn(1 << 24, generator=generator).to(torch.bfloat16)
    pool = torch.cat([pool, pool])

    def normals(shape: tuple[int, ...]) -> torch.Tensor:
        count = math.prod(shape)
        out = torch.empty(count, dtype=torch.bfloat16)
        done = 0
        while done < count:
            start = int(torch.randint(0, 1 << 24, (1,), generator=generator))
            step = min(count - done, 1 << 24)
            out[done:done + step] = pool[start:start + step]
            done += step
        return out.view(shape)

    weight_map: dict[str, str] = {}
    total = 0
    names = sorted(groups)
    for i, group in enumerate(names):
        file = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
        tensors = {}
        for tensor in groups[group]:
            shape = shapes[tensor]
            value = normals(shape)
            if tensor.endswith("norm.weight") or "layernorm" in tensor:
                value = 1.0 + 0.1 * value
            elif tensor.endswith("mlp.gate.weight"):  # the router: f32, sharp, as the tiny model
                value = value.float() * (4.0 / math.sqrt(shape[-1]))
            elif not tensor.endswith("embed_tokens.weight"):
                value = value * (1.0 / math.sqrt(shape[-1]))
            tensors[tensor] = value.contiguous()
            weight_map[tensor] = file
            total += value.numel() * value.element_size()
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        del tensors
        log(f"  wrote {file} ({group})")
    values = {**config.to_dict(), "torch_dtype": "bfloat16"}
    (directory / "config.json").write_text(json.dumps(values, indent=2) + "\n")
    (directory / WEIGHTS_INDEX_NAME).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return directory


def checkpoint_bytes(directory: Path) -> dict[str, int]:
    """The checkpoint's file bytes, and its routed-expert and other tensors' bytes at bf16,
    from the safetensors headers."""
    out = {"file_bytes": 0, "expert_bf16_bytes": 0, "non_expert_bf16_bytes": 0}
    for file in sorted(directory.glob("*.safetensors")):
        out["file_bytes"] += file.stat().st_size
        with file.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for tensor, entry in header.items():
            if tensor == "__metadata__":
                continue
            key = "expert_bf16_bytes" if ".mlp.experts." in tensor else "non_expert_bf16_bytes"
            out[key] += 2 * math.prod(entry["shape"])
    return out


# -- the sampler ------------------------------------------------------------------------------


def smaps(pid: int | str = "self") -> dict[str, int]:
    """``smaps_rollup`` of one process, KiB per field; {} when it has gone."""
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0])
    except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError):
        pass
    return fields


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


def status(pid: int) -> dict[str, int]:
    """``RssAnon``, ``RssFile``, ``RssShmem`` of one process from ``/proc/<pid>/status``, KiB
    (counters the kernel keeps: cheap to read, unlike ``smaps_rollup``)."""
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Rss"):
                key, value = line.split(":", 1)
                fields[key] = int(value.split()[0])
    except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError):
        pass
    return fields


def peak_memory(command: list[str], env: dict[str, str],
                phases: dict[str, str] | None = None) -> dict[str, object]:
    """Run ``command``; the peaks of its process tree's memory (MiB), its wall time and its
    output: resident sums from ``status`` every 25 ms (``rss_*``), proportional sums from
    ``smaps_rollup`` every 0.5 s (``anon_mib`` / ``file_mib`` / ``pss_mib``: a walk of every
    page table, which on a 10 GB process takes tens of ms: sampled at 25 ms it took half a
    core from the export it measured). ``phases`` maps an output line to the phase it starts:
    ``phase_anon_mib`` is then the anonymous resident peak within each."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    peaks = {"Pss_Anon": 0, "Pss_File": 0, "Pss": 0, "RssAnon": 0, "RssFile": 0, "Rss": 0}
    phase = ["start"]
    phase_peaks: dict[str, int] = {}

    def sample() -> None:
        pids, walked = [proc.pid], 0.0
        while proc.poll() is None:
            slow = time.monotonic() - walked > 0.5
            if slow:
                pids, walked = _tree(proc.pid), time.monotonic()
                rows = [smaps(pid) for pid in pids]
                for key in ("Pss_Anon", "Pss_File", "Pss"):
                    peaks[key] = max(peaks[key], sum(row.get(key, 0) for row in rows))
            rows = [status(pid) for pid in pids]
            anon = sum(row.get("RssAnon", 0) for row in rows)
            file = sum(row.get("RssFile", 0) + row.get("RssShmem", 0) for row in rows)
            peaks["RssAnon"] = max(peaks["RssAnon"], anon)
            phase_peaks[phase[0]] = max(phase_peaks.get(phase[0], 0), anon)
            peaks["RssFile"] = max(peaks["RssFile"], file)
            peaks["Rss"] = max(peaks["Rss"], anon + file)
            time.sleep(0.025)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    lines = []
    for line in proc.stdout:  # echoed as it comes, timestamped: where the time goes
        lines.append(line.decode(errors="replace"))
        phase[0] = (phases or {}).get(lines[-1].strip(), phase[0])
        print(f"    {time.perf_counter() - start:7.1f} s | {lines[-1].rstrip()}",
              file=sys.stderr, flush=True)
    proc.wait()
    sampler.join()
    text = "".join(lines)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{text}")
    return {"anon_mib": peaks["Pss_Anon"] / 1024, "file_mib": peaks["Pss_File"] / 1024,
            "pss_mib": peaks["Pss"] / 1024, "rss_anon_mib": peaks["RssAnon"] / 1024,
            "rss_file_mib": peaks["RssFile"] / 1024, "rss_mib": peaks["Rss"] / 1024,
            "wall_s": time.perf_counter() - start, "output": text,
            "phase_anon_mib": {k: v / 1024 for k, v in phase_peaks.items()}}


# -- the runtime ------------------------------------------------------------------------------

_RUNTIME = textwrap.dedent('''
    import json, sys, time
    from pathlib import Path
    import numpy as np

    def smaps():
        out = {}
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0]) / 1024
        keep = ("Rss", "Anonymous", "Pss", "Pss_Anon", "Pss_File")
        row = {k + "_mib": round(out.get(k, 0.0), 1) for k in keep}
        row["Rss_File_mib"] = round(out["Rss"] - out.get("Anonymous", 0.0)
                                    - out.get("Pss_Shmem", 0.0), 1)
        return row

    directory = Path(sys.argv[1])
    start = time.perf_counter()
    from numaov.runtime.manifest_reader import read_manifest
    imports = smaps()
    import_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = read_manifest(directory).compile_rank(0, {"INFERENCE_NUM_THREADS": 2})
    load_s = time.perf_counter() - start
    loaded = smaps()
    sample = np.load(directory / "reference_sample.npz")
    feeds = {k[len("input."):]: sample[k] for k in sample.files if k.startswith("input.")}
    request = compiled.model.create_infer_request()
    start = time.perf_counter()
    request.infer(feeds)
    first_step_s = time.perf_counter() - start
    start = time.perf_counter()
    request.infer(feeds)
    second_step_s = time.perf_counter() - start
    print("RUNTIME " + json.dumps({
        "import_s": import_s, "load_s": load_s, "first_step_s": first_step_s,
        "second_step_s": second_step_s, "after_imports": imports, "after_load": loaded,
        "after_step": smaps(), "feeds": {k: list(v.shape) for k, v in feeds.items()}}),
        flush=True)
''')


def runtime(model_dir: Path, env: dict[str, str]) -> dict[str, object]:
    """Load rank 0 of a dp=1 export in a fresh process and run its reference sample; then
    ``numaov run lm`` on it."""
    rank = model_dir / "rank_0"
    store = sum(f.stat().st_size for f in rank.glob("*.nxs"))
    ir_bin = sum(f.stat().st_size for f in rank.glob("*.bin"))
    load = peak_memory([sys.executable, "-c", _RUNTIME, str(model_dir)], env)
    line = next(x for x in str(load.pop("output")).splitlines() if x.startswith("RUNTIME "))
    row: dict[str, object] = {"store_mib": store / 2**20, "ir_bin_mib": ir_bin / 2**20,
                              "load_process_peak": load, **json.loads(line[len("RUNTIME "):])}
    run = peak_memory([*NUMAOV, "run", "lm", "--model-dir", str(model_dir), "--prompt-ids",
                       "1,2,3", "--max-new-tokens", "4", "--quiet"], env)
    run.pop("output")
    row["run_lm_peak"] = run
    return row


# -- the run ----------------------------------------------------------------------------------

STORE_LINE = re.compile(r"expert store ([\d.]+) GB written, ([\d.]+) GB read from the "
                        r"checkpoint in ([\d.]+) s \((\d+) MB/s\)")


def export(name: str, checkpoint: Path, dp: int, precision: str, sizes: dict[str, int],
           imports: dict[str, object], env: dict[str, str]) -> dict[str, object]:
    out = WORK / f"export_{name}_dp{dp}_{precision}"
    env = {**env, "NUMAOV_CPU_BIND": "0|1" if dp == 2 else "0-1"}
    log(f"export {name} dp={dp} {precision}")
    peak = peak_memory([*NUMAOV, "export", "lm", "--checkpoint", str(checkpoint), "--out",
                        str(out), "--dp", str(dp), "--precision", precision, "--force"], env)
    output = str(peak.pop("output"))
    manifest = json.loads((out / "manifest.json").read_text())
    target_mib = (1.5 * sizes["non_expert_bf16_bytes"] + GIB) / 2**20
    row: dict[str, object] = {
        **peak,
        "export_seconds": manifest.get("export_seconds"),
        "expert_store_lines": [m.group(0) for m in STORE_LINE.finditer(output)],
        "expert_store_mb_per_s": [int(m.group(4)) for m in STORE_LINE.finditer(output)],
        "target_mib": target_mib,
        "anon_x_target": peak["rss_anon_mib"] / target_mib,
        "pss_anon_x_target": peak["anon_mib"] / target_mib,
        "rss_x_target": peak["rss_mib"] / target_mib,
        "anon_above_imports_mib": peak["rss_anon_mib"] - imports["rss_anon_mib"],
        "anon_x_checkpoint": peak["rss_anon_mib"] * 2**20 / sizes["file_bytes"],
        "store_mib": sum(f.stat().st_size for f in out.glob("rank_*/*.nxs")) / 2**20,
        "ir_bin_mib": sum(f.stat().st_size for f in out.glob("rank_*/*.bin")) / 2**20,
        "onnx_data_mib": sum(f.stat().st_size for f in out.glob("rank_*/*.onnx*")) / 2**20,
        "model_dir": str(out),
    }
    log(f"  peak anonymous {row['rss_anon_mib']:.0f} MiB ({row['anon_x_target']:.2f}x target "
        f"{target_mib:.0f} MiB), resident {row['rss_mib']:.0f} MiB, {row['wall_s']:.0f} s")
    return row


# -- Wan ---------------------------------------------------------------------------------------

WAN_OUT = HERE / "out" / "export_memory_wan.json"


def build_wan_checkpoint(layers: int) -> tuple[Path, int]:
    """A bf16 Wan 2.1 T2V 1.3B transformer at its published width (``dit.WIDTH_1_3B``) cut to
    ``layers`` blocks, random weights (std 0.02), in diffusers' layout; cached. Returns it and
    its weights' bytes."""
    from dataclasses import replace

    import torch
    from dit import WIDTH_1_3B  # benchmarks/dit.py

    from numaov.models.builtin.wan_tiny import save_wan_checkpoint
    from numaov.models.wan.transformer import WanTransformer

    directory = WORK / f"wan_1_3b_{layers}_blocks"
    if not (directory / "config.json").is_file():
        log(f"building {directory.name}")
        with torch.device("meta"):
            model = WanTransformer(replace(WIDTH_1_3B, num_layers=layers))
        model = model.to_empty(device="cpu").to(torch.bfloat16)
        generator = torch.Generator().manual_seed(SEED)
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0.0, 0.02, generator=generator)
        save_wan_checkpoint(model, directory)
        del model
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    return directory, size


def main_wan(layer_counts: list[int]) -> None:
    """``numaov export wan --precision bf16`` of the 1.3B-width transformer at each depth:
    peak anonymous memory against the target 1.5 x bf16 weights + 1 GiB, wall time and where
    it went (the manifest's ``export_seconds``), and the parity's stage figures."""
    env = dict(os.environ)
    figures: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model(),
        "command": " ".join([".venv/bin/python", "benchmarks/export_memory.py", *sys.argv[1:]]),
        "exports": {},
    }
    rows = []
    for layers in layer_counts:
        checkpoint, size = build_wan_checkpoint(layers)
        out = WORK / f"wan_export_{layers}"
        log(f"numaov export wan {checkpoint.name} --precision bf16")
        row = peak_memory([*NUMAOV, "export", "wan", "--checkpoint", str(checkpoint), "--out",
                           str(out), "--precision", "bf16", "--force"], env)
        row.pop("output")
        manifest = json.loads((out / "manifest.json").read_text())
        target = (1.5 * size + GIB) / 2**20
        stages = [f["rel_error"] for f in manifest["parity"] if f.get("criterion") == "rms"]
        whole = [f["rel_error"] for f in manifest["parity"]
                 if f["backend"] == "openvino" and not f.get("judged", True)]
        row.update(weights_bytes=size, target_mib=target, anon_over_target=row["rss_anon_mib"]
                   / target, export_seconds=manifest["export_seconds"],
                   worst_stage_rms=max(stages), whole_sample_max_rel=max(whole))
        figures["exports"][str(layers)] = row  # type: ignore[index]
        WAN_OUT.parent.mkdir(parents=True, exist_ok=True)
        WAN_OUT.write_text(json.dumps(figures, indent=2) + "\n")
        rows.append((layers, row))
    print("| blocks | bf16 weights GB | peak anon MiB | peak resident MiB | target MiB | "
          "anon / target | wall s | where the time went | worst block (RMS) | whole sample |")
    print("| --- " * 10 + "|")
    for layers, row in rows:
        seconds = ", ".join(f"{k} {v:.0f}" for k, v in row["export_seconds"].items())
        print(f"| {layers} | {row['weights_bytes'] / 1e9:.2f} | {row['rss_anon_mib']:,.0f} | "
              f"{row['rss_mib']:,.0f} | {row['target_mib']:,.0f} | "
              f"{row['anon_over_target']:.2f} | {row['wall_s']:.0f} | {seconds} | "
              f"{row['worst_stage_rms']:.3f} | {row['whole_sample_max_rel']:.3f} |")


# Wan 2.1's published UMT5-XXL text encoder (text_encoder/config.json) but for its layers.
UMT5_XXL = {"vocab_size": 256384, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_heads": 64,
            "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
            "feed_forward_proj": "gated-gelu", "dense_act_fn": "gelu_new", "is_gated_act": True,
            "layer_norm_epsilon": 1e-6, "tie_word_embeddings": False}
EXPORT_PHASES = {"numaov: text encoder (UMT5)": "text_encoder", "numaov: transformer":
                 "transformer", "numaov: VAE decoder": "vae_decoder"}
HELD = re.compile(r"numaov: the (text encoder|transformer\(s\) on openvino|VAE decoder \(with "
                  r"the decoded video\)) held ([\d.]+ [MG]iB) after running \(([\d.]+ [MG]iB)")
COMPONENTS_VIDEO = ("9", "128", "128")  # frames, height, width of the run


def build_components_pipeline(umt5_layers: int) -> Path:
    """A diffusers Wan 2.1 T2V pipeline directory: UMT5-XXL at its published width cut to
    ``umt5_layers`` layers (bf16, as published), the VAE at its published config (f32, as
    published), a two-block transformer of small width and a word tokenizer; cached."""
    import torch
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    from numaov.models.builtin.tiny_text_encoder import word_tokenizer

    directory = WORK / f"wan_components_umt5_{umt5_layers}_layers"
    if (directory / "model_index.json").is_file():
        return directory
    log(f"building {directory.name}")
    torch.manual_seed(SEED)
    config = UMT5Config(**UMT5_XXL, num_layers=umt5_layers)
    with torch.device("meta"):
        encoder = UMT5EncoderModel(config)
    encoder = encoder.to_empty(device="cpu").to(torch.bfloat16)
    encoder.tie_weights()  # to_empty unties them: the checkpoint holds the table once
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in encoder.named_parameters():
            if "layer_norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    vae = AutoencoderKLWan().eval()  # diffusers' defaults are Wan 2.1's published VAE
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
        out_channels=16, text_dim=UMT5_XXL["d_model"], freq_dim=32, ffn_dim=64, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=1024).eval()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=3.0)
    words = ["<pad>", "</s>", "<unk>", *(f"w{i}" for i in range(60))]
    WanPipeline(tokenizer=word_tokenizer(words), text_encoder=encoder, vae=vae,
                transformer=transformer, scheduler=scheduler).save_pretrained(directory)
    return directory


def main_wan_components(umt5_layers: int) -> None:
    """``numaov export wan --precision bf16`` of a pipeline with UMT5-XXL's width and the
    published VAE: the anonymous peak while each component was exported against its target
    (1.5x its weights at the export dtype + 1 GiB), then ``numaov run wan`` on a small video:
    what each component held once it had run, against its IR weights."""
    env = dict(os.environ)
    pipeline = build_components_pipeline(umt5_layers)
    weights = {
        "text_encoder": sum(f.stat().st_size for f in
                            (pipeline / "text_encoder").glob("*.safetensors")),
        # the IR holds the VAE in bf16: half its f32 checkpoint
        "vae_decoder": sum(f.stat().st_size for f in (pipeline / "vae").glob("*.safetensors"))
        // 2,
    }
    out = WORK / f"wan_components_export_{umt5_layers}"
    log(f"numaov export wan {pipeline.name} --precision bf16")
    export_row = peak_memory([*NUMAOV, "export", "wan", "--checkpoint", str(pipeline), "--out",
                              str(out), "--precision", "bf16", "--force"], env, EXPORT_PHASES)
    export_row.pop("output")
    frames, height, width = COMPONENTS_VIDEO
    log(f"numaov run wan {frames}x{height}x{width}")
    run_row = peak_memory([*NUMAOV, "run", "wan", "--model-dir", str(out), "--prompt", "w1 w2",
                           "--frames", frames, "--height", height, "--width", width, "--steps",
                           "2", "--guidance", "5", "--seed", "0", "--out",
                           str(WORK / "components.gif")], env)
    def gib(size: str) -> float:
        value, unit = size.split()
        return float(value) / (1024 if unit == "MiB" else 1)

    held = {what: (gib(h), gib(w)) for what, h, w in HELD.findall(str(run_row.pop("output")))}
    manifest = json.loads((out / "manifest.json").read_text())
    figures = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model(),
        "command": " ".join([".venv/bin/python", "benchmarks/export_memory.py", *sys.argv[1:]]),
        "umt5_layers": umt5_layers, "weights_bytes": weights, "export": export_row,
        "export_seconds": manifest["export_seconds"], "run": run_row, "held_gib": held,
        "video": COMPONENTS_VIDEO,
    }
    out_json = HERE / "out" / "export_memory_wan_components.json"
    out_json.write_text(json.dumps(figures, indent=2) + "\n")
    print("| component | weights (export dtype) GB | peak anon while exported MiB | target MiB "
          "| of target | export s | held after running GiB | IR weights GiB | held / IR |")
    print("| --- " * 9 + "|")
    for name, what in (("text_encoder", "text encoder"),
                       ("vae_decoder", "VAE decoder (with the decoded video)")):
        size = weights[name]
        target = (1.5 * size + GIB) / 2**20
        peak = export_row["phase_anon_mib"].get(name, 0.0)
        h, w = held.get(what, (0.0, 0.0))
        print(f"| {name} | {size / 1e9:.2f} | {peak:,.0f} | {target:,.0f} | "
              f"{peak / target:.2f} | {manifest['export_seconds'].get(name, 0):.0f} | {h:.2f} | "
              f"{w:.2f} | {h / w if w else 0:.2f} |")
    print(f"wrote {out_json}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoints", default="lite-1gb,lite-3gb,lite-10gb",
                        help=f"comma-separated, of {', '.join(SIZES)}, engine")
    parser.add_argument("--dp", default="1", help="comma-separated DP degrees (default 1)")
    parser.add_argument("--dp-for", default="",
                        help="per-checkpoint DP degrees, e.g. lite-3gb:1,2 (overrides --dp)")
    parser.add_argument("--precision", default="bf16", choices=("f32", "bf16"))
    parser.add_argument("--no-runtime", action="store_true", help="skip the runtime loads")
    parser.add_argument("--family", default="lm", choices=("lm", "wan", "wan-components"),
                        help="wan: the Wan 1.3B-width transformer instead (--wan-blocks); "
                        "wan-components: UMT5-XXL's width and the published VAE (--umt5-layers)")
    parser.add_argument("--wan-blocks", default="4,12",
                        help="comma-separated block counts for --family wan (default 4,12)")
    parser.add_argument("--umt5-layers", type=int, default=2,
                        help="UMT5-XXL layers for --family wan-components (default 2)")
    args = parser.parse_args()
    if args.family == "wan":
        main_wan([int(n) for n in args.wan_blocks.split(",")])
        return
    if args.family == "wan-components":
        main_wan_components(args.umt5_layers)
        return
    per = {}
    for item in filter(None, args.dp_for.split(";")):
        key, degrees = item.split(":")
        per[key] = [int(d) for d in degrees.split(",")]

    env = dict(os.environ)
    imports = peak_memory([sys.executable, "-c", IMPORTS], env)
    imports.pop("output")
    figures: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_model(),
        "command": " ".join([".venv/bin/python", "benchmarks/export_memory.py", *sys.argv[1:]]),
        "precision": args.precision,
        "imports": imports,
        "checkpoints": {},
    }
    log(f"imports alone: anonymous {imports['rss_anon_mib']:.0f} MiB, resident "
        f"{imports['rss_mib']:.0f} MiB")
    rows = []
    for name in args.checkpoints.split(","):
        if name == "engine":
            from lm_engine import build_checkpoint  # benchmarks/lm_engine.py

            checkpoint, precision = build_checkpoint(), "f32"
        else:
            checkpoint, precision = build_lite_checkpoint(name), args.precision
        sizes = checkpoint_bytes(checkpoint)
        entry: dict[str, object] = {**sizes, "exports": {}}
        figures["checkpoints"][name] = entry  # type: ignore[index]
        for dp in per.get(name, [int(d) for d in args.dp.split(",")]):
            row = export(name, checkpoint, dp, precision, sizes, imports, env)
            if dp == 1 and not args.no_runtime:
                log(f"  runtime load of {row['model_dir']}")
                row["runtime"] = runtime(Path(str(row["model_dir"])), env)
            entry["exports"][f"dp{dp}_{precision}"] = row  # type: ignore[index]
            rows.append((name, dp, precision, sizes, row))
            OUT.parent.mkdir(parents=True, exist_ok=True)
            OUT.write_text(json.dumps(figures, indent=2) + "\n")

    print(f"imports alone: anonymous {imports['rss_anon_mib']:.0f} MiB, resident "
          f"{imports['rss_mib']:.0f} MiB")
    print("| checkpoint | dp | ckpt GB | experts GB | other GB (bf16) | peak anon MiB (Pss_Anon) "
          "| peak resident MiB | target MiB | anon / target | wall s | expert store s (MB/s) |")
    print("| --- " * 11 + "|")
    for name, dp, _precision, sizes, row in rows:
        seconds = row["export_seconds"] or {}
        print(f"| {name} | {dp} | {sizes['file_bytes'] / 1e9:.2f} | "
              f"{sizes['expert_bf16_bytes'] / 1e9:.2f} | "
              f"{sizes['non_expert_bf16_bytes'] / 1e9:.2f} | {row['rss_anon_mib']:,.0f} "
              f"({row['anon_mib']:,.0f}) | "
              f"{row['rss_mib']:,.0f} | {row['target_mib']:,.0f} | "
              f"{row['anon_x_target']:.2f} | {row['wall_s']:.0f} | "
              f"{seconds.get('expert_store', 0):.1f} ({row['expert_store_mb_per_s']}) |")
    print()
    print("| checkpoint | store MiB | IR .bin MiB | load s | peak anon MiB | peak file MiB | "
          "after load: anon / file MiB | after step: anon / file MiB | resident / (store + "
          "bin) | run lm peak anon / resident MiB |")
    print("| --- " * 10 + "|")
    for name, _dp, _precision, _sizes, row in rows:
        rt = row.get("runtime")
        if not rt:
            continue
        load, step, peak = rt["after_load"], rt["after_step"], rt["load_process_peak"]
        files = rt["store_mib"] + rt["ir_bin_mib"]
        print(f"| {name} | {rt['store_mib']:,.0f} | {rt['ir_bin_mib']:,.0f} | "
              f"{rt['load_s']:.1f} | {peak['rss_anon_mib']:,.0f} | {peak['rss_file_mib']:,.0f} | "
              f"{load['Pss_Anon_mib']:,.0f} / {load['Pss_File_mib']:,.0f} | "
              f"{step['Pss_Anon_mib']:,.0f} / {step['Pss_File_mib']:,.0f} | "
              f"{step['Pss_mib'] / files:.2f} | {rt['run_lm_peak']['rss_anon_mib']:,.0f} / "
              f"{rt['run_lm_peak']['rss_mib']:,.0f} |")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

"""One Wan denoising step on 1 worker against N sequence-parallel workers (``dit.py --parallel``).

A Wan-1.3B-width transformer (``dit.WIDTH_1_3B``, ``--layers`` blocks, random weights) is
exported in bf16 with ``--sequence-parallel N`` (``numaov export wan``), then one guided step
(a batch of two: conditional and unconditional, 64 text tokens) of a ``--frames x --height x
--width`` video is timed:

- **1 worker**: this process, the plain graph on all ``N`` CPUs (``N`` OpenVINO threads);
- **N workers**: ``N`` rank processes, each pinned to one of the CPUs with one thread, each the
  split graph on its share of the tokens, as ``run wan --workers N --parallel sequence`` runs it.

They alternate round by round (the workers wait on a barrier, asleep, while the one worker
runs), so drift hits both alike; the ratio is the median of per-round ratios. One more
profiled step per side gives the collectives' share of the split step (OpenVINO's per-node
times of the AllToAll / AllGatherIntoTensor nodes against the step) and the bytes they moved,
hence the all-to-all bandwidth achieved. From those, the expected speed-up on a 2-socket
server is written down with its assumptions. Writes ``benchmarks/out/dit_parallel.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

OUT = Path(__file__).resolve().parent / "out" / "dit_parallel.json"
TEXT_LEN = 64
VAE_SCALE, VAE_TEMPORAL = 8, 4
# numaov's extension ops run as OpenVINO "Reference" nodes, named after the exported ops
COLLECTIVE_NAMES = ("all_to_all", "all_gather_into_tensor")


def log(message: str) -> None:
    print(message, flush=True)


def step_inputs(frames: int, height: int, width: int) -> dict[str, np.ndarray]:
    latent = (1 + (frames - 1) // VAE_TEMPORAL, height // VAE_SCALE, width // VAE_SCALE)
    rng = np.random.default_rng(0)
    return {"hidden_states": rng.standard_normal((2, 16, *latent), dtype=np.float32),
            "timestep": np.array([700.0, 700.0], dtype=np.float32),
            "encoder_hidden_states": rng.standard_normal((2, TEXT_LEN, 4096),
                                                         dtype=np.float32)}


def profile(request: Any) -> tuple[float, float, int]:
    """Of the last run's executed nodes: the seconds of all, those of the collectives, and
    the bytes of the values the collectives moved (2 for bf16, else 4)."""
    total = collective = 0.0
    element = 4
    for info in request.get_profiling_info():
        seconds = info.real_time.total_seconds()
        total += seconds
        if info.node_type == "Reference" and any(n in info.node_name for n in COLLECTIVE_NAMES):
            collective += seconds
            element = 2 if "bf16" in info.exec_type.lower() else element
    return total, collective, element


@dataclass(frozen=True)
class _RankJob:
    xml: str
    inputs: dict[str, np.ndarray]
    rounds: int
    ready: Any
    go: Any
    done: Any
    exchange_values: int  # of one q / k / v all_to_all


def exchange_rate(group: str, values: int, ranks: int) -> float:
    """Bytes per second a rank sends in an eager ``all_to_all`` of ``values`` f32 values, the
    size of a step's q / k / v exchange (best of 5; the rank's one thread copies)."""
    from numaov.distributed.communicator import find_communicator

    communicator = find_communicator(group)
    values -= values % ranks
    data = np.random.default_rng(0).standard_normal(values, dtype=np.float32)
    out = np.empty_like(data)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        communicator.all_to_all(out, data)
        best = min(best, time.perf_counter() - start)
    return values * 4 * (ranks - 1) / ranks / best


def _rank(context: Any, job: _RankJob) -> dict[str, Any]:
    """One sequence-parallel worker: pinned to its CPU, one step per round between barriers."""
    from numaov.custom_ops import compile_ir

    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[context.rank]})
    compiled = compile_ir(job.xml, "bf16", {"INFERENCE_NUM_THREADS": 1, "PERF_COUNT": True})
    request = compiled.create_infer_request()
    feeds = {**job.inputs, "sequence_rank": np.array([context.rank], dtype=np.int64)}
    request.infer(feeds)  # warm-up
    job.ready.wait()  # the one worker's rounds start once no worker compiles any more
    times = []
    for _ in range(job.rounds + 1):  # the last round is the profiled one
        job.go.wait()
        start = time.perf_counter()
        request.infer(feeds)
        times.append(time.perf_counter() - start)
        job.done.wait()
    total, collective, element = profile(request)
    out = np.array(request.get_output_tensor(0).data)
    del compiled, request
    return {"times_s": times[:-1], "profiled_s": times[-1], "node_s": total,
            "collective_s": collective, "element_bytes": element,
            "exchange_bytes_s": exchange_rate(context.group, job.exchange_values,
                                              context.world_size),
            "sample": out if context.rank == 0 else None}


def exchanged_bytes(tokens: int, batch: int, width: int, layers: int, ranks: int,
                    element: int) -> int:
    """Bytes one rank sends per step: per block q, k, v out and the attention back, each
    ``(ranks - 1) / ranks`` of its share's ``batch x share x width`` values, and its output
    rows once (``all_gather``: 64 values per token of Wan's 16 x 2 x 2 patch)."""
    share = -(-tokens // ranks)
    per_block = 4 * batch * share * width * (ranks - 1) // ranks
    return (per_block * layers + batch * share * 64) * element


def step_flops(tokens: int, batch: int, config: Any, layers: int) -> float:
    """Multiply-adds x 2 of one step's blocks: self-attention's four projections and its
    L x L scores and values, cross-attention's two projections (the text's k / v are
    small), the feed-forward."""
    width, ffn = config.inner_dim, config.ffn_dim
    per_token = 2 * (6 * width * width + 2 * width * ffn) + 4 * tokens * width
    return float(batch * tokens * per_token * layers)


def run_parallel(args: Any, work: Path) -> int:
    import multiprocessing as mp

    import openvino as ov
    from dit import WIDTH_1_3B, build_checkpoint
    from machine import cpu_model

    from numaov.custom_ops import compile_ir
    from numaov.distributed.rank_group import run_rank_group
    from numaov.exporter.wan_export import export_wan
    from numaov.models.wan import SEQUENCE_GROUP

    ranks = args.ranks
    config = replace(WIDTH_1_3B, num_layers=args.layers)
    inputs = step_inputs(args.frames, args.height, args.width)
    tokens = int(np.prod(inputs["hidden_states"].shape[2:])) // 4
    log(f"{args.frames}x{args.height}x{args.width}: {tokens} tokens, batch 2 (guided step), "
        f"{args.layers} block(s) of Wan 1.3B width, {ranks} workers vs 1")
    start = time.perf_counter()
    checkpoint = build_checkpoint(work / "checkpoint", config)
    export_wan(checkpoint, work / "export", precision="bf16", sequence_parallel=[ranks])
    log(f"exported (bf16, --sequence-parallel {ranks}) in {time.perf_counter() - start:.0f} s")

    cpus = sorted(os.sched_getaffinity(0))[:ranks]
    whole = compile_ir(work / "export" / "model.xml", "bf16",
                       {"INFERENCE_NUM_THREADS": len(cpus), "PERF_COUNT": True})
    request = whole.create_infer_request()
    request.infer(inputs)  # warm-up
    ctx = mp.get_context("spawn")
    ready, go, done = (ctx.Barrier(ranks + 1) for _ in range(3))
    share = -(-tokens // ranks)
    job = _RankJob(str(work / "export" / f"sequence_{ranks}" / "model.xml"), inputs,
                   args.rounds, ready, go, done, exchange_values=3 * 2 * ranks * share * config.inner_dim)
    results: dict[str, Any] = {}
    workers = threading.Thread(target=lambda: results.update(split=run_rank_group(
        ranks, _rank, [job] * ranks, group=SEQUENCE_GROUP, timeout_s=7200)))
    workers.start()
    ready.wait()  # (earlier runs timed their first round while the workers still compiled)
    one = []
    for round_ in range(args.rounds + 1):  # alternate: one worker, then the N workers
        begin = time.perf_counter()
        request.infer(inputs)
        one.append(time.perf_counter() - begin)
        go.wait()
        done.wait()
        log(f"round {round_ + 1}: 1 worker {one[-1]:.2f} s")
    workers.join()
    whole_total, _, _ = profile(request)
    expected = np.array(request.get_output_tensor(0).data)
    split = results["split"]
    step = [max(r["times_s"][i] for r in split) for i in range(args.rounds)]
    ratios = [a / b for a, b in zip(one[:-1], step, strict=True)]
    # A collective's node time includes waiting for the slower rank: the rank that waited
    # least gives the exchange itself, the one that waited most the exchange and imbalance.
    collective = min(r["collective_s"] for r in split)
    collective_with_wait = max(r["collective_s"] for r in split)
    profiled = max(r["profiled_s"] for r in split)
    element = split[0]["element_bytes"]  # the collectives' precision as compiled
    moved = exchanged_bytes(tokens, 2, config.inner_dim, args.layers, ranks, element)
    bandwidth = moved / collective if collective else float("nan")
    copy_rate = min(r["exchange_bytes_s"] for r in split)
    # Two sockets, one rank each: a rank computes 1/N of the step's FLOPs at the socket's
    # sustained bf16 rate, and its exchange crosses the socket link at the given rate; one
    # worker on one socket computes all of it.
    flops = step_flops(tokens, 2, config, args.layers)
    per_rank_s = flops / ranks / (args.socket_tflops * 1e12)
    link_s = moved / (args.link_gbs * 1e9)
    copy_s = moved / copy_rate
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_model(),
        "openvino": ov.__version__,
        "video": [args.frames, args.height, args.width], "tokens": tokens,
        "layers": args.layers, "ranks": ranks, "cpus": cpus, "rounds": args.rounds,
        "one_worker_s": one[:-1], "split_step_s": step,
        "ratio_median": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
        "split_profiled_step_s": profiled, "split_collective_s": collective,
        "split_collective_with_wait_s": collective_with_wait,
        "collective_share": collective / profiled,
        "bytes_sent_per_rank": moved, "in_graph_bytes_s_with_wait": bandwidth,
        "eager_all_to_all_sent_bytes_s": copy_rate,
        "one_worker_node_s": whole_total,
        "max_abs_diff_vs_one_worker": float(np.abs(split[0]["sample"] - expected).max()),
        "output_scale": float(np.abs(expected).max()),
        "step_flops": flops,
        "two_socket_model": {
            "assumptions": f"one rank per socket computing 1/{ranks} of the step's "
                           f"{flops / 1e12:.1f} TFLOP at {args.socket_tflops:g} TFLOP/s "
                           f"sustained bf16; {moved / 2**20:.0f} MiB per rank sent at "
                           f"{copy_rate / 1e9:.2f} GB/s (this machine's one-thread all_to_all "
                           f"at the q / k / v size) or {args.link_gbs:g} GB/s (a copy that "
                           "uses the socket's bandwidth); no overlap of exchange and compute",
            "rank_compute_s": per_rank_s, "exchange_s_measured_copy": copy_s,
            "exchange_s_link": link_s,
            "speedup_measured_copy": ranks * per_rank_s / (per_rank_s + copy_s),
            "speedup_link": ranks * per_rank_s / (per_rank_s + link_s),
        },
    }
    log(f"1 worker / {ranks} sequence workers: median {report['ratio_median']:.3f}x "
        f"(range {min(ratios):.3f}-{max(ratios):.3f}); collectives {collective:.2f} s of a "
        f"{profiled:.2f} s split step ({100 * report['collective_share']:.1f}%; "
        f"{collective_with_wait:.2f} s with waiting for the other rank), "
        f"{moved / 2**20:.0f} MiB sent per rank ({bandwidth / 1e9:.2f} GB/s in the graph with "
        f"waiting, {copy_rate / 1e9:.2f} GB/s eager all_to_all); frames "
        f"differ by {report['max_abs_diff_vs_one_worker']:.3g} of {report['output_scale']:.3g}")
    model = report["two_socket_model"]
    log(f"2-socket model: {model['speedup_measured_copy']:.2f}x at the measured copy rate, "
        f"{model['speedup_link']:.2f}x at {args.link_gbs:g} GB/s ({model['assumptions']})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {args.out}")
    return 0

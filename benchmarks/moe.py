"""DeepSeek-V2 MoE with DP attention: prefill and decode per step, OpenVINO versus torch eager.

A DeepSeek-V2-shaped model (hidden 1024, 3 layers: one dense, two MoE with 64 routed experts,
top-6, 2 shared experts; vocab 16384) whose f32 weights, whole and per rank at dp=2, exceed
the L3 cache, so decode reads its weights from DRAM as a real model does. Side by side,
each in pinned worker processes of the binding plan (one rank per NUMA node, or
``NUMAOV_CPU_BIND``; on a one-node machine the allowed CPUs are split over the ranks):

- OpenVINO dp=1: the dp=1 IR on one worker with every core;
- OpenVINO dp=2: the per-rank IRs with the extension collectives (shared memory);
- torch eager dp=2 over gloo (the reference transport of torch.distributed);
- torch eager dp=2 over numaov's shared-memory collectives.

Workload: 4 prompts of 32 tokens (prompts round-robin over the ranks), one prefill step, then
8 decode steps of one token per prompt; one untimed warm-up generation first in each worker.
Printed: ms per prefill and per decode step, and ratios against torch eager dp=2 (gloo).

The whole model is also exported at dp=1 in each other weight format of ``--formats`` (int8,
int4, fp8, bf16: ``numaov export deepseek --weights``) and run on one worker.

Second part: one MoE layer (router + routed experts in numaov's MoeExperts op + shared
experts) exported alone in each weight format and compiled as the runtime does, against torch
eager f32 and bf16 (the op's eager face: the grouped loop), with ``n_routed_experts`` 64 and
doubled to 128 at the same top-k, at 4 rows (decode) and 128 / 1,024 rows (prefill). Every
competitor is sampled once per round, rounds alternate, medians and ranges are printed; bf16 is
timed twice where AMX is usable, as the runtime runs it (AMX tiles for experts of two rows or
more) and with ``NUMAOV_MOE_AMX=off`` (AVX512-BF16 only). Every call of the op is also set
against the machine's limits, measured in the same run by ``benchmarks/roofline.py`` on the
process's cores: the bytes it must read (the experts its rows hit, in the format with scales,
the shared experts and the f32 router) per second, as a share of the read bandwidth; its
multiply-adds (router, shared experts and each (row, slot) pair's expert) per second, as a
share of the f32 FMA peak and of the peak of the instructions the kernel runs the format on
(bf16: AMX tiles or AVX512-BF16; the others: f32 FMAs); and the roofline (the time the
binding limit allows over the median time). Every call here routes the same rows, so at 4 rows
the same 19-23 experts (9-80 MB by format) are read each time and, with a last-level cache of tens of
MB, partly from the cache: the read share can then overstate what memory gives
(``benchmarks/roofline.py`` cycles over disjoint sets of experts instead).

Third part (``--part amx-rows``): the bf16 MoeExperts op alone, 64 experts each given exactly
c = 1 .. 64 rows, on AMX tiles against AVX512-BF16, where AMX is usable: the row count from
which the kernel's automatic choice puts an expert on the tiles, and each kernel's
multiply-adds a second as a share of its measured peak (``benchmarks/roofline.py``).

    python benchmarks/moe.py [--decode-steps 8] [--rounds 15] [--part all|model|moe|amx-rows]
        [--formats f32,bf16,int8,int4,fp8]

Writes benchmarks/out/moe.json. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from numaov.exporter.lm_export import export_lm
from numaov.exporter.onnx_export import export_onnx
from numaov.exporter.openvino_convert import convert_to_ir
from numaov.models.builtin.deepseek_tiny import init_tiny_weights
from numaov.models.deepseek_v2 import DeepseekV2, DeepseekV2Config, DeepseekV2MoE
from numaov.runtime.lm.engine import (
    StepModel,
    TorchStep,
    generate_on_rank,
    open_step_model,
    plan_for_ranks,
    split_prompts,
)
from numaov.runtime.manifest_reader import read_manifest
from numaov.runtime.placement.workers import run_on_ranks

OUT = Path(__file__).resolve().parent / "out" / "moe.json"
SEED = 0
PROMPTS = 4
PROMPT_LEN = 32
MOE_ROWS = (4, 128, 1024)

BENCH_CONFIG = DeepseekV2Config(
    vocab_size=16384,
    hidden_size=1024,
    intermediate_size=2816,
    moe_intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=384,
    kv_lora_rank=256,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    topk_method="greedy",
    routed_scaling_factor=1.0,
    first_k_dense_replace=1,
    max_position_embeddings=512,
)


def log(message: str) -> None:
    print(message, flush=True)


def l3_bytes() -> int | None:
    """The largest level-3 cache of cpu0, from sysfs."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "level").read_text().strip() != "3":
                continue
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes) if sizes else None


# -- the whole model: prefill and decode on the worker processes ------------------------------


@dataclasses.dataclass(frozen=True)
class _Job:
    kind: str  # "openvino", "torch-shm" or "torch-gloo"
    model_dir: str
    prompts: list[list[int]]
    new_tokens: int
    rendezvous: str | None = None


def _bench_rank(context: Any, job: _Job) -> list[float]:
    """Worker: load this rank's model, one warm-up generation, then a timed one."""
    manifest = read_manifest(job.model_dir, expected_kind="deepseek")
    comm = None
    if job.kind == "torch-gloo":
        import torch.distributed as dist

        from numaov.distributed.communicator import GlooCommunicator, register_communicator

        dist.init_process_group("gloo", init_method=f"file://{job.rendezvous}",
                                rank=context.rank, world_size=context.world_size)
        # Under the group name the model's collectives look up: the same model code, another
        # transport.
        comm = GlooCommunicator(str(manifest.collective_group), dist.group.WORLD)
        register_communicator(comm)
        model: StepModel = TorchStep(manifest, context.rank)
    else:
        backend = "openvino" if job.kind == "openvino" else "torch"
        model = open_step_model(manifest, backend, context.rank, context.openvino_config())
    cache = manifest.record.cache
    generate_on_rank(model, job.prompts, 3, cache)
    timed = generate_on_rank(model, job.prompts, job.new_tokens, cache)
    model.close()
    return timed.step_seconds


def run_model(kind: str, model_dir: Path, dp: int, prompts: list[list[int]], new_tokens: int,
              tmp: Path) -> dict[str, Any]:
    # The placement group of run_on_ranks carries the shared-memory communicator; the gloo
    # run registers its own communicator under the model's group name instead.
    group = "deepseek" if kind != "torch-gloo" else "bench-placement"
    plan, placement = plan_for_ranks(dp)
    jobs = [_Job(kind, str(model_dir), share, new_tokens, str(tmp / f"gloo-{kind}-{dp}"))
            for share in split_prompts(prompts, dp)]
    log(f"  {kind} dp={dp} ({placement})")
    per_rank = run_on_ranks(plan, _bench_rank, jobs, group=group if dp > 1 else None,
                            timeout_s=3600)
    steps = [max(r[i] for r in per_rank) for i in range(new_tokens)]
    return {
        "placement": placement,
        "prefill_ms": 1e3 * steps[0],
        "decode_step_ms": 1e3 * statistics.median(steps[1:]),
        "decode_steps_ms": [1e3 * s for s in steps[1:]],
        "decode_tokens_per_s": len(prompts) / statistics.median(steps[1:]),
    }


def build_checkpoint(directory: Path) -> tuple[Path, int]:
    with torch.device("cpu"):
        model = DeepseekV2.empty(BENCH_CONFIG)
    init_tiny_weights(model, torch.Generator().manual_seed(SEED))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    path = model.save_pretrained(directory)
    return path, nbytes


# -- one MoE layer: the numaov op in every weight format against eager -------------------


class _MoEOnly(torch.nn.Module):
    def __init__(self, moe: DeepseekV2MoE) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


def _moe_module(experts: int) -> DeepseekV2MoE:
    config = dataclasses.replace(BENCH_CONFIG, n_routed_experts=experts)
    torch.manual_seed(SEED)
    moe = DeepseekV2MoE(config, 1)
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn(param.shape) / math.sqrt(param.shape[-1]))
        moe.gate.weight.mul_(4.0)
    return moe.eval()


def _format_bytes(numel: int, weights: str, row_length: int, group: int | None) -> float:
    """Bytes a stack of ``numel`` weights (rows of ``row_length``) takes in ``weights``."""
    per = {"f32": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5, "fp8": 1.0}[weights]
    scales = 0.0
    if weights in ("int8", "int4"):
        scales = 4.0 * numel / (group or row_length)
    elif weights == "fp8":  # 128 x 128 block scales kept as per-row groups of up to 128 values
        scales = 4.0 * numel / min(row_length, 128)
    return numel * per + scales


def layer_work(moe: DeepseekV2MoE, x: torch.Tensor, weights: str,
               group: int | None) -> dict[str, float]:
    """What a call on ``x`` must do: the bytes it reads (the hit experts' stacks, the shared
    experts in the weight format and the f32 router) and its multiply-adds (every row through
    the router and the shared experts, every (row, slot) pair through its expert)."""
    with torch.no_grad():
        ids, _ = moe.gate(x)
    hit = int(torch.unique(ids).numel())
    gate_up, down = moe.experts.gate_up_proj, moe.experts.down_proj
    per_expert = (_format_bytes(gate_up[0].numel(), weights, gate_up.shape[2], group)
                  + _format_bytes(down[0].numel(), weights, down.shape[2], group))
    shared = list(moe.shared_experts.parameters()) if moe.shared_experts else []
    shared_bytes = sum(_format_bytes(p.numel(), weights, p.shape[-1], group) for p in shared)
    router = moe.gate.weight.numel()
    per_row = router + sum(p.numel() for p in shared)  # a weight's numel: its MACs per row
    return {"hit_experts": hit, "rows_per_expert": ids.numel() / hit,
            "bytes": hit * per_expert + shared_bytes + 4.0 * router,
            "macs": x.shape[0] * per_row + ids.numel() * (gate_up[0].numel() + down[0].numel())}


def compile_moe_layer(moe: DeepseekV2MoE, weights: str, tmp: Path) -> Any:
    """The layer exported alone in ``weights`` and compiled as the runtime compiles it."""
    from numaov.custom_ops import compile_ir
    from numaov.custom_ops.expert_store import STORE_NAME, open_store, write_stacks
    from numaov.exporter.weight_formats import compress_other_weights, expert_group_size
    from numaov.models.layers.experts import StoredExperts

    layer = copy.deepcopy(moe)
    config = BENCH_CONFIG
    group = expert_group_size(weights, config.hidden_size, config.moe_intermediate_size)
    where = tmp / f"moe{moe.gate.num_experts}-{weights}"
    # the experts go to an expert store beside the IR, as an export writes them
    store = where / STORE_NAME
    write_stacks(store, {0: (layer.experts.gate_up_proj, layer.experts.down_proj)}, weights,
                 group)
    layer.experts = StoredExperts(open_store(store).store_id, 0)
    module = _MoEOnly(layer).eval()
    example = torch.randn(8, config.hidden_size)
    graph = export_onnx(module, (example,), None, {"x": {0: torch.export.Dim.DYNAMIC}},
                        where / "moe.onnx")
    compress = None
    if weights in ("int8", "int4"):
        def compress(model: Any) -> None:
            compress_other_weights(model, weights, group, moe.gate.num_experts)
    xml = convert_to_ir(graph.path, where / "moe.xml", "bf16" if weights == "bf16" else "f32",
                        compress=compress)
    threads = len(os.sched_getaffinity(0))
    precision = "bf16" if weights == "bf16" else "f32"
    compiled = compile_ir(xml, precision, {"INFERENCE_NUM_THREADS": threads})
    return compiled.create_infer_request(), group


def _timed(call: Any, min_s: float = 0.02) -> float:
    """Seconds per call: calls repeated until ``min_s`` has passed (one call for slow ones)."""
    count, start = 0, time.perf_counter()
    while True:
        call()
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_s:
            return elapsed / count


def _with_amx(setting: str, call: Any) -> Any:
    """``call`` run under NUMAOV_MOE_AMX=setting (read by the kernel at every call)."""
    def run() -> None:
        before = os.environ.get("NUMAOV_MOE_AMX")
        os.environ["NUMAOV_MOE_AMX"] = setting
        try:
            call()
        finally:
            if before is None:
                del os.environ["NUMAOV_MOE_AMX"]
            else:
                os.environ["NUMAOV_MOE_AMX"] = before
    return run


def moe_layer_bench(tmp: Path, rounds: int, formats: list[str]) -> dict[str, Any]:
    """For E = 64 and 128: the op in each weight format (OpenVINO; bf16 also with AMX off,
    ``openvino_bf16-avx512``) and eager f32 / bf16, at every row count, timed in alternating
    rounds (one sample of every competitor per round); medians and ranges over the rounds."""
    # imported here: roofline.py itself takes this module's timing helpers
    from roofline import format_limits, measure_limits, shares

    from numaov.custom_ops.moe_ops import bf16_kernel

    measured = measure_limits(sorted(os.sched_getaffinity(0)), min(rounds, 5), l3_bytes())
    kernel = bf16_kernel()
    log(f"bf16 experts: {kernel['kernel']} ({kernel['reason']})")
    log("the machine's limits (benchmarks/roofline.py):\n" + format_limits(measured))
    results: dict[str, Any] = {"limits": measured, "moe_bf16_kernel": kernel, "layers": []}
    rng = np.random.default_rng(SEED)
    inputs = {rows: rng.standard_normal((rows, BENCH_CONFIG.hidden_size), dtype=np.float32)
              for rows in MOE_ROWS}
    # Both expert counts are built first and timed in the same rounds, so load from other
    # processes falls on E=64 and E=128 alike and the doubling ratio compares like with like.
    layers: list[dict[str, Any]] = []
    for experts in (64, 128):
        moe = _moe_module(experts)
        eager_bf16 = copy.deepcopy(moe).to(torch.bfloat16)
        competitors: dict[str, Any] = {}
        groups: dict[str, int | None] = {}
        for weights in formats:
            log(f"  E={experts}: exporting the layer with {weights} weights")
            request, groups[weights] = compile_moe_layer(moe, weights, tmp)
            for rows, x in inputs.items():
                competitors[f"openvino_{weights}_{rows}"] = (
                    lambda request=request, x=x: request.infer({0: x}))
                if weights == "bf16" and kernel["kernel"] == "amx":
                    competitors[f"openvino_bf16-avx512_{rows}"] = _with_amx(
                        "off", lambda request=request, x=x: request.infer({0: x}))
        for rows, x in inputs.items():
            xt = torch.from_numpy(x)
            xb = xt.bfloat16()
            competitors[f"eager_f32_{rows}"] = lambda xt=xt, m=moe: m(xt)
            competitors[f"eager_bf16_{rows}"] = lambda xb=xb, m=eager_bf16: m(xb)
        layers.append({"experts": experts, "moe": moe, "groups": groups,
                       "competitors": competitors, "samples": {k: [] for k in competitors}})
    with torch.inference_mode():
        for layer in layers:
            for call in layer["competitors"].values():  # warm-up
                call()
        keys = list(layers[0]["competitors"])
        for round_number in range(rounds):
            # Every other round in reverse, so no competitor always follows eager's calls,
            # whose OpenMP threads keep spinning for a while after them: in one order only,
            # bf16 at 4 rows (always first after eager) measured 0.56-0.60x of the same op
            # with AMX off (second); in alternating orders, 0.82-0.88x.
            for key in keys if round_number % 2 == 0 else keys[::-1]:
                for layer in layers:
                    layer["samples"][key].append(1e3 * _timed(layer["competitors"][key]))
    for built in layers:
        moe, experts = built["moe"], built["experts"]
        layer: dict[str, Any] = {"experts": experts, "top_k": BENCH_CONFIG.num_experts_per_tok,
                                 "times_ms": {}}
        for key, times in built["samples"].items():
            layer["times_ms"][key] = {"median": statistics.median(times), "min": min(times),
                                      "max": max(times)}
        layer["work"] = {}
        for weights in formats:
            for rows in MOE_ROWS:
                need = layer_work(moe, torch.from_numpy(inputs[rows]), weights,
                                  built["groups"][weights])
                ms = layer["times_ms"][f"openvino_{weights}_{rows}"]["median"]
                read = measured["limits"].get("read", {}).get("all_cores", {}).get("median")
                layer["work"][f"{weights}_{rows}"] = {**need, **shares(
                    measured, read, weights, need["rows_per_expert"], need["bytes"],
                    need["macs"], ms / 1e3)}
        results["layers"].append(layer)
        log(f"  E={experts} (top-{BENCH_CONFIG.num_experts_per_tok}), ms median [min-max] "
            f"over {rounds} rounds:")
        for key, t in layer["times_ms"].items():
            log(f"    {key:24s} {t['median']:9.3f} [{t['min']:.3f}-{t['max']:.3f}]")
        for key, d in layer["work"].items():
            fma = f"{_share(d['of_fma_f32'])} of fma_f32, " if d["peak"] != "fma_f32" else ""
            log(f"    {key:10s} {d['hit_experts']:3d} experts hit, {d['bytes'] / 1e6:6.1f} MB, "
                f"{d['macs'] / 1e9:6.2f} GMAC: {d['gb_s']:5.1f} GB/s = "
                f"{_share(d['of_read'])} of read, {d['gmac_s']:6.1f} GMAC/s = {fma}"
                f"{_share(d['of_peak'])} of {d['peak']}; bound by {d.get('bound')}, "
                f"{_share(d.get('of_roofline'))} of the roofline")
    first, second = results["layers"]
    results["experts_doubled"] = {
        k: second["times_ms"][k]["median"] / first["times_ms"][k]["median"]
        for k in first["times_ms"]}
    for layer in results["layers"]:
        times = layer["times_ms"]
        layer["speedup"] = {
            f"{weights}_{rows}_vs_eager_{base}": times[f"eager_{base}_{rows}"]["median"]
            / times[f"openvino_{weights}_{rows}"]["median"]
            for weights in formats for rows in MOE_ROWS for base in ("f32", "bf16")}
        if f"openvino_bf16-avx512_{MOE_ROWS[0]}" in times:
            layer["speedup"].update({
                f"bf16_{rows}_amx_vs_avx512": times[f"openvino_bf16-avx512_{rows}"]["median"]
                / times[f"openvino_bf16_{rows}"]["median"] for rows in MOE_ROWS})
        log(f"  E={layer['experts']} speed-ups: " + ", ".join(
            f"{k} {v:.2f}x" for k, v in layer["speedup"].items()))
    log("  experts doubled (E=128 / E=64): " + ", ".join(
        f"{k} {v:.2f}x" for k, v in results["experts_doubled"].items()))
    return results


def _share(value: float | None) -> str:
    return f"{100 * value:3.0f}%" if value is not None else "  -"


AMX_SWEEP_ROWS = (1, 2, 3, 4, 8, 16, 64)


def amx_rows_sweep(tmp: Path, rounds: int) -> dict[str, Any]:
    """The MoeExperts op alone with bf16 weights (64 experts of the benchmark's shape, top-1),
    every expert given exactly c rows, on AMX tiles (NUMAOV_MOE_AMX=always) and on AVX512-BF16
    (off), in alternating rounds: where the tiles start to pay (the kernel's kAmxMinRows)."""
    from numaov.custom_ops import compile_ir
    from numaov.custom_ops.moe_ops import bf16_kernel, write_moe_onnx

    if bf16_kernel()["kernel"] != "amx":
        log(f"AMX rows sweep skipped: {bf16_kernel()['reason']}")
        return {}
    experts, hidden, inter = 64, BENCH_CONFIG.hidden_size, BENCH_CONFIG.moe_intermediate_size
    g = torch.Generator().manual_seed(SEED)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / math.sqrt(hidden)
    down = torch.randn(experts, hidden, inter, generator=g) / math.sqrt(inter)
    onnx_path = write_moe_onnx(tmp / "moe_op.onnx", gate_up, down, 1)
    request = compile_ir(convert_to_ir(onnx_path, tmp / "moe_op.xml", "bf16"), "bf16",
                         {"INFERENCE_NUM_THREADS": len(os.sched_getaffinity(0))}
                         ).create_infer_request()
    competitors: dict[str, Any] = {}
    for c in AMX_SWEEP_ROWS:
        feeds = {"x": torch.randn(c * experts, hidden, generator=g).numpy(),
                 "ids": torch.arange(experts).repeat(c).reshape(-1, 1).numpy(),
                 "weights": torch.rand(c * experts, 1, generator=g).numpy()}
        for setting, name in (("always", "amx"), ("off", "avx512")):
            competitors[f"{name}_{c}"] = _with_amx(setting, lambda feeds=feeds: request.infer(feeds))
    samples: dict[str, list[float]] = {k: [] for k in competitors}
    for call in competitors.values():  # warm-up
        call()
    for _ in range(rounds):
        for key, call in competitors.items():
            samples[key].append(1e3 * _timed(call))
    times = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
             for k, v in samples.items()}
    # imported here: roofline.py itself takes this module's timing helpers
    from roofline import format_limits, measure_limits

    measured = measure_limits(sorted(os.sched_getaffinity(0)), min(rounds, 5), l3_bytes())
    log("the machine's limits (benchmarks/roofline.py):\n" + format_limits(measured))
    peaks = {name: limit["all_cores"]["median"] for name, limit in measured["limits"].items()}
    log(f"MoeExperts op alone, bf16, {experts} experts each with c rows (top-1), ms median "
        f"[min-max] over {rounds} rounds; multiply-adds a second as a share of the AMX bf16 "
        f"and AVX512-BF16 peaks:")
    gmac_s: dict[str, float] = {}
    for c in AMX_SWEEP_ROWS:
        amx, avx = times[f"amx_{c}"], times[f"avx512_{c}"]
        macs = c * experts * 3 * hidden * inter
        gmac_s[f"amx_{c}"] = macs / amx["median"] / 1e6
        gmac_s[f"avx512_{c}"] = macs / avx["median"] / 1e6
        log(f"  c={c:3d}: AMX {amx['median']:8.2f} [{amx['min']:.2f}-{amx['max']:.2f}]  AVX512-BF16 "
            f"{avx['median']:8.2f} [{avx['min']:.2f}-{avx['max']:.2f}]  AMX speed-up "
            f"{avx['median'] / amx['median']:.2f}x; "
            f"{_share(gmac_s[f'amx_{c}'] / peaks['amx_bf16'] if 'amx_bf16' in peaks else None)}"
            f" of amx_bf16, "
            f"{_share(gmac_s[f'avx512_{c}'] / peaks['dot_bf16'] if 'dot_bf16' in peaks else None)}"
            f" of dot_bf16")
    return {"amx_rows_sweep": {"experts": experts, "rows_per_expert": list(AMX_SWEEP_ROWS),
                               "times_ms": times, "gmac_s": gmac_s, "limits": measured}}


def whole_model(tmp: Path, decode_steps: int, l3: int | None,
                formats: tuple[str, ...] = ()) -> dict[str, Any]:
    results: dict[str, Any] = {}
    checkpoint, nbytes = build_checkpoint(tmp / "checkpoint")
    results["weights_bytes"] = nbytes
    log(f"model weights {nbytes / 2**20:.0f} MiB (f32) vs L3 "
        f"{l3 / 2**20 if l3 else float('nan'):.0f} MiB")
    for dp in (1, 2):
        start = time.perf_counter()
        export_lm(checkpoint, tmp / f"dp{dp}", dp=dp, precision="f32",
                        progress=lambda m: log(f"    export: {m}"))
        results[f"export_dp{dp}_s"] = time.perf_counter() - start
    rng = np.random.default_rng(SEED)
    prompts = rng.integers(2, BENCH_CONFIG.vocab_size, (PROMPTS, PROMPT_LEN)).tolist()
    new_tokens = 1 + decode_steps
    log(f"whole model: prefill {PROMPTS} x {PROMPT_LEN} tokens, then {decode_steps} decode steps")
    runs = {
        "openvino_dp1": run_model("openvino", tmp / "dp1", 1, prompts, new_tokens, tmp),
        "openvino_dp2": run_model("openvino", tmp / "dp2", 2, prompts, new_tokens, tmp),
        "torch_gloo_dp2": run_model("torch-gloo", tmp / "dp2", 2, prompts, new_tokens, tmp),
        "torch_shm_dp2": run_model("torch-shm", tmp / "dp2", 2, prompts, new_tokens, tmp),
    }
    for weights in formats:  # dp=1 only: the format changes the weight bytes, not the DP split
        if weights == "f32":
            continue
        export_lm(checkpoint, tmp / f"dp1-{weights}", dp=1, precision="f32",
                        weights=weights, progress=lambda m: log(f"    export: {m}"))
        runs[f"openvino_dp1_{weights}"] = run_model("openvino", tmp / f"dp1-{weights}", 1,
                                                    prompts, new_tokens, tmp)
    results["runs"] = runs
    base = runs["torch_gloo_dp2"]
    log(f"{'':18s}{'prefill ms':>12s}{'decode ms/step':>16s}   speed vs torch eager dp=2 gloo")
    for name, run in runs.items():
        log(f"{name:18s}{run['prefill_ms']:12.1f}{run['decode_step_ms']:16.1f}"
            f"{base['prefill_ms'] / run['prefill_ms']:9.2f}x prefill"
            f"{base['decode_step_ms'] / run['decode_step_ms']:7.2f}x decode")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15,
                        help="timed MoE-layer rounds (medians and ranges)")
    parser.add_argument("--formats", default="f32,bf16,int8,int4,fp8",
                        help="weight formats of the MoE layer (comma-separated)")
    parser.add_argument("--part", choices=["all", "model", "moe", "amx-rows"], default="all",
                        help="the whole model, the MoE layer, the op's AMX rows sweep, or all "
                             "(default)")
    args = parser.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    l3 = l3_bytes()
    results: dict[str, Any] = {
        "machine": {"cpus": sorted(os.sched_getaffinity(0)), "l3_bytes": l3,
                    "platform": platform.platform(), "python": sys.version.split()[0]},
        "config": BENCH_CONFIG.to_dict(),
    }
    if args.part != "all" and OUT.is_file():  # keep the other part's figures
        results = {**json.loads(OUT.read_text()), **results}
    with tempfile.TemporaryDirectory(prefix="numaov-moe-") as tmp_name:
        tmp = Path(tmp_name)
        if args.part in ("all", "model"):
            results.update(whole_model(tmp, args.decode_steps, l3,
                                       tuple(args.formats.split(","))))
            save(results)
        if args.part in ("all", "moe"):
            results.update(moe_layer_bench(tmp, args.rounds, args.formats.split(",")))
            save(results)
        if args.part in ("all", "amx-rows"):
            results.update(amx_rows_sweep(tmp, args.rounds))
    save(results)


def save(results: dict[str, Any]) -> None:
    """Written after each part, so a later failure keeps what was measured."""
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    log(f"wrote {OUT}")


if __name__ == "__main__":
    main()

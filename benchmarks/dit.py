"""Wan DiT forward: numaov on PyTorch / ONNX Runtime / OpenVINO versus the naive export.

One forward of a Wan-1.3B-width transformer (hidden 1536, 12 heads, FFN 8960, text dim 4096,
2 blocks) at 1,280 and 5,120 video tokens, batch 1, 64 text tokens, side by side:

- numaov's model in PyTorch eager, fp32 and bf16 (bf16 also with the FFN in the column blocks
  the export writes; and diffusers' eager bf16 for context);
- numaov's ONNX export in ONNX Runtime (fp32);
- numaov's IR in OpenVINO, f32 and bf16 inference precision (bf16 as the runtime compiles it:
  with numaov's AMX flash attention where AMX is usable; and with OpenVINO's own attention);
- the naive path: diffusers' own ``WanTransformer3DModel`` (same weights) exported with
  ``torch.onnx.export(dynamo=True)`` and run by OpenVINO, f32 and bf16.

Competitors are timed round-robin (one forward each per round), each target's pair back to
back, so load from other processes and the machine's speed drift hit them alike; every ratio is
printed as the median of its per-round ratios, with the ratio of best times beside it. Also
printed: the compiled models' executed layer types (how many RMS / MVN / RoPE / attention /
Reorder / Transpose nodes), one self-attention alone (PyTorch's, OpenVINO's and numaov's
kernels), and per-block time and memory, measured against a 0-block model, extrapolated to
Wan 2.1 T2V 1.3B (30 blocks).

    python benchmarks/dit.py [--quick] [--rounds 3]

Writes benchmarks/out/dit.json. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from numaov.custom_ops import compile_ir
from numaov.custom_ops.flash_attention import attention_kernel, flash_attention
from numaov.exporter.onnx_export import export_onnx
from numaov.exporter.openvino_convert import convert_to_ir
from numaov.exporter.wan_export import FFN_COLUMN_BLOCK
from numaov.models.builtin.wan_tiny import save_wan_checkpoint
from numaov.models.wan.transformer import WanTransformer, WanTransformerConfig

OUT = Path(__file__).resolve().parent / "out" / "dit.json"
SEED = 0
TEXT_LEN = 64
# Latent (frames, height, width) giving 1,280 and 5,120 tokens with patch (1, 2, 2).
SHAPES = {1280: (5, 32, 32), 5120: (5, 64, 64)}
# Wan 2.1 T2V 1.3B at 480x832, 81 frames: latent 21 x 60 x 104 -> 32,760 tokens.
WAN_480P_TOKENS = 21 * 30 * 52
WAN_1_3B_BLOCKS = 30
SAMPLING_FORWARDS = 50 * 2  # 50 steps, conditional + unconditional

WIDTH_1_3B = WanTransformerConfig(
    patch_size=(1, 2, 2),
    num_attention_heads=12,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=8960,
    num_layers=2,
    cross_attn_norm=True,
    eps=1e-6,
)
# Round order: each target's two runners back to back (see run()).
RUN_ORDER = (
    "torch eager bf16",
    "openvino bf16 numaov",
    "openvino bf16 numaov ov-attention",
    "openvino bf16 naive",
    "torch eager bf16 ffn blocks",
    "diffusers eager bf16",
    "torch eager fp32",
    "openvino f32 numaov",
    "openvino f32 naive",
    "onnxruntime fp32",
    "openvino bf16 numaov 0-block",
)
# name: (the runners to beat (the fastest of them counts), the runner that should be faster)
RATIOS = {
    "openvino bf16 / eager bf16 speedup": (
        ("torch eager bf16", "torch eager bf16 ffn blocks"), "openvino bf16 numaov"),
    "openvino bf16 numaov / naive speedup": (("openvino bf16 naive",), "openvino bf16 numaov"),
    "numaov attention / openvino attention speedup (bf16 forward)": (
        ("openvino bf16 numaov ov-attention",), "openvino bf16 numaov"),
    "openvino bf16 / diffusers eager bf16 speedup": (
        ("diffusers eager bf16",), "openvino bf16 numaov"),
    "openvino f32 numaov / naive speedup": (("openvino f32 naive",), "openvino f32 numaov"),
    "openvino f32 / eager fp32 speedup": (("torch eager fp32",), "openvino f32 numaov"),
    "openvino f32 / onnxruntime fp32 speedup": (("onnxruntime fp32",), "openvino f32 numaov"),
}
# Layer types of interest in OpenVINO's executed graph (rt_info "layerType").
INVENTORY = {
    "RMS": ("RMS",),
    "MVN": ("MVN",),
    "RoPE": ("RoPE",),
    "attention": ("ScaledDotProductAttention", "ScaledAttn", "MHA", "SDPA"),
    "Reorder": ("Reorder",),
    "Transpose": ("Transpose",),
}


def log(message: str) -> None:
    print(message, flush=True)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_inputs(tokens: int) -> dict[str, np.ndarray]:
    frames, height, width = SHAPES[tokens]
    rng = np.random.default_rng(SEED + tokens)
    return {
        "hidden_states": rng.standard_normal((1, 16, frames, height, width), dtype=np.float32),
        "timestep": np.array([700.0], dtype=np.float32),
        "encoder_hidden_states": rng.standard_normal((1, TEXT_LEN, 4096), dtype=np.float32),
    }


def dynamic_shapes() -> dict[str, dict[int, object]]:
    dim = torch.export.Dim
    batch, text = dim("batch", min=1, max=256), dim("text_length", min=1, max=4096)
    return {
        "hidden_states": {
            0: batch,
            2: dim("frame_patches", min=1, max=1024),
            3: 2 * dim("height_patches", min=1, max=1024),
            4: 2 * dim("width_patches", min=1, max=1024),
        },
        "timestep": {0: batch},
        "encoder_hidden_states": {0: batch, 1: text},
    }


def example_inputs() -> dict[str, torch.Tensor]:
    # Sizes other than 0/1 on every dynamic axis (torch.export would specialise those).
    gen = torch.Generator().manual_seed(SEED)
    return {
        "hidden_states": torch.randn(2, 16, 3, 8, 10, generator=gen),
        "timestep": torch.tensor([10.0, 500.0]),
        "encoder_hidden_states": torch.randn(2, 11, 4096, generator=gen),
    }


class DiffusersForward(torch.nn.Module):
    """diffusers' model with a plain-tensor output, as a user would export it."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, hidden_states, timestep, encoder_hidden_states):
        return self.model(hidden_states, timestep, encoder_hidden_states, return_dict=False)[0]


def build_checkpoint(directory: Path, config: WanTransformerConfig) -> Path:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = WanTransformer(config)
    return save_wan_checkpoint(model, directory)


def diffusers_model(checkpoint: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """diffusers' model on the same weights (its from_pretrained needs `accelerate` for Wan).

    In bf16, parameters matching _keep_in_fp32_modules stay fp32, as from_pretrained does.
    """
    import diffusers
    from safetensors.torch import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    model = diffusers.WanTransformer3DModel.from_config(config).eval()
    model.load_state_dict(load_file(checkpoint / "diffusion_pytorch_model.safetensors"))
    for name, param in model.named_parameters():
        if not any(keep in name for keep in model._keep_in_fp32_modules):
            param.data = param.data.to(dtype)
    return model


def export_numaov(checkpoint: Path, out: Path) -> tuple[Path, dict[str, Path], float]:
    """ONNX plus an f32 IR and a bf16-weights IR (what `numaov export --precision` writes)."""
    model = WanTransformer.from_pretrained(checkpoint).split_ffn_columns(FFN_COLUMN_BLOCK)
    start = time.perf_counter()
    graph = export_onnx(model, (), example_inputs(), dynamic_shapes(), out / "model.onnx")
    irs = {p: convert_to_ir(graph.path, out / f"model_{p}.xml", p) for p in ("f32", "bf16")}
    return graph.path, irs, time.perf_counter() - start


def export_naive(checkpoint: Path, out: Path) -> tuple[Path, float]:
    """diffusers -> torch.onnx.export -> openvino.convert_model, no numaov involved."""
    import openvino as ov

    module = DiffusersForward(diffusers_model(checkpoint)).eval()
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # The same dynamic axes as numaov's export, so neither graph is specialised to a shape.
    with torch.no_grad():
        program = torch.onnx.export(
            module,
            (),
            kwargs=example_inputs(),
            dynamo=True,
            dynamic_shapes=dynamic_shapes(),
            optimize=True,
            verbose=False,
        )
    program.save(str(out / "model.onnx"), external_data=True)
    xml = out / "model.xml"
    ov.save_model(ov.convert_model(str(out / "model.onnx")), str(xml), compress_to_fp16=False)
    return xml, time.perf_counter() - start


def inventory(compiled) -> dict[str, object]:
    """Executed layer types; attention counts SDPA nodes and Softmax-bearing MHA subgraphs."""
    types: Counter[str] = Counter()
    fused_attention = 0
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        layer_type = info["layerType"].astype(str)
        types[layer_type] += 1
        if layer_type in ("Subgraph", "Reference") and is_attention(info):
            fused_attention += 1
    counts = {
        key: sum(n for t, n in types.items() if t in names) for key, names in INVENTORY.items()
    }
    counts["attention"] += fused_attention
    return {"counts": counts, "all": dict(sorted(types.items()))}


def is_attention(rt_info) -> bool:
    """Whether a compiled node runs attention: OpenVINO's MHA snippet (it holds a Softmax) or
    numaov's FlashAttention (a Reference node named after the attention it replaced)."""
    names = rt_info["originalLayersNames"].astype(str)
    return "Softmax" in names or "scaled_dot_product_attention" in names


class Runner:
    """A named forward over numpy inputs, plus the memory its setup took."""

    def __init__(self, name: str, run: Callable[[dict[str, np.ndarray]], np.ndarray], memory: int):
        self.name, self.run, self.memory = name, run, memory


def torch_runner(name: str, model: torch.nn.Module, dtype: torch.dtype) -> Runner:
    def run(inputs: dict[str, np.ndarray]) -> np.ndarray:
        with torch.no_grad():
            out = model(
                torch.from_numpy(inputs["hidden_states"]).to(dtype),
                torch.from_numpy(inputs["timestep"]),
                torch.from_numpy(inputs["encoder_hidden_states"]).to(dtype),
            )
        return out.float().numpy()

    return Runner(name, run, 0)


def openvino_runner(
    name: str, xml: Path, precision: str, attention: str = "openvino"
) -> tuple[Runner, object]:
    """The IR compiled as the runtime compiles it (``compile_ir``), with ``attention``
    ("numaov" / "openvino") in place of NUMAOV_ATTENTION so both kernels run in one process."""
    before = rss_bytes()
    compiled = compile_ir(xml, precision, attention=attention).model
    request = compiled.create_infer_request()

    def run(inputs: dict[str, np.ndarray]) -> np.ndarray:
        return request.infer(inputs)[0].copy()

    return Runner(name, run, rss_bytes() - before), compiled


def onnxruntime_runner(name: str, onnx_path: Path) -> Runner:
    import onnxruntime as ort

    before = rss_bytes()
    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count() or 1
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])

    def run(inputs: dict[str, np.ndarray]) -> np.ndarray:
        return session.run(None, inputs)[0]

    return Runner(name, run, rss_bytes() - before)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _memory_probe(
    xml: str, precision: str, token_counts: list[int], attention: str
) -> dict[str, float]:
    """In a fresh process: RSS after compiling, peak RSS after a forward at each size, and
    the share of the forward spent in attention at the largest size (from OpenVINO's
    per-node counters), which the extrapolation scales quadratically."""
    base = _status_bytes("VmRSS")
    compiled = compile_ir(xml, precision, {"PERF_COUNT": "YES"}, attention=attention).model
    request = compiled.create_infer_request()
    result: dict[str, float] = {"compiled": _status_bytes("VmRSS") - base}
    for tokens in sorted(token_counts):  # VmHWM only grows: smallest size first
        request.infer(make_inputs(tokens))
        result[str(tokens)] = _status_bytes("VmHWM") - base
    attention_nodes = {
        op.get_friendly_name()
        for op in compiled.get_runtime_model().get_ordered_ops()
        if is_attention(op.get_rt_info())
    }
    shares = []
    for _ in range(2):
        request.infer(make_inputs(max(token_counts)))
        times = {p.node_name: p.real_time.total_seconds() for p in request.profiling_info}
        shares.append(sum(times.get(n, 0.0) for n in attention_nodes) / sum(times.values()))
    result["attention_share"] = min(shares)
    return result


def memory_probe(
    xml: Path, precision: str, token_counts: list[int], attention: str
) -> dict[str, float]:
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_memory_probe, (str(xml), precision, token_counts, attention))


def attention_alone(tokens: int, heads: int, head_dim: int, rounds: int) -> dict:
    """Self-attention of one block alone, [1, heads, tokens, head_dim], round-robin: PyTorch's
    bf16 SDPA (its CPU flash attention), OpenVINO's ScaledDotProductAttention compiled at bf16
    (its MHA snippet), and numaov's FlashAttention kernel where AMX is usable."""
    import openvino as ov
    import openvino.opset13 as ops

    rng = np.random.default_rng(SEED)
    q, k, v = (rng.standard_normal((1, heads, tokens, head_dim), dtype=np.float32) for _ in "qkv")
    params = [ops.parameter([1, heads, -1, head_dim], np.float32, name=n) for n in "qkv"]
    sdpa = ov.Model([ops.scaled_dot_product_attention(*params, causal=False)], params)
    request = compile_ir(sdpa, "bf16", attention="openvino").create_infer_request()
    tq, tk, tv = (torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v))

    def torch_sdpa(_: dict) -> np.ndarray:
        return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv).float().numpy()

    runners = [
        Runner("torch sdpa bf16", torch_sdpa, 0),
        Runner("openvino sdpa bf16", lambda _: request.infer([q, k, v])[0].copy(), 0),
    ]
    if attention_kernel("bf16") == "numaov":
        runners.append(Runner("numaov flash attention", lambda _: flash_attention(q, k, v), 0))
    reference = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(x) for x in (q, k, v))
    ).numpy()
    results = time_round_robin(runners, {}, rounds, reference)
    best = {name: result["best_s"] for name, result in results.items()}
    errors = {name: result["max_abs_diff_vs_reference"] for name, result in results.items()}
    log(f"\n== attention alone: [1, {heads}, {tokens}, {head_dim}], best of {rounds} ==")
    for name, seconds in best.items():
        log(f"  {name:24s} {seconds * 1e3:8.1f} ms   max|diff| vs torch fp32 {errors[name]:.1e}")
    result: dict[str, object] = {"best_s": best, "max_abs_diff_vs_torch_fp32": errors}
    if "numaov flash attention" in best:
        fast = best["numaov flash attention"]
        result["ratios"] = {
            "numaov / openvino sdpa speedup": best["openvino sdpa bf16"] / fast,
            "numaov / torch sdpa speedup": best["torch sdpa bf16"] / fast,
        }
        for name, value in result["ratios"].items():
            log(f"  {name:42s} {value:5.2f}x")
    return result


def paired_ratio(results: dict, slower: tuple[str, ...], faster: str) -> dict:
    """How many times faster ``faster`` is than the fastest of ``slower``: per round (the
    runners ran back to back), its median over the rounds, and the ratio of best times."""
    rounds = len(results[faster]["times_s"])
    per_round = [
        min(results[name]["times_s"][i] for name in slower) / results[faster]["times_s"][i]
        for i in range(rounds)
    ]
    best = min(results[name]["best_s"] for name in slower) / results[faster]["best_s"]
    return {"median_of_rounds": float(np.median(per_round)), "best_of": best, "per_round": per_round}


def time_round_robin(
    runners: list[Runner],
    inputs: dict[str, np.ndarray],
    rounds: int,
    reference: str | np.ndarray = "torch eager fp32",
) -> dict:
    """Warm up, then ``rounds`` rounds of one forward per runner; outputs are compared with
    the ``reference`` runner's (or with ``reference`` itself, when it is an array)."""
    results = {}
    outputs = {}
    for runner in runners:  # warm-up (OpenVINO shape inference, allocator, caches)
        before = rss_bytes()
        outputs[runner.name] = runner.run(inputs)
        results[runner.name] = {"times_s": [], "rss_after_first_run_bytes": rss_bytes() - before}
    for _ in range(rounds):
        for runner in runners:
            start = time.perf_counter()
            runner.run(inputs)
            results[runner.name]["times_s"].append(time.perf_counter() - start)
    expected = outputs[reference] if isinstance(reference, str) else reference
    scale = float(np.abs(expected).max())
    for name, result in results.items():
        result["best_s"] = min(result["times_s"])
        result["reference"] = reference if isinstance(reference, str) else "given"
        result["max_abs_diff_vs_reference"] = float(np.abs(outputs[name] - expected).max())
        result["output_scale"] = scale
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1,280 tokens only")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON report (default {OUT}; with --parallel dit_parallel.json)")
    parallel = parser.add_argument_group(
        "--parallel: one guided step on 1 worker against N sequence-parallel workers "
        "(benchmarks/dit_parallel.py)")
    parallel.add_argument("--parallel", action="store_true")
    parallel.add_argument("--ranks", type=int, default=2, help="sequence-parallel workers")
    parallel.add_argument("--layers", type=int, default=2, help="blocks of Wan 1.3B width")
    parallel.add_argument("--frames", type=int, default=33)
    parallel.add_argument("--height", type=int, default=480)
    parallel.add_argument("--width", type=int, default=832)
    parallel.add_argument("--socket-tflops", type=float, default=20.0,
                          help="2-socket model: a socket's sustained bf16 TFLOP/s")
    parallel.add_argument("--link-gbs", type=float, default=40.0,
                          help="2-socket model: GB/s a rank's exchange gets across sockets")
    args = parser.parse_args(argv)
    # The exports take several GB of disk; they are removed when the run ends.
    with tempfile.TemporaryDirectory(prefix="numaov-dit-bench-") as work:
        if args.parallel:
            from dit_parallel import OUT as PARALLEL_OUT
            from dit_parallel import run_parallel

            args.out = args.out or PARALLEL_OUT
            return run_parallel(args, Path(work))
        args.out = args.out or OUT
        return run(args, Path(work))


def run(args: argparse.Namespace, work: Path) -> int:
    import openvino as ov

    torch.manual_seed(SEED)
    torch.set_num_threads(os.cpu_count() or 1)
    token_counts = [1280] if args.quick else [1280, 5120]
    report: dict[str, object] = {
        "config": WIDTH_1_3B.to_dict(),
        "text_len": TEXT_LEN,
        "rounds": args.rounds,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
        },
        "versions": {"torch": torch.__version__, "openvino": ov.__version__},
        "results": {},
    }
    log(f"work dir {work}")
    checkpoint = build_checkpoint(work / "ckpt", WIDTH_1_3B)
    empty_checkpoint = build_checkpoint(work / "ckpt0", replace(WIDTH_1_3B, num_layers=0))

    log("exporting numaov (2 blocks, 0 blocks) and the naive diffusers path ...")
    onnx_path, irs, seconds = export_numaov(checkpoint, work / "numaov")
    log(f"  numaov export + IRs: {seconds:.1f} s")
    _, irs0, _ = export_numaov(empty_checkpoint, work / "numaov0")
    naive_xml, seconds = export_naive(checkpoint, work / "naive")
    log(f"  naive export + IR: {seconds:.1f} s")
    gc.collect()

    eager32 = WanTransformer.from_pretrained(checkpoint)
    eager16 = WanTransformer.from_pretrained(checkpoint, dtype=torch.bfloat16)
    runners = [
        torch_runner("torch eager fp32", eager32, torch.float32),
        torch_runner("torch eager bf16", eager16, torch.bfloat16),
        # The exported FFN layout run eagerly, to show the layout is not what makes the gap.
        torch_runner(
            "torch eager bf16 ffn blocks",
            WanTransformer.from_pretrained(checkpoint, dtype=torch.bfloat16).split_ffn_columns(
                FFN_COLUMN_BLOCK
            ),
            torch.bfloat16,
        ),
        # For context: diffusers' own eager model, to show numaov's eager baseline is not slow.
        torch_runner(
            "diffusers eager bf16",
            DiffusersForward(diffusers_model(checkpoint, torch.bfloat16)),
            torch.bfloat16,
        ),
        onnxruntime_runner("onnxruntime fp32", onnx_path),
    ]
    # numaov runs its own IR of each precision; the naive path compiles its one f32 IR with
    # either inference precision, as a user of openvino.convert_model would.
    # numaov's bf16 IR runs as the runtime runs it: with numaov's AMX flash attention where
    # the CPU has AMX (and NUMAOV_ATTENTION allows), and also with OpenVINO's own attention.
    attention = attention_kernel("bf16")
    log(f"numaov bf16 attention: {attention}'s")
    compiled = {}
    for label, precision, path, attn in (
        ("numaov", "f32", irs["f32"], "openvino"),
        ("numaov", "bf16", irs["bf16"], attention),
        ("numaov ov-attention", "bf16", irs["bf16"], "openvino"),
        ("naive", "f32", naive_xml, "openvino"),
        ("naive", "bf16", naive_xml, "openvino"),
        ("numaov 0-block", "bf16", irs0["bf16"], attention),
    ):
        if label == "numaov ov-attention" and attention == "openvino":
            continue  # the same as "numaov bf16"
        runner, compiled[(label, precision)] = openvino_runner(
            f"openvino {precision} {label}", path, precision, attn
        )
        runners.append(runner)
    # The pairs the targets compare run next to each other in every round, so that this VM's
    # speed drift (benchmarks/RESULTS.md) moves both alike; the ratios are taken per round.
    by_name = {runner.name: runner for runner in runners}
    runners = [by_name[name] for name in RUN_ORDER if name in by_name]

    for tokens in token_counts:
        log(f"\n== {tokens} video tokens, {TEXT_LEN} text tokens, {args.rounds} rounds ==")
        inputs = make_inputs(tokens)
        results = time_round_robin(runners, inputs, args.rounds)
        for name, result in results.items():
            if "0-block" in name:  # a different model: its output is not comparable
                log(f"  {name:28s} {result['best_s']:7.3f} s")
                continue
            log(
                f"  {name:28s} {result['best_s']:7.3f} s   max|diff| vs eager fp32 "
                f"{result['max_abs_diff_vs_reference']:.2e} (scale {result['output_scale']:.2f})"
            )
        best = {name: r["best_s"] for name, r in results.items()}
        ratios = {
            name: paired_ratio(results, slower, faster) for name, (slower, faster) in RATIOS.items()
            if all(runner in results for runner in (*slower, faster))
        }
        for name, ratio in ratios.items():
            rounds = ratio["per_round"]
            log(
                f"  {name:58s} {ratio['median_of_rounds']:5.2f}x  (best-of {ratio['best_of']:.2f}x, "
                f"rounds {min(rounds):.2f}-{max(rounds):.2f}x)"
            )
        per_block = (best["openvino bf16 numaov"] - best["openvino bf16 numaov 0-block"]) / 2
        report["results"][str(tokens)] = {
            "shape": SHAPES[tokens],
            "runners": results,
            "ratios": ratios,
            "openvino_bf16_per_block_s": per_block,
            "openvino_bf16_outside_blocks_s": best["openvino bf16 numaov 0-block"],
        }
        log(
            f"  per block (OpenVINO bf16): {per_block:.3f} s; outside the blocks "
            f"{best['openvino bf16 numaov 0-block']:.3f} s"
        )

    report["attention_alone"] = {}
    for tokens in token_counts:
        report["attention_alone"][str(tokens)] = attention_alone(
            tokens, WIDTH_1_3B.num_attention_heads, WIDTH_1_3B.attention_head_dim,
            args.rounds,
        )

    log("\n== executed layer types (OpenVINO, after the runs) ==")
    inventories = {}
    for (label, precision), model in compiled.items():
        if label == "numaov 0-block":
            continue
        inventories[f"{label} {precision}"] = inventory(model)
        log(f"  {label:7s} {precision:4s} {inventories[f'{label} {precision}']['counts']}")
    report["inventory"] = inventories

    del runners, compiled, eager16
    gc.collect()

    # Memory, each in a fresh process: RSS after compiling the bf16 IR, and peak RSS after a
    # forward at each size. Per block = (2-block - 0-block) / 2 after compiling; activations =
    # peak - compiled of the 2-block model (they do not grow with depth: buffers are reused).
    log("\n== memory (OpenVINO bf16, fresh process each) ==")
    probe = memory_probe(irs["bf16"], "bf16", token_counts, attention)
    probe0 = memory_probe(irs0["bf16"], "bf16", token_counts, attention)
    per_block_bytes = (probe["compiled"] - probe0["compiled"]) / 2
    params_per_block = sum(p.numel() for p in eager32.blocks[0].parameters())
    params_outside = sum(
        p.numel() for n, p in eager32.named_parameters() if not n.startswith("blocks.")
    )
    activations = {tokens: probe[str(tokens)] - probe["compiled"] for tokens in token_counts}
    report["memory"] = {
        "probe_2_blocks": probe,
        "probe_0_blocks": probe0,
        "per_block_bytes": per_block_bytes,
        "activation_bytes": activations,
        "params_per_block": params_per_block,
        "params_outside_blocks": params_outside,
    }
    log(
        f"  parameters: {params_per_block / 1e6:.1f} M per block, {params_outside / 1e6:.1f} M "
        f"outside; compiled memory per block {per_block_bytes / 2**20:.0f} MiB, outside the "
        f"blocks {probe0['compiled'] / 2**20:.0f} MiB"
    )
    for tokens, value in activations.items():
        log(f"  activations at {tokens} tokens: {value / 2**20:.0f} MiB")

    # Extrapolation from the largest measured size L0 to Wan 2.1 T2V 1.3B at 480p x 81 frames:
    # per block, the attention share of the time (profiled) grows with (L/L0)^2 and the rest
    # (projections, FFN, norms) with L/L0; activation memory is fitted as a + b*L through the
    # measured sizes (with one size, proportional to L). The blocks of the real model are the
    # benchmark's blocks (same width), so per-block figures carry over; only depth differs.
    l0 = max(token_counts)
    length = WAN_480P_TOKENS
    share = probe["attention_share"]
    per_block0 = report["results"][str(l0)]["openvino_bf16_per_block_s"]
    block_time = per_block0 * ((1 - share) * length / l0 + share * (length / l0) ** 2)
    outside = report["results"][str(l0)]["openvino_bf16_outside_blocks_s"] * length / l0
    forward = outside + WAN_1_3B_BLOCKS * block_time
    if len(token_counts) > 1:
        l1 = min(token_counts)
        slope = (activations[l0] - activations[l1]) / (l0 - l1)
        activation = activations[l0] + slope * (length - l0)
    else:
        activation = activations[l0] * length / l0
    memory = probe0["compiled"] + WAN_1_3B_BLOCKS * per_block_bytes + activation
    report["wan_1_3b_480p_81f_estimate"] = {
        "tokens": length,
        "cores": os.cpu_count(),
        "from_tokens": l0,
        "attention_share_at_from_tokens": share,
        "per_block_s": block_time,
        "forward_s": forward,
        "sampling_50_steps_cfg_s": forward * SAMPLING_FORWARDS,
        "memory_bytes": memory,
        "activation_bytes": activation,
    }
    log(
        f"\n  estimate, Wan 2.1 T2V 1.3B ({WAN_1_3B_BLOCKS} blocks), 480x832 x 81 frames "
        f"({length} tokens), OpenVINO bf16 on {os.cpu_count()} cores, from {l0} tokens "
        f"(attention {share:.0%} of block time there): ~{block_time:.1f} s per block, "
        f"~{forward:.0f} s per forward, ~{forward * SAMPLING_FORWARDS / 3600:.1f} h for 50 "
        f"steps with CFG; memory ~{memory / 2**30:.1f} GiB "
        f"(activations ~{activation / 2**30:.1f} GiB)"
    )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    log(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""numaov's ``DenseLinear`` op on fp8 weights against OpenVINO's own bf16 matmul, side by side.

What ``numaov export lm --fp8-dense`` trades: a released FP8 checkpoint's projection kept fp8
on ``DenseLinear`` (the MoE experts' kernel; one byte per weight, widened as read) or
dequantized to bf16 and run by OpenVINO's CPU plugin (a ``FullyConnected`` reading two bytes
per weight). Each shape is one weight ``[M, K]`` (DeepSeek-V3's projections at the
``lm_engine.py`` checkpoint's width, and one of 8,192 x 4,096 whose 32 MiB of fp8 and 64 MiB of
bf16 do not stay in cache), both compiled at bf16 inference precision, timed at each row
count in alternating rounds (``--rounds``, each the median of 10 calls after one warm-up).
Prints each time and the ratio (above 1x: ``DenseLinear`` faster) and writes
``benchmarks/out/dense_linear.json``. The projections' weights (1-6 MiB) stay in the L3 cache
when one is called over and over, which favours the bf16 side; in a decode step every weight
is read from memory once a token, as the 8,192 x 4,096 one is here.

    .venv/bin/python benchmarks/dense_linear.py [--rows 1,2,4,8,16,512] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
OUT = HERE / "out" / "dense_linear.json"
WORK = HERE / "out" / "dense_linear"
# [M, K]: DeepSeek-V3's MLA projections at hidden 2,048 with 16 heads (lm_checkpoints.py), and
# one larger than the caches
SHAPES = {"q_a_proj": (1536, 2048), "q_b_proj": (3072, 1536), "kv_a_proj_with_mqa": (576, 2048),
          "o_proj": (2048, 2048), "8192x4096": (8192, 4096)}


def compiled_pair(name: str, m: int, k: int) -> dict[str, Any]:
    """The shape's fp8 ``DenseLinear`` and bf16 ``MatMul`` models, compiled at bf16."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from numaov.custom_ops import compile_ir
    from numaov.custom_ops.moe_ops import (
        fp8_row_scales,
        quantize_block_fp8,
        write_dense_linear_onnx,
    )
    from numaov.exporter.openvino_convert import convert_to_ir

    WORK.mkdir(parents=True, exist_ok=True)
    weight = torch.randn(m, k, generator=torch.Generator().manual_seed(m * k)) / k**0.5
    q, scale_inv = quantize_block_fp8(weight)
    path = write_dense_linear_onnx(WORK / f"{name}_fp8.onnx", q,
                                   fp8_row_scales(scale_inv, 0, m, 0, k))
    dense = compile_ir(convert_to_ir(path, WORK / f"{name}_fp8.xml", "bf16"), "bf16")
    # the bf16 side: the same fp8 values dequantized, as the export would hold them
    dequantized = (q.float() * scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
                   [:m, :k]).bfloat16().float()
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "weight_t"], ["y"])], name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", m])],
        initializer=[numpy_helper.from_array(dequantized.T.contiguous().numpy(), "weight_t")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
              WORK / f"{name}_bf16.onnx")
    matmul = compile_ir(convert_to_ir(WORK / f"{name}_bf16.onnx", WORK / f"{name}_bf16.xml",
                                      "bf16"), "bf16")
    return {"dense_linear_fp8": dense.runner(), "openvino_bf16": matmul.runner()}


def timed(run: Any, x: np.ndarray, calls: int = 10) -> float:
    run({"x": x})
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run({"x": x})
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,512",
                        help="rows per call (decode: a few, prefill: hundreds)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "rounds": args.rounds, "shapes": {}}
    for name, (m, k) in SHAPES.items():
        runs = compiled_pair(name, m, k)
        results["shapes"][name] = {"m": m, "k": k, "rows": {}}
        for n in rows:
            x = np.random.default_rng(n).standard_normal((n, k), dtype=np.float32)
            times: dict[str, list[float]] = {system: [] for system in runs}
            for _ in range(args.rounds):
                for system, run in runs.items():
                    times[system].append(timed(run, x))
            medians = {system: statistics.median(t) for system, t in times.items()}
            ratio = medians["openvino_bf16"] / medians["dense_linear_fp8"]
            results["shapes"][name]["rows"][n] = {
                "ms": {s: 1e3 * t for s, t in medians.items()},
                "ms_range": {s: [1e3 * min(t), 1e3 * max(t)] for s, t in times.items()},
                "dense_linear_vs_openvino": ratio}
            print(f"{name} [{m}x{k}] {n:4d} rows: DenseLinear fp8 "
                  f"{1e3 * medians['dense_linear_fp8']:.3f} ms, OpenVINO bf16 "
                  f"{1e3 * medians['openvino_bf16']:.3f} ms: {ratio:.2f}x", flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

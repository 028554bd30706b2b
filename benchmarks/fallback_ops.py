"""Fallback ops: PyTorch eager versus OpenVINO (numaov's ONNX lowering), at DiT sizes.

Each op is exported alone (dynamic B/L/heads) in fp32 and in bf16 and compiled by OpenVINO
(f32 resp. bf16 inference precision, bf16 tensors in and out for bf16); both sides run at
``B=1``, ``L`` in {8190, 32760}, ``C`` in {1536, 5120} (``--quick``: L=8190 only), round-robin
(one call each per round, best of the rounds) so load from other processes hits both alike.

The ops are memory-bound, so beside the time each line gives the achieved bandwidth of the
op's minimal traffic (every activation read once and written once: e.g. 2*B*L*C*itemsize for
``fuse_scale_shift``) and that as a share of this machine's measured copy bandwidth (a large
``torch`` ``copy_``, read + write). Ops:

- ``fuse_scale_shift`` with per-frame scale ``[1, F=5, 1, C]`` and a ``[1, C]`` shift;
- ``norm_infer`` LayerNorm without affine (Wan's modulation norm) and RMSNorm with weight;
- ``rotary_embedding`` interleaved (Wan) and half-split on ``[1, L, C/128, 128]``;
- ``scale_residual_norm_scale_shift`` with per-frame gate/scale, LayerNorm;
- ``rows_copy`` (gather of L rows into a 2L-row buffer at row 64; OpenVINO runs the functional
  form, which also copies the untouched rows: listed for completeness, not like-for-like).

    python benchmarks/fallback_ops.py [--quick] [--rounds 5]

Writes benchmarks/out/fallback_ops.json. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov
import torch

from numaov.custom_ops import (
    compile_ir,
    fuse_scale_shift,
    norm_infer,
    onnx_opset_version,
    onnx_translation_table,
    rotary_embedding,
    rows_copy,
    scale_residual_norm_scale_shift,
)

OUT = Path(__file__).resolve().parent / "out" / "fallback_ops.json"
FRAMES = 5  # per-frame modulation rows; 8190 and 32760 are multiples of 5
HEAD_DIM = 128
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OV_PRECISION = {"fp32": "f32", "bf16": "bf16"}


# 1. the ops as modules (parameters become initializers, as in a model) ------------------------


class ScaleShift(torch.nn.Module):
    def forward(self, x, scale, shift):
        return fuse_scale_shift(x, scale, shift)


class LayerNormNoAffine(torch.nn.Module):
    def forward(self, x):
        return norm_infer(x, None, None, 1e-6, False)


class RmsNorm(torch.nn.Module):
    def __init__(self, channels: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(channels, dtype=dtype))

    def forward(self, x):
        return norm_infer(x, self.weight, None, 1e-6, True)


class Rotary(torch.nn.Module):
    def __init__(self, interleaved: bool) -> None:
        super().__init__()
        self.interleaved = interleaved

    def forward(self, x, cos, sin):
        return rotary_embedding(x, cos, sin, self.interleaved)


class ResidualNormModulation(torch.nn.Module):
    def forward(self, residual, x, gate, scale, shift):
        return scale_residual_norm_scale_shift(residual, x, gate, None, None, 1e-6, False,
                                               scale, shift)


class RowGather(torch.nn.Module):
    def forward(self, dst, src):
        out = dst.clone()
        rows_copy(out, src, 64, 2**31 - 1, False)  # all of src (the count is clamped)
        return out


@dataclass
class Case:
    """One op: how to build the module and its inputs, and its minimal traffic in bytes."""

    name: str
    module: Callable[[int, torch.dtype], torch.nn.Module]
    inputs: Callable[[int, int, torch.dtype], tuple[torch.Tensor, ...]]
    dynamic: Callable[[], tuple]
    traffic: Callable[[int, int, int], int]  # (L, C, itemsize) -> bytes


def _x(seq: int, channels: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(1, seq, channels).to(dtype)


def _frame_rows(channels: int) -> torch.Tensor:
    """Per-frame rows in fp32, as Wan computes its modulation."""
    return torch.randn(1, FRAMES, 1, channels) * 0.1


def _rotary_inputs(seq: int, channels: int, dtype: torch.dtype):
    angle = torch.rand(seq, HEAD_DIM // 2) * 6.3
    return (torch.randn(1, seq, channels // HEAD_DIM, HEAD_DIM).to(dtype), angle.cos(),
            angle.sin())


def _dims_blc(n: int) -> tuple:
    seq = torch.export.Dim("L")
    return tuple({1: seq} for _ in range(n))


CASES = [
    Case("fuse_scale_shift[per-frame]", lambda c, d: ScaleShift(),
         lambda s, c, d: (_x(s, c, d), _frame_rows(c), torch.randn(1, c) * 0.1),
         lambda: ({1: torch.export.Dim("L")}, None, None),
         lambda s, c, e: 2 * s * c * e),
    Case("norm_infer[layernorm]", lambda c, d: LayerNormNoAffine(),
         lambda s, c, d: (_x(s, c, d),), lambda: _dims_blc(1), lambda s, c, e: 2 * s * c * e),
    Case("norm_infer[rms+weight]", lambda c, d: RmsNorm(c, d),
         lambda s, c, d: (_x(s, c, d),), lambda: _dims_blc(1), lambda s, c, e: 2 * s * c * e),
    Case("rotary[interleaved]", lambda c, d: Rotary(True), _rotary_inputs,
         lambda: ({1: torch.export.Dim("T"), 2: torch.export.Dim("H")},
                  {0: torch.export.Dim("T")}, {0: torch.export.Dim("T")}),
         lambda s, c, e: 2 * s * c * e),
    Case("rotary[half-split]", lambda c, d: Rotary(False), _rotary_inputs,
         lambda: ({1: torch.export.Dim("T"), 2: torch.export.Dim("H")},
                  {0: torch.export.Dim("T")}, {0: torch.export.Dim("T")}),
         lambda s, c, e: 2 * s * c * e),
    Case("scale_residual_norm_scale_shift", lambda c, d: ResidualNormModulation(),
         lambda s, c, d: (_x(s, c, d), _x(s, c, d), _frame_rows(c),
                          _frame_rows(c), torch.randn(1, c) * 0.1),
         lambda: ({1: torch.export.Dim("L")}, {1: torch.export.Dim("L")}, None, None, None),
         lambda s, c, e: 4 * s * c * e),
    Case("rows_copy[gather L rows]", lambda c, d: RowGather(),
         lambda s, c, d: (torch.zeros(2 * s, c).to(d), torch.randn(s, c).to(d)),
         lambda: ({0: torch.export.Dim("R")}, {0: torch.export.Dim("S")}),
         lambda s, c, e: 2 * s * c * e),
]


# 2. runners -----------------------------------------------------------------------------------


def _ov_tensor(t: torch.Tensor) -> ov.Tensor:
    if t.dtype == torch.bfloat16:  # numpy has no bf16: share the bits, tag the type
        return ov.Tensor(t.contiguous().view(torch.int16).numpy(), list(t.shape), ov.Type.bf16)
    return ov.Tensor(t.contiguous().numpy())


def export_and_compile(case: Case, channels: int, dtype: torch.dtype, precision: str,
                       folder: Path) -> ov.CompiledModel:
    torch.manual_seed(0)
    module = case.module(channels, dtype)
    example = case.inputs(2 * FRAMES * 8, channels, dtype)
    path = folder / f"{case.name.replace('[', '_').replace(']', '')}_{precision}_{channels}.onnx"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, example, dynamo=True, dynamic_shapes=case.dynamic(),
            custom_translation_table=onnx_translation_table(), verbose=False,
            opset_version=onnx_opset_version(),
        )
    program.save(str(path))
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": os.cpu_count() or 1}
    return compile_ir(path, precision, config).model


def copy_bandwidth(rounds: int) -> float:
    """Bytes/s of a 256 MiB torch copy_ (read + write), best of the rounds."""
    src = torch.randn(64 * 1024 * 1024)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(rounds + 1):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def measure(case: Case, seq: int, channels: int, dtype_name: str, compiled: ov.CompiledModel,
            rounds: int) -> dict[str, float]:
    dtype = DTYPES[dtype_name]
    torch.manual_seed(1)
    inputs = case.inputs(seq, channels, dtype)
    module = case.module(channels, dtype)
    request = compiled.create_infer_request()
    ov_inputs = [_ov_tensor(t) for t in inputs]

    def eager() -> None:
        with torch.no_grad():
            if isinstance(module, RowGather):  # eager copies in place into a live buffer
                rows_copy(inputs[0], inputs[1], 64, 2**31 - 1, False)
            else:
                module(*inputs)

    def openvino() -> None:
        # share_outputs: time the op, not a copy of its result into a fresh numpy array.
        request.infer(ov_inputs, share_inputs=True, share_outputs=True)

    times = {"eager": float("inf"), "openvino": float("inf")}
    runners = {"eager": eager, "openvino": openvino}
    for name in runners:  # warm-up: first call at a new shape compiles kernels
        runners[name]()
    for _ in range(rounds):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            times[name] = min(times[name], time.perf_counter() - start)
    return times


# 3. main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="L=8190 only")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (best is kept)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)

    torch.set_num_threads(os.cpu_count() or 1)
    seqs = [8190] if args.quick else [8190, 32760]
    channel_sizes = [1536, 5120]
    copy_bw = copy_bandwidth(args.rounds)
    print(f"copy bandwidth (torch copy_, read+write): {copy_bw / 1e9:.1f} GB/s, "
          f"{os.cpu_count()} threads")
    print(f"{'op':34s} {'dtype':5s} {'L':>6s} {'C':>5s} {'eager ms':>9s} {'ov ms':>8s} "
          f"{'ov/eager':>8s} {'eager GB/s':>10s} {'ov GB/s':>8s} {'ov %copy':>8s}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            for dtype_name, dtype in DTYPES.items():
                for channels in channel_sizes:
                    compiled = export_and_compile(case, channels, dtype,
                                                  OV_PRECISION[dtype_name], Path(tmp))
                    for seq in seqs:
                        times = measure(case, seq, channels, dtype_name, compiled, args.rounds)
                        traffic = case.traffic(seq, channels, dtype.itemsize)
                        row = {
                            "op": case.name, "dtype": dtype_name, "B": 1, "L": seq,
                            "C": channels, "eager_s": times["eager"],
                            "openvino_s": times["openvino"],
                            "speedup_openvino_over_eager": times["eager"] / times["openvino"],
                            "traffic_bytes": traffic,
                            "eager_GBps": traffic / times["eager"] / 1e9,
                            "openvino_GBps": traffic / times["openvino"] / 1e9,
                            "openvino_share_of_copy_bw": traffic / times["openvino"] / copy_bw,
                        }
                        results.append(row)
                        print(f"{case.name:34s} {dtype_name:5s} {seq:6d} {channels:5d} "
                              f"{times['eager'] * 1e3:9.2f} {times['openvino'] * 1e3:8.2f} "
                              f"{row['speedup_openvino_over_eager']:7.2f}x "
                              f"{row['eager_GBps']:10.2f} {row['openvino_GBps']:8.2f} "
                              f"{row['openvino_share_of_copy_bw'] * 100:7.0f}%", flush=True)
                    del compiled

    report = {
        "benchmark": "fallback_ops",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": sys.version.split()[0]},
        "versions": {"torch": torch.__version__, "openvino": ov.get_version(),
                     "numpy": np.__version__},
        "copy_bandwidth_GBps": copy_bw / 1e9,
        "rounds": args.rounds,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The Wan DiT bf16 target alone, over many paired rounds.

`dit.py` runs eleven competitors per round, so a round at 5,120 tokens is long enough for
this VM's speed drift (benchmarks/RESULTS.md) to land inside it. This runs only the three
the bf16 target is about, back to back in every round, on the same Wan-1.3B-width 2-block
model and inputs as `dit.py`:

- PyTorch eager bf16 (numaov's model);
- OpenVINO bf16 as the runtime compiles it (numaov's AMX flash attention where AMX is usable);
- OpenVINO bf16 with OpenVINO's own attention.

and prints each ratio's median over the rounds, its range, and the ratio of best times.

    python benchmarks/dit_pairs.py [--tokens 5120] [--rounds 8]

Writes benchmarks/out/dit_pairs.json. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
from dit import (
    SEED,
    SHAPES,
    WIDTH_1_3B,
    build_checkpoint,
    export_numaov,
    log,
    make_inputs,
    openvino_runner,
    paired_ratio,
    time_round_robin,
    torch_runner,
)

from numaov.custom_ops.flash_attention import attention_kernel
from numaov.models.wan.transformer import WanTransformer

OUT = Path(__file__).resolve().parent / "out" / "dit_pairs.json"
EAGER, NUMAOV, OV_ATTENTION = (
    "torch eager bf16", "openvino bf16 numaov", "openvino bf16 numaov ov-attention")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, choices=sorted(SHAPES), default=5120)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)

    torch.manual_seed(SEED)
    torch.set_num_threads(os.cpu_count() or 1)
    attention = attention_kernel("bf16")
    with tempfile.TemporaryDirectory(prefix="numaov-dit-pairs-") as work:
        checkpoint = build_checkpoint(Path(work) / "ckpt", WIDTH_1_3B)
        _, irs, _ = export_numaov(checkpoint, Path(work) / "numaov")
        runners = [
            torch_runner(EAGER, WanTransformer.from_pretrained(checkpoint, dtype=torch.bfloat16),
                         torch.bfloat16),
            openvino_runner(NUMAOV, irs["bf16"], "bf16", attention)[0],
            openvino_runner(OV_ATTENTION, irs["bf16"], "bf16", "openvino")[0],
        ]
        results = time_round_robin(runners, make_inputs(args.tokens), args.rounds, EAGER)
    ratios = {
        "openvino bf16 / eager bf16 speedup": paired_ratio(results, (EAGER,), NUMAOV),
        "numaov attention / openvino attention speedup": paired_ratio(
            results, (OV_ATTENTION,), NUMAOV),
        "openvino bf16 (openvino attention) / eager bf16 speedup": paired_ratio(
            results, (EAGER,), OV_ATTENTION),
    }
    log(f"{args.tokens} video tokens, {args.rounds} rounds, numaov bf16 attention: {attention}'s")
    for name in (EAGER, NUMAOV, OV_ATTENTION):
        log(f"  {name:36s} best {results[name]['best_s']:.3f} s, max|diff| vs eager bf16 "
            f"{results[name]['max_abs_diff_vs_reference']:.2e}")
    for name, ratio in ratios.items():
        rounds = ratio["per_round"]
        log(f"  {name:56s} {ratio['median_of_rounds']:5.2f}x  (best-of {ratio['best_of']:.2f}x, "
            f"rounds {min(rounds):.2f}-{max(rounds):.2f}x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(
        {"tokens": args.tokens, "rounds": args.rounds, "attention": attention,
         "results": results, "ratios": ratios}, indent=2) + "\n")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Greedy tokens of each weight format against f32, on the trained built-in MoE (tiny-moe).

A random-weight checkpoint has nearly flat logits, so its greedy tokens say little about a
format's quality; ``numaov/models/builtin/tiny-moe`` is trained on Python's documentation
topics, so its choices are real. It is exported at dp=1 in each format of ``--formats``
(``numaov export deepseek --weights``) and every export decodes the same prompts greedily on
OpenVINO: the opening words of the held-out topics (every tenth topic, which training never
saw). A format whose export fails its parity check on this model is recorded with the
check's message. Printed per format: the share of prompts whose tokens equal f32's exactly, the share of
token positions equal to f32's, and the mean position of the first disagreement.

    python benchmarks/weight_agreement.py [--formats bf16,int8,int4] [--prompts 32] [--tokens 32]

Writes benchmarks/out/weight_agreement.json. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from numaov.exporter.lm_export import export_lm
from numaov.exporter.parity import ParityError
from numaov.models.builtin import TINY_MOE_DIR
from numaov.models.builtin.train_tiny_moe import topics
from numaov.runtime.lm.engine import SamplingParams, load_tokenizer, run_lm

OUT = Path(__file__).resolve().parent / "out" / "weight_agreement.json"
PROMPT_WORDS = 6


def log(message: str) -> None:
    print(f"[weight_agreement] {message}", file=sys.stderr, flush=True)


def held_out_prompts(tokenizer, count: int) -> list[list[int]]:
    _, held = topics()
    texts = [" ".join(text.split()[:PROMPT_WORDS]) for text in held if len(text.split()) > 20]
    return [tokenizer.encode(text).ids for text in texts[:count]]


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> dict[str, float]:
    same_rows = sum(a == b for a, b in zip(reference, tokens, strict=True))
    positions = sum(len(a) for a in reference)
    same_positions = sum(x == y for a, b in zip(reference, tokens, strict=True)
                         for x, y in zip(a, b, strict=False))
    first = [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
             for a, b in zip(reference, tokens, strict=True)]
    return {"same_prompts": same_rows / len(reference),
            "same_positions": same_positions / positions,
            "mean_first_difference": sum(first) / len(first)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="bf16,int8,int4")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    tokenizer = load_tokenizer(TINY_MOE_DIR)
    prompts = held_out_prompts(tokenizer, args.prompts)
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "prompts": len(prompts), "tokens": args.tokens, "formats": {}}
    with tempfile.TemporaryDirectory(prefix="numaov-agreement-") as tmp:
        outputs = {}
        for weights in ["f32", *args.formats.split(",")]:
            precision = "bf16" if weights == "bf16" else "f32"
            out = Path(tmp) / weights
            log(f"export {weights}")
            try:
                export_lm(TINY_MOE_DIR, out, precision=precision, weights=weights)
            except ParityError as exc:  # a format whose export this model fails is a finding
                results["formats"][weights] = {"export_refused": str(exc).splitlines()[0]}
                log(f"{weights}: {results['formats'][weights]}")
                continue
            # every prompt runs to --tokens (no early end-of-sequence), so the rows line up
            got = run_lm(out, prompts, args.tokens, "openvino",
                               params=SamplingParams(args.tokens, ignore_eos=True))
            outputs[weights] = got.tokens
        for weights, tokens in outputs.items():
            if weights == "f32":
                continue
            results["formats"][weights] = agreement(outputs["f32"], tokens)
            log(f"{weights}: {results['formats'][weights]}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""The export parity check's per-row shares on correct and on deliberately broken exports.

Each model of ``--models`` (built by the tests' harnesses in their real layouts: ``v3wide-S``
the FP8 tests' DeepSeek-V3 of hidden 256 and 8 experts at seed S, ``v3-S`` the tests' V3,
``qwen3-S`` / ``qwen2-S`` the tests' Qwen3-MoE / Qwen2-MoE, ``tiny-moe`` the trained built-in)
is exported at dp=1 in each ``PRECISION:WEIGHTS`` of ``--formats`` with the required shares set
to 0, so every export records its figures: the logits rows within the format's tolerance, the
greedy tokens kept and the cached-token rows within, over all parity inputs. ``--break`` edits
what the exporter stores for the first MoE layer's experts before it is written
(``double``: gate_up, or its scales, x2; ``swap``: experts 0 and 1 exchanged), the errors the
shares must refuse. Printed per export, with the verdict of the shares in force
(``weight_formats.MIN_ROW_SHARE`` / ``MIN_TOKEN_SHARE``).

    python benchmarks/parity_shares.py [--models v3wide-1,qwen3-1] [--formats f32:int8,bf16:bf16]
        [--break double]

Writes benchmarks/out/parity_shares.json. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the harnesses that write the tests' checkpoints

import numaov.exporter.lm_export as lm_export  # noqa: E402
from numaov import NumaovError  # noqa: E402
from numaov.exporter.expert_streaming import ExpertConverter  # noqa: E402
from numaov.exporter.openvino_convert import INFERENCE_PRECISION  # noqa: E402
from numaov.exporter.weight_formats import (  # noqa: E402
    MIN_ROW_SHARE,
    MIN_TOKEN_SHARE,
    rounding_format,
    row_criterion,
)
from numaov.manifest import WEIGHT_FORMATS, row_shares  # noqa: E402

OUT = REPO / "benchmarks" / "out" / "parity_shares.json"
# The FP8 tests' wider DeepSeek-V3 (tests/lm/test_expert_store_export.py WIDE)
WIDE = {"hidden_size": 256, "intermediate_size": 192, "moe_intermediate_size": 160,
        "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2,
        "q_lora_rank": 64}


def log(message: str) -> None:
    print(f"[parity_shares] {message}", file=sys.stderr, flush=True)


def checkpoint(name: str, root: Path) -> Path:
    """The checkpoint directory of model ``name`` (written under ``root``)."""
    if name == "tiny-moe":
        from numaov.models.builtin import TINY_MOE_DIR
        return TINY_MOE_DIR
    kind, _, seed = name.rpartition("-")
    directory = root / name
    if kind in ("v3", "v3wide"):
        from support.deepseek_v3_harness import save_hf_checkpoint
        save_hf_checkpoint(directory, seed=int(seed), **(WIDE if kind == "v3wide" else {}))
    elif kind in ("qwen3", "qwen2"):
        from support.qwen_moe_harness import save_checkpoint
        save_checkpoint(directory, f"{kind}_moe", int(seed))
    else:
        raise SystemExit(f"model {name!r}; expected v3-S, v3wide-S, qwen3-S, qwen2-S or tiny-moe")
    return directory


def broken_converter(kind: str, original: Any) -> Any:
    """``original`` (ExpertConverter.expert) editing the first MoE layer it converts, as
    ``--break`` says."""
    first: list[int] = []

    def expert(self: ExpertConverter, layer: int, index: int) -> list[dict[str, Any]]:
        first[:] = first or [layer]
        if layer != first[0]:
            return original(self, layer, index)
        if kind == "swap":
            return original(self, layer, {0: 1, 1: 0}.get(index, index))
        regions = original(self, layer, index)
        key = "gate_up_scale" if "gate_up_scale" in regions[0] else "gate_up"
        return [{**r, key: r[key] * 2} for r in regions]
    return expert


def criterion(fmt: str) -> str:
    """The shares that judge exports of ``PRECISION:WEIGHTS`` (``row_criterion``)."""
    precision, _, weights = fmt.partition(":")
    by_rows = (row_criterion(rounding_format(weights, precision, False),
                             INFERENCE_PRECISION[precision])
               if precision in INFERENCE_PRECISION and weights in WEIGHT_FORMATS else None)
    if by_rows is None:
        raise SystemExit(f"format {fmt!r}; expected PRECISION:WEIGHTS of an export that rounds "
                         "(f32:f32 is judged on the whole output)")
    return by_rows


def shares(directory: Path, fmt: str, out: Path) -> dict:
    """Export ``directory`` in ``fmt``; each output's rows per phase, and the verdict of the
    shares in force."""
    precision, _, weights = fmt.partition(":")
    by_rows = criterion(fmt)
    try:
        manifest = lm_export.export_lm(directory, out, dp=1, precision=precision,
                                       weights=weights)
    except NumaovError as exc:  # e.g. a non-finite output: refused whatever the shares
        return {"error": str(exc), "passes_the_shares": False}
    finally:
        shutil.rmtree(out, ignore_errors=True)
    judged = [replace(share, min_row_share=MIN_ROW_SHARE[by_rows],
                      min_token_share=MIN_TOKEN_SHARE[by_rows])
              for share in row_shares(manifest.parity) if share.backend == "openvino"]
    return {"shares": [{"output": share.output, "rows": share.rows,
                        "rows_within": share.rows_within, "token_rows": share.token_rows,
                        "tokens_kept": share.rows_same_argmax,
                        "phases": {phase: [within, rows] for phase, rows, within in share.phases}}
                       for share in judged],
            "worst_whole_output_error": max(f["rel_error"] for f in manifest.parity),
            "required": [MIN_ROW_SHARE[by_rows], MIN_TOKEN_SHARE[by_rows]],
            "passes_the_shares": all(share.passed for share in judged)}


def describe(result: dict) -> str:
    if "error" in result:
        return f"refused: {result['error']}"
    parts = [f"{s['output']} {s['rows_within']} of {s['rows']} rows"
             + (f", {s['tokens_kept']} of {s['token_rows']} tokens" if s["token_rows"] else "")
             + "".join(f", {phase} {within} of {rows}"
                       for phase, (within, rows) in s["phases"].items())
             for s in result["shares"]]
    return (f"{'; '.join(parts)}; whole output {result['worst_whole_output_error']:.3g}; "
            f"{'passes' if result['passes_the_shares'] else 'refused'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="v3wide-1,v3wide-2,v3wide-3,v3wide-4,v3wide-5,v3-11,"
                        "qwen3-1,qwen3-2,qwen2-1,qwen2-2,tiny-moe")
    parser.add_argument("--formats", default="f32:int8,f32:int4,f32:fp8,bf16:int8,bf16:int4,"
                        "bf16:fp8,bf16:bf16")
    parser.add_argument("--break", dest="broken", choices=("double", "swap"), default=None)
    args = parser.parse_args()
    # every export is kept, whatever its shares; the verdict is recomputed above
    lm_export.MIN_ROW_SHARE = dict.fromkeys(MIN_ROW_SHARE, 0.0)
    lm_export.MIN_TOKEN_SHARE = dict.fromkeys(MIN_TOKEN_SHARE, 0.0)
    original = ExpertConverter.expert
    formats = args.formats.split(",")
    for fmt in formats:
        criterion(fmt)  # before any export
    results = []
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="parity_shares_") as work:
        root = Path(work)
        for name in args.models.split(","):
            with contextlib.redirect_stdout(sys.stderr):  # the harnesses print what they write
                directory = checkpoint(name, root)
            for fmt in formats:
                if args.broken:  # its first MoE layer found anew for every export
                    ExpertConverter.expert = broken_converter(args.broken, original)
                result = {"model": name, "format": fmt, "broken": args.broken,
                          **shares(directory, fmt, root / "export")}
                results.append(result)
                print(f"{name} {fmt}{' ' + args.broken if args.broken else ''}: "
                      f"{describe(result)}", flush=True)
                OUT.write_text(json.dumps(results, indent=2))  # each export as it ends
    log(f"wrote {OUT}")


if __name__ == "__main__":
    main()

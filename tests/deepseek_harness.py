"""The tiny DeepSeek-V2 exported for dp=2, shared by the engine and service tests.

The builtin model is exported once per test session through the CLI (which also runs the
export's own parity check with the two rank graphs in two worker processes), with torch dp=1
references for a few prompt scenarios.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SEED = 3
MAX_NEW_TOKENS = 6
# "three": prompts of different lengths, rank 0 gets prompts 0 and 2, rank 1 prompt 1.
# "one": a single prompt, so rank 1 is idle and runs every step with a batch of 0 rows.
SCENARIOS: dict[str, list[list[int]]] = {
    "three": [[5, 17, 99, 3, 250, 8, 41], [300, 2], [77, 12, 19, 401]],
    "one": [[11, 22, 33, 44, 55]],
}
CLI = [sys.executable, "-m", "numaov.cli"]
CLI_TIMEOUT_S = 600


def two_cpu_bind_string() -> str | None:
    """``NUMAOV_CPU_BIND`` for one rank on each of two allowed CPUs (None with fewer CPUs)."""
    allowed = sorted(os.sched_getaffinity(0))
    return f"{allowed[0]}|{allowed[1]}" if len(allowed) >= 2 else None


def export_tiny_dp2(root: Path, bind: str) -> dict[str, Any]:
    """Build, export (dp=2, through the CLI) and take torch dp=1 references."""
    from numaov.models.builtin.deepseek_tiny import build_tiny_deepseek
    from numaov.models.deepseek import DeepseekV2, generate_greedy

    print(f"tiny DeepSeek-V2 seed: {SEED}")
    checkpoint = build_tiny_deepseek(root / "checkpoint", seed=SEED)
    model_dir = root / "model"
    proc = subprocess.run(
        [*CLI, "export", "deepseek", "--checkpoint", str(checkpoint), "--dp", "2",
         "--out", str(model_dir)],
        capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
        env={**os.environ, "NUMAOV_CPU_BIND": bind},
    )
    assert proc.returncode == 0, proc.stderr
    model = DeepseekV2.from_pretrained(checkpoint)
    references = {}
    for name, prompts in SCENARIOS.items():
        out = generate_greedy(model, prompts, MAX_NEW_TOKENS)
        references[name] = (out.tokens, out.logits)
    return {"root": root, "checkpoint": checkpoint, "model_dir": model_dir, "export": proc,
            "references": references}


def tiny_tokenizer(directory: Path) -> Any:
    """A word-level tokenizer whose 512 ids cover the tiny model's vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "the", "cat", "sat", "on", "a", "mat", "hello", "world"]
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({f"w{i}": i for i in range(len(words), 512)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return tokenizer

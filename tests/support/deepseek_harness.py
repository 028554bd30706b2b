"""The tiny DeepSeek-V2 exported for dp=2, shared by the engine and service tests.

The builtin model is exported once per test session through the CLI (which also runs the
export's own parity check with the two rank graphs in two worker processes), with torch dp=1
references for a few prompt scenarios. The references come from :func:`greedy_reference`:
every token recomputed from the whole sequence with no cache at all, so they share nothing
with the engine's cache, scheduler or sampler.
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
    from numaov.models.deepseek_v2 import DeepseekV2

    print(f"tiny DeepSeek-V2 seed: {SEED}")
    checkpoint = build_tiny_deepseek(root / "checkpoint", seed=SEED)
    model_dir = root / "model"
    proc = subprocess.run(
        [*CLI, "export", "lm", "--checkpoint", str(checkpoint), "--dp", "2",
         "--out", str(model_dir)],
        capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
        env={**os.environ, "NUMAOV_CPU_BIND": bind},
    )
    assert proc.returncode == 0, proc.stderr
    model = DeepseekV2.from_pretrained(checkpoint)
    references = {}
    for name, prompts in SCENARIOS.items():
        references[name] = greedy_reference(model, prompts, MAX_NEW_TOKENS)
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


def greedy_reference(model: Any, prompts: list[list[int]], max_new_tokens: int,
                     eos: int | None = None) -> tuple[list[list[int]], Any]:
    """Greedy tokens and the logits ``[B, steps, V]`` they were chosen from, each step a full
    forward of every prompt with its tokens so far (left-padded, no cache). Exactly
    ``max_new_tokens`` forwards, also for an empty batch, so DP ranks stay in lockstep; with
    ``eos``, each prompt's tokens are cut before its first ``eos``."""
    import torch

    tokens: list[list[int]] = [[] for _ in prompts]
    kept = []
    for _ in range(max_new_tokens):
        rows = [list(p) + t for p, t in zip(prompts, tokens, strict=True)]
        longest = max((len(r) for r in rows), default=1)
        ids = torch.zeros((len(rows), longest), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, longest - len(row):] = torch.tensor(row)
            mask[i, longest - len(row):] = 1
        with torch.no_grad():
            last = model(ids, mask)[:, -1].float()
        kept.append(last)
        for i, token in enumerate(last.argmax(-1).tolist()):
            tokens[i].append(token)
    logits = torch.stack(kept, 1) if prompts else torch.zeros((0, max_new_tokens, 0))
    if eos is not None:
        tokens = [t[:t.index(eos)] if eos in t else t for t in tokens]
    return tokens, logits

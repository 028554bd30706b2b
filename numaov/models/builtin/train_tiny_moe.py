"""Train the built-in ``tiny-moe``: a small DeepSeek-V2 MoE language model of Python's own
documentation (the ``pydoc_data.topics`` text that ships with every Python).

    python -m numaov.models.builtin.train_tiny_moe [--out DIR] [--seed 0]

The model is numaov's ``DeepseekV2`` (MLA with a low-rank query, one dense layer then MoE
layers of routed and shared experts, the same ops it exports with), saved in the Hugging Face
layout ``numaov export deepseek`` reads, beside a byte-level BPE ``tokenizer.json`` built with
``tokenizers`` and a ``tokenizer_config.json``. Every tenth topic (sorted by name) is held out;
``training.json`` records the held-out loss and the unigram baseline of the same tokenizer
(the cross-entropy of the held-out tokens under the training tokens' frequencies).

Seeded; a step count, not time, bounds the training, so a run repeats exactly on one machine.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from numaov.models.builtin.training_run import (
    one_cycle_adamw,
    optimizer_step,
    set_up_threads,
    training_main,
)
from numaov.models.deepseek_v2 import DeepseekV2, DeepseekV2Config

DEFAULT_OUT = Path(__file__).parent / "tiny-moe"
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<|endoftext|>"]  # id 0: separates topics; bos and eos
SEQUENCE, BATCH, STEPS = 128, 16, 500
HELD_OUT_EVERY = 10

TINY_MOE_CONFIG = DeepseekV2Config(
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    topk_method="greedy",
    routed_scaling_factor=1.0,
    norm_topk_prob=False,
    first_k_dense_replace=1,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=0,
)


def topics() -> tuple[list[str], list[str]]:
    """The documentation topics split into training and held-out text."""
    from pydoc_data.topics import topics as table

    names = sorted(table)
    held = [table[n] for i, n in enumerate(names) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [table[n] for i, n in enumerate(names) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    return train, held


def build_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """Every text's ids, each followed by the end-of-text id, as one 1-D tensor."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text).ids)
        ids.append(0)
    return torch.tensor(ids, dtype=torch.long)


def unigram_loss(train: torch.Tensor, held: torch.Tensor) -> float:
    """Cross-entropy (nats/token) of ``held`` under add-one-smoothed training frequencies."""
    counts = torch.bincount(train, minlength=VOCAB_SIZE).double() + 1.0
    log_p = (counts / counts.sum()).log()
    return float(-log_p[held].mean())


@torch.no_grad()
def held_out_loss(model: DeepseekV2, held: torch.Tensor) -> float:
    """Mean next-token cross-entropy over ``held`` in consecutive windows of ``SEQUENCE``."""
    rows = held[: len(held) // (SEQUENCE + 1) * (SEQUENCE + 1)].view(-1, SEQUENCE + 1)
    total, count = 0.0, 0
    for i in range(0, len(rows), 32):
        batch = rows[i : i + 32]
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB_SIZE).float(),
                                                 batch[:, 1:].reshape(-1), reduction="sum")
        total, count = total + float(loss), count + batch[:, 1:].numel()
    return total / count


def init_weights(model: DeepseekV2, generator: torch.Generator) -> None:
    """GPT-2's initialisation: N(0, 0.02) matrices, unit norms."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.fill_(1.0)
            else:
                param.copy_(0.02 * torch.randn(param.shape, generator=generator))


def save_tokenizer(tokenizer, out: Path) -> None:
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[0],
              "eos_token": SPECIAL_TOKENS[0], "unk_token": None, "add_bos_token": False,
              "model_max_length": TINY_MOE_CONFIG.max_position_embeddings,
              "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n",
                                               encoding="utf-8")


def train(out: Path, seed: int = 0, threads: int = 1, say=print) -> dict[str, float]:
    set_up_threads(threads)
    started = time.perf_counter()
    train_text, held_text = topics()
    tokenizer = build_tokenizer(train_text)
    train_ids, held_ids = token_stream(tokenizer, train_text), token_stream(tokenizer, held_text)
    baseline = unigram_loss(train_ids, held_ids)
    say(f"{len(train_ids)} training tokens, {len(held_ids)} held out; unigram baseline "
        f"{baseline:.3f} nats/token")

    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = DeepseekV2(TINY_MOE_CONFIG)
    init_weights(model, generator)
    model.train()
    optimizer, schedule = one_cycle_adamw(model.parameters(), 3e-3, STEPS, weight_decay=0.05,
                                          betas=(0.9, 0.95))
    loss = torch.tensor(0.0)
    for step in range(STEPS):
        starts = torch.randint(len(train_ids) - SEQUENCE - 1, (BATCH,), generator=generator)
        rows = torch.stack([train_ids[s : s + SEQUENCE + 1] for s in starts.tolist()])
        logits = model(rows[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB_SIZE),
                                                 rows[:, 1:].reshape(-1))
        optimizer_step(loss, optimizer, schedule, clip=model.parameters())
        if step % 50 == 0 or step == STEPS - 1:
            say(f"step {step}: training loss {loss.item():.3f}")
    model.eval()
    held = held_out_loss(model, held_ids)
    seconds = time.perf_counter() - started
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    figures = {"seed": seed, "steps": STEPS, "batch": BATCH, "sequence": SEQUENCE,
               "training_tokens": len(train_ids), "held_out_tokens": len(held_ids),
               "training_loss": round(loss.item(), 4), "held_out_loss": round(held, 4),
               "unigram_baseline": round(baseline, 4),
               "held_out_perplexity": round(math.exp(held), 2),
               "seconds": round(seconds, 1), "threads": threads}
    (out / "training.json").write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    say(f"held-out loss {held:.3f} nats/token against the unigram {baseline:.3f}; saved {out} "
        f"in {seconds:.0f} s")
    return figures


def main(argv: list[str] | None = None) -> int:
    return training_main(__doc__, DEFAULT_OUT, train, argv)


if __name__ == "__main__":
    raise SystemExit(main())

"""What the training scripts share: the thread setup, the optimiser and its step, and the
command line."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch


def set_up_threads(threads: int) -> None:
    """One thread by default: on a machine whose cores are shared, two spinning OpenMP threads
    ran a VAE step 10x slower than one (20 s against 2 s, measured while training
    digits-wan). Denormals flushed: tiny gradients late in training cost nothing then."""
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)


def one_cycle_adamw(parameters: object, lr: float, steps: int, **options: object,
                    ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.OneCycleLR]:
    """AdamW (``options``: its weight decay, betas, ``fused``) under the one-cycle schedule
    every training loop here uses: up to ``lr`` over the first 5% of ``steps``, then down."""
    optimizer = torch.optim.AdamW(parameters, lr=lr, **options)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps,
                                                   pct_start=0.05)
    return optimizer, schedule


def optimizer_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, schedule: object,
                   clip: object = None) -> None:
    """One update on ``loss``: fresh gradients, their norm over ``clip``'s parameters capped at
    1 when given, the optimiser's step, then the learning-rate schedule's."""
    optimizer.zero_grad()
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(clip, 1.0)
    optimizer.step()
    schedule.step()


def training_main(doc: str, default_out: Path, train: Callable[..., object],
                  argv: list[str] | None = None, flags: dict[str, str] | None = None) -> int:
    """``python -m ...train_x [--out DIR] [--seed N] [--threads N]``, progress on stdout.
    ``flags``: a script's own on/off options (name: help), passed to ``train`` by keyword."""
    from numaov.console import quiet_libraries

    quiet_libraries("INFO")  # the model libraries' warnings and progress bars stay off
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_out, help="model directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    for name, text in (flags or {}).items():
        parser.add_argument(name, action="store_true", help=text)
    args = vars(parser.parse_args(argv))
    out, seed, threads = args.pop("out"), args.pop("seed"), args.pop("threads")
    train(out, seed, threads, say=lambda m: print(m, flush=True), **args)
    return 0

"""The head's exchange under DP (``data_parallel.logits_from_vocab_shards``) over real gloo
ranks: each rank holds its vocabulary slice of the head (``sharding.shard_tensor``), and every
rank's logits equal its rows times the whole head (float32 sums of 8 products, to 1e-5: only
their order may differ), whatever the vocabulary, the row counts and the idle ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.collectives_harness import run_ranks

pytestmark = pytest.mark.slow  # spawned rank processes

HIDDEN = 8
# (world, vocab, rows of each rank): a vocabulary the world divides, one it does not (the
# last slice padded with zero rows), one smaller than the world (a slice of zero rows only),
# idle ranks among busy ones, and every rank idle
CASES = [(2, 12, [3, 1]), (2, 7, [0, 3]), (3, 2, [2, 0, 1]), (3, 11, [1, 4, 0]),
         (3, 5, [0, 0, 0])]


def _rank(rank: int, world: int, args: dict) -> list[float]:
    import torch.distributed as dist

    from numaov.distributed.communicator import GlooCommunicator
    from numaov.models.layers.data_parallel import DataParallelGroup, logits_from_vocab_shards
    from numaov.models.layers.sharding import HEAD, shard_tensor

    dist.init_process_group("gloo", init_method=f"file://{args['store']}_{world}", rank=rank,
                            world_size=world)
    group = f"head-{world}"
    comm = GlooCommunicator(group, dist.group.WORLD)
    errors = []
    for case, (case_world, vocab, rows) in enumerate(CASES):
        if case_world != world:
            continue
        generator = torch.Generator().manual_seed(case)  # the same head on every rank
        full = torch.randn(vocab, HIDDEN, generator=generator, dtype=torch.float32)
        mine = torch.randn(rows[rank], HIDDEN, generator=torch.Generator().manual_seed(
            100 * case + rank), dtype=torch.float32)
        head = torch.nn.Linear(HIDDEN, 1, bias=False, dtype=torch.float32)
        head.weight = torch.nn.Parameter(shard_tensor(HEAD, full, rank, world))
        with torch.no_grad():
            logits = logits_from_vocab_shards(head, mine, DataParallelGroup(group, rank, world),
                                              vocab)
        assert logits.shape == (rows[rank], vocab), (case, logits.shape)
        errors.append(float((logits - mine @ full.T).abs().max()) if rows[rank] else 0.0)
    comm.close()
    dist.destroy_process_group()
    return errors


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_its_rows_logits_over_the_whole_vocabulary(tmp_path: Path,
                                                                   world: int) -> None:
    results = run_ranks(world, _rank, {"store": str(tmp_path / "store")})
    for rank, errors in results.items():
        assert errors and max(errors) < 1e-5, (rank, errors)

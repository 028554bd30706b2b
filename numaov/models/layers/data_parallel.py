"""DP attention's exchange around every MLP / MoE block and the head, for every family.

With a :class:`DataParallelGroup` of ``dp`` ranks, each rank holds its own sequences and runs
attention on them only; around every MLP and MoE block (``docs/architecture.md``, "DP
attention, in one paragraph"):

1. the ranks agree on the padded row count ``M = max_r rows_r`` (one all-gather of the counts
   per forward, shared by every layer, :func:`agree_rows`, at least 1 row so an idle rank's
   empty batch still has a shape);
2. each rank pads its normalised rows to ``M`` and ``all_gather_into_tensor`` stacks them:
   rank r's rows sit at ``r*M ..`` (MAX_LEN layout);
3. every rank runs its shard of the block on the real rows of all ranks: a partial sum;
4. ``reduce_scatter_tensor`` sums the partials and hands rank r rows ``r*M ..``; it keeps its
   first ``rows_r``. There is no all-reduce: one before the reduce-scatter would count every
   partial ``dp`` times.

and once more around ``lm_head``, which each rank holds a vocabulary slice of
(:func:`logits_from_vocab_shards`): the rows are gathered (with their own count: the head takes
each sequence's last row), each rank computes its slice of the vocabulary for all of them, and
an all-to-all hands every rank all the slices of its own rows. A replicated head would have
each rank read the whole ``[vocab, hidden]`` matrix every step (a fifth to a half of a cut
checkpoint's bytes a token, 2-9% of a released model's), and ranks that share a memory bus read
it ``dp`` times.

The collectives are called by group name only; which transport serves the group (gloo,
shared memory, the OpenVINO extension op) is not the model's concern.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from numaov import NumaovError
from numaov.custom_ops import all_gather_into_tensor, all_to_all, reduce_scatter_tensor


class ShardError(NumaovError):
    """The requested DP degree does not divide the dims the experts and MLPs are sharded along."""


@dataclass(frozen=True)
class DataParallelGroup:
    """The DP group this model instance is one rank of.

    ``group`` names the communicator the collective ops look up (registered by the process
    before the first forward); ``world_size`` fixes the shard shapes.
    """

    group: str
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.group, str) or not self.group:
            raise ShardError(f"DP group name is {self.group!r}; expected a non-empty string")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ShardError(
                f"DP rank {self.rank} of world size {self.world_size}; expected "
                "0 <= rank < world_size"
            )


@dataclass(frozen=True)
class RankRows:
    """This step's rows across the DP ranks: ``padded`` rows per rank in the exchange, and
    ``real [total]``: the indices of the rows that are not padding among the gathered ones."""

    padded: int
    real: Tensor


def agree_rows(dp: DataParallelGroup | None, rows: int) -> RankRows | None:
    """Every rank's row count this step: the padding (the largest count, at least 1: the
    MAX_LEN of the exchange) and where the real rows sit among the gathered ones.

    One tiny all-gather, shared by every layer's exchange (the head has its own: its rows are
    the sequences' last ones). None without DP.
    """
    if dp is None or dp.world_size == 1:
        return None
    world = dp.world_size
    count = torch.full((1,), rows, dtype=torch.float32)  # exact below 2**24 rows
    counts = all_gather_into_tensor(count, dp.group, world)
    # Integer conversion on the tensor side: while exporting, .item() of an int tensor is
    # a symbolic size the graph computes at run time.
    padded = counts.max().clamp(min=1).to(torch.int64).item()
    torch._check(padded >= 1)  # a size: tells torch.export it is non-negative
    torch._check(padded >= rows)
    total = counts.sum().clamp(min=1).to(torch.int64).item()
    torch._check(total >= 1)
    torch._check(total <= world * padded)
    # gathered row r*M + i (rank r's i-th) is real when i < rank r's count
    real = (torch.arange(padded).unsqueeze(0) < counts.to(torch.int64).unsqueeze(1))
    real = real.reshape(-1).to(torch.float32)  # [world*M]
    # the real rows' indices, in any order (each row's MLP output is its own)
    return RankRows(padded, torch.topk(real, total).indices)


def run_on_all_ranks(block: nn.Module, rows: Tensor, dp: DataParallelGroup | None,
                     rows_of: RankRows | None) -> Tensor:
    """``rows [n, H]`` of this rank -> the finished output of ``block`` (this rank's shard of
    an MLP or MoE block) on the same rows, summed over every rank's shard."""
    if dp is None or rows_of is None:
        return block(rows)
    group, world = dp.group, dp.world_size
    n = rows.shape[0]
    padded = F.pad(rows, (0, 0, 0, rows_of.padded - n))  # [M, H]
    everyone = all_gather_into_tensor(padded, group, world)  # [world*M, H], rank-major
    # Only the real rows go through this rank's shard: a padding row would cost as much as
    # a real one (in the MoE's per-row gather, a copy of top-k experts' weights).
    real = everyone.index_select(0, rows_of.real)  # [total, H]
    partial = torch.zeros_like(everyone).index_copy(0, rows_of.real, block(real))
    mine = reduce_scatter_tensor(partial, group, world)  # [M, H]: summed, rows of this rank
    return mine[:n]


def logits_from_vocab_shards(head: nn.Module, rows: Tensor, dp: DataParallelGroup | None,
                             vocab_size: int) -> Tensor:
    """``rows [n, H]`` of this rank -> their logits ``[n, vocab_size]``, with ``head`` this
    rank's slice of the vocabulary (``sharding.head_rows`` rows, rank-major) and every rank
    calling at once; without DP (or a group of one), ``head(rows)``."""
    n = rows.shape[0]
    rows_of = agree_rows(dp, n)
    if dp is None or rows_of is None:
        return head(rows)
    group, world = dp.group, dp.world_size
    padded = F.pad(rows, (0, 0, 0, rows_of.padded - n))  # [M, H]
    everyone = all_gather_into_tensor(padded, group, world)  # [world*M, H]
    mine = head(everyone)  # [world*M, V/world]: this rank's vocabulary slice of every row
    # rank r's rows go to rank r; block s of what comes back is rank s's slice of this rank's
    # rows (an all-gather would hand every rank all ranks' rows: world times the bytes)
    slices = all_to_all(mine, group, world).view(world, rows_of.padded, -1)  # [slice, M, V/w]
    return slices.permute(1, 0, 2).reshape(rows_of.padded, -1)[:n, :vocab_size]

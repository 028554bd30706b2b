"""Ulysses sequence parallelism for the Wan transformer: one video's tokens split over ranks.

Each of ``world_size`` ranks holds a contiguous share of the video's tokens (frame-major, as
``WanTransformer.embed_patches`` orders them): ``share = ceil(L / world_size)`` tokens, rank
``r`` the tokens ``r * share ..``. When ``L`` does not divide evenly the last shares run past
the video; those rows repeat its last token, so every rank computes the same shapes and the
collectives move equal blocks, and they are dropped where it matters: from the keys and
values of every self-attention and from the gathered output.

Around each self-attention an ``all_to_all`` turns the token split into a head split (every
rank gets all tokens of ``heads / world_size`` heads; q, k and v move in one exchange) and a
second one turns the attention's output back. Rotary embedding uses each token's global
position and runs before the exchange; q / k norms run over all heads of a token, also before
it. Cross-attention, the feed-forward and the modulation see only the rank's own tokens and
run unchanged. The output tokens are gathered once, after the output projection.

Heads must divide by the ranks (Wan 2.1 1.3B's 12 heads: 2, 3, 4, 6 or 12 ranks; 14B's 40:
2, 4, 5, 8, 10 ...): padding heads would run attention for heads no rank needs, so other
counts are refused with the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from numaov import NumaovError
from numaov.custom_ops import all_gather_into_tensor, all_to_all
from numaov.models.wan import RANK_INPUT, SEQUENCE_GROUP


class SequenceSplitError(NumaovError):
    """A sequence split the model cannot take (heads not divisible by the ranks, ...)."""


def check_rank_count(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise SequenceSplitError(
            f"sequence-parallel ranks {world_size!r}; expected an integer of at least 2")


def check_sequence_split(heads: int, world_size: int) -> None:
    """``world_size`` ranks can share ``heads`` attention heads evenly."""
    check_rank_count(world_size)
    if heads % world_size:
        divisors = [n for n in range(2, heads + 1) if heads % n == 0]
        raise SequenceSplitError(
            f"the transformer has {heads} attention heads, which {world_size} sequence-parallel "
            f"ranks cannot share evenly; expected a number of ranks dividing {heads} "
            f"({', '.join(map(str, divisors))})")


def token_share(tokens: int, world_size: int) -> int:
    """Tokens per rank (the last shares padded): ``ceil(tokens / world_size)``."""
    return (tokens + world_size - 1) // world_size


@dataclass(frozen=True)
class SequenceSplit:
    """The split a model was set up for: ``world_size`` ranks of collective group ``group``."""

    world_size: int
    group: str = SEQUENCE_GROUP


@dataclass(frozen=True)
class RankTokens:
    """One forward's view of the split: the video's ``tokens`` and this rank's ``positions``
    (global token indices, ``[share]`` int64, past the video on a padded share)."""

    split: SequenceSplit
    tokens: int | torch.SymInt
    positions: Tensor

    @classmethod
    def of_rank(cls, split: SequenceSplit, tokens: int | torch.SymInt,
                rank: Tensor) -> RankTokens:
        share = token_share(tokens, split.world_size)
        positions = torch.arange(share, device=rank.device) + rank.reshape(()) * share
        return cls(split, tokens, positions)

    def own(self, hidden_states: Tensor) -> Tensor:
        """This rank's rows of ``[B, L, C]`` tokens: ``[B, share, C]`` (padding repeats the
        last token)."""
        return hidden_states.index_select(1, self.positions.clamp(max=self.tokens - 1))

    def to_heads(self, query: Tensor, key: Tensor,
                 value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``[B, share, H, D]`` each -> every token of this rank's ``H / world_size`` heads:
        query ``[B, world_size * share, H/N, D]``, key and value cut to the video's tokens."""
        ranks = self.split.world_size
        batch, share, heads, dim = query.shape
        stacked = torch.stack([query, key, value])  # [3, B, share, H, D]
        # head group n goes to rank n: [N, 3, B, share, H/N, D]
        blocks = stacked.reshape(3, batch, share, ranks, heads // ranks, dim).permute(
            3, 0, 1, 2, 4, 5)
        received = all_to_all(blocks, self.split.group, ranks)  # block i: rank i's tokens
        gathered = received.permute(1, 2, 0, 3, 4, 5).reshape(
            3, batch, ranks * share, heads // ranks, dim)
        # narrow, not a slice: a slice's length is min(tokens, rows), which torch.export
        # cannot relate to the other sizes (and then specialises the batch)
        return (gathered[0], gathered[1].narrow(1, 0, self.tokens),
                gathered[2].narrow(1, 0, self.tokens))

    def to_tokens(self, out: Tensor) -> Tensor:
        """``[B, world_size * share, H/N, D]`` attention output -> this rank's tokens of all
        heads, ``[B, share, H, D]``."""
        ranks = self.split.world_size
        batch, rows, group_heads, dim = out.shape
        share = rows // ranks
        # token block n goes back to rank n: [N, B, share, H/N, D]
        blocks = out.reshape(batch, ranks, share, group_heads, dim).transpose(0, 1)
        received = all_to_all(blocks, self.split.group, ranks)  # block i: head group i
        return received.permute(1, 2, 0, 3, 4).reshape(batch, share, ranks * group_heads, dim)

    def gather(self, tokens: Tensor) -> Tensor:
        """Every rank's ``[B, share, X]`` rows joined in token order, tokens first:
        ``[L, B, X]`` (a view of the gathered rows, which dim 0 joins)."""
        rows = tokens.transpose(0, 1)  # [share, B, X]
        joined = all_gather_into_tensor(rows, self.split.group, self.split.world_size)
        return joined.narrow(0, 0, self.tokens)


__all__ = [
    "RANK_INPUT",
    "SEQUENCE_GROUP",
    "RankTokens",
    "SequenceSplit",
    "SequenceSplitError",
    "check_rank_count",
    "check_sequence_split",
    "token_share",
]

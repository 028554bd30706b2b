"""The routed experts as weight stacks, computed by numaov's MoE op."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from numaov.custom_ops import moe_experts


class DeepseekV2Experts(nn.Module):
    """The routed experts as weight stacks: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``
    (``I`` is this rank's shard of ``moe_intermediate_size``; gate rows first, then up).

    The compute is one op, ``numaov::moe_experts`` (``custom_ops/moe_ops.py``), in every mode:
    eagerly its grouped loop (each expert that got rows runs once over just those rows), under
    export one ``numaov.moe::MoeExperts`` node with the stacks as its weight inputs, which
    OpenVINO runs with numaov's kernel. So no graph copies weights per (row, expert) pair or
    runs every expert on every row, and the stacks are stored in the export's weight format.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        return moe_experts(x, ids, weights, self.gate_up_proj, self.down_proj)

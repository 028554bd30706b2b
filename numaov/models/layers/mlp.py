"""The SwiGLU MLP of the dense layers and of the shared experts."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class GatedMLP(nn.Module):
    """SwiGLU MLP (dense layers and shared experts); ``intermediate`` is this rank's shard."""

    #: The linear layers an export may run on numaov's DenseLinear op
    #: (``exporter.dense_projections``; this rank's slice under DP).
    PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

"""DeepSeek's MoE block (V2, V3, Kimi-K2): the router, the routed experts and the always-on
shared experts, added up."""

from __future__ import annotations

from torch import Tensor, nn

from numaov.models.layers.experts import RoutedExperts
from numaov.models.layers.mlp import GatedMLP
from numaov.models.layers.router import Router


class SharedExpertsMoE(nn.Module):
    """Router (replicated, fp32), routed experts and shared experts (both sharded by
    intermediate: ``intermediate`` and ``shared_intermediate`` are this rank's shard; 0 shared
    means none). Parameter names are Hugging Face's (``gate``, ``experts``,
    ``shared_experts``)."""

    def __init__(self, router: Router, hidden: int, intermediate: int,
                 shared_intermediate: int) -> None:
        super().__init__()
        self.gate = router
        self.experts = RoutedExperts(router.num_experts, hidden, intermediate)
        self.shared_experts = (
            GatedMLP(hidden, shared_intermediate) if shared_intermediate else None
        )

    def forward(self, x: Tensor) -> Tensor:
        """``x [N, H]`` -> this rank's partial sum ``[N, H]``."""
        ids, weights = self.gate(x)
        out = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

"""The routed experts as weight stacks, and the forms (faces) their compute takes."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _experts_grouped(
    x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor
) -> Tensor:
    """Eager face: one pair of matmuls per expert that got rows, over just those rows.

    Every selected expert's weights are read once, in place: the fastest form in eager PyTorch
    at every batch size (see DeepseekV2Experts). Data-dependent (a Python loop over the hit
    experts), so it is never traced.
    """
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    rows = order // k  # token row of each (sorted) assignment
    slot_weights = weights.reshape(-1)[order]
    out = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        idx = rows[start:start + count]
        gate, up = F.linear(x[idx], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert])
        out.index_add_(0, idx, y.float() * slot_weights[start:start + count, None])
        start += count
    return out.to(x.dtype)


def _experts_gather(
    x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor
) -> Tensor:
    """Graph face for small batches: gather each (row, slot)'s expert weights, batched matmul.

    Cost ``N*k`` weight copies: grows with top-k, not with the expert count.
    """
    n, k = ids.shape
    flat = ids.reshape(-1)
    xk = x.unsqueeze(1).expand(n, k, x.shape[1]).reshape(n * k, 1, x.shape[1])
    gate, up = torch.matmul(xk, gate_up.index_select(0, flat).transpose(1, 2)).chunk(2, -1)
    y = torch.matmul(F.silu(gate) * up, down.index_select(0, flat).transpose(1, 2))
    y = y.reshape(n, k, x.shape[1]).float() * weights.unsqueeze(-1)
    return y.sum(dim=1).to(x.dtype)


def _experts_dense(
    x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor
) -> Tensor:
    """Graph face for large batches: every expert on every row, unselected ones weighted 0.

    Reads each expert's weights once (no copies), so it beats the gather when ``N*k`` exceeds
    the expert count; costs ``E`` expert passes per row.
    """
    n = x.shape[0]
    e = gate_up.shape[0]
    routing = torch.zeros(n, e, dtype=torch.float32, device=x.device).scatter(1, ids, weights)
    xe = x.unsqueeze(0).expand(e, n, x.shape[1])  # explicit: OpenVINO mis-runs the broadcast
    gate, up = torch.matmul(xe, gate_up.transpose(1, 2)).chunk(2, dim=-1)
    y = torch.matmul(F.silu(gate) * up, down.transpose(1, 2))  # [E, N, H]
    y = y.float() * routing.transpose(0, 1).unsqueeze(-1)
    return y.sum(dim=0).to(x.dtype)


def _experts_graph(
    x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor
) -> Tensor:
    # The branch is chosen at run time from the row count (ONNX If), not while tracing.
    small = x.shape[0] * ids.shape[1] <= gate_up.shape[0]
    return torch.cond(small, _experts_gather, _experts_dense, (x, ids, weights, gate_up, down))


EXPERT_IMPLS: dict[str, Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]] = {
    "grouped": _experts_grouped,
    "gather": _experts_gather,
    "dense": _experts_dense,
    "graph": _experts_graph,
}


class DeepseekV2Experts(nn.Module):
    """The routed experts as weight stacks: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``
    (``I`` is this rank's shard of ``moe_intermediate_size``; gate rows first, then up).

    The expert compute has two faces, like numaov's custom ops:

    - eager (``impl="auto"`` outside export): :func:`_experts_grouped`, a loop over the experts
      that got rows, each running its matmuls on its own rows;
    - graph (``impl="auto"`` while ``torch.export`` / ``torch.onnx.export`` traces):
      :func:`_experts_graph`, no Python control flow at all. ``torch.cond`` on the row count
      (an ONNX ``If``, decided at run time) picks the per-row weight gather + batched matmul
      when ``N*k <= E`` (decode: cost grows with top-k, not with E) and the dense all-experts
      form otherwise (prefill: each weight read once, no per-row copies).

    Weight copies dominate the gather form: ``N*k`` experts' weights are copied per call
    (whatever E is), so beyond ``N*k ~ E`` reading every expert once (dense) is cheaper, and
    per-row gathers at prefill sizes would need ``N*k*3*I*H`` elements of scratch. Neither
    graph form reaches the eager loop: a fused MoE op (grouped GEMM) for the graph is the real
    fix. OpenVINO 2026.4's CPU plugin carries a ``GatherMatmul`` node fed by a tiled-MoE
    pattern matcher, but hand-built tiled patterns (f32, u8 and i8 weights) did not trigger it.

    ``impl`` forces one form (``"grouped"``, ``"gather"``, ``"dense"``, ``"graph"``) for tests
    and benchmarks; ``"auto"`` is the default described above.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.impl = "auto"

    def forward(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        impl = self.impl
        if impl == "auto":
            impl = "graph" if torch.compiler.is_exporting() else "grouped"
        return EXPERT_IMPLS[impl](x, ids, weights, self.gate_up_proj, self.down_proj)

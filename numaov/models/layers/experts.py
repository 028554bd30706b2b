"""The routed experts as weight stacks, computed by numaov's MoE op."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from numaov.custom_ops import moe_experts
from numaov.custom_ops.moe_ops import quantize_experts


class RoutedExperts(nn.Module):
    """The routed experts as weight stacks: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``
    (``I`` is this rank's shard of the expert intermediate size; gate rows first, then up).

    The compute is one op, ``numaov::moe_experts`` (``custom_ops/moe_ops.py``), in every mode:
    eagerly its grouped loop (each expert that got rows runs once over just those rows), under
    export one ``numaov.moe::MoeExperts`` node with the stacks as its weight inputs, which
    OpenVINO runs with numaov's kernel. So no graph copies weights per (row, expert) pair or
    runs every expert on every row, and the stacks are stored in the export's weight format.

    :meth:`store_as` turns the stacks into int8 / int4 (with scales) or bf16 buffers, which
    the op reads as they are: an export of the module then holds them in that format.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.register_buffer("gate_up_scale", None)
        self.register_buffer("down_scale", None)

    def store_as(self, weight_format: str, group_size: int | None = None) -> None:
        """Hold the stacks in ``weight_format`` (``moe_ops.quantize_experts``) from now on."""
        gate_up, gate_up_scale = quantize_experts(self.gate_up_proj.detach(), weight_format,
                                                  group_size)
        down, down_scale = quantize_experts(self.down_proj.detach(), weight_format, group_size)
        del self.gate_up_proj, self.down_proj
        self.register_buffer("gate_up_proj", gate_up)
        self.register_buffer("down_proj", down)
        self.register_buffer("gate_up_scale", gate_up_scale)
        self.register_buffer("down_scale", down_scale)

    def forward(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        return moe_experts(x, ids, weights, self.gate_up_proj, self.down_proj,
                           self.gate_up_scale, self.down_scale)

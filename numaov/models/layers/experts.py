"""The routed experts as weight stacks, computed by numaov's MoE op."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from numaov.custom_ops import moe_experts


class RoutedExperts(nn.Module):
    """The routed experts as weight stacks: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``
    (``I`` is this rank's shard of the expert intermediate size; gate rows first, then up).

    The compute is one op, ``numaov::moe_experts`` (``custom_ops/moe_ops.py``): its grouped
    loop runs each expert that got rows once, over just those rows. What the PyTorch backend
    and training hold. An export never builds this module: the experts go from the checkpoint
    to each rank's expert store, and the exported model holds :class:`StoredExperts`, whose
    node names the store.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        return moe_experts(x, ids, weights, self.gate_up_proj, self.down_proj)


class StoredExperts(nn.Module):
    """Layer ``layer``'s routed experts read from the open expert store ``store_id``
    (``custom_ops.expert_store``): no parameters, so a model built with them holds every
    weight but the experts, and its export is one ``MoeExperts`` node naming the store."""

    def __init__(self, store_id: str, layer: int) -> None:
        super().__init__()
        self.store_id = store_id
        self.layer = layer

    def forward(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        from numaov.custom_ops.expert_store import moe_experts_stored

        return moe_experts_stored(x, ids, weights, self.store_id, self.layer)


class CheckpointExperts(nn.Module):
    """Layer ``layer``'s routed experts read from the checkpoint as rows reach them: each
    expert that gets rows is read (this rank's shard), widened to f32 and let go. The parity
    reference of a streamed export: the PyTorch model computes with the checkpoint's own
    weights without ever holding a layer's experts."""

    def __init__(self, read_expert: Callable[[int], tuple[Tensor, Tensor]],
                 num_experts: int) -> None:
        super().__init__()
        self.read_expert = read_expert
        self.num_experts = num_experts

    def forward(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32)
        for expert in torch.unique(ids).tolist():
            rows, slots = (ids == expert).nonzero(as_tuple=True)
            gate_up, down = (w.float() for w in self.read_expert(expert))
            # the op on this one expert: the same grouped loop, one expert, its rows only
            y = moe_experts(x[rows], torch.zeros(len(rows), 1, dtype=torch.int64),
                            weights[rows, slots][:, None].contiguous(), gate_up[None],
                            down[None])
            out.index_add_(0, rows, y.float())
        return out.to(x.dtype)


def replace_experts(model: nn.Module, make: Callable[[int], nn.Module]) -> list[int]:
    """Swap every :class:`RoutedExperts` of ``model`` (``model.layers.{l}.mlp.experts``) for
    ``make(l)``; returns the layers swapped."""
    layers = []
    for name, module in list(model.named_modules()):
        if isinstance(module, RoutedExperts):
            layer = int(name.split(".")[2])
            model.set_submodule(name, make(layer))
            layers.append(layer)
    return layers

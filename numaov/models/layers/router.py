"""The expert choice of a routed MoE block, kept in fp32 whatever the model dtype, as
transformers and the model authors do: bf16 scores would flip near-tied experts.

One module covers the routers of the families numaov serves:

- scores: ``softmax`` over all experts (DeepSeek-V2, Qwen-MoE) or ``sigmoid`` per expert
  (DeepSeek-V3);
- an optional ``score_correction_bias`` (DeepSeek-V3's ``e_score_correction_bias``) added to the
  scores for the choice only: the weights are the uncorrected scores of the chosen experts;
- selection: ``greedy`` top-k, or group-limited (``n_group`` groups of experts, keep the
  ``topk_group`` best groups, top-k inside them), a group's merit being its best expert
  (``group_limited_greedy``, DeepSeek-V2) or the sum of its two best (``noaux_tc``, DeepSeek-V3);
- the chosen weights renormalised to sum 1 (``norm_topk_prob``) and multiplied by
  ``routed_scaling_factor``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: How scores become expert probabilities.
SCORE_FUNCTIONS = ("softmax", "sigmoid")
#: How the top-k experts are chosen.
SELECTIONS = ("greedy", "group_limited_greedy", "noaux_tc")


class Router(nn.Module):
    """Top-k expert choice per row: ``x [N, H]`` -> ``(ids [N, k] int64, weights [N, k] fp32)``.

    The weights are renormalised when ``norm_topk_prob`` (whatever k), then always times
    ``routed_scaling_factor``, as transformers' DeepSeek-V3 and Qwen-MoE routers (Qwen's factor
    is 1; transformers' DeepSeek-V2 router never renormalises, its family passes False).
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, *,
                 score_function: str = "softmax", selection: str = "greedy",
                 n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = False,
                 routed_scaling_factor: float = 1.0, correction_bias: bool = False) -> None:
        super().__init__()
        assert score_function in SCORE_FUNCTIONS and selection in SELECTIONS
        self.num_experts, self.top_k = num_experts, top_k
        self.score_function, self.selection = score_function, selection
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))
        else:
            self.register_parameter("e_score_correction_bias", None)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if self.score_function == "sigmoid" else logits.softmax(-1)
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = scores + self.e_score_correction_bias.float()
        if self.selection != "greedy":
            choice = self._keep_best_groups(choice)
        ids = torch.topk(choice, self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.routed_scaling_factor

    def _keep_best_groups(self, choice: Tensor) -> Tensor:
        """``choice [N, E]`` with the experts outside the ``topk_group`` best groups at -inf
        (a bias-corrected score may be negative: a masked 0 could still be chosen)."""
        n = choice.shape[0]
        per_group = self.num_experts // self.n_group
        grouped = choice.view(n, self.n_group, per_group)
        if self.selection == "noaux_tc":
            merit = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)  # [N, G]
        else:
            merit = grouped.amax(dim=-1)  # [N, G]
        chosen = torch.topk(merit, self.topk_group, dim=-1).indices
        group_mask = torch.zeros_like(merit).scatter(1, chosen, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand(n, self.n_group, per_group)
        return choice.masked_fill(expert_mask.reshape(n, self.num_experts) == 0, float("-inf"))

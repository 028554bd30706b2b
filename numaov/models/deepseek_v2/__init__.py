"""DeepSeek-V2: multi-head latent attention (MLA) and a shared + routed-expert MoE, with
data-parallel (DP) attention across ranks.

Parameter names are those of Hugging Face ``DeepseekV2ForCausalLM.state_dict()``
(transformers 5), so a ``deepseek_v2`` checkpoint directory (``config.json`` +
``model.safetensors`` or a sharded index) loads with :meth:`DeepseekV2.from_pretrained`. On
disk, DeepSeek checkpoints keep one tensor per expert
(``mlp.experts.{e}.gate_proj.weight`` ...); like transformers, the model holds the experts as
stacks (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``), because
an expert stack can be indexed by the router's choice inside one graph.

Semantics follow transformers' ``deepseek_v2`` (which follows DeepSeek's own code):

- rope on the ``qk_rope_head_dim`` slice only, adjacent pairs rotated (interleaved layout);
  yarn scales cos/sin by ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` and the
  softmax scale by ``mscale(factor, mscale_all_dim) ** 2``;
- the router is fp32: softmax over all experts, then greedy top-k or group-limited top-k
  (keep the ``topk_group`` groups with the best single expert, top-k inside them);
- the top-k weights are multiplied by ``routed_scaling_factor``; ``norm_topk_prob`` is not
  read, as in transformers (DeepSeek's own V2 code renormalised instead when it was set; every
  published V2 checkpoint sets it False);
- layer ``i`` is an MoE layer when ``i >= first_k_dense_replace``, else a dense MLP; as in
  transformers ``moe_layer_freq`` is not read (DeepSeek's own code also made the layers with
  ``i % moe_layer_freq != 0`` dense; every published checkpoint sets it to 1).

DP attention: each rank runs attention on its own sequences and, around every MLP and MoE
block, the exchange of :mod:`numaov.models.layers.data_parallel` (gather every rank's rows, run
this rank's shard, reduce-scatter the partial sums); each rank's head is its slice of the
vocabulary, applied to every rank's last rows (an all-to-all returns each rank its logits).

Sharding is along the intermediate dim (dense MLP, shared experts, and inside every routed
expert), not by expert. Why: with an intermediate split every rank does exactly ``1/dp`` of
every token's work whatever the router picks, and the shapes stay data-independent (one graph,
no token dispatch); an expert split makes the busiest rank's experts set the step time and
needs a data-dependent dispatch of tokens to the rank owning each expert. The router is
replicated: every rank routes the same gathered rows with the same fp32 weights, so all ranks
pick the same experts. ``--dp`` must therefore divide ``intermediate_size``,
``moe_intermediate_size`` and ``n_shared_experts * moe_intermediate_size``
(:func:`check_dp_divides`). The model calls the collectives of
:mod:`numaov.custom_ops.collective_ops` by group name only.

The package, one concern per module: ``family`` (what the rest of numaov reads:
:class:`numaov.models.families.LMFamily`), ``config`` (the config and its rope / yarn keys),
``sharding`` (the weight split), ``checkpoint_layout`` (per-expert files <-> expert stacks),
then the blocks (``attention``, ``moe``: the router and experts from the shared
``numaov.models.layers``) and ``causal_lm`` (the model: the shared decoder stack and causal LM
of ``numaov.models.layers`` with DeepSeek-V2's blocks). Generation (scheduling, sampling, the
cache pool) is the runtime's: :mod:`numaov.runtime.lm.engine`.
"""

# Names in __all__ are the interface; the ones imported "as" themselves are the building blocks,
# importable from here as they were before the package split (tests, benchmarks, builtin/).
from numaov.models.deepseek_v2.attention import LATENT_NORM_EPS as LATENT_NORM_EPS
from numaov.models.deepseek_v2.attention import DeepseekV2Attention as DeepseekV2Attention
from numaov.models.deepseek_v2.causal_lm import DeepseekV2, DeepseekV2Step
from numaov.models.deepseek_v2.checkpoint_layout import WEIGHTS_INDEX_NAME as WEIGHTS_INDEX_NAME
from numaov.models.deepseek_v2.checkpoint_layout import WEIGHTS_NAME as WEIGHTS_NAME
from numaov.models.deepseek_v2.checkpoint_layout import (
    checkpoint_to_model_state_dict,
    model_to_checkpoint_state_dict,
)
from numaov.models.deepseek_v2.config import DeepseekConfigError, DeepseekV2Config
from numaov.models.deepseek_v2.moe import DeepseekV2MoE as DeepseekV2MoE
from numaov.models.deepseek_v2.moe import deepseek_v2_router as deepseek_v2_router
from numaov.models.deepseek_v2.sharding import check_dp_divides, shard_state_dict
from numaov.models.layers.data_parallel import DataParallelGroup, ShardError

__all__ = [
    "DataParallelGroup",
    "DeepseekConfigError",
    "DeepseekV2",
    "DeepseekV2Config",
    "DeepseekV2Step",
    "ShardError",
    "check_dp_divides",
    "checkpoint_to_model_state_dict",
    "model_to_checkpoint_state_dict",
    "shard_state_dict",
]

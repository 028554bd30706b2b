"""DeepSeek-V3 (``model_type`` ``deepseek_v3``; Kimi-K2's ``kimi_k2`` is the same
architecture): DeepSeek-V2's multi-head latent attention with a low-rank query (q LoRA), and
an MoE whose router scores experts with a sigmoid and chooses them with the score correction
bias inside the best groups (``noaux_tc``), with data-parallel (DP) attention across ranks.

Built from :mod:`numaov.models.layers`: ``mla`` (the attention and its cache: per token the
normalised latent and the rotated rope key), ``router`` (fp32; ``score_function="sigmoid"``,
``selection="noaux_tc"``, ``correction_bias``), ``experts`` (numaov's
MoE op), ``mlp``, ``rope`` (yarn with ``mscale`` / ``mscale_all_dim``), ``data_parallel``,
``sharding`` (the intermediate-dim split) and ``expert_layout`` (per-expert tensors <->
stacks). Semantics follow transformers' ``DeepseekV3ForCausalLM``:

- layer ``i`` is an MoE layer when ``i >= first_k_dense_replace``, else a dense MLP
  (``moe_layer_freq`` is not read, as in transformers; every release sets it to 1);
- scores ``sigmoid(x W^T)`` in fp32; the choice uses ``scores + e_score_correction_bias``:
  the ``topk_group`` of ``n_group`` groups whose two best corrected scores sum highest, then
  top-k inside them; the weights are the uncorrected scores of the chosen experts,
  renormalised to sum 1 when ``norm_topk_prob``, then times ``routed_scaling_factor``;
- ``rope_interleave`` (default true) rotates adjacent pairs of the rope dims, else the halves.

Checkpoints: the multi-token-prediction layers (``model.layers.{num_hidden_layers}.*``) are
skipped with a log line; released FP8 checkpoints (float8_e4m3fn weights with 128x128 block
``weight_scale_inv``) are dequantized block by block as they are read. Refused with one line:
a checkpoint without ``e_score_correction_bias``, DeepSeek-V3.2's sparse attention (its
indexer) and DeepSeek-V4.

The package: ``config``, ``family`` (the :class:`numaov.models.families.LMFamily`),
``sharding``, ``checkpoint_layout``, ``model`` (MoE block, decoder layer and stack) and
``causal_lm`` (load, save, the cached and the pooled step).
"""

from numaov.models.deepseek_v3.causal_lm import DeepseekV3, DeepseekV3Step
from numaov.models.deepseek_v3.config import DeepseekV3Config, DeepseekV3ConfigError

__all__ = ["DeepseekV3", "DeepseekV3Config", "DeepseekV3ConfigError", "DeepseekV3Step"]

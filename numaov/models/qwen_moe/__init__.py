"""Qwen-MoE (``qwen3_moe``, ``qwen2_moe``): grouped-query attention and a routed-expert MoE
(Qwen2-MoE: plus a gated shared expert), with data-parallel (DP) attention across ranks.

Parameter names are those of Hugging Face ``Qwen3MoeForCausalLM`` / ``Qwen2MoeForCausalLM``
(transformers 5), so a checkpoint directory written by their ``save_pretrained`` (one tensor
per expert: ``mlp.experts.{e}.gate_proj.weight`` ...) loads with
:meth:`QwenMoe.from_pretrained`; the model holds the experts as stacks
(``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) on numaov's MoE op.

Semantics follow transformers:

- attention: GQA (``num_key_value_heads`` KV heads of ``head_dim``, scale
  ``head_dim ** -0.5``), Qwen3's per-head RMSNorm on q and k before rope, Qwen2's q/k/v bias
  (``qkv_bias``) or Qwen3's ``attention_bias`` (q/k/v and o); rope on the whole head in the
  half-split (NeoX) layout, plain or scaled by ``rope_scaling`` (linear, yarn, llama3);
- the router is fp32: softmax over all experts, greedy top-k, renormalised to sum 1 when
  ``norm_topk_prob`` (also at top-k 1), never scaled;
- layer ``i`` is sparse unless listed in ``mlp_only_layers``, when ``(i + 1) %
  decoder_sparse_step == 0``; other layers are a dense SwiGLU MLP of ``intermediate_size``;
- Qwen2-MoE adds ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` to the routed output;
- sliding-window attention (``use_sliding_window: true``) is refused.

The KV cache entry of a token and layer is its rotated keys then its values
(``CacheLayout("gqa", layers, (("key", kv*D), ("value", kv*D)))``, see
:mod:`numaov.models.layers.gqa`). DP attention and sharding are DeepSeek-V2's: attention and
the router replicated, the dense MLPs, the shared expert and every routed expert split along
their intermediate dim (:func:`check_dp_divides` names the dims a dp does not divide), the
head by vocabulary rows.

Modules: ``family`` (what the rest of numaov reads), ``config``, ``sharding``,
``checkpoint_layout``, ``moe``, ``decoder``, ``causal_lm``.
"""

from numaov.models.qwen_moe.causal_lm import QwenMoe, QwenMoeStep
from numaov.models.qwen_moe.config import QwenMoeConfig, QwenMoeConfigError
from numaov.models.qwen_moe.sharding import check_dp_divides

__all__ = ["QwenMoe", "QwenMoeConfig", "QwenMoeConfigError", "QwenMoeStep", "check_dp_divides"]

"""The layers the language-model families share, each written once.

- ``norm``: RMSNorm on the ``norm_infer`` fallback op;
- ``rope``: rotary tables (plain, yarn, Llama-3-style scaling) and the yarn attention scale;
- ``router``: the fp32 expert choice (softmax / sigmoid scores, greedy / group-limited top-k,
  a selection-only score correction bias, renormalisation and scaling);
- ``experts``: the routed experts as weight stacks on numaov's MoE op;
- ``mlp``: the SwiGLU MLP of dense layers and shared experts;
- ``kernel_linear``: a linear layer on numaov's op, its weight bf16 or a released
  checkpoint's FP8 (an export's projections, ``exporter.dense_projections``);
- ``mla``: multi-head latent attention (DeepSeek-V2 / V3 / Kimi-K2) over a compressed latent
  cache;
- ``gqa``: grouped-query attention (Qwen-MoE) over a cache of rotated K and V heads;
- ``attention_mask``: the causal mask over past and new tokens that MLA and GQA are given;
- ``data_parallel``: the DP group a model instance is one rank of, and the exchange around
  every MLP / MoE block and the head under DP attention;
- ``sharding``: the check that dp divides the split dims, and which MLP / expert / head
  tensors a rank holds a slice of (``shard_tensor``);
- ``expert_layout``: checkpoints with one tensor per routed expert to and from the model's
  expert stacks (read shard by shard), and the checkpoint file names;
- ``moe``: DeepSeek's MoE block (router, routed experts, shared experts);
- ``decoder``: the decoder layer and stack (norm, attention, residual, norm, MLP / MoE across
  the DP ranks, residual) around a family's attention and MoE block;
- ``causal_lm``: the causal LM and its exported step module: load, save, the cached and the
  pooled step; a family subclasses it with its config, checkpoint layout and decoder;
- ``config_keys``: config dataclasses from and to ``config.json`` keys, the shared checks;
- ``lm_loading``: around loading and running a causal LM: dtype resolution, the fp32 router,
  freezing, positions from the mask, the past rows of a pooled step.

A family (``numaov/models/<family>/``) builds its decoder from these and adds only what is its
own (attention design, config keys, checkpoint layout).
"""

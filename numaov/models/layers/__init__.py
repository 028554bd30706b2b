"""The layers the language-model families share, each written once.

- ``norm``: RMSNorm on the ``norm_infer`` fallback op;
- ``rope``: rotary tables (plain, yarn, Llama-3-style scaling) and the yarn attention scale;
- ``router``: the fp32 expert choice (softmax / sigmoid scores, greedy / group-limited top-k,
  a selection-only score correction bias, renormalisation and scaling);
- ``experts``: the routed experts as weight stacks on numaov's MoE op;
- ``mlp``: the SwiGLU MLP of dense layers and shared experts;
- ``data_parallel``: the DP group a model instance is one rank of, and the exchange around
  every MLP / MoE block under DP attention.

A family (``numaov/models/<family>/``) builds its decoder from these and adds only what is its
own (attention design, config keys, checkpoint layout).
"""

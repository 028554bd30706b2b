"""The language-model runtime: the engine (continuous batching over DP ranks), its scheduler,
cache pool, per-rank runner and sampler, the rank transports and the text helpers. Model-family
agnostic: what it needs of a model is in the export's manifest (family, cache layout)."""

"""Wan 2.1 / 2.2 in the diffusers layout: the transformer (``transformer``) and the text
encoder and VAE graphs the exporter writes (``components``)."""

# The token states an exported transformer returns beside its sample (into the first block,
# out of it, out of the last), so the runtime's step cache can run it in parts
# (``WanTransformer.block_outputs``, ``runtime/wan/step_cache.py``). Here, not in
# ``transformer``, so the runtime reads them without importing torch.
BLOCK_OUTPUTS = ("embedded", "first_block", "last_block")

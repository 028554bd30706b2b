"""Wan 2.1 / 2.2 in the diffusers layout: the transformer (``transformer``) and the text
encoder and VAE graphs the exporter writes (``components``)."""

# The token states an exported transformer returns beside its sample (into the first block,
# out of it, out of the last), so the runtime's step cache can run it in parts
# (``WanTransformer.block_outputs``, ``runtime/wan/step_cache.py``). Here, not in
# ``transformer``, so the runtime reads them without importing torch.
BLOCK_OUTPUTS = ("embedded", "first_block", "last_block")

# A transformer split over sequence-parallel ranks (``sequence_parallel``): the collective
# group its graph's nodes name, the input that gives a rank its index, and the directory of
# the graph for ``ranks`` ranks within the transformer's export.
SEQUENCE_GROUP = "wan-sequence"
RANK_INPUT = "sequence_rank"


def sequence_dir_name(ranks: int) -> str:
    return f"sequence_{ranks}"


def block_states(num_layers: int) -> tuple[str, ...]:
    """The token states along the blocks, in order: into the first block, then out of each
    (``block_<i>`` for the ones between the first and the last). An exported transformer
    returns them all, so its parity is judged block by block (``exporter/wan_export.py``)."""
    middle = tuple(f"block_{i}" for i in range(1, num_layers - 1))
    return ("embedded", "first_block", *middle, *(("last_block",) if num_layers > 1 else ()))


def state_outputs(num_layers: int) -> tuple[str, ...]:
    """The token states an exported transformer returns after its sample, in the order
    ``WanTransformer.forward`` returns them: ``BLOCK_OUTPUTS``, then the states between the
    first block and the last."""
    return (*BLOCK_OUTPUTS, *block_states(num_layers)[2:-1])

"""What ranks share, not ops: the shared-memory communicator (and a gloo one behind the same
interface), its group registry, and the rank-process spawner (``rank_group``)."""

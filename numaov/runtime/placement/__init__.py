"""Where work runs: the machine's NUMA topology, the binding plan (one rank per NUMA node or
``NUMAOV_CPU_BIND``) and the pinned worker processes."""

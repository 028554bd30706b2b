"""The KV cache of every rank: a token pool numaov owns, updated in place.

Each rank holds one pool, ``[layers, capacity_tokens, width]`` f32, shaped by the export's
cache layout (``manifest.CacheLayout``, which the model family describes: for MLA, per token the
normalised latent and the rotated rope key; for GQA, the K and V heads), allocated once when
the rank starts and passed to the graph as an input that shares the pool's memory (no copy in).
A step's graph reads the cached tokens of its rows by slot (``past_slots``) and returns only the
new tokens' entries (``new_key_values``), which the rank writes into their slots (no copy out);
see ``docs/architecture.md`` ("KV cache") for why this and not OpenVINO's stateful or
paged-attention transformations.

:class:`CacheManager` is the pool's bookkeeping, kept by the engine (one per rank): which slots
each sequence owns. A sequence gets the slots of its prompt and of every token it may generate
when it is admitted, so it never runs out mid-generation; the slots go back to the free list
the moment it finishes or is cancelled. Slots need not be contiguous, so nothing is ever
compacted or moved. :func:`check_pool_fits` refuses a capacity the rank's NUMA node cannot
hold, when the rank starts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from numaov import NumaovError
from numaov.runtime.lm.sequence import GenerationInputError

# Cache entries are f32 (the graph's kv_cache input), whatever the weights' precision.
ENTRY_BYTES = 4
# The default capacity of each rank's pool, in tokens.
DEFAULT_CACHE_TOKENS = 32768
# A pool may take at most this share of the memory its node has available at start.
MEMORY_SHARE = 0.8


class CacheCapacityError(GenerationInputError):
    """A cache capacity the node cannot hold, or a request no cache of this size can hold."""


def pool_bytes(layers: int, width: int, tokens: int) -> int:
    return layers * width * tokens * ENTRY_BYTES


def check_capacity(tokens: int) -> int:
    if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens < 1:
        raise CacheCapacityError(f"cache_tokens is {tokens!r}; expected a positive integer "
                                 "(cache slots per rank)", parameter="cache_tokens")
    return int(tokens)


def available_memory(cpus: Iterable[int] | None = None) -> int | None:
    """Bytes free on the NUMA nodes of ``cpus`` (default: this process's CPUs), from sysfs;
    the whole machine's ``MemAvailable`` when the nodes cannot be read; None when neither can."""
    from numaov.runtime.placement.topology import parse_cpu_list

    allowed = set(cpus) if cpus is not None else os.sched_getaffinity(0)
    total, found = 0, False
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        try:
            if not set(parse_cpu_list((node / "cpulist").read_text().strip())) & allowed:
                continue
            for line in (node / "meminfo").read_text().splitlines():
                if "MemFree:" in line:
                    total += int(line.split("MemFree:")[1].split()[0]) * 1024
                    found = True
        except (OSError, ValueError, IndexError, NumaovError):
            continue
    if found:
        return total
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_pool_fits(layers: int, width: int, tokens: int, rank: int) -> int:
    """The pool's bytes, after checking that the rank's node can hold it."""
    need = pool_bytes(layers, width, tokens)
    free = available_memory()
    if free is not None and need > MEMORY_SHARE * free:
        raise CacheCapacityError(
            f"a KV cache of {tokens} tokens needs {need / 2**20:.0f} MiB on rank {rank}, but its "
            f"NUMA node has {free / 2**20:.0f} MiB free; expected cache_tokens at most "
            f"{int(MEMORY_SHARE * free // pool_bytes(layers, width, 1))}",
            parameter="cache_tokens")
    return need


class CacheManager:
    """The slots of one rank's pool: free list, and the slots each sequence owns."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = check_capacity(capacity_tokens)
        # A stack: the most recently freed slots are reused first (warm in the cache).
        self._free = list(range(self.capacity - 1, -1, -1))
        self._owned: dict[int, np.ndarray] = {}

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def free(self) -> int:
        return len(self._free)

    def can_hold(self, tokens: int) -> bool:
        return tokens <= len(self._free)

    def allocate(self, request_id: int, tokens: int) -> np.ndarray:
        """``tokens`` slots for ``request_id`` (int64, in the order its tokens fill them)."""
        if request_id in self._owned:
            raise ValueError(f"request {request_id} already holds cache slots")
        if tokens > len(self._free):
            raise CacheCapacityError(f"{tokens} cache slots asked, {len(self._free)} free")
        slots = np.array(self._free[len(self._free) - tokens:][::-1], dtype=np.int64)
        del self._free[len(self._free) - tokens:]
        self._owned[request_id] = slots
        return slots

    def release(self, request_id: int) -> int:
        """Give ``request_id``'s slots back; returns how many (0 when it held none)."""
        slots = self._owned.pop(request_id, None)
        if slots is None:
            return 0
        self._free.extend(slots[::-1].tolist())
        return len(slots)

    def holds(self, request_id: int) -> bool:
        return request_id in self._owned

"""The KV cache of every rank: a token pool numaov owns, updated in place.

Each rank holds one pool, ``[layers, capacity_tokens, width]``, shaped and typed by the
export's cache layout (``manifest.CacheLayout``, which the model family describes: for MLA, per
token the normalised latent and the rotated rope key; for GQA, the K and V heads; bf16 values
in a bf16 export, f32 in an f32 one), allocated once when
the rank starts and passed to the graph as an input that shares the pool's memory (no copy in).
A step's graph reads the cached tokens of its rows by slot (``past_slots``) and returns only the
new tokens' entries (``new_key_values``), which the rank writes into their slots (no copy out);
see ``docs/architecture.md`` ("KV cache") for why this and not OpenVINO's stateful or
paged-attention transformations.

:class:`CacheManager` is the pool's bookkeeping, kept by the engine (one per rank): which slots
each sequence holds, and the prefix cache. A sequence gets the slots of its prompt and of every
token it may generate when it is admitted, so it never runs out mid-generation; the slots go
back the moment it finishes or is cancelled, except the blocks it left in the prefix cache,
which later prompts starting with the same tokens read instead of computing them again.
Slots need not be contiguous, so nothing is ever compacted or moved. :func:`check_pool_fits` refuses a capacity the rank's NUMA node cannot
hold, when the rank starts.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from numaov import NumaovError
from numaov.manifest import CacheLayout
from numaov.runtime.lm.sequence import GenerationInputError

# The default capacity of each rank's pool, in tokens.
DEFAULT_CACHE_TOKENS = 32768
# A pool may take at most this share of the memory its node has available at start.
MEMORY_SHARE = 0.8
# Tokens per prefix-cache block: a prompt reuses cached entries in whole blocks. Small enough
# that a chat turn's shared history is nearly all found, large enough that a 2,000-token
# prompt is 125 dict lookups.
PREFIX_BLOCK = 16


class CacheCapacityError(GenerationInputError):
    """A cache capacity the node cannot hold, or a request no cache of this size can hold."""


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


def check_pool_fits(cache: CacheLayout, tokens: int, rank: int) -> int:
    """The pool's bytes, after checking that the rank's node can hold it."""
    need = cache.pool_bytes(tokens)
    free = available_memory()
    if free is not None and need > MEMORY_SHARE * free:
        raise CacheCapacityError(
            f"a KV cache of {tokens} tokens needs {need / 2**20:.0f} MiB on rank {rank}, but its "
            f"NUMA node has {free / 2**20:.0f} MiB free; expected cache_tokens at most "
            f"{int(MEMORY_SHARE * free // cache.pool_bytes(1))}",
            parameter="cache_tokens")
    return need


@dataclass(eq=False)
class _Block:
    """``PREFIX_BLOCK`` cached tokens whose entries later prompts may read: the slots that hold
    them, the block before it in the prompt (``parent``, -1 for the first) and how many
    sequences read it now (``refs``; 0: kept for reuse, evictable)."""

    id: int
    key: tuple[int, tuple[int, ...]]
    slots: np.ndarray
    refs: int = 0


@dataclass(eq=False)
class _Holding:
    """What one sequence holds: every slot in token order (``slots``; the first
    ``len(blocks) * PREFIX_BLOCK`` may be shared blocks), the blocks it reads, and how far its
    tokens were offered for reuse (``published`` blocks, ``parent`` the last one's id)."""

    slots: np.ndarray
    blocks: list[_Block]
    published: int = 0
    parent: int = -1


class CacheManager:
    """The slots of one rank's pool: the free list, the slots each sequence holds, and (with
    ``prefix_cache``) the blocks of cached tokens later prompts may start from.

    Prefix caching: the entries of a token depend only on the tokens before it, so a prompt
    that starts with tokens another sequence already fed can read that sequence's entries
    instead of computing them. The unit is a block of ``PREFIX_BLOCK`` tokens, identified by
    its tokens and the block before it (a chain of blocks, as vLLM's block hashes, kept in a
    dict: one lookup per block of the prompt). A sequence offers its blocks when its prompt is
    read and again when it leaves (prompt and output); a block stays in the pool after its
    readers left and is evicted, least recently used first, only when a new sequence needs
    its slots. Blocks are read-only: a sequence writes only its own slots, after the prefix it
    found, so sharing never changes an entry another sequence reads.
    """

    def __init__(self, capacity_tokens: int, prefix_cache: bool = True) -> None:
        self.capacity = check_capacity(capacity_tokens)
        self.prefix_cache = prefix_cache
        # A stack: the most recently freed slots are reused first (warm in the cache).
        self._free = list(range(self.capacity - 1, -1, -1))
        self._held: dict[int, _Holding] = {}
        self._blocks: dict[tuple[int, tuple[int, ...]], _Block] = {}
        # Blocks no sequence reads, least recently used first: the eviction order.
        self._unused: OrderedDict[int, _Block] = OrderedDict()
        self._next_block = 0
        self.prompt_tokens = 0  # prompt tokens admitted, and of them found in the cache
        self.cached_prompt_tokens = 0

    @property
    def used(self) -> int:
        """Slots sequences hold (blocks kept only for reuse count as free)."""
        return self.capacity - len(self._free) - self.reusable

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def reusable(self) -> int:
        """Slots of cached blocks no sequence reads: evicted when the slots are needed."""
        return len(self._unused) * PREFIX_BLOCK

    @property
    def cached_tokens(self) -> int:
        """Tokens in the prefix cache (read now or kept for reuse)."""
        return len(self._blocks) * PREFIX_BLOCK

    def _match(self, prompt: Seq[int]) -> list[_Block]:
        """The cached blocks ``prompt`` starts with; never the whole prompt: its last token is
        always fed, for the logits the first new token is sampled from."""
        found: list[_Block] = []
        if not self.prefix_cache:
            return found
        parent = -1
        for start in range(0, len(prompt) - PREFIX_BLOCK, PREFIX_BLOCK):
            block = self._blocks.get((parent, tuple(prompt[start:start + PREFIX_BLOCK])))
            if block is None:
                break
            found.append(block)
            parent = block.id
        return found

    def cached_prefix(self, prompt: Seq[int]) -> int:
        """How many of ``prompt``'s tokens this rank would read from its cache."""
        return len(self._match(prompt)) * PREFIX_BLOCK

    def fits(self, tokens: int, prompt: Seq[int] = ()) -> int | None:
        """How many of ``prompt``'s tokens a sequence of ``tokens`` slots starting with it
        would read from the cache, when it fits now; None when it does not (one match of the
        prompt answers both, for the scheduler's choice of rank)."""
        found = self._match(prompt)
        idle_found = sum(1 for b in found if b.refs == 0) * PREFIX_BLOCK
        cached = len(found) * PREFIX_BLOCK
        return cached if tokens - cached <= len(self._free) + self.reusable - idle_found else None

    def can_hold(self, tokens: int, prompt: Seq[int] = ()) -> bool:
        """Whether a sequence of ``tokens`` slots, starting with ``prompt``, fits now."""
        return self.fits(tokens, prompt) is not None

    def allocate(self, request_id: int, tokens: int, prompt: Seq[int] = ()) -> tuple[np.ndarray,
                                                                                    int]:
        """``tokens`` slots for ``request_id`` (int64, in the order its tokens fill them) and
        how many of its first tokens are already in them (the cached prefix of ``prompt``)."""
        if request_id in self._held:
            raise ValueError(f"request {request_id} already holds cache slots")
        found = self._match(prompt)
        for block in found:  # read now: not evictable
            block.refs += 1
            self._unused.pop(block.id, None)
        cached = len(found) * PREFIX_BLOCK
        need = tokens - cached
        while need > len(self._free) and self._unused:
            self._evict()
        if need > len(self._free):
            self._drop_reads(found)
            raise CacheCapacityError(f"{need} cache slots asked, {len(self._free)} free")
        own = np.array(self._free[len(self._free) - need:][::-1], dtype=np.int64)
        del self._free[len(self._free) - need:]
        slots = np.concatenate([*(b.slots for b in found), own]) if found else own
        self._held[request_id] = _Holding(slots, found, len(found),
                                          found[-1].id if found else -1)
        self.prompt_tokens += len(prompt)
        self.cached_prompt_tokens += cached
        return slots, cached

    def publish(self, request_id: int, tokens: Seq[int]) -> None:
        """Offer the whole blocks of ``tokens`` (the sequence's tokens whose entries are in
        its slots, or are being written by the step now running) for later prompts to read."""
        held = self._held.get(request_id)
        if held is None or not self.prefix_cache:
            return
        for index in range(held.published, len(tokens) // PREFIX_BLOCK):
            start = index * PREFIX_BLOCK
            key = (held.parent, tuple(tokens[start:start + PREFIX_BLOCK]))
            block = self._blocks.get(key)
            if block is None:  # new: these slots are the cache's now, read by this sequence
                block = _Block(self._next_block, key, held.slots[start:start + PREFIX_BLOCK])
                self._next_block += 1
                self._blocks[key] = block
                block.refs += 1
                held.blocks.append(block)
            # else: another sequence cached the same tokens first; this one's slots stay its own
            held.published, held.parent = index + 1, block.id

    def release(self, request_id: int) -> int:
        """Give ``request_id``'s slots back (its blocks stay cached); returns how many slots
        went back to the free list (0 when it held none)."""
        held = self._held.pop(request_id, None)
        if held is None:
            return 0
        own = held.slots
        if held.blocks:
            shared = np.concatenate([b.slots for b in held.blocks])
            own = own[np.isin(own, shared, invert=True)]
        self._free.extend(own[::-1].tolist())
        self._drop_reads(held.blocks)
        return len(own)

    def clear_prefixes(self) -> None:
        """Forget every cached block (the pools were replaced: their entries are gone). Only
        with no sequence holding slots."""
        assert not self._held, "clear_prefixes with sequences still holding slots"
        for block in self._blocks.values():
            self._free.extend(block.slots[::-1].tolist())
        self._blocks.clear()
        self._unused.clear()

    def holds(self, request_id: int) -> bool:
        return request_id in self._held

    def _drop_reads(self, blocks: list[_Block]) -> None:
        # the later blocks of a chain first: they become evictable before the ones they
        # follow, so a chain is evicted from its end and what stays is still reachable
        for block in reversed(blocks):
            block.refs -= 1
            if block.refs == 0:
                self._unused[block.id] = block

    def _evict(self) -> None:
        _, block = self._unused.popitem(last=False)
        del self._blocks[block.key]
        self._free.extend(block.slots[::-1].tolist())

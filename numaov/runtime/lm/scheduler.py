"""Which sequences step, on which rank, with how many tokens: the LM engine's scheduler.

Per engine step, :meth:`Scheduler.schedule`:

1. **Admits** waiting requests in arrival order, each to a rank that can hold it and has room
   for another sequence: the rank whose prefix cache holds the longest start of its prompt,
   unless that rank runs more than ``PREFIX_ROUTING_SLACK`` sequences above the least-loaded
   one (then, as without a match, the least-loaded: fewest running sequences, then fewest used
   cache slots, then the lowest rank), as SGLang's cache-aware DP routing trades reuse
   against balance. Its cache slots (prompt + every token it may generate, less the cached
   prefix it reads) are taken at once, so it never runs out later, and its prompt is read
   from the end of that prefix. The first request that fits nowhere waits, and
   so do the ones behind it (no overtaking: a large request is not starved by small ones).
   A request larger than a whole rank's cache is refused at :meth:`add`, with the reason.
2. **Plans phases.** A *decode* phase feeds every running sequence whose prompt is in the
   cache its last token; a *prefill* phase feeds the sequences still reading their prompt,
   at most ``prefill_chunk`` prompt tokens per rank per step (chunked prefill: a long prompt
   takes several steps, and the decode phase runs at every one of them, so it never stalls
   the others). A phase runs when any rank has rows for it, on every rank (0 rows on a rank
   with none): the ranks stay in lockstep because each runs the same phases. A row that
   samples (a decode row, a prompt's last chunk) of a sequence with a structure carries the
   mask of the tokens its grammar matcher allows next (:mod:`numaov.runtime.lm.grammar`),
   computed here, from the matcher's state after every token so far.
3. Returns None when no rank has anything to run: the engine then waits for a request instead
   of stepping.

Releases (sequences that finished or were cancelled) ride along with the next step, so the
rank drops its state for them before it reads the new joins; their cache slots were already
back in the free list (:class:`numaov.runtime.lm.cache.CacheManager`), their whole blocks of
fed tokens in the prefix cache. A sequence also offers its prompt's blocks as soon as its
last prompt chunk is planned: the step that writes them runs before the next admission.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from numaov.runtime.lm.cache import CacheCapacityError, CacheManager
from numaov.runtime.lm.runner import Join, RankStep, Row
from numaov.runtime.lm.sequence import GenerationInputError, Sequence

DEFAULT_PREFILL_CHUNK = 256
DEFAULT_MAX_RUNNING = 256
# A rank holding a request's prefix gets it unless it runs more than this many sequences above
# the least-loaded rank that could take it: reuse saves the prefix's prefill once, while an
# unbalanced rank slows every step of every sequence on the others (the ranks step together).
PREFIX_ROUTING_SLACK = 4


def _check_positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GenerationInputError(f"{name} is {value!r}; expected a positive integer",
                                   parameter=name)
    return value


class Scheduler:
    """Waiting and running sequences of every rank; not thread-safe (the engine locks)."""

    def __init__(self, caches: list[CacheManager], prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 max_running: int = DEFAULT_MAX_RUNNING) -> None:
        self.caches = caches
        self.world_size = len(caches)
        self.prefill_chunk = _check_positive("prefill_chunk", prefill_chunk)
        self.max_running = _check_positive("max_running", max_running)
        self.waiting: deque[Sequence] = deque()
        # Per rank, in admission order (dicts keep it): prefill goes first come, first served.
        self.running: list[dict[int, Sequence]] = [{} for _ in caches]
        self._releases: list[list[int]] = [[] for _ in caches]
        self._keep_logits: set[int] = set()
        # Seconds spent computing structures' token masks, since the scheduler started.
        self.mask_seconds = 0.0

    # -- arrivals and departures --------------------------------------------------------------

    def add(self, seq: Sequence, keep_logits: bool = False) -> None:
        """Queue ``seq``; refused when no rank's whole cache could hold it."""
        capacity = max(c.capacity for c in self.caches)
        if seq.reserved_tokens > capacity:
            raise CacheCapacityError(
                f"a request of {len(seq.prompt)} prompt tokens + {seq.params.max_new_tokens} new "
                f"tokens needs {seq.reserved_tokens} cache slots, more than a rank's whole cache "
                f"({capacity} tokens); expected a shorter prompt or max_new_tokens, or a larger "
                "cache", parameter="max_new_tokens")
        if keep_logits:
            self._keep_logits.add(seq.request_id)
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """``seq`` leaves (finished or cancelled): its cache slots are free at once."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._keep_logits.discard(seq.request_id)
        if seq.rank is None:
            return
        self.running[seq.rank].pop(seq.request_id, None)
        cache = self.caches[seq.rank]
        cache.publish(seq.request_id, (seq.prompt + seq.tokens)[:seq.cached])
        cache.release(seq.request_id)
        if seq.joined:
            self._releases[seq.rank].append(seq.request_id)
            seq.joined = False

    def forget_releases(self) -> None:
        """Drop the releases not yet sent: the ranks they were meant for are gone (fresh
        ranks after a failure start with no sequences)."""
        self._releases = [[] for _ in self.caches]

    # -- a step -------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return any(self.running) or self._admissible() is not None

    def _admissible(self) -> int | None:
        """The rank the first waiting sequence would go to now, or None."""
        if not self.waiting:
            return None
        seq = self.waiting[0]
        cached = {r: self.caches[r].fits(seq.reserved_tokens, seq.prompt)
                  for r in range(self.world_size) if len(self.running[r]) < self.max_running}
        ranks = [r for r, found in cached.items() if found is not None]
        if not ranks:
            return None
        least = min(ranks, key=lambda r: (len(self.running[r]), self.caches[r].used, r))
        best = max(ranks, key=lambda r: (cached[r], -len(self.running[r]), -r))
        if cached[best] and (len(self.running[best]) - len(self.running[least])
                             <= PREFIX_ROUTING_SLACK):
            return best
        return least

    def schedule(self) -> list[RankStep] | None:
        """Every rank's part of the next step, or None when there is nothing to run."""
        steps = [RankStep(releases=self._releases[r]) for r in range(self.world_size)]
        self._releases = [[] for _ in range(self.world_size)]
        while (rank := self._admissible()) is not None:
            seq = self.waiting.popleft()
            seq.rank = rank
            slots, seq.cached = self.caches[rank].allocate(seq.request_id, seq.reserved_tokens,
                                                           seq.prompt)
            seq.cached_prompt = seq.cached
            self.running[rank][seq.request_id] = seq
            steps[rank].joins.append(Join(seq.request_id, slots, seq.params, seq.seed,
                                          seq.request_id in self._keep_logits, seq.cached))
            seq.joined = True
        decode = [self._decode_rows(running.values()) for running in self.running]
        prefill = [self._prefill_rows(running.values(), cache)
                   for running, cache in zip(self.running, self.caches, strict=True)]
        for phase in (decode, prefill):
            if any(phase):
                for rank, rows in enumerate(phase):
                    steps[rank].phases.append(rows)
        if not any(step.phases for step in steps):
            # nothing to run: keep the releases for the next step
            self._releases = [step.releases for step in steps]
            return None
        return steps

    def _decode_rows(self, sequences) -> list[Row]:
        rows = []
        for seq in sequences:
            if not seq.in_prefill:
                rows.append(Row(seq.request_id, (seq.tokens[-1],), True, self._mask(seq)))
                seq.cached += 1
        return rows

    def _mask(self, seq: Sequence) -> np.ndarray | None:
        """The tokens ``seq``'s structure allows next; None without a structure, or when its
        matcher failed (the engine ends the sequence when its token comes back)."""
        if seq.grammar is None:
            return None
        start = time.perf_counter()
        mask = seq.grammar.next_mask()
        self.mask_seconds += time.perf_counter() - start
        return mask

    def _prefill_rows(self, sequences, cache: CacheManager) -> list[Row]:
        rows, budget = [], self.prefill_chunk
        for seq in sequences:
            if budget == 0:
                break
            if not seq.in_prefill:
                continue
            chunk = seq.next_input(budget)
            seq.cached += len(chunk)
            budget -= len(chunk)
            last = not seq.in_prefill
            rows.append(Row(seq.request_id, tuple(chunk), last, self._mask(seq) if last else None))
            if not seq.in_prefill:  # this step writes the prompt's last entries
                cache.publish(seq.request_id, seq.prompt)
        return rows

    def counts(self) -> tuple[int, list[int]]:
        return len(self.waiting), [len(r) for r in self.running]

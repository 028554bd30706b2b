"""Two backends' results of the same work side by side: how far apart and how fast.

`max_rel_error` is numaov's parity measure (the largest absolute difference relative to the
reference's largest magnitude). `SampleComparison` compares two `run_wan` results of one
request, `GenerationComparison` two `run_lm` results of the same prompts; each
returns its figures as properties and as lines of text (``lines()``) for whoever prints them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from numaov.runtime.lm.engine import GenerationResult
    from numaov.runtime.wan.sampler import SampleResult

# Below this magnitude the reference counts as zero (no division by it).
_TINY = 1e-12


def max_rel_error(got: np.ndarray, expected: np.ndarray) -> float:
    """``max |got - expected|`` over ``max |expected|``."""
    scale = max(float(np.max(np.abs(expected))), _TINY)
    return float(np.max(np.abs(got - expected))) / scale


@dataclass(frozen=True)
class SampleComparison:
    """``other``'s final latents and step times against ``reference``'s."""

    reference: SampleResult
    other: SampleResult

    @property
    def max_rel_error(self) -> float:
        return max_rel_error(self.other.latents, self.reference.latents)

    @staticmethod
    def _warm_step_seconds(result: SampleResult) -> float:
        # The first step includes one-time work (allocation, kernel selection); skip it.
        steps = result.step_seconds[1:] or result.step_seconds
        return float(np.mean(steps))

    @property
    def speedup(self) -> float:
        """How many times faster ``other``'s warm steps are."""
        return self._warm_step_seconds(self.reference) / self._warm_step_seconds(self.other)

    def lines(self) -> list[str]:
        ref, other = self.reference.backend, self.other.backend
        return [
            f"{other} vs {ref} final latents: max rel error {self.max_rel_error:.2g}",
            f"per step: {ref} {self._warm_step_seconds(self.reference) * 1e3:.1f} ms, {other} "
            f"{self._warm_step_seconds(self.other) * 1e3:.1f} ms ({self.speedup:.2f}x)",
        ]


@dataclass(frozen=True)
class GenerationComparison:
    """``other``'s tokens, logits (both kept with ``keep_logits=True``) and speed against
    ``reference``'s, for the same prompts."""

    reference: GenerationResult
    other: GenerationResult

    @property
    def same_prompts(self) -> int:
        """Prompts for which both generated the same tokens."""
        return sum(a == b for a, b in zip(self.reference.tokens, self.other.tokens, strict=True))

    @property
    def logits_max_rel_error(self) -> float | None:
        """The largest per-prompt logits error; None unless both kept their logits."""
        if self.reference.logits is None or self.other.logits is None:
            return None
        return max(max_rel_error(o, r)
                   for o, r in zip(self.other.logits, self.reference.logits, strict=True))

    def lines(self) -> list[str]:
        ref, other = self.reference, self.other
        error = self.logits_max_rel_error
        logits = "" if error is None else f"; logits max rel error {error:.2g}"
        lines = [
            f"placement: {other.placement}",
            f"{len(ref.tokens)} prompts x {len(ref.step_seconds)} greedy tokens: {other.backend} "
            f"== {ref.backend} tokens for {self.same_prompts}/{len(ref.tokens)} prompts{logits}",
        ]
        ref_rate, other_rate = ref.decode_tokens_per_second, other.decode_tokens_per_second
        prefill = (f"first prefill (with each backend's one-time setup) {ref.backend} "
                   f"{ref.prefill_seconds * 1e3:.1f} ms, {other.backend} "
                   f"{other.prefill_seconds * 1e3:.1f} ms")
        if ref_rate and other_rate:
            lines.append(f"decode: {ref.backend} {ref_rate:.0f} tokens/s, {other.backend} "
                         f"{other_rate:.0f} tokens/s ({other_rate / ref_rate:.2f}x); {prefill}")
        else:
            lines.append(prefill)
        return lines

"""Detokenized text of a sequence as it grows: deltas that never split a character.

:class:`TextStream` decodes a sequence's tokens after every new one and hands out only the
text that cannot change any more: text ending in U+FFFD (a UTF-8 character whose bytes are
not all generated yet) is held back, and so is a tail that could be the start of a stop
string. When a stop string appears, the text ends just before it. The deltas joined are the
final text, exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_INCOMPLETE = "\ufffd"


class TextStream:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self.text = ""  # handed out so far
        self._full = ""
        self.stopped = False

    def add(self, tokens: Sequence[int]) -> str:
        """The new text after ``tokens`` (all of the sequence's output so far)."""
        if self._tokenizer is None or self.stopped:
            return ""
        self._full = self._tokenizer.decode(list(tokens))
        found = self._find_stop()
        if found is not None:
            self.stopped = True
            return self._emit(self._full[:found])
        safe = self._full.rstrip(_INCOMPLETE)
        for length in range(min(self._longest_stop - 1, len(safe)), 0, -1):
            if any(s.startswith(safe[-length:]) for s in self._stop):
                safe = safe[:-length]
                break
        return self._emit(safe)

    def finish(self) -> str:
        """What was held back, once the sequence ended (not after a stop string)."""
        if self._tokenizer is None or self.stopped:
            return ""
        return self._emit(self._full)

    def _find_stop(self) -> int | None:
        start = max(0, len(self.text) - self._longest_stop)
        hits = [i for s in self._stop if (i := self._full.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _emit(self, upto: str) -> str:
        # If decoding more tokens rewrote text already handed out, that text stays as it was.
        delta = upto[len(self.text):]
        self.text += delta
        return delta

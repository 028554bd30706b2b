"""Detokenized text of a sequence as it grows: deltas that never split a character.

:class:`TextStream` decodes a sequence's tokens after every new one and hands out only the
text that cannot change any more: text ending in U+FFFD (a UTF-8 character whose bytes are
not all generated yet) is held back, and so is a tail that could be the start of a stop
string. When a stop string appears, the text ends just before it. The deltas joined are the
final text, exactly.

Decoding is incremental, so a long output costs the same per token as a short one: each new
token decodes only a short window, the tokens since the previous settled point, and the text
it adds is the window's decode minus that of the same window without the newest tokens (both
start at the same token, so a tokenizer that treats a window's first token specially, such as
dropping a leading space, treats both alike).
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
        self._full = ""  # the decoded text of tokens[:self._read]
        self._tokens: Sequence[int] = ()
        # tokens[self._prefix:self._read] is the window the next decode starts with.
        self._prefix = self._read = 0
        self.stopped = False

    def _window_text(self) -> str:
        """What tokens[self._read:] add to the text (ends in U+FFFD while a character's
        bytes are still coming)."""
        decode = self._tokenizer.decode
        settled = decode(list(self._tokens[self._prefix:self._read]))
        return decode(list(self._tokens[self._prefix:]))[len(settled):]

    def add(self, tokens: Sequence[int]) -> str:
        """The new text after ``tokens`` (all of the sequence's output so far)."""
        if self._tokenizer is None or self.stopped:
            return ""
        self._tokens = tokens
        added = self._window_text()
        if added and not added.endswith(_INCOMPLETE):
            self._full += added
            self._prefix, self._read = self._read, len(self._tokens)
        found = self._find_stop()
        if found is not None:
            self.stopped = True
            return self._emit(self._full[:found])
        safe = self._full
        for length in range(min(self._longest_stop - 1, len(safe)), 0, -1):
            if any(s.startswith(safe[-length:]) for s in self._stop):
                safe = safe[:-length]
                break
        return self._emit(safe)

    def finish(self) -> str:
        """What was held back, once the sequence ended (not after a stop string)."""
        if self._tokenizer is None or self.stopped:
            return ""
        self._full += self._window_text()  # a character left incomplete for good included
        self._read = len(self._tokens)
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

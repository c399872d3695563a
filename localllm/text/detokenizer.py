"""Streaming text out of generated tokens: UTF-8-safe detokenization and stop strings."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Protocol


class _Pieces(Protocol):
    def token_to_bytes(self, token_id: int) -> bytes: ...

    def is_special(self, token_id: int) -> bool: ...


class IncrementalDetokenizer:
    """Turns token ids into text one at a time, never emitting half a UTF-8 character.

    `skip_special` hides control tokens (e.g. "<|im_end|>"); `strip_leading_space` drops one space
    at the very start of the output (SentencePiece's dummy prefix, e.g. "▁Once" -> "Once"),
    typically `tokenizer.add_space_prefix` when the generation starts a text.
    """

    def __init__(
        self, tokenizer: _Pieces, skip_special: bool = True, strip_leading_space: bool = False
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._strip = strip_leading_space
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """Text completed by this token ("" while a multi-byte character is still partial)."""
        if self._skip_special and self._tokenizer.is_special(token_id):
            return ""
        return self._emit(self._decoder.decode(self._tokenizer.token_to_bytes(token_id)))

    def flush(self) -> str:
        """Whatever is left at the end; an incomplete character becomes U+FFFD."""
        return self._emit(self._decoder.decode(b"", final=True))

    def _emit(self, text: str) -> str:
        if self._strip and text:
            self._strip = False
            if text.startswith(" "):
                text = text[1:]
        return text


class StopChecker:
    """Finds stop strings in streamed text, holding back text that may begin one.

    `feed` returns the text safe to show now and whether a stop string was hit; the stop string
    and everything after it are never returned, even when it arrives split over several pieces.
    """

    def __init__(self, stop_strings: Sequence[str]) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stop_strings if s))
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        buffer = self._pending + text
        hit = self._first_hit(buffer)
        # where a stop string may begin that more text could still complete
        open_at = len(buffer) - self._partial_suffix(buffer)
        if hit >= 0 and hit <= open_at:
            self._pending = ""
            self.stopped = True
            return buffer[:hit], True
        # NOTE: a hit after an open start waits: a longer stop string beginning earlier
        # may still complete, and the earliest one wins, however the text was split
        self._pending = buffer[open_at:]
        return buffer[:open_at], False

    def flush(self) -> str:
        """Held-back text at the end of the stream, up to a stop string found in it (then
        `stopped` turns True)."""
        text, self._pending = self._pending, ""
        if self.stopped:
            return ""
        hit = self._first_hit(text)
        if hit >= 0:
            self.stopped = True
            return text[:hit]
        return text

    def _first_hit(self, buffer: str) -> int:
        hits = [i for i in (buffer.find(s) for s in self._stops) if i >= 0]
        return min(hits) if hits else -1

    def _partial_suffix(self, buffer: str) -> int:
        """Length of the longest end of `buffer` that is a proper prefix of a stop string."""
        hold = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buffer)), hold, -1):
                if buffer.endswith(stop[:k]):
                    hold = k
                    break
        return hold

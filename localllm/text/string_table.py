"""Many short strings held compactly: one bytes blob and an offset array.

A vocabulary of 49k tokens as a Python list costs about 60 bytes a token in `str` objects
(3.4 MB for the default model), and another 3-4 MB more when a dict maps them back to ids;
the GGUF parser's lists of tokens and merges each cost as much again while loading, and left
the small-object arenas they were built in fragmented afterwards. Here a table costs its
UTF-8 bytes plus 8 bytes a string, and an item becomes a `str` (or `bytes`) only when asked.

    blob:    b"<s></s>hello"          every item's bytes, back to back (or with gaps)
    starts:  [0, 3, 7]                int32 [n] (int64 past 2 GiB): where item i begins
    ends:    [3, 7, 12]               int32 [n]: where it ends
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

import numpy as np


class StringTable(Sequence[str]):
    """An immutable sequence of strings stored as UTF-8 in one blob. `raw(i)` gives item i's
    bytes; `[i]` decodes it (invalid UTF-8 becomes U+FFFD)."""

    __slots__ = ("_blob", "_starts", "_ends")

    def __init__(self, blob: bytes, starts: np.ndarray, ends: np.ndarray) -> None:
        if starts.shape != ends.shape or starts.ndim != 1:
            raise ValueError("starts and ends must be 1-D arrays of one length")
        self._blob = blob
        offset = np.int32 if len(blob) < 2**31 else np.int64
        self._starts = starts.astype(offset)
        self._ends = ends.astype(offset)

    @classmethod
    def from_bytes(cls, items: Iterable[bytes]) -> StringTable:
        # streamed into one buffer: no list of the items is ever held
        blob, ends = bytearray(), array("q")
        for item in items:
            blob += item
            ends.append(len(blob))
        end = np.frombuffer(ends, dtype=np.int64) if ends else np.zeros(0, np.int64)
        return cls(bytes(blob), np.concatenate(([0], end[:-1])).astype(np.int64), end)

    @classmethod
    def from_strings(cls, items: Iterable[str]) -> StringTable:
        return cls.from_bytes(s.encode("utf-8", errors="surrogatepass") for s in items)

    def raw(self, i: int) -> bytes:
        """Item `i`'s bytes (negative indices count from the end, as for a list)."""
        return self._blob[self._starts[i]:self._ends[i]]

    def byte_length(self, i: int) -> int:
        return int(self._ends[i] - self._starts[i])

    def __len__(self) -> int:
        return len(self._starts)

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} is outside a table of {len(self)} strings")
        return self.raw(i).decode("utf-8", errors="replace")

    def __iter__(self) -> Iterator[str]:
        blob = self._blob
        for start, end in zip(self._starts.tolist(), self._ends.tolist(), strict=True):
            yield blob[start:end].decode("utf-8", errors="replace")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringTable):
            return len(self) == len(other) and all(
                self.raw(i) == other.raw(i) for i in range(len(self)))
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other,
                                                                           strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-looking equality: unhashable like a list

    def __repr__(self) -> str:
        head = ", ".join(repr(s) for s in self[:3])
        return f"StringTable([{head}{', ...' if len(self) > 3 else ''}], {len(self)} strings)"

    @property
    def nbytes(self) -> int:
        return len(self._blob) + self._starts.nbytes + self._ends.nbytes


def table_of(items: Sequence[str]) -> StringTable:
    """`items` as a StringTable (itself when it already is one)."""
    return items if isinstance(items, StringTable) else StringTable.from_strings(items)

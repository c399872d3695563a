"""SentencePiece-style BPE by piece scores, with byte fallback, as llama.cpp's SPM tokenizer does.

The text is split into Unicode characters; repeatedly the adjacent pair whose concatenation is a
vocabulary token with the highest score is merged (ties: the leftmost pair). Symbols that end up
outside the vocabulary (single characters the vocabulary lacks) become one `<0xNN>` token per
UTF-8 byte
(`byte_ids[b]`, or nothing where that is negative).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence


def spm_tokenize(
    text: str,
    token_to_id: Mapping[str, int],
    scores: Sequence[float],
    byte_ids: Sequence[int],
) -> list[int]:
    """Token ids of `text`, whose spaces the caller has already replaced by U+2581."""
    n = len(text)
    if n == 0:
        return []
    sym = list(text)  # current text of each symbol; "" once merged into its left neighbour
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    # heap entries: (-score, left index, right index, merged length in characters)
    heap: list[tuple[float, int, int, int]] = []

    def push(left: int, right: int) -> None:
        if left < 0 or right < 0:
            return
        merged = sym[left] + sym[right]
        token = token_to_id.get(merged)
        if token is not None:
            heapq.heappush(heap, (-scores[token], left, right, len(merged)))

    for i in range(1, n):
        push(i - 1, i)

    while heap:
        _, left, right, size = heapq.heappop(heap)
        # NOTE: a pair is stale once either side merged elsewhere; lengths only grow.
        if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != size:
            continue
        sym[left] += sym[right]
        sym[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        push(prv[left], left)
        push(left, nxt[left])

    out: list[int] = []
    i = 0
    while i != -1:
        token = token_to_id.get(sym[i])
        if token is not None:
            out.append(token)
        else:
            out.extend(byte_ids[b] for b in sym[i].encode("utf-8") if byte_ids[b] >= 0)
        i = nxt[i]
    return out

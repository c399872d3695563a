"""Paged attention's data: per-layer K/V pools and each step's metadata (device-neutral).

Pools are shaped [num_blocks, block_size, num_kv_heads, head_dim]. A sequence's cached tokens
live in the blocks listed by its block table; `slot_mapping[t] = block * block_size + offset`
is where new token t is written. The queries of a sequence are its last `query_len` positions,
so a query at index i may attend to cached positions j <= context_len - query_len + i.

The attention itself is the backend's (`Backend.attention`): `localllm/backends/pytorch/` runs it
in PyTorch (SDPA) on any device, `localllm/backends/cpu/` with native kernels where they run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

import torch

T = TypeVar("T")


class AttentionSpec(NamedTuple):
    """What one layer's attention computes besides q, k, v: scores are `scale * q.k`, then
    `softcap * tanh(s / softcap)` where softcap > 0 (Gemma 2); with window > 0 a query at
    position p sees only positions j with p - j < window (sliding-window layers)."""

    scale: float
    softcap: float = 0.0
    window: int = 0

    @property
    def plain(self) -> bool:
        """Neither soft-capped nor windowed (the form every attention kernel takes)."""
        return self.softcap == 0 and self.window == 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int64, padded with 0
    query_lens: list[int]  # per sequence, sums to num_tokens
    context_lens: list[int]  # per sequence: cached tokens after this step (incl. new ones)
    block_size: int
    # context_lens as int64 [num_seqs] on the device, where the step's builder made it
    context_lens_tensor: torch.Tensor | None = None
    # per sequence, its prompt's length, where the step's builder knows it: a query at a
    # position before it is a prompt token even alone in its step (a prompt's last token after
    # a cached prefix or a split by the token budget), not a decoding one
    prompt_lens: list[int] | None = None
    _seq_slots: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    # a backend's per-step plans, by the function that builds them (see `plan`)
    _plans: dict[object, object] = field(default_factory=dict, repr=False)

    def plan(self, build: Callable[[AttentionMetadata], T]) -> T:
        """`build(self)`, computed once per step and shared by every layer."""
        if build not in self._plans:
            self._plans[build] = build(self)
        return self._plans[build]  # type: ignore[return-value]

    def seed_plan(self, build: Callable[[AttentionMetadata], T], plan: T) -> None:
        """Fixes `build`'s plan for this metadata to `plan` (the static buffers of a captured
        CUDA graph, whose values change between replays)."""
        self._plans[build] = plan

    def decodes(self, i: int) -> bool:
        """Whether sequence i decodes: one query token, past its prompt."""
        return self.query_lens[i] == 1 and (self.prompt_lens is None
                                            or self.context_lens[i] > self.prompt_lens[i])

    def decoding(self) -> list[int]:
        """The sequences that decode (`decodes`)."""
        return [i for i in range(len(self.query_lens)) if self.decodes(i)]

    def leading_decodes(self) -> int:
        """How many sequences at the front of the batch decode (the scheduler puts decoding
        sequences first)."""
        return next((i for i in range(len(self.query_lens)) if not self.decodes(i)),
                    len(self.query_lens))

    def row_runs(self) -> tuple[tuple[int, int], ...]:
        """The batch's rows in order as runs (rows, prompt length): a sequence's query rows
        at positions before its prompt's end, then its others (decoding tokens, or ones
        computed again after a preemption) with prompt length 0. Needs `prompt_lens`."""
        assert self.prompt_lens is not None
        runs: list[tuple[int, int]] = []
        for qlen, ctx, plen in zip(self.query_lens, self.context_lens, self.prompt_lens):
            prompt = max(0, min(ctx, plen) - (ctx - qlen))
            for n, key in ((prompt, plen), (qlen - prompt, 0)):
                if n and runs and runs[-1][1] == key:
                    runs[-1] = (runs[-1][0] + n, key)
                elif n:
                    runs.append((n, key))
        return tuple(runs)

    def rows_of(self, seqs: list[int]) -> torch.Tensor:
        """[len(seqs)] the first query row of each of these sequences in the flat batch."""
        starts = [0]
        for qlen in self.query_lens:
            starts.append(starts[-1] + qlen)
        return torch.tensor([starts[i] for i in seqs], device=self.block_tables.device)

    def seq_slots(self, i: int) -> torch.Tensor:
        """Pool slots of sequence i's cached positions 0..context_len-1: [context_len] int64.
        Computed once per step and shared by every layer."""
        slots = self._seq_slots.get(i)
        if slots is None:
            ctx, bs = self.context_lens[i], self.block_size
            blocks = self.block_tables[i, :(ctx + bs - 1) // bs]
            offsets = torch.arange(bs, device=blocks.device)
            slots = (blocks[:, None] * bs + offsets).flatten()[:ctx]
            self._seq_slots[i] = slots
        return slots


@dataclass
class KVCache:
    k: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]


def causal_mask(query_len: int, context_len: int, device: torch.device,
                window: int = 0, first: int = 0) -> torch.Tensor:
    """[query_len, context_len - first] bool, True where attention is allowed: the queries are
    the last `query_len` positions, the keys positions first..context_len-1; with `window`,
    only the last `window` positions up to each query."""
    q_pos = torch.arange(context_len - query_len, context_len, device=device).unsqueeze(1)
    k_pos = torch.arange(first, context_len, device=device).unsqueeze(0)
    allowed = k_pos <= q_pos
    return allowed & (q_pos - k_pos < window) if window > 0 else allowed

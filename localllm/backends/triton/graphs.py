"""Decode steps replayed from CUDA graphs (the Triton backend's whole-step fast path).

At batch 1 a decode step is a few hundred small kernel launches; replaying them from a captured
CUDA graph removes the launch cost (gpt-fast's and nano-vllm's main lever). A step is captured
once per batch size in `BATCH_SIZES`, over static buffers: input ids, positions, slots, block
tables and context lengths. A step of B sequences copies its inputs into the first B rows and
replays the graph of the smallest captured size >= B; the padding rows write nowhere (slot -1)
and attend one cached position of block 0, and their outputs are dropped.

`StaticDecodeStep` runs the same padded step eagerly (`capture=False`), which is how the
buffers and the padding are tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from localllm.backends.triton.attention import StepPlan, step_plan
from localllm.layers.attention import AttentionMetadata, KVCache
from localllm.layers.stack import DecoderLayout

BATCH_SIZES = (1, 2, 4, 8, 16)
Forward = Callable[[torch.Tensor, torch.Tensor, list[KVCache], AttentionMetadata],
                   torch.Tensor]


class StaticDecodeStep:
    """Decode-only steps of up to `max(sizes)` sequences over static buffers; with `capture`,
    one CUDA graph per size (captured on the first call)."""

    def __init__(self, layout: DecoderLayout, forward: Forward, capture: bool,
                 sizes: tuple[int, ...] = BATCH_SIZES) -> None:
        self.layout, self.forward, self.capture = layout, forward, capture
        self.sizes = sizes
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._ready = False

    def _allocate(self, caches: list[KVCache]) -> None:
        pool = caches[0].k  # [num_blocks, block_size, num_kv_heads, head_dim]
        dev, bs = pool.device, pool.shape[1]
        n, width = max(self.sizes), -(-self.layout.rope.max_positions // bs)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.tables = torch.zeros(n, width, dtype=torch.int32, device=dev)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_size, self.width = bs, width

    def _meta(self, b: int) -> AttentionMetadata:
        """The static buffers' first `b` rows as a step's metadata."""
        meta = AttentionMetadata(self.slots[:b], self.tables[:b], [1] * b, [1] * b,
                                 self.block_size)
        starts = torch.arange(b + 1, dtype=torch.int32, device=self.slots.device)
        meta.seed_plan(step_plan, StepPlan(True, starts, self.context_lens[:b],
                                           self.tables[:b]))
        return meta

    def _run(self, b: int, caches: list[KVCache]) -> torch.Tensor:
        positions = self.positions[:b]
        for rope in self.layout.ropes():  # no read-back of their maximum while capturing
            rope.pin_tables(positions)
        return self.forward(self.input_ids[:b], positions, caches, self._meta(b))

    def _capture_all(self, caches: list[KVCache]) -> None:
        pool = None
        for b in sorted(self.sizes, reverse=True):  # the largest first: the others share
            self._run(b, caches)  # its memory pool; a warm-up compiles every kernel
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._run(b, caches)
            pool = graph.pool()
            self._graphs[b] = (graph, out)
        torch.cuda.synchronize()

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 caches: list[KVCache], meta: AttentionMetadata,
                 head: bool = False) -> torch.Tensor | None:
        """Final hidden states [num_seqs, hidden] of a decode-only step (with or without
        `head`: the graphs end before the LM head), or None when this step is not one (a prompt
        in it, more sequences than the largest size)."""
        b = len(meta.query_lens)
        if any(n != 1 for n in meta.query_lens) or b > max(self.sizes):
            return None
        if not self._ready:
            self._allocate(caches)
            self._ready = True
        size = min(s for s in self.sizes if s >= b)
        width = meta.block_tables.shape[1]
        if width > self.width:
            return None
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slots[:b].copy_(meta.slot_mapping)
        self.slots[b:size].fill_(-1)
        self.tables[:b, :width].copy_(meta.block_tables)
        self.tables[b:size, 0] = 0
        self.context_lens[:b].copy_(torch.tensor(meta.context_lens, dtype=torch.int32))
        self.context_lens[b:size] = 1
        if not self.capture:
            return self._run(size, caches)[:b]
        if not self._graphs:
            self._capture_all(caches)
        graph, out = self._graphs[size]
        graph.replay()
        return out[:b]

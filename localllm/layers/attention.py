"""Paged attention over per-layer K/V pools.

Pools are shaped [num_blocks, block_size, n_kv_heads, head_dim]. A sequence's cached tokens live
in the blocks listed by its block table; `slot_mapping[t] = block * block_size + offset` is where
new token t is written. The queries of a sequence are its last `query_len` positions, so a
query at index i may attend to cached positions j <= context_len - query_len + i.

`AttentionBackend` is the interface the Triton kernels of the GPU backend plug in behind; the
CPU backend below is PyTorch, with native kernels (`kernels/cpu_native.py`) for the K/V store
and decode attention when they are available.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from localllm.kernels import cpu_native


@dataclass(frozen=True)
class DecodePlan:
    seqs: list[int]  # the decoding sequences, B of them
    rows: torch.Tensor  # [B] their query's row in the flat batch
    blocks: torch.Tensor  # [B * width] their block tables, padded to the longest
    padded_len: int  # width * block_size
    mask: torch.Tensor  # [B, 1, 1, padded_len] True at each sequence's cached positions


@dataclass(frozen=True)
class DecodeBatch:
    rows: torch.Tensor | None  # [B] the query rows of the decoding sequences; None: all rows
    seqs: list[int]  # their sequence numbers
    block_tables: torch.Tensor  # [B, width] int64, contiguous
    context_lens: torch.Tensor  # [B] int64


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int64, padded with 0
    query_lens: list[int]  # per sequence, sums to num_tokens
    context_lens: list[int]  # per sequence: cached tokens after this step (incl. new ones)
    block_size: int
    _seq_slots: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _decode_plan: DecodePlan | None = field(default=None, repr=False)
    _decode_batch: DecodeBatch | None = field(default=None, repr=False)

    def decode_batch(self) -> DecodeBatch | None:
        """The sequences with one query token (any number), as the native decode kernel takes
        them; computed once per step for every layer. None when no sequence decodes."""
        if self._decode_batch is None:
            seqs = self._decoding()
            if not seqs:
                return None
            dev = self.block_tables.device
            if len(seqs) == len(self.query_lens):
                rows, tables = None, self.block_tables.contiguous()
            else:
                rows = self._rows_of(seqs)
                tables = self.block_tables[torch.tensor(seqs, device=dev)].contiguous()
            ctxs = torch.tensor([self.context_lens[i] for i in seqs], dtype=torch.long,
                                device=dev)
            self._decode_batch = DecodeBatch(rows, seqs, tables, ctxs)
        return self._decode_batch

    def _decoding(self) -> list[int]:
        """The sequences with one query token."""
        return [i for i, qlen in enumerate(self.query_lens) if qlen == 1]

    def _rows_of(self, seqs: list[int]) -> torch.Tensor:
        """[len(seqs)] the first query row of each of these sequences in the flat batch."""
        starts = [0]
        for qlen in self.query_lens:
            starts.append(starts[-1] + qlen)
        return torch.tensor([starts[i] for i in seqs], device=self.block_tables.device)

    def decode_plan(self) -> DecodePlan | None:
        """What batched decode attention needs, computed once per step for every layer; None
        when fewer than two sequences decode."""
        if self._decode_plan is None:
            seqs = self._decoding()
            if len(seqs) < 2:
                return None
            bs = self.block_size
            ctxs = [self.context_lens[i] for i in seqs]
            width = (max(ctxs) + bs - 1) // bs
            dev = self.block_tables.device
            blocks = self.block_tables[torch.tensor(seqs, device=dev), :width]  # [B, width]
            lens = torch.tensor(ctxs, device=dev)
            mask = torch.arange(width * bs, device=dev)[None, :] < lens[:, None]
            self._decode_plan = DecodePlan(seqs, self._rows_of(seqs), blocks.flatten(),
                                           width * bs, mask[:, None, None, :])
        return self._decode_plan

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
    k: torch.Tensor  # [num_blocks, block_size, n_kv_heads, head_dim]
    v: torch.Tensor  # [num_blocks, block_size, n_kv_heads, head_dim]


class AttentionBackend(Protocol):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, scale: float) -> torch.Tensor: ...


def store_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # k, v: [num_tokens, n_kv_heads, head_dim]
    n_kv, hd = k.shape[1], k.shape[2]
    cache.k.view(-1, n_kv, hd).index_copy_(0, slot_mapping, k.to(cache.k.dtype))
    cache.v.view(-1, n_kv, hd).index_copy_(0, slot_mapping, v.to(cache.v.dtype))


def causal_mask(query_len: int, context_len: int, device: torch.device) -> torch.Tensor:
    """[query_len, context_len] bool, True where attention is allowed."""
    q_pos = torch.arange(context_len - query_len, context_len, device=device).unsqueeze(1)
    k_pos = torch.arange(context_len, device=device).unsqueeze(0)
    return k_pos <= q_pos


def _native(q: torch.Tensor, cache: KVCache) -> bool:
    """Whether this layer's K/V store and decode attention take the native kernels."""
    return (q.dtype == cache.k.dtype == torch.bfloat16 and q.device.type == "cpu"
            and cache.k.is_contiguous() and cache.v.is_contiguous()
            and cpu_native.decode_attention_supported(q.shape[1], cache.k.shape[2], q.shape[2])
            and cpu_native.available())


class TorchPagedAttention:
    """CPU (and fallback) backend in PyTorch.

    With the native kernels (bf16), the K/V store is one call and every decoding sequence of
    the step is attended by one `decode_attention` call. Otherwise, or for prompts and chunks:

    - A prompt with nothing cached attends over its own new K/V (one causal SDPA call).
    - A chunk after cached context gathers the sequence's K/V slots (one `index_select` per
      pool) and runs SDPA with a causal mask offset by the cached length.
    - A lone decode gathers likewise and runs one SDPA call, the query heads of one KV head
      standing as its queries (GQA without expanding K/V; 2x faster than two small matmuls).
    - Several decodes in one step are attended together: one padded gather of their blocks and
      one SDPA call with a length mask.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [num_tokens, n_heads, head_dim]; k, v: [num_tokens, n_kv_heads, head_dim]
        native = _native(q, cache)
        if native:
            cpu_native.kv_store(k.flatten(1), v.flatten(1), meta.slot_mapping, cache.k, cache.v)
        else:
            store_kv(cache, k, v, meta.slot_mapping)
        out: torch.Tensor | None = None
        done: set[int] = set()
        batch = meta.decode_batch() if native else None
        if batch is not None:
            if batch.rows is None:  # every sequence decodes: one call, no copies
                return cpu_native.decode_attention(q, cache.k, cache.v, batch.block_tables,
                                                   batch.context_lens, scale)
            out = torch.empty_like(q)
            out[batch.rows] = cpu_native.decode_attention(
                q[batch.rows], cache.k, cache.v, batch.block_tables, batch.context_lens, scale)
            done = set(batch.seqs)
        elif len(meta.query_lens) == 1:  # one sequence: no bookkeeping, no copy of the output
            return self._one(q, k, v, cache, meta, 0, scale)
        else:
            plan = meta.decode_plan()
            if plan is not None:
                out = torch.empty_like(q)
                self._decode_batch(q, out, cache, plan, scale)
                done = set(plan.seqs)
        if out is None:
            out = torch.empty_like(q)
        start = 0
        for i, qlen in enumerate(meta.query_lens):
            if i not in done:
                s, e = start, start + qlen
                out[s:e] = self._one(q[s:e], k[s:e], v[s:e], cache, meta, i, scale)
            start += qlen
        return out

    @staticmethod
    def _one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
             meta: AttentionMetadata, i: int, scale: float) -> torch.Tensor:
        # q: [qlen, n_heads, head_dim]; k, v: this step's [qlen, n_kv_heads, head_dim]
        qlen, n_heads, hd = q.shape
        n_kv, ctx = k.shape[1], meta.context_lens[i]
        # NOTE: SDPA gets 4-D inputs: 3-D ones take PyTorch's unfused math path on the CPU
        # (10x slower for a 512-token prompt)
        if qlen == ctx:  # nothing cached before: the new K/V are the whole context
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, scale=scale, enable_gqa=n_heads != n_kv,
            )  # [1, n_heads, qlen, head_dim]
            return o[0].transpose(0, 1)
        slots = meta.seq_slots(i)
        kc = cache.k.view(-1, n_kv, hd).index_select(0, slots)  # [ctx, n_kv_heads, head_dim]
        vc = cache.v.view(-1, n_kv, hd).index_select(0, slots)
        if qlen == 1:
            # the query heads sharing a KV head act as its queries (GQA without expanding K/V)
            o = F.scaled_dot_product_attention(
                q.reshape(1, n_kv, n_heads // n_kv, hd), kc.transpose(0, 1)[None].to(q.dtype),
                vc.transpose(0, 1)[None].to(q.dtype), scale=scale,
            )  # [1, n_kv_heads, group, head_dim]
            return o.view(1, n_heads, hd)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], kc.transpose(0, 1).to(q.dtype)[None],
            vc.transpose(0, 1).to(q.dtype)[None], attn_mask=causal_mask(qlen, ctx, q.device),
            scale=scale, enable_gqa=n_heads != n_kv,
        )  # [1, n_heads, qlen, head_dim]
        return o[0].transpose(0, 1)

    @staticmethod
    def _decode_batch(q: torch.Tensor, out: torch.Tensor, cache: KVCache, plan: DecodePlan,
                      scale: float) -> None:
        n_heads, n_kv, hd = q.shape[1], cache.k.shape[2], cache.k.shape[3]
        b = len(plan.seqs)
        # index_select copies whole blocks (advanced indexing went element by element: 5x
        # slower, and most of a batched step at fp32)
        kt = cache.k.index_select(0, plan.blocks).view(b, plan.padded_len, n_kv, hd)
        vt = cache.v.index_select(0, plan.blocks).view(b, plan.padded_len, n_kv, hd)
        # kt, vt: [B, padded_len, n_kv_heads, head_dim] in the pool's dtype
        # the query heads sharing a KV head act as its queries (GQA without expanding K/V)
        qb = q[plan.rows].view(b, n_kv, n_heads // n_kv, hd)  # [B, n_kv_heads, group, head_dim]
        o = F.scaled_dot_product_attention(
            qb.to(kt.dtype), kt.transpose(1, 2), vt.transpose(1, 2), attn_mask=plan.mask,
            scale=scale,
        )  # [B, n_kv_heads, group, head_dim]
        out[plan.rows] = o.reshape(b, n_heads, hd).to(out.dtype)

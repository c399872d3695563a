"""Paged attention over per-layer K/V pools.

Pools are shaped [num_blocks, block_size, n_kv_heads, head_dim]. A sequence's cached tokens live
in the blocks listed by its block table; `slot_mapping[t] = block * block_size + offset` is where
new token t is written. The queries of a sequence are its last `query_len` positions, so a
query at index i may attend to cached positions j <= context_len - query_len + i.

`AttentionBackend` is the interface the Triton kernels of the GPU backend plug in behind; the
CPU backend below is plain PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int64, padded with 0
    query_lens: list[int]  # per sequence, sums to num_tokens
    context_lens: list[int]  # per sequence: cached tokens after this step (incl. new ones)
    block_size: int


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


class TorchPagedAttention:
    """CPU (and fallback) backend in plain PyTorch.

    Single-token queries (decodes) of a batch are attended together: one padded gather of
    their blocks and one SDPA call with a length mask. Longer queries (prefill chunks) are
    attended one sequence at a time with a causal mask offset by the cached context.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [num_tokens, n_heads, head_dim]; k, v: [num_tokens, n_kv_heads, head_dim]
        store_kv(cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        starts = [0]
        for qlen in meta.query_lens:
            starts.append(starts[-1] + qlen)
        decodes = [i for i, qlen in enumerate(meta.query_lens) if qlen == 1]
        if len(decodes) > 1:
            self._decode_batch(q, out, cache, meta, scale, decodes, starts)
            done = set(decodes)
        else:
            done = set()
        for i, (qlen, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
            if i not in done:
                s, e = starts[i], starts[i + 1]
                out[s:e] = self._one(q[s:e], cache, meta.block_tables[i], qlen, ctx,
                                     meta.block_size, scale)
        return out

    @staticmethod
    def _one(q: torch.Tensor, cache: KVCache, table: torch.Tensor, qlen: int, ctx: int,
             bs: int, scale: float) -> torch.Tensor:
        # q: [qlen, n_heads, head_dim] -> [qlen, n_heads, head_dim]
        n_heads, n_kv, hd = q.shape[1], cache.k.shape[2], cache.k.shape[3]
        blocks = table[:(ctx + bs - 1) // bs]
        kt = cache.k[blocks].view(-1, n_kv, hd)[:ctx].transpose(0, 1).to(q.dtype)
        vt = cache.v[blocks].view(-1, n_kv, hd)[:ctx].transpose(0, 1).to(q.dtype)
        # kt, vt: [n_kv_heads, ctx, head_dim]
        if qlen == 1:
            # the query heads of one KV head form the rows of one small matmul (GQA); fp32,
            # since CPU bf16 bmm of these tiny shapes takes a slow path (~60 us a call)
            qg = q.view(n_kv, n_heads // n_kv, hd).float()  # [n_kv_heads, group, head_dim]
            scores = torch.bmm(qg, kt.float().transpose(1, 2)) * scale  # [n_kv, group, ctx]
            o = torch.bmm(scores.softmax(-1), vt.float())  # [n_kv, group, head_dim]
            return o.to(q.dtype).reshape(1, n_heads, hd)
        mask = None
        if qlen < ctx:
            mask = causal_mask(qlen, ctx, q.device)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), kt, vt, attn_mask=mask, is_causal=qlen == ctx,
            scale=scale, enable_gqa=n_heads != n_kv,
        )  # [n_heads, qlen, head_dim]
        return o.transpose(0, 1)

    @staticmethod
    def _decode_batch(q: torch.Tensor, out: torch.Tensor, cache: KVCache,
                      meta: AttentionMetadata, scale: float, seqs: list[int],
                      starts: list[int]) -> None:
        n_heads, n_kv, hd = q.shape[1], cache.k.shape[2], cache.k.shape[3]
        bs = meta.block_size
        ctxs = [meta.context_lens[i] for i in seqs]
        width = (max(ctxs) + bs - 1) // bs
        idx = torch.tensor(seqs, dtype=torch.long, device=q.device)
        tables = meta.block_tables[idx, :width]  # [B, width]
        b = len(seqs)
        kt = cache.k[tables].view(b, width * bs, n_kv, hd).transpose(1, 2).to(q.dtype)
        vt = cache.v[tables].view(b, width * bs, n_kv, hd).transpose(1, 2).to(q.dtype)
        # kt, vt: [B, n_kv_heads, width * block_size, head_dim]
        lens = torch.tensor(ctxs, device=q.device)
        mask = torch.arange(width * bs, device=q.device)[None, :] < lens[:, None]
        rows = torch.tensor([starts[i] for i in seqs], dtype=torch.long, device=q.device)
        # the query heads sharing a KV head act as its queries (GQA without expanding K/V)
        qb = q[rows].view(b, n_kv, n_heads // n_kv, hd)  # [B, n_kv_heads, group, head_dim]
        o = F.scaled_dot_product_attention(
            qb, kt, vt, attn_mask=mask[:, None, None, :], scale=scale,
        )  # [B, n_kv_heads, group, head_dim]
        out[rows] = o.reshape(b, n_heads, hd)

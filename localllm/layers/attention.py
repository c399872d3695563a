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
    """CPU (and fallback) backend: gather each sequence's blocks, then SDPA with GQA."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [num_tokens, n_heads, head_dim]; k, v: [num_tokens, n_kv_heads, head_dim]
        store_kv(cache, k, v, meta.slot_mapping)
        n_heads, hd = q.shape[1], q.shape[2]
        n_kv = k.shape[1]
        out = torch.empty_like(q)
        bs = meta.block_size
        start = 0
        for i, (qlen, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
            nb = (ctx + bs - 1) // bs
            blocks = meta.block_tables[i, :nb]
            kc = cache.k[blocks].view(-1, n_kv, hd)[:ctx]  # [ctx, n_kv_heads, head_dim]
            vc = cache.v[blocks].view(-1, n_kv, hd)[:ctx]
            qs = q[start:start + qlen].transpose(0, 1)  # [n_heads, qlen, head_dim]
            kt = kc.transpose(0, 1).to(q.dtype)  # [n_kv_heads, ctx, head_dim]
            vt = vc.transpose(0, 1).to(q.dtype)
            if qlen == 1:
                mask = None
                causal = False
            elif qlen == ctx:
                mask, causal = None, True
            else:
                mask, causal = causal_mask(qlen, ctx, q.device), False
            o = F.scaled_dot_product_attention(
                qs, kt, vt, attn_mask=mask, is_causal=causal, scale=scale,
                enable_gqa=n_heads != n_kv,
            )  # [n_heads, qlen, head_dim]
            out[start:start + qlen] = o.transpose(0, 1)
            start += qlen
        return out

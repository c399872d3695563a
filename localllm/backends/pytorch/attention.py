"""Paged attention in PyTorch (SDPA), on any device.

- A prompt with nothing cached attends over its own new K/V (one causal SDPA call).
- A chunk after cached context gathers the sequence's K/V slots (one `index_select` per pool)
  and runs SDPA with a causal mask offset by the cached length.
- A lone decode gathers likewise and runs one SDPA call, the query heads of one KV head
  standing as its queries (GQA without expanding K/V; 2x faster than two small matmuls).
- Several decodes in one step are attended together: one padded gather of their blocks and
  one SDPA call with a length mask (`decode_plan`, built once per step).
- A layer with a sliding window or a soft-cap (`AttentionSpec`) attends sequence by sequence
  over the cached positions its queries may see (gathered from the pools, the window's first
  position on): SDPA with the windowed causal mask, or, soft-capped, the scores in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from localllm.layers.attention import AttentionMetadata, AttentionSpec, KVCache, causal_mask


@dataclass(frozen=True)
class DecodePlan:
    seqs: list[int]  # the decoding sequences, B of them
    rows: torch.Tensor  # [B] their query's row in the flat batch
    blocks: torch.Tensor  # [B * width] their block tables, padded to the longest
    padded_len: int  # width * block_size
    mask: torch.Tensor  # [B, 1, 1, padded_len] True at each sequence's cached positions


def decode_plan(meta: AttentionMetadata) -> DecodePlan | None:
    """What batched decode attention needs (`meta.plan(decode_plan)`); None when fewer than
    two sequences decode."""
    seqs = meta.decoding()
    if len(seqs) < 2:
        return None
    bs = meta.block_size
    ctxs = [meta.context_lens[i] for i in seqs]
    width = (max(ctxs) + bs - 1) // bs
    dev = meta.block_tables.device
    blocks = meta.block_tables[torch.tensor(seqs, device=dev), :width]  # [B, width]
    lens = torch.tensor(ctxs, device=dev)
    mask = torch.arange(width * bs, device=dev)[None, :] < lens[:, None]
    return DecodePlan(seqs, meta.rows_of(seqs), blocks.flatten(), width * bs,
                      mask[:, None, None, :])


def store_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # k, v: [num_tokens, num_kv_heads, head_dim]
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    cache.k.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(cache.k.dtype))
    cache.v.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(cache.v.dtype))


class TorchPagedAttention:
    """`Backend.attention` in PyTorch (see the module docstring)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        store_kv(cache, k, v, meta.slot_mapping)
        if not spec.plain:
            out = torch.empty_like(q)
            start = 0
            for i, qlen in enumerate(meta.query_lens):
                out[start:start + qlen] = windowed(q[start:start + qlen], cache, meta, i, spec)
                start += qlen
            return out
        scale = spec.scale
        if len(meta.query_lens) == 1:  # one sequence: no bookkeeping, no copy of the output
            return self._one(q, k, v, cache, meta, 0, scale)
        out = torch.empty_like(q)
        plan = meta.plan(decode_plan)
        done: set[int] = set()
        if plan is not None:
            self._decode_batch(q, out, cache, plan, scale)
            done = set(plan.seqs)
        self.attend_rest(q, k, v, cache, meta, scale, out, done)
        return out

    def attend_rest(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                    meta: AttentionMetadata, scale: float, out: torch.Tensor,
                    done: set[int]) -> None:
        """Attends every sequence not in `done` one by one, into its rows of `out`."""
        start = 0
        for i, qlen in enumerate(meta.query_lens):
            if i not in done:
                s, e = start, start + qlen
                out[s:e] = self._one(q[s:e], k[s:e], v[s:e], cache, meta, i, scale)
            start += qlen

    @staticmethod
    def _one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
             meta: AttentionMetadata, i: int, scale: float) -> torch.Tensor:
        # q: [qlen, num_heads, head_dim]; k, v: this step's [qlen, num_kv_heads, head_dim]
        qlen, num_heads, head_dim = q.shape
        num_kv_heads, ctx = k.shape[1], meta.context_lens[i]
        # NOTE: SDPA gets 4-D inputs: 3-D ones take PyTorch's unfused math path on the CPU
        # (10x slower for a 512-token prompt)
        if qlen == ctx:  # nothing cached before: the new K/V are the whole context
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, scale=scale, enable_gqa=num_heads != num_kv_heads,
            )  # [1, num_heads, qlen, head_dim]
            return o[0].transpose(0, 1)
        slots = meta.seq_slots(i)
        # [ctx, num_kv_heads, head_dim]
        kc = cache.k.view(-1, num_kv_heads, head_dim).index_select(0, slots)
        vc = cache.v.view(-1, num_kv_heads, head_dim).index_select(0, slots)
        if qlen == 1:
            # the query heads sharing a KV head act as its queries (GQA without expanding K/V)
            o = F.scaled_dot_product_attention(
                q.reshape(1, num_kv_heads, num_heads // num_kv_heads, head_dim),
                kc.transpose(0, 1)[None].to(q.dtype), vc.transpose(0, 1)[None].to(q.dtype),
                scale=scale,
            )  # [1, num_kv_heads, group, head_dim]
            return o.view(1, num_heads, head_dim)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], kc.transpose(0, 1).to(q.dtype)[None],
            vc.transpose(0, 1).to(q.dtype)[None], attn_mask=causal_mask(qlen, ctx, q.device),
            scale=scale, enable_gqa=num_heads != num_kv_heads,
        )  # [1, num_heads, qlen, head_dim]
        return o[0].transpose(0, 1)

    @staticmethod
    def _decode_batch(q: torch.Tensor, out: torch.Tensor, cache: KVCache, plan: DecodePlan,
                      scale: float) -> None:
        num_heads, num_kv_heads, head_dim = q.shape[1], cache.k.shape[2], cache.k.shape[3]
        b = len(plan.seqs)
        # index_select copies whole blocks (advanced indexing went element by element: 5x
        # slower, and most of a batched step at fp32)
        shape = (b, plan.padded_len, num_kv_heads, head_dim)
        kt = cache.k.index_select(0, plan.blocks).view(shape)
        vt = cache.v.index_select(0, plan.blocks).view(shape)
        # kt, vt: [B, padded_len, num_kv_heads, head_dim] in the pool's dtype
        # the query heads sharing a KV head act as its queries (GQA without expanding K/V)
        # [B, num_kv_heads, group, head_dim]
        qb = q[plan.rows].view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(
            qb.to(kt.dtype), kt.transpose(1, 2), vt.transpose(1, 2), attn_mask=plan.mask,
            scale=scale,
        )  # [B, num_kv_heads, group, head_dim]
        out[plan.rows] = o.reshape(b, num_heads, head_dim).to(out.dtype)


def windowed(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, i: int,
             spec: AttentionSpec) -> torch.Tensor:
    """Sequence i's queries q [qlen, num_heads, head_dim] over its cached K/V (this step's
    already stored) as `spec` says -> [qlen, num_heads, head_dim]. Only the positions some
    query's window reaches are gathered: earlier block-table entries are never read."""
    qlen, num_heads, head_dim = q.shape
    num_kv_heads, ctx = cache.k.shape[2], meta.context_lens[i]
    first = max(ctx - qlen - spec.window + 1, 0) if spec.window else 0
    slots = meta.seq_slots(i)[first:]
    kc = cache.k.view(-1, num_kv_heads, head_dim).index_select(0, slots)
    vc = cache.v.view(-1, num_kv_heads, head_dim).index_select(0, slots)
    # kc, vc: [ctx - first, num_kv_heads, head_dim]
    mask = causal_mask(qlen, ctx, q.device, spec.window, first)  # [qlen, ctx - first]
    group = num_heads // num_kv_heads
    if spec.softcap == 0:
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], kc.transpose(0, 1).to(q.dtype)[None],
            vc.transpose(0, 1).to(q.dtype)[None], attn_mask=mask, scale=spec.scale,
            enable_gqa=group != 1,
        )  # [1, num_heads, qlen, head_dim]
        return o[0].transpose(0, 1)
    qh = q.float().transpose(0, 1)  # [num_heads, qlen, head_dim]
    kh = kc.float().transpose(0, 1).repeat_interleave(group, 0)  # [num_heads, n, head_dim]
    vh = vc.float().transpose(0, 1).repeat_interleave(group, 0)
    s = torch.matmul(qh, kh.transpose(1, 2)) * spec.scale  # [num_heads, qlen, n]
    s = spec.softcap * torch.tanh(s / spec.softcap)
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.matmul(p, vh).transpose(0, 1).to(q.dtype)

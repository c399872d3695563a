"""Paged attention on the CPU: native kernels for the K/V store and decode attention where they
run (bf16 pools, head sizes the kernel takes, no soft-cap or sliding window), PyTorch
(`TorchPagedAttention`) otherwise.

With the native kernels, the K/V store is one call and every decoding sequence of the step is
attended by one `decode_attention` call (`decode_batch`, built once per step). A prompt's rows
(`prompt_attention`) take SDPA in blocks of `PROMPT_BLOCK` query positions aligned to the
sequence's start, each over the keys up to its block's end: every SDPA call has the same
shape for a given block, so a prompt row gets the same result whether its prompt is
prefilled in one step, split over steps, or resumed after a cached prefix. Rows past the
prompt computed again after a preemption take the decode kernel, as when they were decoded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from localllm.backends.pytorch.attention import TorchPagedAttention
from localllm.kernels import cpu_native, cpu_ops
from localllm.layers.attention import AttentionMetadata, AttentionSpec, KVCache, causal_mask


@dataclass(frozen=True)
class DecodeBatch:
    rows: torch.Tensor | None  # [B] the query rows of the decoding sequences; None: all rows
    seqs: list[int]  # their sequence numbers
    block_tables: torch.Tensor  # [B, width] int64, contiguous
    context_lens: torch.Tensor  # [B] int64


def decode_batch(meta: AttentionMetadata) -> DecodeBatch | None:
    """The sequences with one query token (any number), as the native decode kernel takes them
    (`meta.plan(decode_batch)`). None when no sequence decodes."""
    seqs = meta.decoding()
    if not seqs:
        return None
    dev = meta.block_tables.device
    if len(seqs) == len(meta.query_lens):
        rows, tables = None, meta.block_tables.contiguous()
        ctxs = meta.context_lens_tensor
        if ctxs is not None and ctxs.dtype == torch.long:
            return DecodeBatch(rows, seqs, tables, ctxs)
    else:
        rows = meta.rows_of(seqs)
        tables = meta.block_tables[torch.tensor(seqs, device=dev)].contiguous()
    ctxs = torch.tensor([meta.context_lens[i] for i in seqs], dtype=torch.long, device=dev)
    return DecodeBatch(rows, seqs, tables, ctxs)


# query positions per SDPA call of a prompt; the keys of a call are a multiple of it
# NOTE: PyTorch's CPU SDPA splits queries and keys by their counts and sums a row's keys in
# vectors: a row's result changes with the call's shape unless both are fixed like this
PROMPT_BLOCK = 32


def prompt_attention(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, i: int,
                     scale: float, first: int) -> torch.Tensor:
    """Query rows q [qlen, num_heads, head_dim] of sequence i at positions first.. (whose K/V
    are stored) over its cached K/V, causal -> [qlen, num_heads, head_dim]. Each block of
    PROMPT_BLOCK positions [b, b + PROMPT_BLOCK) is one SDPA call of PROMPT_BLOCK queries (rows
    outside q zero, their outputs dropped) over keys [0, b + PROMPT_BLOCK) (beyond the
    context, zero; beyond a row's position, masked)."""
    qlen, num_heads, head_dim = q.shape
    num_kv_heads, n = cache.k.shape[2], PROMPT_BLOCK
    end = first + qlen
    padded = -(-end // n) * n
    keys = min(padded, meta.context_lens[i])
    slots = meta.seq_slots(i)[:keys]
    # [1, num_kv_heads, padded, head_dim]
    kt, vt = (F.pad(pool.view(-1, num_kv_heads, head_dim).index_select(0, slots),
                    (0, 0, 0, 0, 0, padded - keys)).to(q.dtype).transpose(0, 1).contiguous()[None]
              for pool in (cache.k, cache.v))
    out = torch.empty_like(q)
    block = torch.empty(n, num_heads, head_dim, dtype=q.dtype, device=q.device)
    pos = first
    while pos < end:
        b = pos // n * n
        stop = min(end, b + n)
        block.zero_()
        block[pos - b:stop - b] = q[pos - first:stop - first]
        mask = causal_mask(n, b + n, q.device)  # [n, b + n]: block row j sees keys <= b + j
        o = F.scaled_dot_product_attention(
            block.transpose(0, 1)[None], kt[:, :, :b + n], vt[:, :, :b + n], attn_mask=mask,
            scale=scale, enable_gqa=num_heads != num_kv_heads,
        )  # [1, num_heads, n, head_dim]
        out[pos - first:stop - first] = o[0, :, pos - b:stop - b].transpose(0, 1)
        pos = stop
    return out


def chunk_attention(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, i: int,
                    scale: float) -> torch.Tensor:
    """Sequence i's query rows q [qlen, num_heads, head_dim] (its last qlen positions) when it
    does not decode: its prompt's rows through `prompt_attention`, and rows past the prompt
    (decoded once, computed again after a preemption) one by one through the decode kernel,
    as when they were decoded."""
    ctx, qlen = meta.context_lens[i], q.shape[0]
    first = ctx - qlen
    prompt_end = ctx if meta.prompt_lens is None else min(max(meta.prompt_lens[i], first), ctx)
    if prompt_end == ctx:
        return prompt_attention(q, cache, meta, i, scale, first)
    out = torch.empty_like(q)
    if prompt_end > first:
        out[:prompt_end - first] = prompt_attention(q[:prompt_end - first], cache, meta, i,
                                                    scale, first)
    n = ctx - prompt_end
    tables = meta.block_tables[i:i + 1].expand(n, -1).contiguous()
    lens = torch.arange(prompt_end + 1, ctx + 1, dtype=torch.long, device=q.device)
    out[prompt_end - first:] = cpu_ops.decode_attention(q[prompt_end - first:], cache.k,
                                                        cache.v, tables, lens, scale)
    return out


def native_attention(q: torch.Tensor, cache: KVCache) -> bool:
    """Whether this layer's K/V store and decode attention take the native kernels."""
    return (q.dtype == cache.k.dtype == torch.bfloat16 and q.device.type == "cpu"
            and cache.k.is_contiguous() and cache.v.is_contiguous()
            and cpu_ops.decode_attention_supported(q.shape[1], cache.k.shape[2], q.shape[2])
            and cpu_native.available())


class CpuPagedAttention(TorchPagedAttention):
    """`Backend.attention` on the CPU (see the module docstring)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        # NOTE: the native kernels have no soft-cap and no window: such layers take PyTorch's
        if not spec.plain or not native_attention(q, cache):
            return super().forward(q, k, v, cache, meta, spec)
        scale = spec.scale
        cpu_ops.kv_store(k.flatten(1), v.flatten(1), meta.slot_mapping, cache.k, cache.v)
        batch = meta.plan(decode_batch)
        if batch is None and len(meta.query_lens) == 1:
            return chunk_attention(q, cache, meta, 0, scale)
        if batch is not None and batch.rows is None:  # every sequence decodes: one call
            return cpu_ops.decode_attention(q, cache.k, cache.v, batch.block_tables,
                                            batch.context_lens, scale)
        out = torch.empty_like(q)
        if batch is not None:
            out[batch.rows] = cpu_ops.decode_attention(
                q[batch.rows], cache.k, cache.v, batch.block_tables, batch.context_lens, scale)
        decoding = set(batch.seqs) if batch is not None else set()
        start = 0
        for i, qlen in enumerate(meta.query_lens):
            if i not in decoding:
                out[start:start + qlen] = chunk_attention(q[start:start + qlen], cache, meta,
                                                          i, scale)
            start += qlen
        return out

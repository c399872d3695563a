"""Paged attention on the CPU: native kernels for the K/V store and decode attention where they
run (bf16 pools, head sizes the kernel takes, no soft-cap or sliding window), PyTorch
(`TorchPagedAttention`) otherwise and for prompts and chunks.

With the native kernels, the K/V store is one call and every decoding sequence of the step is
attended by one `decode_attention` call (`decode_batch`, built once per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localllm.backends.pytorch.attention import TorchPagedAttention
from localllm.kernels import cpu_native, cpu_ops
from localllm.layers.attention import AttentionMetadata, AttentionSpec, KVCache


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
        if batch is None:
            if len(meta.query_lens) == 1:
                return self._one(q, k, v, cache, meta, 0, scale)
            out = torch.empty_like(q)
            self.attend_rest(q, k, v, cache, meta, scale, out, set())
            return out
        if batch.rows is None:  # every sequence decodes: one call, no copies
            return cpu_ops.decode_attention(q, cache.k, cache.v, batch.block_tables,
                                            batch.context_lens, scale)
        out = torch.empty_like(q)
        out[batch.rows] = cpu_ops.decode_attention(
            q[batch.rows], cache.k, cache.v, batch.block_tables, batch.context_lens, scale)
        self.attend_rest(q, k, v, cache, meta, scale, out, set(batch.seqs))
        return out

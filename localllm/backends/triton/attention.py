"""Paged attention of the Triton backend: the K/V store, then one decode kernel for a step
where every sequence has one query (split-KV over long contexts), or one extend kernel for
any other step (prompts, chunks after a cached prefix, and decodes beside them). Both kernels
take the layer's soft-cap and sliding window (`AttentionSpec`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localllm.kernels import triton_decode_attention, triton_extend_attention, triton_ops
from localllm.layers.attention import AttentionMetadata, AttentionSpec, KVCache


@dataclass(frozen=True)
class StepPlan:
    decode_only: bool  # every sequence has one query token
    query_start: torch.Tensor  # [num_seqs + 1] int32: the first query row of each sequence
    context_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, width] int32, contiguous


def step_plan(meta: AttentionMetadata) -> StepPlan:
    """The step's attention metadata as the kernels take it (`meta.plan(step_plan)`: once a
    step, for every layer)."""
    dev = meta.block_tables.device
    starts = [0]
    for qlen in meta.query_lens:
        starts.append(starts[-1] + qlen)
    return StepPlan(all(n == 1 for n in meta.query_lens),
                    torch.tensor(starts, dtype=torch.int32, device=dev),
                    torch.tensor(meta.context_lens, dtype=torch.int32, device=dev),
                    meta.block_tables.to(torch.int32).contiguous())


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                    meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
    # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
    triton_ops.kv_store(k, v, meta.slot_mapping, cache.k, cache.v)
    plan = meta.plan(step_plan)
    if plan.decode_only:
        return triton_decode_attention.paged_decode_attention(
            q, cache.k, cache.v, plan.block_tables, plan.context_lens, spec.scale,
            softcap=spec.softcap, window=spec.window)
    return triton_extend_attention.paged_extend_attention(
        q, cache.k, cache.v, plan.block_tables, plan.query_start, plan.context_lens,
        spec.scale, softcap=spec.softcap, window=spec.window)

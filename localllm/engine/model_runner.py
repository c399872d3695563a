"""Runs the model on one scheduled batch: flat inputs, paged K/V pools, last-position logits."""

from __future__ import annotations

import math
import mmap

import torch

from localllm.config import ModelConfig
from localllm.engine.request import Request
from localllm.engine.scheduler import ScheduledRequest
from localllm.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    KVCache,
    TorchPagedAttention,
)
from localllm.models.llama import LlamaForCausalLM


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def allocate_kv_caches(cfg: ModelConfig, num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: torch.device) -> list[KVCache]:
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    if device.type != "cpu":
        return [KVCache(torch.zeros(shape, dtype=dtype, device=device),
                        torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(cfg.num_layers)]
    # NOTE: on the CPU the pools live in one anonymous memory map: the kernel hands out zeroed
    # pages on first touch, so the cache is resident only as far as blocks are used, and an
    # unwritten slot reads as 0 (never NaN garbage that a mask could not cancel).
    per_pool = math.prod(shape)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    buf = mmap.mmap(-1, 2 * cfg.num_layers * per_pool * itemsize)
    flat = torch.frombuffer(buf, dtype=dtype)  # keeps `buf` alive
    pools = flat.view(cfg.num_layers, 2, *shape)
    return [KVCache(pools[i, 0], pools[i, 1]) for i in range(cfg.num_layers)]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 device: torch.device | None = None,
                 backend: AttentionBackend | None = None) -> None:
        self.model = model
        self.cfg = model.cfg
        self.block_size = block_size
        self.device = device or torch.device("cpu")
        self.backend: AttentionBackend = backend or TorchPagedAttention()
        self.kv_caches = allocate_kv_caches(self.cfg, num_blocks, block_size, model.dtype,
                                            self.device)

    def _prepare(self, batch: list[ScheduledRequest]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        ctxs: list[int] = []
        for s in batch:
            req = s.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens
            ids.extend(req.all_token_ids[start:end])
            pos.extend(range(start, end))
            table = req.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            qlens.append(s.num_new_tokens)
            ctxs.append(end)
        width = max(len(s.request.block_table) for s in batch)
        tables = [s.request.block_table + [0] * (width - len(s.request.block_table))
                  for s in batch]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.long, device=dev),
            query_lens=qlens,
            context_lens=ctxs,
            block_size=bs,
        )
        return (torch.tensor(ids, dtype=torch.long, device=dev),
                torch.tensor(pos, dtype=torch.long, device=dev), meta)

    def execute(self, batch: list[ScheduledRequest]) -> tuple[torch.Tensor, list[Request]]:
        """Run one step; returns logits [num_sampling, vocab] fp32 and the sampling requests."""
        input_ids, positions, meta = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        last: list[int] = []
        sampling: list[Request] = []
        end = 0
        for s, qlen in zip(batch, meta.query_lens):
            end += qlen
            if s.samples:
                last.append(end - 1)
                sampling.append(s.request)
        if not last:
            return torch.empty(0, self.cfg.vocab_size), sampling
        idx = torch.tensor(last, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[idx]).cpu(), sampling


def prompt_logits(model: LlamaForCausalLM, token_ids: list[int], block_size: int = 16,
                  chunk: int = 0) -> torch.Tensor:
    """Teacher-forced logits of every position of one sequence: [len(token_ids), vocab] fp32.

    Uses a private KV pool sized for the sequence, so it never touches an engine's cache.
    `chunk` > 0 feeds the sequence that many tokens at a time (as chunked prefill, or decode
    with chunk=1, would), which exercises the small-batch kernels.
    """
    n = len(token_ids)
    nb = -(-n // block_size)
    caches = allocate_kv_caches(model.cfg, nb, block_size, model.dtype, torch.device("cpu"))
    table = torch.arange(nb, dtype=torch.long).unsqueeze(0)
    step = chunk if chunk > 0 else n
    out = []
    for start in range(0, n, step):
        end = min(n, start + step)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(start, end, dtype=torch.long), block_tables=table,
            query_lens=[end - start], context_lens=[end], block_size=block_size,
        )
        hidden = model(torch.tensor(token_ids[start:end], dtype=torch.long),
                       torch.arange(start, end), caches, meta, TorchPagedAttention())
        out.append(model.compute_logits(hidden))
    return torch.cat(out)

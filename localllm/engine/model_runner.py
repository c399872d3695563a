"""Runs the model on one scheduled batch: flat inputs, paged K/V pools, last-position logits.

The runner holds the model's backend and device: it allocates the KV pools through the
backend, builds each step's metadata, and takes the backend's whole-step fast path (a
decode-only step in one call) where the backend has one, the model's forward otherwise; where the
backend runs several decode steps in one call, `execute_steps` takes them. It also
copies whole blocks out of and into the pools for the prefix store (`read_blocks`,
`write_blocks`: plain indexing, on any device).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from localllm.config import ModelConfig
from localllm.engine.request import Request
from localllm.engine.scheduler import ScheduledRequest
from localllm.layers.attention import AttentionMetadata, KVCache
from localllm.layers.backend import DecodeSteps, RowDraw, StepLogits, StepTokens, WholeStep
from localllm.models.registry import CausalLM


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


class StepOutput(NamedTuple):
    logits: torch.Tensor  # fp32 [num_sampling, vocab] on the device
    sampling: list[Request]  # the requests that sample, one per row
    # each row's argmax and its logit, where the step's fast path picked them
    best: list[int] | None = None
    best_logit: list[float] | None = None


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.cfg = model.cfg
        self.block_size = block_size
        self.backend = model.backend
        self.device = self.backend.device
        cfg = self.cfg
        self.kv_caches = self.backend.allocate_kv(cfg.num_layers, num_blocks, block_size,
                                                  cfg.num_kv_heads, cfg.head_dim, model.dtype)
        self._whole_step: WholeStep | None = None
        self._whole_step_built = False
        self._steps: DecodeSteps | None = None
        self._steps_built = False

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A CPU copy of whole blocks' K/V, every layer (for the prefix store):
        [n, num_layers, 2, block_size, num_kv_heads, head_dim]."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return torch.stack([torch.stack((c.k.index_select(0, idx), c.v.index_select(0, idx)), 1)
                            for c in self.kv_caches], 1).cpu()

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Fill whole blocks from `data` shaped as `read_blocks` gives it (one copy to the
        device, then one indexed copy per pool)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        data = data.to(self.device)
        for layer, c in enumerate(self.kv_caches):
            c.k.index_copy_(0, idx, data[:, layer, 0])
            c.v.index_copy_(0, idx, data[:, layer, 1])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden] of one step."""
        out = self._step(input_ids, positions, meta, False)
        assert isinstance(out, torch.Tensor)
        return out

    def _step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              head: bool) -> torch.Tensor | StepLogits:
        # the final hidden states, or with head the logits of a decode-only step whose fast
        # path runs the LM head
        if not self._whole_step_built:  # after loading, which must not change the weights
            self._whole_step = self.backend.whole_step(self.model.decoder_layout(),
                                                       self._model_forward)
            self._whole_step_built = True
        if self._whole_step is not None:
            out = self._whole_step(input_ids, positions, self.kv_caches, meta, head)
            if out is not None:  # a decode-only step through the backend's fast path
                return out
        return self._model_forward(input_ids, positions, self.kv_caches, meta)

    def _model_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        # decoding rows keep the few-rows kernels and each prompt's rows its own path, whatever
        # shares the step (the scheduler puts decoding sequences first)
        with self.backend.step_rows(meta):
            return self.model(input_ids, positions, caches, meta)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_seqs, hidden] -> fp32 logits [num_seqs, vocab] on the device."""
        # one row per sequence: the same path at any batch
        with self.backend.decoding_rows(hidden.shape[0]):
            return self.model.compute_logits(hidden)

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
            ids.extend(req.token_ids(start, end))
            pos.extend(range(start, end))
            table = req.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            qlens.append(s.num_new_tokens)
            ctxs.append(end)
        width = max(len(s.request.block_table) for s in batch)
        flat = ids + pos + slots + ctxs
        for s in batch:
            flat += s.request.block_table
            flat += [0] * (width - len(s.request.block_table))
        # one copy to the device, then views: ids | positions | slots | context lens | tables
        # (after a decode step has streamed the weights, each tensor made runs with the caches
        # cold: one of about 20 ints costs some 19 us there, 7 us warm)
        n, b = len(ids), len(batch)
        t_ids, t_pos, t_slots, t_ctxs, t_tables = torch.tensor(
            flat, dtype=torch.long, device=self.device).split((n, n, n, b, b * width))
        meta = AttentionMetadata(
            slot_mapping=t_slots,
            block_tables=t_tables.view(b, width),
            query_lens=qlens,
            context_lens=ctxs,
            block_size=bs,
            context_lens_tensor=t_ctxs,
            prompt_lens=[len(s.request.prompt_ids) for s in batch],
        )
        return t_ids, t_pos, meta

    @property
    def decode_steps(self) -> DecodeSteps | None:
        """The backend's path running several decode steps of this model in one call
        (`execute_steps`), or None."""
        if not self._steps_built:  # after loading, which must not change the weights
            self._steps = self.backend.decode_steps(self.model.decoder_layout())
            self._steps_built = True
        return self._steps

    def execute_steps(self, batch: list[ScheduledRequest], steps: int) -> StepTokens | None:
        """Run `steps` decode steps of a decode-only batch in one call (each request's block
        table must already hold its slots for all of them; a request that samples draws as the
        Sampler would, its stream's count not advanced here), or None where the backend has no
        such path or does not take this batch: then nothing was computed."""
        path = self.decode_steps
        if path is None:
            return None
        draws = [None if s.request.draws is None else RowDraw(
            s.request.params.temperature, s.request.params.top_k, s.request.params.top_p,
            s.request.params.min_p, s.request.draws.key, s.request.draws.count) for s in batch]
        input_ids, positions, meta = self._prepare(batch)
        return path.run(input_ids, positions, self.kv_caches, meta, steps, draws)

    def execute(self, batch: list[ScheduledRequest]) -> StepOutput:
        """Run one step: the sampling requests' logits [num_sampling, vocab] fp32 on the
        device, and the requests."""
        input_ids, positions, meta = self._prepare(batch)
        out = self._step(input_ids, positions, meta, True)
        last: list[int] = []
        sampling: list[Request] = []
        end = 0
        for s, qlen in zip(batch, meta.query_lens):
            end += qlen
            if s.samples:
                last.append(end - 1)
                sampling.append(s.request)
        if isinstance(out, StepLogits):  # a decode step that ran the head: one row per request
            if len(last) == len(batch):
                return StepOutput(out.logits, sampling, out.best, out.best_logit)
            idx = torch.tensor(last, dtype=torch.long, device=self.device)
            return StepOutput(out.logits[idx], sampling, [out.best[i] for i in last],
                              [out.best_logit[i] for i in last])
        if not last:
            return StepOutput(torch.empty(0, self.cfg.vocab_size, device=self.device), sampling)
        if len(last) == out.shape[0]:  # a decode-only step: every row samples
            return StepOutput(self.logits(out), sampling)
        idx = torch.tensor(last, dtype=torch.long, device=self.device)
        return StepOutput(self.logits(out[idx]), sampling)


def prompt_logits(model: CausalLM, token_ids: list[int], block_size: int = 16,
                  chunk: int = 0) -> torch.Tensor:
    """Teacher-forced logits of every position of one sequence: [len(token_ids), vocab] fp32.

    Runs its own `ModelRunner` with a private KV pool sized for the sequence, so it never
    touches an engine's cache. `chunk` > 0 feeds the sequence that many tokens at a time (as
    chunked prefill, or decode with chunk=1, would), which exercises the small-batch kernels
    and the whole-step fast path.
    """
    n = len(token_ids)
    nb = -(-n // block_size)
    runner = ModelRunner(model, nb, block_size)
    dev = runner.device
    table = torch.arange(nb, dtype=torch.long, device=dev).unsqueeze(0)
    step = chunk if chunk > 0 else n
    out = []
    for start in range(0, n, step):
        end = min(n, start + step)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(start, end, dtype=torch.long, device=dev),
            block_tables=table, query_lens=[end - start], context_lens=[end],
            block_size=block_size,
        )
        ids = torch.tensor(token_ids[start:end], dtype=torch.long, device=dev)
        hidden = runner.forward(ids, torch.arange(start, end, device=dev), meta)
        out.append(runner.logits(hidden).cpu())
    return torch.cat(out)

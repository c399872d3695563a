"""Kernel timings of prompt processing and token generation, as llama-bench takes them: the
model runner driven directly with synthetic token ids on its own block tables, so neither
tokenization, nor sampling, nor the scheduler enters the figures. Sampling is timed on its own,
on the logits of each step, with the engine's `Sampler`.

Each of `max_batch` sequences owns a contiguous run of blocks. `fill_depth` writes the K/V of
`depth` positions of every one once (untimed); a prompt-processing run over the first `batch`
sequences then prefills `n_prompt` tokens of each after them (in steps of at most
`step_tokens` tokens, as chunked prefill does), and a token-generation run decodes `n_gen`
steps of one token per sequence from position `depth`, so each run sees the same cached
context and overwrites only its own positions.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from localllm.config import SamplingParams
from localllm.engine.model_runner import ModelRunner
from localllm.engine.request import Request
from localllm.engine.sampler import Sampler
from localllm.layers.attention import AttentionMetadata

# the CLI's `generate` defaults, so that sampling costs what it costs a user
BENCH_SAMPLING = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=0)


class RunTimes(NamedTuple):
    kernel: float  # seconds in model forward and logits, summed over the run's steps
    steps: list[float]  # seconds of each step (forward + logits)
    sample: list[float]  # seconds of the sampling after each step that samples


def blocks_per_seq(length: int, block_size: int) -> int:
    return -(-length // block_size)


class LatencyRunner:
    """Times steps of up to `max_batch` synthetic sequences of up to `max_len` tokens on
    `runner`, whose pool must hold `max_batch * blocks_per_seq(max_len)` blocks."""

    def __init__(self, runner: ModelRunner, max_batch: int, max_len: int,
                 step_tokens: int = 2048,
                 seed: int = 0) -> None:
        self.runner = runner
        self.max_batch = max_batch
        self.bs = runner.block_size
        self.nb = blocks_per_seq(max_len, self.bs)
        pool = runner.kv_caches[0].k.shape[0]
        if pool < max_batch * self.nb:
            raise ValueError(f"the KV pool has {pool} blocks, {max_batch * self.nb} needed")
        self.step_tokens = step_tokens
        self.dev = runner.device
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = runner.cfg.vocab_size
        tables = torch.arange(max_batch * self.nb, dtype=torch.long).view(max_batch, self.nb)
        self.tables = tables.to(self.dev)  # [max_batch, nb]
        self.sampler = Sampler(runner.backend)
        self.requests = [Request([0], BENCH_SAMPLING) for _ in range(max_batch)]

    def token_ids(self, n: int) -> torch.Tensor:
        """`n` synthetic token ids (uniform over the vocabulary, seeded)."""
        return torch.randint(0, self.vocab, (n,), generator=self.gen)

    def _sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def _step(self, chunks: list[tuple[int, int, int]], sample_at: int) -> torch.Tensor | None:
        """One step over (sequence, start, end) chunks; returns the logits of the last
        position of each chunk that ends at `sample_at` [n, vocab], None where none does (as
        the engine computes logits only where it samples)."""
        pos = torch.cat([torch.arange(s, e) for _, s, e in chunks])
        seq = torch.cat([torch.full((e - s,), i, dtype=torch.long) for i, s, e in chunks])
        slots = seq * (self.nb * self.bs) + pos  # contiguous blocks: block id * bs + offset
        ids = self.token_ids(len(pos))
        rows = [i for i, _, _ in chunks]
        meta = AttentionMetadata(slot_mapping=slots.to(self.dev),
                                 block_tables=self.tables[rows],
                                 query_lens=[e - s for _, s, e in chunks],
                                 context_lens=[e for _, _, e in chunks], block_size=self.bs)
        hidden = self.runner.forward(ids.to(self.dev), pos.to(self.dev), meta)
        ends = torch.tensor([e - s for _, s, e in chunks]).cumsum(0) - 1
        last = [int(ends[k]) for k, (_, _, e) in enumerate(chunks) if e == sample_at]
        if not last:
            return None
        return self.runner.logits(hidden[torch.tensor(last, device=self.dev)])

    def _plan(self, start: int, end: int, batch: int) -> list[list[tuple[int, int, int]]]:
        """Steps of at most `step_tokens` tokens covering positions start..end of the first
        `batch` sequences (a step never holds two chunks of one sequence: all but a sequence's last
        chunk fill a step)."""
        steps: list[list[tuple[int, int, int]]] = [[]]
        used = 0
        for i in range(batch):
            for s in range(start, end, self.step_tokens):
                e = min(end, s + self.step_tokens)
                if used + e - s > self.step_tokens:
                    steps.append([])
                    used = 0
                steps[-1].append((i, s, e))
                used += e - s
        return [s for s in steps if s]

    def fill_depth(self, depth: int) -> None:
        """K/V of positions 0..depth of every sequence (synthetic tokens, untimed)."""
        for chunks in self._plan(0, depth, self.max_batch):
            self._step(chunks, -1)
        self._sync()

    def prompt(self, depth: int, n_prompt: int, batch: int) -> RunTimes:
        """Prefill `n_prompt` tokens of `batch` sequences after `depth` cached ones, then
        sample each sequence's first token."""
        steps, rows = [], []
        end = depth + n_prompt
        for chunks in self._plan(depth, end, batch):
            self._sync()
            t = time.perf_counter()
            logits = self._step(chunks, end)
            self._sync()
            steps.append(time.perf_counter() - t)
            if logits is not None:
                rows.append(logits)
        t = time.perf_counter()
        self.sampler(torch.cat(rows), self.requests[:batch])
        sample = time.perf_counter() - t
        return RunTimes(sum(steps), steps, [sample])

    def generate(self, depth: int, n_gen: int, batch: int) -> RunTimes:
        """`n_gen` decode steps of one token for each of `batch` sequences from position
        `depth`, sampling after each."""
        steps, samples = [], []
        for p in range(depth, depth + n_gen):
            self._sync()
            t = time.perf_counter()
            logits = self._step([(i, p, p + 1) for i in range(batch)], p + 1)
            self._sync()
            t1 = time.perf_counter()
            assert logits is not None
            self.sampler(logits, self.requests[:batch])
            t2 = time.perf_counter()
            steps.append(t1 - t)
            samples.append(t2 - t1)
        return RunTimes(sum(steps), steps, samples)

"""Continuous-batching scheduler with a per-step token budget and chunked prefill.

Each step: running requests first — decodes (one token each) before partly prefilled prompts —
then waiting requests in arrival order, whose prompts are split into chunks that fill the rest
of the budget. When the KV pool runs out, the most recently admitted running request is
preempted: its blocks are freed and it is recomputed later (its blocks' hashes usually let the
prefix cache give most of them back).

NOTE: only the scheduler changes `Request.status` and `num_computed_tokens`.
"""

from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple

from localllm.config import SchedulerConfig
from localllm.engine.block_manager import BlockManager
from localllm.engine.request import FinishReason, Request, RequestStatus


class ScheduledRequest(NamedTuple):
    request: Request
    num_new_tokens: int  # tokens computed this step, starting at request.num_computed_tokens
    samples: bool  # whether this step ends the known tokens, so a new token is sampled


class SchedulerOutput(NamedTuple):
    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 max_model_len: int) -> None:
        self.config = config
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.bm.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        now = time.perf_counter()

        # Decodes first, then partly prefilled prompts; each group in admission order.
        order = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        for req in order:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.bm.allocate(req, n):
                # the latest admitted request not already given a place in this step
                done = {id(s.request) for s in scheduled}
                victim = next((r for r in reversed(self.running) if id(r) not in done), req)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            scheduled.append(self._scheduled(req, n))
            budget -= n

        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            hits = self.bm.match_prefix(req.all_token_ids)
            hit = hits.num_blocks * self.bm.block_size
            n = req.num_tokens - hit
            if not self.config.enable_chunked_prefill:
                # a whole prompt at once; one larger than the budget runs alone in its step
                if n > budget and scheduled:
                    break
            else:
                n = min(n, budget)
            if not self.bm.allocate(req, n, hits):
                break
            # blocks the store failed to load are computed instead (this step or the next)
            hit = len(req.block_hashes) * self.bm.block_size
            self.waiting.popleft()
            self.bm.record_prefix_lookup(req.num_tokens, hit)
            req.num_computed_tokens = hit
            req.num_cached_tokens = hit
            req.status = RequestStatus.RUNNING
            if req.times.first_scheduled is None:
                req.times.first_scheduled = now
            self.running.append(req)
            scheduled.append(self._scheduled(req, n))
            budget = max(0, budget - n)
        return SchedulerOutput(scheduled, preempted)

    def reserve_ahead(self, out: SchedulerOutput, steps: int) -> int:
        """Blocks for up to `steps` decode steps of every request of `out`, a batch of decodes
        that one call may run back to back: how many steps it may run (blocks for them
        taken), `steps` capped so that no request runs past its max_tokens or the context
        (tokens past a stop are computed and dropped), or 1 (nothing taken) where the pool
        lacks the blocks."""
        reqs = [s.request for s in out.scheduled]
        for r in reqs:
            steps = min(steps, r.params.max_tokens - len(r.output_ids),
                        self.max_model_len - r.num_tokens)
        if steps <= 1 or not self.bm.can_grow(reqs, steps):
            return 1
        for r in reqs:
            if not self.bm.allocate(r, steps):
                raise AssertionError(f"{r}: blocks for {steps} steps were counted but not there")
        return steps

    @staticmethod
    def _scheduled(req: Request, n: int) -> ScheduledRequest:
        return ScheduledRequest(req, n, req.num_computed_tokens + n == req.num_tokens)

    def update(self, out: SchedulerOutput, sampled: dict[str, int],
               stop_ids: frozenset[int]) -> list[Request]:
        """Record computed tokens and sampled ones; returns requests that finished."""
        finished: list[Request] = []
        now = time.perf_counter()
        for s in out.scheduled:
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted or failed while the step ran
            req.num_computed_tokens += s.num_new_tokens
            self.bm.cache_full_blocks(req)
            self.bm.release_behind_window(req)
            token = sampled.get(req.request_id)
            if token is None:
                continue
            req.output_ids.append(token)
            if req.times.first_token is None:
                req.times.first_token = now
            req.times.token_times.append(now)
            reason = self._stop_reason(req, token, stop_ids)
            if reason is not None:
                self.finish(req, reason)
                finished.append(req)
        return finished

    def _stop_reason(self, req: Request, token: int,
                     stop_ids: frozenset[int]) -> FinishReason | None:
        p = req.params
        if (token in stop_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return FinishReason.STOP
        if len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        """End a request (any status) and release its blocks."""
        if req.status is RequestStatus.FINISHED:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.bm.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error
        req.times.finished = time.perf_counter()

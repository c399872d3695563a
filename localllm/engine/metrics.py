"""Engine-level counters read by `bench`, `/metrics` and the chat statistics.

`EngineStats` is updated by the engine after each step. `engine_snapshot` turns it and the
scheduler / block manager state into an immutable `EngineSnapshot`; `request_metrics` does the
same for one request's `RequestTimes`. Snapshots are plain values, safe to hand to any thread.
`engine_snapshot` reads any object with the `EngineParts` attributes (an `LLMEngine` has them),
so this module does not import the engine.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from localllm.engine.block_manager import BlockManager
from localllm.engine.request import RequestStatus, RequestTimes
from localllm.engine.scheduler import Scheduler


@dataclass
class EngineStats:
    steps: int = 0
    tokens: int = 0  # tokens computed (prefill + decode) over all steps
    preemptions: int = 0
    last_step_tokens: int = 0
    tokens_per_step: list[int] = field(default_factory=list)

    def record_step(self, num_tokens: int, num_preempted: int) -> None:
        self.steps += 1
        self.tokens += num_tokens
        self.preemptions += num_preempted
        self.last_step_tokens = num_tokens
        if len(self.tokens_per_step) < 100_000:
            self.tokens_per_step.append(num_tokens)


@dataclass(frozen=True)
class EngineSnapshot:
    num_blocks: int
    used_blocks: int  # blocks referenced by a live request (cached free blocks do not count)
    num_running: int
    num_waiting: int  # includes preempted requests waiting to be recomputed
    num_preempted: int  # waiting requests that were preempted at least once
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of those, tokens whose K/V were reused
    steps: int
    tokens: int  # tokens computed over all steps
    last_step_tokens: int
    preemptions: int

    @property
    def kv_utilization(self) -> float:
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0


class EngineParts(Protocol):
    """What `engine_snapshot` reads of an engine."""

    @property
    def bm(self) -> BlockManager: ...

    @property
    def scheduler(self) -> Scheduler: ...

    @property
    def stats(self) -> EngineStats: ...


def engine_snapshot(engine: EngineParts) -> EngineSnapshot:
    """Read on the thread that steps the engine (or while it is idle)."""
    bm, sched, st = engine.bm, engine.scheduler, engine.stats
    waiting = list(sched.waiting)
    return EngineSnapshot(
        num_blocks=bm.num_blocks,
        used_blocks=bm.num_blocks - bm.num_free_blocks,
        num_running=sum(1 for r in sched.running if r.status is RequestStatus.RUNNING),
        num_waiting=len(waiting),
        num_preempted=sum(1 for r in waiting if r.status is RequestStatus.PREEMPTED),
        prefix_queries=bm.prefix_queries,
        prefix_hits=bm.prefix_hits,
        steps=st.steps,
        tokens=st.tokens,
        last_step_tokens=st.last_step_tokens,
        preemptions=st.preemptions,
    )


class RequestMetrics(NamedTuple):
    queue_time: float | None  # seconds from arrival to first scheduled
    ttft: float | None  # seconds from arrival to first token
    e2e: float | None  # seconds from arrival to finish
    mean_itl: float | None  # mean seconds between consecutive tokens
    num_tokens: int


def request_metrics(times: RequestTimes) -> RequestMetrics:
    itl = times.itl
    return RequestMetrics(times.queue_time, times.ttft, times.e2e,
                          statistics.fmean(itl) if itl else None, len(times.token_times))


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated q-th percentile (0..100) of a non-empty list."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1 in the denominator, as llama-bench reports)
    of a non-empty list; the deviation of one value is 0."""
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values, mean) if len(values) > 1 else 0.0

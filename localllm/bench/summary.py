"""What a serving run measured: latency statistics, throughput, goodput, prefix-cache hits."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from localllm.bench.timeline import EngineSample, RequestTimeline
from localllm.engine.metrics import percentile


class Stat(NamedTuple):
    mean: float
    p50: float
    p90: float
    p99: float


def stat(values: Sequence[float]) -> Stat | None:
    """Mean and linear-interpolated percentiles; None for no values."""
    if not values:
        return None
    xs = list(values)
    return Stat(statistics.fmean(xs), percentile(xs, 50), percentile(xs, 90), percentile(xs, 99))


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in seconds (None: not set). A request meets them when its TTFT,
    its largest inter-token gap, its TPOT and its E2E latency are each within the set limit."""

    ttft: float | None = None
    itl: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.ttft, self.itl, self.tpot, self.e2e))

    def met_by(self, r: RequestTimeline) -> bool:
        if not r.ok:
            return False
        # a one-token reply has no gap and no TPOT to miss
        checks = ((self.ttft, r.ttft), (self.itl, max(r.itls, default=0.0)),
                  (self.tpot, 0.0 if r.tpot is None else r.tpot), (self.e2e, r.e2e))
        return all(limit is None or (v is not None and v <= limit) for limit, v in checks)


class ServeSummary(NamedTuple):
    completed: int
    failed: int
    duration: float  # from the first arrival to the last stream's end (seconds)
    input_tokens: int  # of completed requests, where the server said
    output_tokens: int  # of completed requests
    request_throughput: float  # completed requests / duration
    output_throughput: float  # output tokens / duration
    per_request_throughput: Stat | None  # each request's output tokens / its E2E latency
    ttft: Stat | None
    itl: Stat | None  # over every gap of every request
    tpot: Stat | None
    e2e: Stat | None
    good: int | None  # completed requests that met every SLO; None: no SLO set
    goodput: float | None  # good / duration (requests/s)
    prefix_hit_rate: float | None  # cached / prompt tokens over the requests that report both


def run_duration(records: Sequence[RequestTimeline]) -> float:
    ends = [r.finished if r.finished is not None else max(r.chunk_times, default=r.sent)
            for r in records]
    return max(ends, default=0.0) - min((r.arrival for r in records), default=0.0)


def summarize(records: Sequence[RequestTimeline], slo: Slo = Slo()) -> ServeSummary:
    done = [r for r in records if r.ok]
    duration = run_duration(records)
    per_s = duration if duration > 0 else float("inf")
    out = sum(r.output_tokens for r in done)
    with_usage = [r for r in done if r.prompt_tokens is not None and r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens or 0 for r in with_usage)
    good = sum(slo.met_by(r) for r in done) if slo.any else None
    return ServeSummary(
        completed=len(done), failed=len(records) - len(done), duration=duration,
        input_tokens=sum(r.prompt_tokens or 0 for r in done), output_tokens=out,
        request_throughput=len(done) / per_s, output_throughput=out / per_s,
        per_request_throughput=stat([r.output_tokens / r.e2e for r in done
                                     if r.e2e and r.e2e > 0]),
        ttft=stat([r.ttft for r in done if r.ttft is not None]),
        itl=stat([g for r in done for g in r.itls]),
        tpot=stat([t for r in done if (t := r.tpot) is not None]),
        e2e=stat([r.e2e for r in done if r.e2e is not None]),
        good=good, goodput=None if good is None else good / per_s,
        prefix_hit_rate=(sum(r.cached_tokens or 0 for r in with_usage) / prompt
                         if prompt else None),
    )


class EngineSummary(NamedTuple):
    samples: int
    kv_mean: float
    kv_peak: float
    running_mean: float
    running_peak: int
    waiting_mean: float
    waiting_peak: int
    preemptions: int  # during the run


def summarize_engine(samples: Sequence[EngineSample]) -> EngineSummary | None:
    if not samples:
        return None
    return EngineSummary(
        len(samples), statistics.fmean(s.kv_utilization for s in samples),
        max(s.kv_utilization for s in samples), statistics.fmean(s.running for s in samples),
        max(s.running for s in samples), statistics.fmean(s.waiting for s in samples),
        max(s.waiting for s in samples), samples[-1].preemptions - samples[0].preemptions)

"""One benchmark request's raw timeline, and the engine state sampled beside the run.

Every time is in seconds from the start of the run, as the client saw it (the moment each
streamed delta arrived), which is how `vllm bench serve` measures too: the figures include the
transport and the server's own queueing, and read the same for the in-process engine and for
any OpenAI-compatible server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class RequestTimeline:
    index: int
    arrival: float  # when the workload meant to send it
    sent: float  # when it was sent (later than arrival while --concurrency slots were all busy)
    chunk_times: tuple[float, ...]  # arrival of each streamed delta that carried tokens
    chunk_tokens: tuple[int, ...]  # tokens of each such delta
    finished: float | None  # end of the stream; None: it failed or was interrupted
    output_tokens: int  # the server's count where it gave one, else sum(chunk_tokens)
    prompt_tokens: int | None = None  # None: the server did not say
    cached_tokens: int | None = None  # prompt tokens served from a prefix cache
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finished is not None and bool(self.chunk_times)

    @property
    def ttft(self) -> float | None:
        """Time to first token: from sending the request to its first streamed token."""
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        """End-to-end latency: from sending the request to the end of its stream."""
        return None if self.finished is None else self.finished - self.sent

    @property
    def itls(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive token-carrying deltas."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (output tokens - 1)."""
        if not self.ok or self.output_tokens < 2:
            return None
        assert self.e2e is not None and self.ttft is not None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def wait(self) -> float:
        """Time the client held the request back for a free --concurrency slot."""
        return self.sent - self.arrival


class EngineSample(NamedTuple):
    t: float  # seconds from the start of the run
    kv_utilization: float  # fraction of KV blocks held by live requests
    running: int
    waiting: int  # preempted requests included
    preemptions: int  # cumulative since the engine started

"""Request state. Only the scheduler changes `status`; only the block manager changes
`block_table` and `block_hashes`."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from localllm.config import SamplingParams
from localllm.engine.draw import DrawStream


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class RequestTimes:
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


_ids = itertools.count()


class Request:
    def __init__(self, prompt_ids: list[int], params: SamplingParams,
                 request_id: str | None = None, arrival: float | None = None) -> None:
        self.request_id = request_id if request_id is not None else f"req-{next(_ids)}"
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # of those, taken from the prefix cache at admission
        self.num_preemptions = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # hash of each full block of block_table, in order
        # block_table[:n] were released: behind every layer's sliding window (see BlockManager)
        self.num_released_blocks = 0
        self.times = RequestTimes(arrival if arrival is not None else time.perf_counter())
        # the random draws of a request that samples (the seed's, else a random stream)
        self.draws = None if params.greedy else DrawStream(params.seed)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end], without copying the rest (a decode step's one token)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n:end - n]
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.value}, prompt={len(self.prompt_ids)}, "
                f"out={len(self.output_ids)}, computed={self.num_computed_tokens})")

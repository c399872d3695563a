"""One streamed chat reply: it goes to stdout as it comes, and what was shown is kept when the
reply is cancelled; `ReplyStats` are what `/stats` shows."""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass

from localllm.client import Client
from localllm.config import SamplingParams


@dataclass(frozen=True)
class ReplyStats:
    tokens: int
    ttft: float | None  # seconds from sending to the first text
    seconds: float  # sending to the end
    decode_rate: float  # tokens/s after the first
    prompt_tokens: int | None
    cached_tokens: int | None
    finish: str  # stop, length, interrupted, error

    def line(self) -> str:
        first = f", first after {self.ttft:.2f} s" if self.ttft is not None else ""
        return f"[{self.tokens} tokens{first}, {self.decode_rate:.1f} tokens/s]"

    def table(self) -> str:
        def known(v: object) -> str:
            return "unknown" if v is None else str(v)

        ttft = "none" if self.ttft is None else f"{self.ttft:.3f} s"
        rows = [("reply tokens", f"{self.tokens} in {self.seconds:.2f} s ({self.finish})"),
                ("first token", ttft), ("tokens/s", f"{self.decode_rate:.1f}"),
                ("prompt tokens", known(self.prompt_tokens)),
                ("cached tokens", known(self.cached_tokens))]
        return "\n".join(f"{k:<15}{v}" for k, v in rows)


class Reply:
    """What one streamed reply has shown so far (kept when it is cancelled)."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.tokens = 0
        self.start = time.perf_counter()
        self.first: float | None = None
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.finish = "stop"
        self.error: str | None = None

    async def stream(self, client: Client, prompt: list[dict[str, str]],
                     params: SamplingParams) -> None:
        # a Client's streams are async generators (typed as iterators): aclose() aborts
        stream = client.stream_chat(prompt, params)
        async with contextlib.aclosing(stream) as deltas:
            async for d in deltas:
                if d.text:
                    if self.first is None:
                        self.first = time.perf_counter()
                    self.parts.append(d.text)
                    sys.stdout.write(d.text)
                    sys.stdout.flush()
                self.tokens += d.tokens
                if d.usage is not None:
                    self.prompt_tokens, self.cached_tokens = (d.usage.prompt_tokens,
                                                              d.usage.cached_tokens)
                    self.tokens = d.usage.completion_tokens
                self.finish = d.finish_reason or self.finish

    def stats(self) -> ReplyStats:
        end = time.perf_counter()
        first = self.first
        rate = ((self.tokens - 1) / (end - first) if first is not None and self.tokens > 1
                and end > first else 0.0)
        return ReplyStats(self.tokens, None if first is None else first - self.start,
                          end - self.start, rate, self.prompt_tokens, self.cached_tokens,
                          self.finish)

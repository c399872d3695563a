"""Engine-level counters read by `bench`, `/metrics` and the chat statistics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    steps: int = 0
    tokens: int = 0  # tokens computed (prefill + decode) over all steps
    preemptions: int = 0
    tokens_per_step: list[int] = field(default_factory=list)

    def record_step(self, num_tokens: int, num_preempted: int) -> None:
        self.steps += 1
        self.tokens += num_tokens
        self.preemptions += num_preempted
        if len(self.tokens_per_step) < 100_000:
            self.tokens_per_step.append(num_tokens)

"""What `localllm summarize` says on stderr while it runs: a tqdm bar on a terminal (files
done, elapsed and time left, output tokens/s), one plain line per finished file otherwise.
Skip and failure lines go above the bar."""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

from tqdm import tqdm


def _columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError):
        return 0


class Progress:
    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.total, self.done = total, 0
        self.t0 = time.perf_counter()
        self.bar: tqdm | None = None
        if total and self.stream.isatty():
            sized = _columns(self.stream) > 0  # a pseudo-terminal may have no size
            self.bar = tqdm(total=total, unit="file", file=self.stream, dynamic_ncols=sized,
                            ncols=None if sized else 100, nrows=None if sized else 24,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} files "
                            "[{elapsed}<{remaining}{postfix}]")

    def say(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def rate(self, output_tokens: int) -> float:
        elapsed = time.perf_counter() - self.t0
        return output_tokens / elapsed if elapsed > 0 else 0.0

    def tick(self, output_tokens: int) -> None:
        """Refresh the tokens/s figure (called every half second while the run is on)."""
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.rate(output_tokens):.0f} tokens/s", refresh=True)

    def finished(self, name: str, detail: str, output_tokens: int) -> None:
        self.done += 1
        if self.bar is not None:
            self.tick(output_tokens)
            self.bar.update(1)
        else:
            self.say(f"[{self.done}/{self.total}] {name}: {detail}")

    def failed(self, name: str, reason: str) -> None:
        self.done += 1
        self.say(f"localllm: failed {name}: {reason}")
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

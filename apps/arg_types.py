"""argparse `type=` checks shared by the subcommands: a value out of range is refused while the
arguments are parsed, with argparse's one-line usage error (`argument --threads: must be at
least 1, got -3`), before anything loads."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None


def at_least(low: int) -> Callable[[str], int]:
    """A whole number >= `low`."""
    def parse(text: str) -> int:
        n = _whole(text)
        if n < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return n
    return parse


def positive_number(text: str) -> float:
    """A finite number > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return v


def tcp_port(text: str) -> int:
    """A TCP port: 1..65535, or 0 for any free one (the startup line shows which)."""
    n = _whole(text)
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in 1..65535 (0: any free "
                                         f"port), got {text}")
    return n

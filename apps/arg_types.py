"""argparse `type=` checks shared by the subcommands: a value out of range is refused while the
arguments are parsed, with argparse's one-line usage error (`argument --threads: must be at
least 1, got -3`), before anything loads."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
SIZE_UNITS = {"b": 1, "k": KIB, "m": MIB, "g": GIB, "t": TIB,
              "kib": KIB, "mib": MIB, "gib": GIB, "tib": TIB,
              "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


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


def byte_size(bare: int, bare_name: str) -> Callable[[str], int]:
    """A size in bytes, > 0: `4G`, `4GiB` (binary: K, M, G, T and KiB...), `4GB` (decimal: KB,
    MB, GB, TB), `512b`, or a bare number of `bare` bytes each (`bare_name`)."""
    def parse(text: str) -> int:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
        unit = m.group(2).lower() if m else ""
        if m is None or (unit and unit not in SIZE_UNITS):
            raise argparse.ArgumentTypeError(
                f"not a size: {text!r} (such as 4G, 512M or 8GB; a bare number is "
                f"{bare_name})")
        value = float(m.group(1)) * (SIZE_UNITS[unit] if unit else bare)
        if not math.isfinite(value) or value < 1:
            raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text}")
        return math.ceil(value)
    return parse

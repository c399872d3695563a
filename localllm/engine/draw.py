"""The random draw of a sampled token: each request's own stream, and the draw among a row's
candidates.

A request that samples has a `DrawStream`: draw n of the stream with key K takes
u = mix(K ^ mix(n)) >> 11, times 2^-53 (SplitMix64's mix), a number in [0, 1) that depends on
nothing but the key and n. The key is the request's seed (else 64 random bits), so a seeded
request draws the same tokens alone or in any batch, one step a call or several steps in one
native call, and after a preemption.

`draw_index` picks among candidate logits v[0] >= v[1] >= ... in doubles:
p[i] = exp((v[i] - v[0]) / T); tokens are kept from the first while the mass before a token is
below top_p of the whole, p[i] >= min_p (min-p against the best, whose p is 1) and p[i] > 0; the
token is the first whose running sum passes u times the kept sum. The CPU's native kernels
repeat it operation for operation (kernels/cpu_sample.c: the same libm exp, the same order),
so a draw gives the same token there; `draw_sorted` is the same rule over a whole sorted
vocabulary in PyTorch (top-k off), which no native call runs.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence

import torch

MASK = (1 << 64) - 1


def _mix(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def draw_u(key: int, n: int) -> float:
    """Draw n of stream `key`: a number in [0, 1), a multiple of 2^-53."""
    return (_mix(key ^ _mix(n & MASK)) >> 11) * 2.0 ** -53


class DrawStream:
    """A sampling request's draws: `next()` gives draw `count` and counts it."""

    def __init__(self, seed: int | None) -> None:
        self.key = seed & MASK if seed is not None else secrets.randbits(64)
        self.count = 0

    def next(self) -> float:
        u = draw_u(self.key, self.count)
        self.count += 1
        return u


def weights(values: Sequence[float], temperature: float) -> list[float]:
    """p[i] = exp((v[i] - v[0]) / T) of candidate logits `values`, largest first."""
    top = values[0]
    return [math.exp((v - top) / temperature) for v in values]


def kept(p: Sequence[float], top_p: float, min_p: float) -> int:
    """How many of the candidates with weights `p` (`weights`) top-p and min-p keep (>= 1)."""
    total = 0.0
    for x in p:
        total += x
    limit = top_p * total
    mass = 0.0
    n = 0
    for x in p:
        if n and (mass >= limit or x < min_p or x == 0.0):
            break
        mass += x
        n += 1
    return n


def draw_index(values: Sequence[float], temperature: float, top_p: float, min_p: float,
               u: float) -> int:
    """The drawn position among candidate logits `values`, largest first (at least one)."""
    p = weights(values, temperature)
    n = kept(p, top_p, min_p)
    mass = 0.0
    for x in p[:n]:
        mass += x
    r = u * mass
    acc = 0.0
    for i in range(n):
        acc += p[i]
        if acc > r:
            return i
    return n - 1


def draw_sorted(values: torch.Tensor, temperature: float, top_p: float, min_p: float,
                u: float) -> int:
    """`draw_index` over fp32 logits [n] sorted largest first, in float64 PyTorch ops (sums
    rounded in another order: the same rule, not always the same last bits)."""
    v = values.double()
    p = torch.exp((v - v[0]) / temperature)
    cum = torch.cumsum(p, 0)
    before = cum - p
    keep = (before < top_p * cum[-1]) & (p >= min_p) & (p > 0)
    keep[0] = True
    n = int(keep.long().cumprod(0).sum())
    r = u * float(cum[n - 1])
    return min(int(torch.searchsorted(cum[:n], torch.tensor([r], dtype=torch.float64),
                                      right=True)), n - 1)

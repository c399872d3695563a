"""What limits latency in a serving run, read from its timelines and engine samples.

Signals (`signals`), each from what the run recorded:

- waiting share: the share of engine samples with a request waiting; with KV room: the share
  where one waited while the KV cache was under 90% full (it waited for a batch slot or the
  step's token budget, not for memory).
- KV peak and preemptions over the run.
- prefill ITL ratio: the mean inter-token gap that overlaps another request's prefill (its
  span from being sent to its first token) over the mean gap that overlaps none; prefill
  time share: the share of all time between tokens spent in such gaps. Deltas under 1 ms
  apart count as one arrival and a gap is divided by the tokens its arrival brought: with
  several decode steps to a call (--decode-steps) tokens come in bursts, and a raw gap would
  set one call's time beside a near-zero gap inside a burst.
- batch ITL ratio: among gaps that overlap no prefill, the mean gap at the largest decode
  batch seen (requests between their first token and their end) over the mean at the
  smallest (batch sizes with at least 2 such gaps and 5% of them). Means, not medians: a
  client that reads a burst of queued deltas sees near-zero gaps, which a mean averages out.
- CPU share (in-process only): the CPU time the process got over the time it had work (samples
  with a request running or waiting) times its engine threads: well under 1 when other
  processes take the cores.

Verdicts (`diagnose`), most specific first, at most two:

- kv-capacity: preemptions, or a KV peak of 95% or more with requests waiting in 10% of samples.
- cpu-contention: a CPU share under 60%.
- queueing: requests waiting with KV room in 20% of samples or more (without engine samples:
  mean TTFT at least 3x the smallest TTFT, a client-side estimate).
- prefill-interference: prefill ITL ratio >= 2 and prefill time share >= 20%.
- compute: batch ITL ratio >= 1.5 with requests waiting in under 20% of samples.
Else: none (the machine has headroom at this load).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from localllm.bench.timeline import EngineSample, RequestTimeline

KV_FULL = 0.95
KV_ROOM = 0.9
BURST = 1e-3  # seconds: deltas closer than this arrived together


class Signals(NamedTuple):
    samples: int
    waiting_share: float | None
    waiting_with_kv_room_share: float | None
    kv_peak: float | None
    preemptions: int | None
    ttft_mean_over_min: float | None
    prefill_itl_ratio: float | None
    prefill_time_share: float | None
    batch_lo: int | None
    batch_hi: int | None
    batch_itl_ratio: float | None
    cpu_share: float | None = None


def cpu_share(cpu_seconds: float, wall: float, threads: int,
              samples: Sequence[EngineSample]) -> float | None:
    """CPU time over the busy wall time x threads; busy: the share of samples with work."""
    if not samples or wall <= 0 or threads <= 0:
        return None
    busy = sum(s.running + s.waiting > 0 for s in samples) / len(samples)
    return cpu_seconds / (wall * busy * threads) if busy else None


class Finding(NamedTuple):
    kind: str  # kv-capacity, queueing, prefill-interference, compute, none
    evidence: str
    advice: str

    def line(self) -> str:
        label = {"none": "no limit reached", "cpu-contention": "cpu-contention"}.get(
            self.kind, f"{self.kind}-bound")
        return f"{label}: {self.evidence}; {self.advice}"


def _arrivals(r: RequestTimeline) -> tuple[np.ndarray, np.ndarray]:
    """A stream's token arrivals as (times, tokens): deltas under BURST apart are one arrival,
    so tokens a decode call made together (--decode-steps) count as one step's worth."""
    t = np.asarray(r.chunk_times, dtype=float)
    k = np.asarray(r.chunk_tokens, dtype=float)
    start = np.concatenate(([True], np.diff(t) >= BURST))
    group = np.cumsum(start) - 1
    return t[start], np.bincount(group, weights=k)


def _gap_tables(records: Sequence[RequestTimeline]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every gap between arrivals: (its length per token it brought, overlaps another
    prefill, decode batch at its middle)."""
    ok = [r for r in records if r.chunk_times]
    pre = np.array([(r.sent, r.chunk_times[0]) for r in ok], dtype=float).reshape(-1, 2)
    dec = np.array([(r.chunk_times[0], r.chunk_times[-1]) for r in ok], dtype=float
                   ).reshape(-1, 2)
    lengths, overlaps, batch = [], [], []
    for i, r in enumerate(ok):
        t, k = _arrivals(r)
        if len(t) < 2:
            continue
        a, b = t[:-1, None], t[1:, None]  # [gaps, 1]
        hit = (pre[None, :, 0] < b) & (pre[None, :, 1] > a)  # [gaps, requests]
        hit[:, i] = False
        mid = (a + b) / 2
        lengths.append((t[1:] - t[:-1]) / np.maximum(k[1:], 1))
        overlaps.append(hit.any(axis=1))
        batch.append(((dec[None, :, 0] <= mid) & (dec[None, :, 1] >= mid)).sum(axis=1))
    if not lengths:
        return np.zeros(0), np.zeros(0, dtype=bool), np.zeros(0, dtype=int)
    return np.concatenate(lengths), np.concatenate(overlaps), np.concatenate(batch)


def signals(records: Sequence[RequestTimeline], samples: Sequence[EngineSample],
            cpu: float | None = None) -> Signals:
    """`cpu`: the CPU share (`cpu_share`), where known."""
    n = len(samples)
    waiting = sum(s.waiting > 0 for s in samples) / n if n else None
    room = sum(s.waiting > 0 and s.kv_utilization < KV_ROOM for s in samples) / n if n else None
    ttfts = [t for r in records if r.ok and (t := r.ttft) is not None]
    over_min = (statistics.fmean(ttfts) / min(ttfts)) if ttfts and min(ttfts) > 0 else None
    gaps, overlap, batch = _gap_tables(records)
    ratio = tail = None
    if overlap.any() and (~overlap).any() and np.median(gaps[~overlap]) > 0:
        ratio = float(np.median(gaps[overlap]) / np.median(gaps[~overlap]))
        tail = float(gaps[overlap].sum() / gaps.sum())
    lo = hi = bratio = None
    quiet, qbatch = gaps[~overlap], batch[~overlap]
    sizes, counts = np.unique(qbatch, return_counts=True)
    sizes = sizes[counts >= max(2, 0.05 * len(quiet))]
    if len(sizes):
        lo, hi = int(sizes.min()), int(sizes.max())
        if hi > lo and quiet[qbatch == lo].mean() > 0:
            bratio = float(quiet[qbatch == hi].mean() / quiet[qbatch == lo].mean())
    return Signals(n, waiting, room, max((s.kv_utilization for s in samples), default=None),
                   samples[-1].preemptions - samples[0].preemptions if n else None,
                   over_min, ratio, tail, lo, hi, bratio, cpu)


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def diagnose(s: Signals, local: bool, request_rate: float | None = None) -> list[Finding]:
    """At most two findings, the most specific first. `local`: name this program's settings
    (else a server's); `request_rate`: completed requests/s, quoted as what the machine
    sustains."""
    out: list[Finding] = []
    waiting = s.waiting_share or 0.0
    if (s.preemptions or 0) > 0 or (s.kv_peak is not None and s.kv_peak >= KV_FULL
                                    and waiting >= 0.1):
        out.append(Finding(
            "kv-capacity",
            f"the KV cache peaked at {_pct(s.kv_peak or 0)} full with {s.preemptions or 0} "
            f"preemptions and requests waiting in {_pct(waiting)} of samples",
            "give the KV cache more memory (--kv-cache-memory GiB) or send fewer requests at "
            "once (--concurrency / --request-rate)" if local else
            "give the server's KV cache more memory (vLLM --gpu-memory-utilization, "
            "llama-server --ctx-size) or send fewer requests at once (--concurrency)"))
    elif s.cpu_share is not None and s.cpu_share < 0.6:
        out.append(Finding(
            "cpu-contention",
            f"the engine got {_pct(s.cpu_share)} of the CPU time its threads could use: "
            "other processes take the cores",
            "stop them, or compare figures only within one run (with more --threads than "
            "free cores, its threads also wait on each other)"))
    elif (s.waiting_with_kv_room_share or 0) >= 0.2 or (
            s.samples == 0 and (s.ttft_mean_over_min or 0) >= 3):
        rate = f" (it completes {request_rate:.2f} requests/s)" if request_rate else ""
        evidence = (f"requests waited with the KV cache under {_pct(KV_ROOM)} full in "
                    f"{_pct(s.waiting_with_kv_room_share or 0)} of samples" if s.samples else
                    f"mean TTFT is {s.ttft_mean_over_min:.1f}x the smallest (client-side "
                    "estimate: the server exports no queue length)")
        out.append(Finding(
            "queueing", evidence + ", so TTFT is mostly time in the queue",
            f"send fewer at once (--concurrency / --request-rate){rate}, or "
            + ("let more run at once (--max-num-seqs)" if local else
               "raise the server's batch limit (vLLM --max-num-seqs, llama-server --parallel)")))
    if (s.prefill_itl_ratio or 0) >= 2 and (s.prefill_time_share or 0) >= 0.2:
        out.append(Finding(
            "prefill-interference",
            f"gaps between tokens are {s.prefill_itl_ratio:.1f}x longer while another "
            f"request's prompt is processed: {_pct(s.prefill_time_share or 0)} of all time "
            "between tokens",
            "take prompts in smaller chunks between decode steps (--max-num-batched-tokens)"
            if local else "lower the server's prefill chunk (vLLM --max-num-batched-tokens "
            "with chunked prefill)"))
    if (len(out) < 2 and (s.batch_itl_ratio or 0) >= 1.5 and waiting < 0.2
            and not any(f.kind == "queueing" for f in out)):
        out.append(Finding(
            "compute",
            f"the inter-token gap grows {s.batch_itl_ratio:.1f}x from {s.batch_lo} to "
            f"{s.batch_hi} requests decoding at once, with no queue and KV room",
            "the machine's compute is the limit: a bigger machine (more cores, a GPU), or "
            "fewer requests at once for lower latency (--concurrency)"))
    if not out:
        growth = (f"the gap between tokens changes {s.batch_itl_ratio:.1f}x from {s.batch_lo} "
                  f"to {s.batch_hi} requests decoding" if s.batch_itl_ratio is not None else
                  "one decode batch size only")
        kv = f", the KV cache peaked at {_pct(s.kv_peak)}" if s.kv_peak is not None else ""
        out.append(Finding(
            "none", f"requests waited in {_pct(waiting)} of samples{kv}, {growth}",
            "raise --concurrency or --request-rate to find this machine's limit"))
    return out[:2]

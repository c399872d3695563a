"""`bench serve`'s arithmetic on synthetic timelines: every expected figure is worked out by
hand in the comments (percentiles interpolate linearly between sorted values)."""

from __future__ import annotations

import pytest

from localllm.bench.diagnosis import cpu_share, diagnose, signals
from localllm.bench.summary import Slo, summarize, summarize_engine
from localllm.bench.timeline import EngineSample, RequestTimeline

approx = pytest.approx

# R0: sent at once; tokens at 0.1 0.2 0.3 0.4  -> TTFT 0.1, gaps .1 .1 .1, TPOT .3/3 = .1
# R1: arrives at 0 but is sent at 0.5 (no free slot); tokens 1+1+2 at 0.8 0.9 1.3
#     -> TTFT 0.3, gaps .1 .4, E2E 0.8, TPOT (0.8 - 0.3) / 3 = 0.1667
# R2: one token at 2.0 after being sent at 1.0 -> TTFT 1.0, no gap, E2E 1.0, no TPOT
# R3: failed
RECORDS = [
    RequestTimeline(0, 0.0, 0.0, (0.1, 0.2, 0.3, 0.4), (1, 1, 1, 1), 0.4, 4, 10, 0, "length"),
    RequestTimeline(1, 0.0, 0.5, (0.8, 0.9, 1.3), (1, 1, 2), 1.3, 4, 10, 5, "length"),
    RequestTimeline(2, 1.0, 1.0, (2.0,), (1,), 2.0, 1, 20, 10, "length"),
    RequestTimeline(3, 1.5, 1.5, (), (), None, 0, None, None, None, "boom"),
]


def test_timeline_figures() -> None:
    r0, r1, r2, r3 = RECORDS
    assert (r0.ttft, r1.ttft, r2.ttft, r3.ttft) == (approx(0.1), approx(0.3), 1.0, None)
    assert r1.itls == [approx(0.1), approx(0.4)] and r2.itls == []
    assert (r0.tpot, r1.tpot, r2.tpot) == (approx(0.1), approx(0.5 / 3), None)
    assert (r1.e2e, r1.wait) == (approx(0.8), 0.5)
    assert not r3.ok and r3.tpot is None


def test_summary_equals_hand_computation() -> None:
    s = summarize(RECORDS)
    # the run lasts from the first arrival (0) to the last end (R2 at 2.0)
    assert (s.completed, s.failed, s.duration) == (3, 1, 2.0)
    assert (s.output_tokens, s.input_tokens) == (9, 40)
    assert (s.output_throughput, s.request_throughput) == (4.5, 1.5)
    # TTFT .1 .3 1.0: mean .4667; p90 at position 1.8: .3 + .8 * .7 = .86; p99: .3 + .98 * .7
    assert s.ttft == approx((1.4 / 3, 0.3, 0.86, 0.986))
    # ITL .1 .1 .1 .1 .4: mean .16; p90 at position 3.6: .1 + .6 * .3 = .28; p99: .1 + .96 * .3
    assert s.itl == approx((0.16, 0.1, 0.28, 0.388))
    # TPOT .1 and .1667: mean = p50 = .1333; p90 at 0.9: .1 + .9 * .0667 = .16
    assert s.tpot == approx((0.4 / 3, 0.4 / 3, 0.16, 0.1 + 0.99 * (0.5 / 3 - 0.1)))
    # E2E .4 .8 1.0: p90 at 1.8: .8 + .8 * .2 = .96; p99 at 1.98: .8 + .98 * .2 = .996
    assert s.e2e == approx((2.2 / 3, 0.8, 0.96, 0.996))
    # per request 4/.4 = 10, 4/.8 = 5, 1/1 = 1 tokens/s
    assert s.per_request_throughput == approx((16 / 3, 5.0, 9.0, 9.9))
    assert s.prefix_hit_rate == approx(15 / 40)
    assert s.good is None and s.goodput is None  # no SLO set


@pytest.mark.parametrize(("slo", "good"), [
    (Slo(ttft=0.5), 2),  # R2's TTFT is 1.0
    (Slo(ttft=0.5, itl=0.2), 1),  # R1 has a 0.4 gap
    (Slo(tpot=0.15), 2),  # R1's TPOT is .1667; R2 has one token, so no TPOT to miss
    (Slo(e2e=0.9), 2),  # R2's E2E is 1.0
    (Slo(ttft=0.5, tpot=0.2, e2e=0.9), 2),
    (Slo(ttft=0.05), 0),
])
def test_goodput_counts_requests_meeting_every_slo(slo: Slo, good: int) -> None:
    s = summarize(RECORDS, slo)
    assert s.good == good
    assert s.goodput == good / 2.0  # over the 2-second run; the failed R3 never counts


def test_engine_summary() -> None:
    samples = [EngineSample(0.0, 0.1, 1, 0, 0), EngineSample(0.5, 0.5, 2, 1, 0),
               EngineSample(1.0, 0.3, 1, 0, 1)]
    e = summarize_engine(samples)
    assert e is not None
    assert (e.kv_mean, e.kv_peak) == (approx(0.3), 0.5)
    assert (e.running_mean, e.running_peak) == (approx(4 / 3), 2)
    assert (e.waiting_mean, e.waiting_peak, e.preemptions) == (approx(1 / 3), 1, 1)
    assert summarize_engine([]) is None


def _rec(i: int, sent: float, chunks: tuple[float, ...]) -> RequestTimeline:
    return RequestTimeline(i, sent, sent, chunks, (1,) * len(chunks), chunks[-1], len(chunks))


def _samples(rows: list[tuple[float, int, int]]) -> list[EngineSample]:
    """(kv utilization, waiting, cumulative preemptions), 50 ms apart, 4 running."""
    return [EngineSample(0.05 * i, kv, 4, w, p) for i, (kv, w, p) in enumerate(rows)]


def test_kv_capacity_bound() -> None:
    sig = signals([_rec(0, 0.0, (1.0, 2.0, 3.0))],
                  _samples([(0.9, 0, 0), (1.0, 2, 1), (1.0, 2, 2)]))
    assert (sig.kv_peak, sig.preemptions) == (1.0, 2)
    [kv] = diagnose(sig, local=True)
    assert kv.kind == "kv-capacity"
    assert "--kv-cache-memory" in kv.advice and "2 preemptions" in kv.evidence


def test_queueing_bound() -> None:
    # waiting in 3 of 5 samples, each with the KV cache at most 60% full
    sig = signals([_rec(0, 0.0, (1.0, 2.0, 3.0))],
                  _samples([(0.3, 2, 0), (0.3, 2, 0), (0.6, 1, 0), (0.6, 0, 0), (0.2, 0, 0)]))
    assert (sig.waiting_share, sig.waiting_with_kv_room_share) == (0.6, 0.6)
    [q] = diagnose(sig, local=False, request_rate=1.25)
    assert q.kind == "queueing" and "60% of samples" in q.evidence
    assert "1.25 requests/s" in q.advice and "--max-num-seqs" in q.advice


# A decodes at 1..5 and 8..10; B is sent at 5 and its prompt takes until 8, so A's gap (5, 8)
# is 3 while every other gap is 1. B then decodes at 8, 9, 10 beside A.
PREFILL = [_rec(0, 0.0, (1.0, 2.0, 3.0, 4.0, 5.0, 8.0, 9.0, 10.0)),
           _rec(1, 5.0, (8.0, 9.0, 10.0))]


def test_prefill_interference_bound() -> None:
    sig = signals(PREFILL, [])
    # overlapping gaps: [3]; the other 8 gaps are 1 -> ratio 3, and 3 of the 11 seconds
    # between tokens (A: 1 1 1 1 3 1 1, B: 1 1) are spent in it
    assert (sig.prefill_itl_ratio, sig.prefill_time_share) == (3.0, 3 / 11)
    # quiet gaps at batch 1 (A alone: 4 gaps) and 2 (A and B: 4 gaps), all 1 -> mean ratio 1
    assert (sig.batch_lo, sig.batch_hi, sig.batch_itl_ratio) == (1, 2, 1.0)
    assert sig.ttft_mean_over_min == 2.0  # TTFT 1 and 3: no queueing estimate
    [p] = diagnose(sig, local=True)
    assert p.kind == "prefill-interference" and "3.0x" in p.evidence and "27%" in p.evidence
    assert "--max-num-batched-tokens" in p.advice


def test_compute_bound() -> None:
    # A alone: gaps 1, 1; B sent at 3 (its prompt overlaps A's gap 3..5, left out); then both
    # decode with gaps of 2 (A: 5-7-9, B: 4.5-6.5-8.5) -> mean 2 at batch 2 vs 1 at batch 1
    recs = [_rec(0, 0.0, (1.0, 2.0, 3.0, 5.0, 7.0, 9.0)), _rec(1, 3.0, (4.5, 6.5, 8.5))]
    sig = signals(recs, _samples([(0.2, 0, 0)] * 4))
    assert (sig.batch_lo, sig.batch_hi, sig.batch_itl_ratio) == (1, 2, 2.0)
    # overlapping [2] vs others 1 1 2 2 2 2 (median 2); 2 of the 12 seconds between tokens
    assert (sig.prefill_itl_ratio, sig.prefill_time_share) == (1.0, 2 / 12)
    [c] = diagnose(sig, local=True)
    assert c.kind == "compute" and "2.0x from 1 to 2" in c.evidence


def test_tokens_in_bursts_count_per_token() -> None:
    # several decode steps to a call: A's tokens arrive 4 at a time (microseconds apart), one
    # call a second; B's prompt (sent at 2.2, first token at 2.9) overlaps only A's gap 2..3.
    # Raw gaps would set that whole second beside the near-zero gaps inside bursts; per token
    # every gap is 1/4 s, so nothing is slower while B's prompt runs.
    a = tuple(t + k * 1e-6 for t in (1.0, 2.0, 3.0, 4.0, 5.0) for k in range(4))
    sig = signals([_rec(0, 0.0, a), _rec(1, 2.2, (2.9, 3.9))], [])
    assert sig.prefill_itl_ratio == approx(1.0)
    assert all(f.kind != "prefill-interference" for f in diagnose(sig, local=True))
    # one delta carrying 4 tokens counts the same as 4 deltas in a burst
    t = (1.0, 2.0, 3.0, 4.0, 5.0)
    a4 = RequestTimeline(0, 0.0, 0.0, t, (4,) * 5, 5.0, 20)
    assert signals([a4, _rec(1, 2.2, (2.9, 3.9))], []).prefill_itl_ratio == approx(1.0)
    # and a slower gap still shows: 2 s for A's 4 tokens while B's prompt runs
    a4 = RequestTimeline(0, 0.0, 0.0, (1.0, 2.0, 4.0, 5.0, 6.0), (4,) * 5, 6.0, 20)
    assert signals([a4, _rec(1, 2.2, (3.9, 4.9))], []).prefill_itl_ratio == approx(2.0)


def test_nothing_limits_a_light_load() -> None:
    sig = signals([_rec(0, 0.0, (1.0, 2.0, 3.0))], _samples([(0.1, 0, 0)] * 3))
    assert sig.batch_itl_ratio is None and sig.prefill_itl_ratio is None
    [n] = diagnose(sig, local=True)
    assert n.kind == "none" and n.line().startswith("no limit reached")


def test_cpu_contention() -> None:
    # work in 3 of 4 samples over a 2 s run: 1.5 busy seconds x 2 threads = 3 CPU seconds
    # could be used; 1.2 were had -> 40%
    samples = [EngineSample(0.0, 0.1, 1, 0, 0), EngineSample(0.5, 0.1, 0, 1, 0),
               EngineSample(1.0, 0.1, 2, 0, 0), EngineSample(1.5, 0.1, 0, 0, 0)]
    share = cpu_share(1.2, 2.0, 2, samples)
    assert share == approx(0.4)
    [c] = diagnose(signals([_rec(0, 0.0, (1.0, 2.0))], samples, share), local=True)
    assert c.kind == "cpu-contention" and "40%" in c.evidence
    assert c.line().startswith("cpu-contention: the engine got 40%")
    assert cpu_share(1.2, 2.0, 2, []) is None

"""Sampler, the draw (localllm/engine/draw.py), apply_repetition_penalty and SamplingParams
validation.

No model: synthetic logits and `Request` objects. `filter_ref` is the plain definition of top-k,
top-p and min-p over a whole vocabulary that the draw's candidates must follow.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from localllm.backends.cpu import CpuBackend
from localllm.config import SamplingParams
from localllm.engine.draw import (
    DrawStream,
    draw_index,
    draw_sorted,
    draw_u,
    kept,
    weights,
)
from localllm.engine.request import Request
from localllm.engine.sampler import Sampler, apply_repetition_penalty
from localllm.errors import RequestError

NEG_INF = float("-inf")


def req(prompt: list[int] | None = None, **kw: object) -> Request:
    return Request(prompt or [0], SamplingParams(**kw))  # type: ignore[arg-type]


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32)


def finite(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits)).flatten().tolist())


def filter_ref(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Excluded tokens set to -inf: top-k, then top-p (a token goes when the tokens ranked above
    it already reach top_p), then min-p (below min_p times the best's probability), over the
    whole vocabulary. logits: [vocab], already divided by the temperature."""
    if 0 < top_k < logits.shape[-1]:
        top = torch.topk(logits, top_k)
        logits = torch.full_like(logits, NEG_INF).scatter(-1, top.indices, top.values)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[0] = False
        logits = logits.clone()
        logits[order[drop]] = NEG_INF
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), NEG_INF)
    return logits


def kept_tokens(logits: torch.Tensor, top_k: int, top_p: float, min_p: float,
                temperature: float = 1.0) -> set[int]:
    """The tokens the draw may pick: its candidates (top-k, else the whole vocabulary, best
    first) cut by `kept`."""
    order = torch.sort(logits, descending=True, stable=True).indices
    if 0 < top_k < logits.shape[-1]:
        order = order[:top_k]
    n = kept(weights(logits[order].tolist(), temperature), top_p, min_p)
    return set(order[:n].tolist())


def draws(logits: torch.Tensor, r: Request, n: int) -> list[int]:
    sampler = Sampler(CpuBackend())
    return [sampler(logits[None], [r])[0] for _ in range(n)]


# ------------------------------------------------------------------------ greedy


def test_greedy_is_argmax() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 100, generator=g)
    reqs = [req(temperature=0) for _ in range(5)]
    assert Sampler(CpuBackend())(logits, reqs) == logits.argmax(-1).tolist()


def test_temperature_zero_is_greedy_and_has_no_draw_stream() -> None:
    p = SamplingParams(temperature=0)
    assert p.greedy
    assert req(temperature=0).draws is None
    assert req(temperature=0.5, top_k=1).draws is None
    assert SamplingParams(temperature=0.5, top_k=1).greedy
    assert not SamplingParams(temperature=0.5).greedy


def test_greedy_mixed_with_sampled_rows_stays_argmax() -> None:
    # one sampled request in the batch takes the per-row path; greedy rows must still be argmax
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=g)
    reqs = [req(temperature=0), req(temperature=1.0, seed=3), req(temperature=0.7, top_k=1)]
    for _ in range(20):
        out = Sampler(CpuBackend())(logits, reqs)
        assert out[0] == int(logits[0].argmax())
        assert out[2] == int(logits[2].argmax())


def test_tiny_temperature_behaves_like_greedy() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(64, generator=g)
    top = int(logits.argmax())
    # make the margin to the runner-up at least 0.1 so that T=1e-3 leaves e^-100 for the rest
    logits[top] = logits.max() + 0.1
    assert set(draws(logits, req(temperature=1e-3, seed=0), 200)) == {top}


def test_extremely_small_temperature_is_greedy_not_an_error() -> None:
    logits = torch.tensor([10.0, 5.0, 1.0])
    assert draws(logits, req(temperature=1e-38, seed=0), 3) == [0, 0, 0]


# ------------------------------------------------------------------------ seeds


def test_same_seed_same_draws_different_seed_differs() -> None:
    logits = torch.zeros(10)  # uniform: 30 draws collide by chance with probability 1e-30
    a = draws(logits, req(temperature=1.0, seed=42), 30)
    b = draws(logits, req(temperature=1.0, seed=42), 30)
    c = draws(logits, req(temperature=1.0, seed=43), 30)
    assert a == b
    assert a != c


def test_draws_do_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(3)
    row = torch.randn(32, generator=g)
    params = {"temperature": 0.9, "top_p": 0.95, "seed": 7}

    alone_req = req(**params)
    alone = [Sampler(CpuBackend())(row[None], [alone_req])[0] for _ in range(40)]

    batch_req = req(**params)
    others = [req(temperature=1.2, seed=1), req(temperature=0), req(temperature=0.8)]
    batch = torch.stack([torch.randn(32, generator=g), row, torch.randn(32, generator=g),
                         torch.randn(32, generator=g)])
    in_batch = []
    for _ in range(40):
        out = Sampler(CpuBackend())(batch, [others[0], batch_req, others[1], others[2]])
        in_batch.append(out[1])
    assert in_batch == alone


def test_unseeded_requests_get_independent_generators() -> None:
    logits = torch.zeros(1000)
    a = draws(logits, req(temperature=1.0), 10)
    b = draws(logits, req(temperature=1.0), 10)
    assert a != b


def test_draw_streams_are_counted_and_keyed() -> None:
    a, b, c = DrawStream(5), DrawStream(5), DrawStream(6)
    xs = [a.next() for _ in range(20000)]
    assert xs[:50] == [b.next() for _ in range(50)]
    assert xs[:50] != [c.next() for _ in range(50)]
    assert a.count == 20000 and b.count == 50
    assert xs[7] == draw_u(5, 7) and DrawStream(-1).key == 2**64 - 1
    assert all(0.0 <= x < 1.0 and (x * 2**53).is_integer() for x in xs)
    assert 0.49 < sum(xs) / len(xs) < 0.51
    assert len(set(xs)) == len(xs)


def test_draw_is_the_inverse_cdf_of_the_kept_mass() -> None:
    values = logits_of([0.5, 0.3, 0.2]).tolist()  # best first
    picks = [draw_index(values, 1.0, 1.0, 0.0, u) for u in (0.0, 0.49, 0.51, 0.79, 0.81, 0.999)]
    assert picks == [0, 0, 1, 1, 2, 2]
    # top-p 0.6 keeps 0.5 and 0.3 (the mass before 0.2 is 0.8): u splits 0.8 as 0.5 : 0.3
    assert [draw_index(values, 1.0, 0.6, 0.0, u) for u in (0.6, 0.65, 0.999)] == [0, 1, 1]
    # tokens of probability 0 are never drawn, even at u just below 1
    assert draw_index([1.0, NEG_INF, NEG_INF], 1.0, 1.0, 0.0, 1 - 2**-53) == 0


def test_draw_over_a_whole_sorted_vocabulary_is_the_same_rule() -> None:
    g = torch.Generator().manual_seed(21)
    for t in range(40):
        row = torch.sort(torch.randn(300, generator=g) * 3, descending=True).values
        temp, top_p, min_p = 0.3 + t / 20, (0.5, 0.9, 1.0)[t % 3], (0.0, 0.01, 0.1)[t % 3]
        for n in range(25):
            u = draw_u(t, n)
            assert draw_sorted(row, temp, top_p, min_p, u) == \
                draw_index(row.tolist(), temp, top_p, min_p, u)


# ------------------------------------------------------------------------ draw statistics


def _frequencies(logits: torch.Tensor, r: Request, n: int = 2000) -> list[float]:
    counts = Counter(draws(logits, r, n))
    return [counts.get(i, 0) / n for i in range(logits.shape[0])]


def test_draw_frequencies_match_probabilities() -> None:
    probs = [0.2, 0.5, 0.3]
    freq = _frequencies(logits_of(probs), req(temperature=1.0, seed=11))
    assert freq == pytest.approx(probs, abs=0.05)


def test_temperature_sharpens_and_flattens() -> None:
    probs = [0.2, 0.5, 0.3]
    for t in (0.5, 2.0):
        expected = torch.tensor(probs).pow(1 / t)
        expected = (expected / expected.sum()).tolist()
        freq = _frequencies(logits_of(probs), req(temperature=t, seed=12))
        assert freq == pytest.approx(expected, abs=0.05), t


def test_top_k_renormalizes_the_survivors() -> None:
    probs = [0.2, 0.5, 0.3]
    freq = _frequencies(logits_of(probs), req(temperature=1.0, top_k=2, seed=13))
    assert freq == pytest.approx([0.0, 0.5 / 0.8, 0.3 / 0.8], abs=0.05)
    assert freq[0] == 0.0


# ------------------------------------------------------------------------ top-k


def test_top_k_draws_stay_within_top_k() -> None:
    logits = torch.linspace(0.0, 1.0, 20)  # nearly flat: every survivor gets drawn
    top = set(torch.topk(logits, 4).indices.tolist())
    got = draws(logits, req(temperature=1.0, top_k=4, seed=5), 400)
    assert set(got) == top


# ------------------------------------------------------------------------ top-p


# probabilities deliberately out of rank order: ranks 3 > 0 > 4 > 1 > 2
TOP_P_PROBS = [0.25, 0.1, 0.05, 0.45, 0.15]


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.01, {3}),  # the top token is always kept
        (0.40, {3}),
        (0.45 - 1e-3, {3}),
        (0.50, {3, 0}),
        (0.70 - 1e-3, {3, 0}),
        (0.75, {3, 0, 4}),
        (0.90, {3, 0, 4, 1}),
        (0.99, {3, 0, 4, 1, 2}),
        (1.0, {3, 0, 4, 1, 2}),
    ],
)
def test_top_p_keeps_smallest_set_reaching_p(top_p: float, expected: set[int]) -> None:
    assert kept_tokens(logits_of(TOP_P_PROBS), 0, top_p, 0.0) == expected
    assert finite(filter_ref(logits_of(TOP_P_PROBS), 0, top_p, 0.0)) == expected


def test_top_p_keeps_top_token_even_when_it_is_tiny() -> None:
    logits = torch.zeros(100)
    logits[17] = 0.01  # top token with about 1% of the mass
    assert kept_tokens(logits, 0, 0.005, 0.0) == {17}


def test_top_p_after_top_k_uses_the_renormalized_mass() -> None:
    # after top-k=2 the survivors are 0.45/0.7 and 0.25/0.7 = 0.64, 0.36
    assert kept_tokens(logits_of(TOP_P_PROBS), 2, 0.6, 0.0) == {3}
    assert kept_tokens(logits_of(TOP_P_PROBS), 2, 0.7, 0.0) == {3, 0}


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(-8, 8, allow_nan=False), min_size=2, max_size=40, unique=True),
    top_p=st.floats(0.01, 0.99),
)
def test_top_p_property(values: list[float], top_p: float) -> None:
    logits = torch.tensor(values, dtype=torch.float64)
    probs = logits.softmax(-1)
    keep = kept_tokens(logits, 0, top_p, 0.0)
    assert int(logits.argmax()) in keep
    # the kept set is a prefix of the ranking ...
    assert all(probs[i] >= probs[j] for i in keep for j in set(range(len(values))) - keep)
    # ... that reaches top_p, and is the smallest such prefix
    mass = float(probs[list(keep)].sum())
    smallest = float(probs[list(keep)].min())
    assert mass >= top_p - 1e-9 or len(keep) == len(values)
    assert len(keep) == 1 or mass - smallest < top_p + 1e-9


# ------------------------------------------------------------------------ min-p


def test_min_p_drops_tokens_below_min_p_times_max() -> None:
    probs = [0.05, 0.5, 0.3, 0.15]
    assert kept_tokens(logits_of(probs), 0, 1.0, min_p=0.2) == {1, 2, 3}  # < 0.1 out
    assert kept_tokens(logits_of(probs), 0, 1.0, min_p=0.5) == {1, 2}  # < 0.25 out
    assert kept_tokens(logits_of(probs), 0, 1.0, min_p=1.0) == {1}
    assert kept_tokens(logits_of(probs), 0, 1.0, min_p=0.0) == {0, 1, 2, 3}
    for min_p in (0.0, 0.2, 0.5, 1.0):
        assert finite(filter_ref(logits_of(probs), 0, 1.0, min_p)) == \
            kept_tokens(logits_of(probs), 0, 1.0, min_p)


def test_min_p_draws() -> None:
    probs = [0.05, 0.5, 0.3, 0.15]
    got = set(draws(logits_of(probs), req(temperature=1.0, min_p=0.5, seed=9), 300))
    assert got == {1, 2}


# ------------------------------------------------------------------------ repetition penalty


def test_repetition_penalty_divides_positive_multiplies_negative_seen_only() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5, 0.0])
    before = logits.clone()
    out = apply_repetition_penalty(logits, [0, 1, 0, 5, 1], penalty=2.0)
    assert out.tolist() == [1.0, -4.0, 1.0, -1.0, 0.5, 0.0]  # each seen token penalized once
    assert torch.equal(logits, before)  # the input is not modified
    assert apply_repetition_penalty(logits, [0, 1], 1.0) is logits
    assert apply_repetition_penalty(logits, [], 2.0) is logits


def test_repetition_penalty_in_sampler_uses_prompt_and_output() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.6]])
    r = req(prompt=[0], temperature=0, repetition_penalty=2.0)
    assert Sampler(CpuBackend())(logits, [r]) == [1]  # [1.5, 2.0, 1.6]
    r.output_ids.append(1)
    assert Sampler(CpuBackend())(logits, [r]) == [2]  # [1.5, 1.0, 1.6]
    # without the penalty the same tokens give plain argmax
    assert Sampler(CpuBackend())(logits, [req(prompt=[0, 1], temperature=0)]) == [0]


def test_repetition_penalty_applies_before_sampling() -> None:
    logits = torch.tensor([5.0, 0.0, 0.0, 0.0])
    r = req(prompt=[0], temperature=1.0, repetition_penalty=100.0, seed=1)
    # 5/100 = 0.05: token 0 drops from ~98% to ~26%
    freq = Counter(draws(logits, r, 400))
    assert freq[0] / 400 < 0.4


# ------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, r"temperature must be >= 0, got -0\.1"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0\.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1\.5"),
        ({"max_tokens": 0}, r"max_tokens must be at least 1, got 0"),
        ({"top_k": -1}, r"top_k must be >= 0, got -1"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be positive"),
        ({"stop": ("ok", "")}, r"stop strings must not be empty"),
        ({"stop": ""}, r"stop strings must not be empty"),
        # NaN passes every comparison: refused as not finite, as is infinity
        ({"temperature": float("nan")}, r"temperature must be a finite number, got nan"),
        ({"temperature": float("inf")}, r"temperature must be a finite number, got inf"),
        ({"top_p": float("nan")}, r"top_p must be a finite number, got nan"),
        ({"min_p": float("nan")}, r"min_p must be a finite number, got nan"),
        ({"repetition_penalty": float("nan")},
         r"repetition_penalty must be a finite number, got nan"),
        ({"repetition_penalty": float("inf")},
         r"repetition_penalty must be a finite number, got inf"),
    ],
)
def test_sampling_params_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(RequestError, match=message) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_sampling_params_normalizes_stop() -> None:
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=[5]).stop_token_ids == (5,)  # type: ignore[arg-type]


def test_top_k_draws_follow_the_fully_filtered_distribution(cpu_path: str) -> None:
    # with top-k, the sampler filters and draws among the k candidates only: the frequencies
    # must still be those of top-k -> top-p -> min-p over the whole vocabulary
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(200, generator=g) * 2
    r = req(temperature=0.9, top_k=6, top_p=0.9, min_p=0.08, seed=13)
    want = filter_ref(logits / 0.9, 6, 0.9, 0.08).softmax(-1)
    freq = _frequencies(logits, r, n=4000)
    assert freq == pytest.approx(want.tolist(), abs=0.03)

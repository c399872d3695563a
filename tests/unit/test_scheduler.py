"""Scheduler and block manager without a model: budgets, chunking, prefix hits, preemption,
and a property test that no block is ever leaked or double-owned."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from localllm.config import SamplingParams, SchedulerConfig
from localllm.engine.block_manager import BlockManager
from localllm.engine.request import FinishReason, Request, RequestStatus
from localllm.engine.scheduler import Scheduler

EOS = 0


def make(num_blocks: int, block_size: int = 4, budget: int = 32, max_seqs: int = 8,
         chunked: bool = True, max_len: int = 1024) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, "test-model")
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                          enable_chunked_prefill=chunked)
    return Scheduler(cfg, bm, max_len)


def fake_token(req: Request) -> int:
    # deterministic "model": next token depends on the whole sequence
    return 1 + (sum(req.all_token_ids) * 31 + req.num_tokens) % 97


def step(s: Scheduler) -> list[Request]:
    out = s.schedule()
    sampled = {x.request.request_id: fake_token(x.request) for x in out.scheduled if x.samples}
    finished = s.update(out, sampled, frozenset({EOS}))
    s.bm.check_invariants(s.running)
    return finished


def run_all(s: Scheduler, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not s.has_unfinished():
            return
        step(s)
    raise AssertionError("requests did not finish")


def test_decodes_go_first_and_prompt_is_chunked() -> None:
    s = make(num_blocks=64, budget=8)
    a = Request(list(range(1, 4)), SamplingParams(max_tokens=5, temperature=0))
    s.add(a)
    step(s)  # a prefilled (3 tokens) and sampled its first token
    b = Request(list(range(1, 21)), SamplingParams(max_tokens=2, temperature=0))
    s.add(b)
    out = s.schedule()
    assert [(x.request is a, x.num_new_tokens) for x in out.scheduled] == [(True, 1), (False, 7)]
    assert out.scheduled[1].samples is False  # a partial prefill samples nothing
    s.update(out, {a.request_id: 5}, frozenset())
    out = s.schedule()  # decode of a again first, then the next chunk of b
    assert out.scheduled[0].request is a and out.scheduled[1].num_new_tokens == 7


def test_reserve_ahead_caps_steps_and_takes_blocks_only_when_all_fit() -> None:
    s = make(num_blocks=8, block_size=4, max_len=14)
    a = Request([1, 2, 3], SamplingParams(max_tokens=20, temperature=0))
    b = Request([4, 5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0))
    s.add(a)
    s.add(b)
    step(s)  # both prefilled, one token each: a 4 tokens (1 block), b 6 (2 blocks)
    out = s.schedule()
    assert [x.num_new_tokens for x in out.scheduled] == [1, 1]
    # b may sample 2 more tokens before max_tokens: 2 steps, blocks through position 6 of b
    assert s.reserve_ahead(out, 8) == 2
    assert [len(r.block_table) for r in (a, b)] == [2, 2]
    s.update(out, {a.request_id: 9, b.request_id: 9}, frozenset())
    s.update(out, {a.request_id: 9, b.request_id: 9}, frozenset())  # b ends on max_tokens
    assert b.is_finished and len(a.output_ids) == 3
    out = s.schedule()
    # a alone: its context (14) caps it at 14 - 6 = 8 steps, and one step is not reserved
    assert s.reserve_ahead(out, 20) == 8 and len(a.block_table) == 4
    assert s.reserve_ahead(out, 1) == 1
    s.bm.check_invariants(s.running)
    # a pool without the blocks for every request's steps: one step, nothing taken
    t = make(num_blocks=3, block_size=4)
    c = Request([1, 2, 3], SamplingParams(max_tokens=20, temperature=0))
    t.add(c)
    step(t)
    out = t.schedule()
    assert t.reserve_ahead(out, 16) == 1 and len(c.block_table) == 1
    assert t.reserve_ahead(out, 8) == 8 and len(c.block_table) == 3
    # blocks one request holds for steps that did not run are not the others' to use
    u = make(num_blocks=4, block_size=4)
    a = Request([1, 2, 3, 4, 5], SamplingParams(max_tokens=20, temperature=0))
    b = Request([1, 2], SamplingParams(max_tokens=4, temperature=0))
    u.add(a)
    u.add(b)
    step(u)  # a: 6 tokens (2 blocks), b: 3 (1 block); 1 block free
    assert u.bm.allocate(a, 4)  # a's blocks for 4 steps that did not run (a failed call)
    out = u.schedule()
    assert [len(r.block_table) for r in (a, b)] == [3, 1] and u.bm.num_free_blocks == 0
    # 3 steps (b's max_tokens) need no block more for a and one more for b: none is free
    assert u.reserve_ahead(out, 4) == 1 and len(b.block_table) == 1
    assert u.reserve_ahead(out, 2) == 2  # within b's block


def test_prefix_blocks_are_shared_and_reused_after_finish() -> None:
    s = make(num_blocks=32)
    prompt = list(range(1, 18))  # 4 full blocks of 4 + 1 token
    a = Request(prompt, SamplingParams(max_tokens=1, temperature=0))
    s.add(a)
    run_all(s)
    b = Request(prompt + [50, 51], SamplingParams(max_tokens=1, temperature=0))
    s.add(b)
    step(s)
    assert b.num_cached_tokens == 16
    assert s.bm.prefix_hits == 16


def test_preemption_recomputes_and_frees_everything() -> None:
    s = make(num_blocks=6, block_size=4, budget=64)
    reqs = [Request([i + 1] * 6, SamplingParams(max_tokens=8, temperature=0)) for i in range(3)]
    for r in reqs:
        s.add(r)
    run_all(s)
    assert s.num_preemptions > 0
    assert all(r.finish_reason is FinishReason.LENGTH and len(r.output_ids) == 8 for r in reqs)
    assert s.bm.num_free_blocks == s.bm.num_blocks


def test_same_outputs_with_and_without_pressure() -> None:
    def outputs(num_blocks: int, budget: int) -> list[list[int]]:
        s = make(num_blocks=num_blocks, budget=budget)
        reqs = [Request([3 + i] * (5 + 3 * i), SamplingParams(max_tokens=6 + i, temperature=0))
                for i in range(4)]
        for r in reqs:
            s.add(r)
        run_all(s)
        return [r.output_ids for r in reqs]

    assert outputs(64, 64) == outputs(8, 5)


@settings(max_examples=60, deadline=None)
@given(
    num_blocks=st.integers(6, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(1, 40),
    max_seqs=st.integers(1, 6),
    chunked=st.booleans(),
    plan=st.lists(
        st.tuples(
            st.integers(0, 6),  # arrival step
            st.lists(st.integers(1, 5), min_size=1, max_size=20),  # prompt (small vocab)
            st.integers(1, 10),  # max_tokens
            st.one_of(st.none(), st.integers(0, 12)),  # cancel at step
        ),
        min_size=1, max_size=8,
    ),
)
def test_random_workloads_never_leak_or_double_own_blocks(
        num_blocks: int, block_size: int, budget: int, max_seqs: int, chunked: bool,
        plan: list[tuple[int, list[int], int, int | None]]) -> None:
    s = make(num_blocks, block_size, budget, max_seqs, chunked)
    reqs: list[tuple[int, Request, int | None]] = []
    for arrival, prompt, max_tokens, cancel in plan:
        if s.bm.blocks_needed(len(prompt) + max_tokens) > num_blocks:
            max_tokens = 1
            prompt = prompt[: max(1, (num_blocks - 1) * block_size)]
        reqs.append((arrival, Request(prompt, SamplingParams(max_tokens=max_tokens,
                                                             temperature=0)), cancel))
    for t in range(2000):
        for arrival, req, cancel in reqs:
            if arrival == t:
                s.add(req)
            if cancel == t and req.status is not RequestStatus.FINISHED and arrival <= t:
                s.finish(req, FinishReason.ABORT)
        if t > 6 and not s.has_unfinished():
            break
        step(s)
        live = s.running + list(s.waiting)
        s.bm.check_invariants(live)
        assert sum(len(r.block_table) for r in s.waiting) == 0
    assert not s.has_unfinished()
    for _, req, _ in reqs:
        assert req.status is RequestStatus.FINISHED
        if req.finish_reason is FinishReason.LENGTH:
            assert len(req.output_ids) == req.params.max_tokens
    assert s.bm.num_free_blocks == num_blocks
    s.bm.check_invariants([])


@given(st.lists(st.integers(0, 99), min_size=1, max_size=12),
       st.lists(st.integers(0, 99), max_size=12), st.data())
@settings(max_examples=200, deadline=None)
def test_token_ids_is_a_slice_of_all_token_ids(prompt: list[int], output: list[int],
                                               data: st.DataObject) -> None:
    req = Request(prompt, SamplingParams(max_tokens=20, temperature=0))
    req.output_ids = list(output)
    n = len(prompt) + len(output)
    start = data.draw(st.integers(0, n))
    end = data.draw(st.integers(start, n))
    assert req.token_ids(start, end) == req.all_token_ids[start:end]

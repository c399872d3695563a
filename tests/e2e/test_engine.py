"""The engine on real models: greedy outputs must not depend on batching, arrival times,
chunked prefill, the prefix cache or preemption (fp32 compute), plus abort, over-long prompts
and a failure confined to one request; in bf16, greedy tokens of the default model must not
depend on batching either."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from localllm import LLM, CacheConfig, RequestError, SamplingParams, SchedulerConfig
from localllm.engine.engine import TokenLogprobs
from localllm.engine.request import Request
from localllm.engine.scheduler import ScheduledRequest

STORIES_TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    "Tom had a big red ball. He liked to play with it in the park every day with his dog.",
    "The sun was hot.",
    "One day, a cat and a bird were friends. They went to the forest to find a big tree. The "
    "bird said, \"Let's fly to the top!\" The cat was sad because it could not fly.",
    "Mom made a cake for Sam. It was sweet and soft.",
    "There was a boy who loved to look at the stars at night with his grandpa.",
]


class Job:
    def __init__(self, prompt: list[int], max_tokens: int, arrival_step: int = 0) -> None:
        self.prompt = prompt
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        self.arrival_step = arrival_step


def make_llm(path: Path, dtype: str = "float32", budget: int = 512, num_blocks: int = 0,
             max_seqs: int = 16) -> LLM:
    return LLM(path, dtype=dtype, cache=CacheConfig(num_blocks=num_blocks),
               scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget))


def run_alone(llm: LLM, jobs: Sequence[Job]) -> list[list[int]]:
    return [llm.generate([j.prompt], j.params)[0].token_ids for j in jobs]


def run_staggered(llm: LLM, jobs: Sequence[Job]) -> list[Request]:
    """Add each job at its arrival step, step until all finish, check blocks at every step."""
    eng = llm.engine
    reqs: list[Request | None] = [None] * len(jobs)
    step = 0
    while step <= max(j.arrival_step for j in jobs) or eng.has_unfinished():
        for i, j in enumerate(jobs):
            if j.arrival_step == step:
                reqs[i] = eng.add_request(j.prompt, j.params)
        eng.step()
        eng.bm.check_invariants(eng.scheduler.running)
        step += 1
        assert step < 10_000
    assert all(r is not None and r.finish_reason is not None for r in reqs)
    return [r for r in reqs if r is not None]


def stories_jobs(llm: LLM) -> list[Job]:
    lens = [40, 25, 60, 17, 33, 48]
    return [Job(llm.encode(t), n, arrival_step=3 * i) for i, (t, n) in
            enumerate(zip(STORIES_TEXTS, lens))]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def stories(stories_path: Path) -> LLM:
    return make_llm(stories_path)


@pytest.fixture(scope="module")
def stories_alone(stories: LLM) -> list[list[int]]:
    return run_alone(stories, stories_jobs(stories))


def test_staggered_batch_matches_alone(stories_path: Path, stories_alone: list[list[int]]
                                       ) -> None:
    llm = make_llm(stories_path)
    reqs = run_staggered(llm, stories_jobs(llm))
    assert llm.engine.stats.tokens_per_step and max(llm.engine.stats.tokens_per_step) > 1
    for r, alone in zip(reqs, stories_alone):
        assert r.output_ids == alone, r.request_id


def test_all_at_once_matches_alone(stories_path: Path, stories_alone: list[list[int]]) -> None:
    llm = make_llm(stories_path)
    jobs = stories_jobs(llm)
    outs = llm.generate([j.prompt for j in jobs[:1]], jobs[0].params)  # warm, alone
    assert outs[0].token_ids == stories_alone[0]
    reqs = [llm.engine.add_request(j.prompt, j.params) for j in jobs]
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert [r.output_ids for r in reqs] == stories_alone


def test_chunked_prefill_matches_unchunked(stories_path: Path,
                                           stories_alone: list[list[int]]) -> None:
    llm = make_llm(stories_path, budget=16)
    reqs = run_staggered(llm, stories_jobs(llm))
    assert max(llm.engine.stats.tokens_per_step) <= 16
    assert [r.output_ids for r in reqs] == stories_alone


def test_prefix_cache_hit_matches_cold(stories_path: Path) -> None:
    llm = make_llm(stories_path)
    long_prompt = llm.encode(" ".join(STORIES_TEXTS * 2))
    assert len(long_prompt) > 100
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    cold = llm.engine.add_request(long_prompt, params)
    while llm.engine.has_unfinished():
        llm.engine.step()
    warm = llm.engine.add_request(long_prompt, params)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens >= len(long_prompt) - llm.engine.block_size
    assert warm.output_ids == cold.output_ids
    snap = llm.engine.snapshot()
    assert snap.prefix_hits == warm.num_cached_tokens
    assert 0.4 < snap.prefix_hit_rate < 0.5
    # a third prompt sharing only part of the prefix reuses those blocks
    branch = long_prompt[:70] + llm.encode("The dog ran away.")[1:]
    fresh = make_llm(stories_path)
    assert (llm.generate([branch], params)[0].token_ids
            == fresh.generate([branch], params)[0].token_ids)


def test_preemption_matches_unpreempted(stories_path: Path,
                                        stories_alone: list[list[int]]) -> None:
    # each job fits alone (<= 6 blocks of 16) but not all at once
    llm = make_llm(stories_path, num_blocks=10)
    jobs = stories_jobs(llm)
    for j in jobs:
        j.arrival_step = 0
    reqs = run_staggered(llm, jobs)
    assert llm.engine.stats.preemptions > 0
    assert sum(r.num_preemptions for r in reqs) == llm.engine.stats.preemptions
    assert [r.output_ids for r in reqs] == stories_alone
    assert llm.engine.bm.num_free_blocks == llm.engine.bm.num_blocks
    # a lookup retried while the pool is full counts once per admission
    snap = llm.engine.snapshot()
    assert snap.prefix_queries <= sum(len(r.prompt_ids) + r.num_preemptions * r.num_tokens
                                      for r in reqs)


def test_sequence_longer_than_kv_pool_stops_with_length(stories_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    llm = make_llm(stories_path, num_blocks=2)  # 32 tokens
    # said at start: float32 stories260K KV is 5 layers x 2 x 4 heads x 8 x 4 bytes a token;
    # a whole 2048-token context is 2.5 MiB = 0.0024 GiB
    assert ("the KV cache holds 32 tokens, fewer than the 2048-token context: a request stops "
            "there (finish reason length); --kv-cache-memory 0.01 holds a whole context"
            in caplog.text)
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    req = llm.engine.add_request(llm.encode("Once upon a time"), params)
    for _ in range(100):
        if req.is_finished:
            break
        llm.engine.step()
    assert req.finish_reason is not None and req.finish_reason.value == "length"
    assert req.num_tokens == 32 and req.num_preemptions == 0
    with pytest.raises(RequestError, match="KV cache holds only 32"):
        llm.engine.add_request([1] * 40, params)


def test_combined_default_model(smollm_path: Path) -> None:
    """Staggered arrivals, chunked prefill, a shared prefix and preemption on SmolLM2."""
    llm = make_llm(smollm_path, budget=32, num_blocks=5)
    system = llm.encode_chat([{"role": "system", "content": "You are a terse assistant."},
                              {"role": "user", "content": "Name a color."}])
    other = llm.encode("The capital of France is")
    jobs = [Job(system, 12, 0), Job(other, 16, 1), Job(system, 12, 2)]
    alone = run_alone(llm, jobs)
    llm2 = make_llm(smollm_path, budget=32, num_blocks=5)
    reqs = run_staggered(llm2, jobs)
    assert reqs[2].num_cached_tokens > 0
    assert llm2.engine.stats.preemptions > 0
    assert [r.output_ids for r in reqs] == alone


def test_abort_mid_generation_frees_every_block(stories: LLM) -> None:
    eng = stories.engine
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    a = eng.add_request(stories.encode(STORIES_TEXTS[3]), params)
    b = eng.add_request(stories.encode(STORIES_TEXTS[1]), params)
    for _ in range(5):
        eng.step()
    assert a.block_table and b.block_table and eng.bm.num_free_blocks < eng.bm.num_blocks
    eng.abort(a.request_id)
    outs = eng.step()
    assert any(o.request_id == a.request_id and o.finish_reason == "abort" for o in outs)
    assert a.block_table == [] and len(b.output_ids) == 6
    eng.abort(b.request_id)
    eng.step()
    assert not eng.has_unfinished()
    assert eng.bm.num_free_blocks == eng.bm.num_blocks
    eng.bm.check_invariants([])


def test_prompt_longer_than_context_is_refused(stories: LLM) -> None:
    n = stories.engine.max_model_len
    with pytest.raises(RequestError, match=rf"prompt has {n + 5} tokens .* context holds {n}"):
        stories.engine.add_request([1] * (n + 5), SamplingParams())
    with pytest.raises(RequestError, match=rf"\({n + 5 - n + 1} too many"):
        stories.engine.check_prompt([1] * (n + 5))
    with pytest.raises(RequestError, match="prompt is empty"):
        stories.engine.add_request([], SamplingParams())
    assert not stories.engine.has_unfinished()


def run_logged(llm: LLM, prompts: list[list[int]], params: SamplingParams
               ) -> tuple[list[tuple[list[int], list[TokenLogprobs]]], list[Request]]:
    """The prompts added at once and run to the end: each one's tokens and log-probabilities,
    and the requests."""
    reqs = [llm.engine.add_request(p, params) for p in prompts]
    got: dict[str, tuple[list[int], list[TokenLogprobs]]] = {r.request_id: ([], []) for r in reqs}
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            got[out.request_id][0].extend(out.token_ids)
            got[out.request_id][1].extend(out.logprobs or [])
    return [got[r.request_id] for r in reqs], reqs


def first_logprobs(llm: LLM, ids: list[int], params: SamplingParams) -> TokenLogprobs:
    req = llm.engine.add_request(ids, params)
    outs = []
    while not req.is_finished:
        outs += [o for o in llm.engine.step() if o.request_id == req.request_id]
    assert outs[0].logprobs is not None
    return outs[0].logprobs[0]


def test_logprobs_are_the_models_distribution(stories: LLM) -> None:
    """Each sampled token's log-probability and the top ones, as the model gives them before
    temperature: the same when recomputed from the prefix alone, and under a high temperature."""
    prompt = stories.encode(STORIES_TEXTS[0])
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3)
    req = stories.engine.add_request(prompt, params)
    lps: list[TokenLogprobs] = []
    while not req.is_finished:
        for out in stories.engine.step():
            assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
            lps += out.logprobs
    assert [lp.token_id for lp in lps] == req.output_ids
    hot = SamplingParams(max_tokens=1, temperature=5.0, top_k=2, seed=0, logprobs=3)
    for k, lp in enumerate(lps):
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy: the most likely
        assert lp.logprob == pytest.approx(lp.top[0][1]) and lp.logprob <= 0
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert sum(math.exp(v) for _, v in lp.top) <= 1 + 1e-6
        again = first_logprobs(stories, prompt + req.output_ids[:k], hot)
        assert [i for i, _ in again.top] == [i for i, _ in lp.top]
        assert [v for _, v in again.top] == pytest.approx([v for _, v in lp.top], abs=1e-4)
    plain = stories.generate([prompt], SamplingParams(max_tokens=4, temperature=0))[0]
    assert plain.token_ids == req.output_ids[:len(plain.token_ids)]


def test_failure_in_one_request_ends_only_that_one(stories_path: Path,
                                                   stories_alone: list[list[int]],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    llm = make_llm(stories_path)
    jobs = stories_jobs(llm)[:3]
    runner = llm.engine.runner
    execute = runner.execute
    calls = {"n": 0}

    def flaky(batch: list[ScheduledRequest]) -> tuple[torch.Tensor, list[Request]]:
        calls["n"] += 1
        if any(s.request.request_id == "bad" for s in batch) and calls["n"] > 4:
            raise RuntimeError("injected failure")
        return execute(batch)

    monkeypatch.setattr(runner, "execute", flaky)
    reqs = [llm.engine.add_request(j.prompt, j.params) for j in jobs]
    bad = llm.engine.add_request(jobs[0].prompt, jobs[0].params, request_id="bad")
    outs = []
    while llm.engine.has_unfinished():
        outs += llm.engine.step()
    assert bad.finish_reason is not None and bad.finish_reason.value == "error"
    assert bad.error == "RuntimeError: injected failure"
    assert [o.finish_reason for o in outs if o.request_id == "bad" and o.finished] == ["error"]
    assert [r.output_ids for r in reqs] == stories_alone[:3]
    assert all(r.finish_reason is not None and r.finish_reason.value == "length" for r in reqs)
    assert llm.engine.bm.num_free_blocks == llm.engine.bm.num_blocks


SMOLLM_TEXTS = [
    "The history of the printing press begins in",
    "Write a haiku about autumn leaves.",
    "def fibonacci(n):",
    "The three primary colors are",
    "Explain why the sky is blue in one sentence.",
    "My favourite recipe for pancakes needs flour, eggs,",
    "The capital of Japan is",
    "Once upon a time in a small village by the sea,",
]


# NOTE: not on the PyTorch-ops path ("pytorch"): there 2 of these 8 sequences differ from
# their tokens alone (its decode logits move by up to 0.75 between steps of 1 and 2 rows,
# outside the linear layers, whose rows are exact in any batch)
@pytest.mark.parametrize("cpu_path", ["native", "native-dense", "native-avx2", "native-avx2-vnni"],
                         indirect=True)
def test_bf16_default_model_batched_matches_alone(smollm_path: Path, cpu_path: str) -> None:
    """A request's greedy bf16 tokens on the default model are the same alone and in a batch
    with staggered arrivals, with either build of the native kernels, on AMX tiles where the
    CPU has them ("native") and off them ("native-dense"): every decoding row's sums run in
    one order whatever the batch."""
    llm = make_llm(smollm_path, dtype="bfloat16")
    jobs = [Job(llm.encode(t), 24, arrival_step=2 * i) for i, t in enumerate(SMOLLM_TEXTS)]
    alone = run_alone(llm, jobs)
    batched = make_llm(smollm_path, dtype="bfloat16")
    reqs = run_staggered(batched, jobs)
    assert max(batched.engine.stats.tokens_per_step) > len(jobs)  # prompts beside decodes
    for r, a, text in zip(reqs, alone, SMOLLM_TEXTS):
        assert r.output_ids == a, text


@pytest.mark.parametrize("cpu_path", ["native", "native-dense", "native-avx2"], indirect=True)
def test_bf16_split_cached_and_preempted_prompts_match_alone(smollm_path: Path,
                                                             cpu_path: str) -> None:
    """A request's greedy bf16 tokens on the default model are the ones it gets alone, in one
    step, when its prompt is prefilled beside others and split over steps by the token
    budget, when it is resumed after a cached prefix, and when it is computed again after a
    preemption: each prompt row takes its whole prompt's path (`dispatch.prompt_path`, and
    SDPA in fixed blocks, `prompt_attention`), and rows past the prompt the decode kernel."""
    llm = make_llm(smollm_path, dtype="bfloat16")
    # 39-49 tokens each; the last ends one token into a block (a 1-token tail when cached)
    prompts = [llm.encode(" ".join(f"item{7 * j + i}" for j in range(n))
                          + " Summarize the list.")
               for i, n in ((0, 13), (1, 12), (3, 14), (2, 15))]
    assert len(prompts[-1]) % llm.engine.block_size == 1
    # each sampled token's log-probability and the best two: they move with any change
    # in the logits, where a greedy token needs a near tie to change
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    alone = [run_logged(llm, [p], params)[0][0] for p in prompts]
    assert [len(p) > 16 for p in prompts] == [True] * 4  # beyond the kernel's prompt rows
    split = make_llm(smollm_path, dtype="bfloat16", budget=72)
    assert run_logged(split, prompts, params)[0] == alone
    assert max(split.engine.stats.tokens_per_step) <= 72 < sum(map(len, prompts))
    # the same prompts again: all but their last partial block cached
    again, reqs = run_logged(split, prompts, params)
    assert [r.num_cached_tokens for r in reqs] == [len(p) // 16 * 16 for p in prompts]
    assert again == alone
    tight = make_llm(smollm_path, dtype="bfloat16", num_blocks=10)
    assert run_logged(tight, prompts, params)[0] == alone
    assert tight.engine.stats.preemptions > 0


@pytest.mark.parametrize("cpu_path", ["native", "native-avx2"], indirect=True)
def test_decode_steps_in_one_call_match_a_step_a_call(smollm_path: Path, cpu_path: str) -> None:
    """Greedy decodes, and seeded draws with top-k (chat's defaults and others), run up to
    `decode_steps` steps in one native call: every request gets the tokens, text and finish
    reason of one step a call, whether it ends on max_tokens, a stop token or a stop string in
    the middle of a call's steps, and a request sampling without top-k in the batch makes it
    one step a call again."""
    def make(steps: int) -> LLM:
        return LLM(smollm_path, dtype="bfloat16",
                   scheduler=SchedulerConfig(max_num_seqs=8, decode_steps=steps))

    one, four = make(1), make(4)
    prompts = [one.encode(t) for t in SMOLLM_TEXTS[:4]]
    # stops taken from the first prompt's own greedy run, so they fall inside a call's steps
    free = one.generate([prompts[0]], SamplingParams(max_tokens=24, temperature=0,
                                                     ignore_eos=True))[0]
    stop_text = one.engine.tokenizer.decode(free.token_ids[9:11]).strip()
    assert stop_text and stop_text in free.text
    greedy = [SamplingParams(max_tokens=13, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, stop=(stop_text,)),
              SamplingParams(max_tokens=30, temperature=0,
                             stop_token_ids=(free.token_ids[6],)),
              SamplingParams(max_tokens=21, temperature=0)]
    sampled = SamplingParams(max_tokens=9, temperature=0.8, seed=5)  # top-k off
    drawn = [SamplingParams(max_tokens=18, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                            seed=3),
             SamplingParams(max_tokens=11, temperature=1.4, top_k=64, seed=2**70 + 9),
             SamplingParams(max_tokens=14, temperature=0.6, top_k=5, top_p=0.8, seed=0,
                            stop=(stop_text,))]
    calls: list[int] = []
    execute_steps = four.engine.runner.execute_steps

    def counted(batch: list[ScheduledRequest], steps: int) -> object:
        out = execute_steps(batch, steps)
        calls.append(steps if out is not None else 0)
        return out

    four.engine.runner.execute_steps = counted  # type: ignore[method-assign]

    def batch(llm: LLM, params: list[SamplingParams], ids: list[list[int]]
              ) -> list[tuple[list[int], str, str]]:
        # each prompt with its own parameters, all in one batch
        reqs = [llm.engine.add_request(i, p) for i, p in zip(ids, params)]
        texts = {r.request_id: "" for r in reqs}
        while llm.engine.has_unfinished():
            for out in llm.engine.step():
                texts[out.request_id] += out.text
        return [(r.output_ids, texts[r.request_id], r.finish_reason.value if r.finish_reason
                 else "") for r in reqs]

    def outputs(llm: LLM, params: list[SamplingParams]) -> list[tuple[list[int], str, str]]:
        # the first prompt with each parameters alone, then with all of them in one batch,
        # then four prompts in one batch
        alone = [x for p in params for x in batch(llm, [p], prompts[:1])]
        return (alone + batch(llm, params, prompts[:1] * len(params))
                + batch(llm, greedy[:1] * 4, prompts))

    for params in (greedy, greedy + [sampled], greedy[:2] + drawn):
        calls.clear()
        want = outputs(one, params)
        assert outputs(four, params) == want
        assert [w[2] for w in want[:2]] == ["length", "stop"]
        assert params[2] is not greedy[2] or want[2][2] == "stop"
        assert calls and max(calls) == 4  # calls ran several steps
    # the draws drew: not the greedy tokens
    assert want[2][0][:18] != free.token_ids[:18]
    # a call that fails: that step alone, and one step a call from then on
    def broken(batch: list[ScheduledRequest], steps: int) -> object:
        calls.append(-1)
        raise RuntimeError("broken")

    calls.clear()
    four.engine.runner.execute_steps = broken  # type: ignore[method-assign]
    assert outputs(four, greedy) == outputs(one, greedy) and calls == [-1]
    four.engine._steps_failed = False
    four.engine.runner.execute_steps = counted  # type: ignore[method-assign]
    # a request sampling without top-k in the batch: one step a call while it runs
    calls.clear()
    batch(four, [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                 SamplingParams(max_tokens=12, temperature=0.8, seed=1)], prompts[:2])
    assert 0 < calls.count(4) < 40 // 4
    # requests waiting for a running one to end (max_num_seqs) do not stop it; they are
    # admitted after the call
    two = [LLM(smollm_path, dtype="bfloat16",
               scheduler=SchedulerConfig(max_num_seqs=2, decode_steps=s)) for s in (1, 4)]
    runner = two[1].engine.runner
    run_steps = runner.execute_steps
    waited: list[int] = []

    def while_waiting(batch: list[ScheduledRequest], steps: int) -> object:
        out = run_steps(batch, steps)
        if out is not None and two[1].engine.scheduler.waiting:
            waited.append(steps)
        return out

    runner.execute_steps = while_waiting  # type: ignore[method-assign]
    jobs = greedy + greedy[:1]
    assert batch(two[1], jobs, prompts + prompts[:1]) == batch(two[0], jobs, prompts + prompts[:1])
    assert waited and max(waited) == 4

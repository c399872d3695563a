"""AsyncLLMEngine on stories260K: concurrent streams, cancellation, errors, crash, shutdown.

pytest-asyncio is not installed: each test runs its own event loop with asyncio.run.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from localllm import LLM, RequestError, SamplingParams
from localllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from localllm.engine.engine import RequestOutput
from localllm.engine.scheduler import SchedulerOutput

PROMPTS = [
    "Once upon a time, there was a little girl named Lily.",
    "Tom had a big red ball.",
    "The sun was hot. The dog was sad because",
    "Mom made a cake for Sam.",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def llm(stories_path: Path) -> LLM:
    return LLM(stories_path, dtype="float32")


@pytest.fixture
def engine(llm: LLM) -> Iterator[AsyncLLMEngine]:
    eng = AsyncLLMEngine(llm.engine)
    yield eng
    eng.shutdown(timeout=10)
    assert not eng.is_running


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


async def collect(engine: AsyncLLMEngine, ids: list[int], params: SamplingParams,
                  request_id: str | None = None) -> list[RequestOutput]:
    return [out async for out in engine.generate(ids, params, request_id)]


async def wait_until_idle(engine: AsyncLLMEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        s = engine.stats()
        if s.num_running == s.num_waiting == s.used_blocks == 0:
            return
        assert time.monotonic() < deadline, f"engine still busy: {s}"
        await asyncio.sleep(0.01)


def test_concurrent_streams_match_sync_generate(llm: LLM, engine: AsyncLLMEngine) -> None:
    prompts = [llm.encode(p) for p in PROMPTS]
    lens = [30, 12, 45, 20]
    expected = [llm.generate([p], greedy(n))[0] for p, n in zip(prompts, lens)]

    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(collect(engine, p, greedy(n))
                                      for p, n in zip(prompts, lens)))

    results = asyncio.run(main())
    for outs, exp, n in zip(results, expected, lens):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].finish_reason == "length"
        assert [t for o in outs for t in o.token_ids] == exp.token_ids
        assert "".join(o.text for o in outs) == exp.text
        assert len(outs) == n  # one output per sampled token
    snap = engine.stats()
    assert snap.used_blocks == 0 and snap.num_running == 0
    assert snap.steps > 0 and snap.tokens >= sum(lens)
    assert snap.mean_tokens_per_step > 1  # the streams were batched together


def test_consumer_that_stops_or_is_cancelled_frees_blocks(llm: LLM,
                                                          engine: AsyncLLMEngine) -> None:
    bm = llm.engine.bm
    ids = llm.encode(PROMPTS[0])

    async def stop_after(n: int) -> int:
        seen = 0
        async with contextlib.aclosing(engine.generate(ids, greedy(10_000))) as stream:
            async for _ in stream:
                seen += 1
                if seen == n:
                    break
        return seen

    async def main() -> None:
        assert await stop_after(3) == 3
        await wait_until_idle(engine)
        assert bm.num_free_blocks == bm.num_blocks
        # a task cancelled while it waits for the next piece
        task = asyncio.create_task(collect(engine, ids, greedy(10_000)))
        while engine.stats().used_blocks == 0:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until_idle(engine)
        # a timeout around a long stream
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(collect(engine, ids, greedy(10_000)), timeout=0.2)
        await wait_until_idle(engine)
        # the engine still serves new requests
        outs = await collect(engine, ids, greedy(5))
        assert outs[-1].finished and sum(len(o.token_ids) for o in outs) == 5

    asyncio.run(main())
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants([])


def test_invalid_request_raises_in_its_stream(llm: LLM, engine: AsyncLLMEngine) -> None:
    async def main() -> None:
        with pytest.raises(RequestError, match="context holds"):
            await collect(engine, [1] * (llm.engine.max_model_len + 1), greedy(4))
        outs = await collect(engine, llm.encode(PROMPTS[1]), greedy(4), request_id="x")
        assert outs[-1].finished

    asyncio.run(main())


def test_failure_of_one_request_ends_it_with_error(llm: LLM, engine: AsyncLLMEngine,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    runner = llm.engine.runner
    execute = runner.execute

    def flaky(batch):  # type: ignore[no-untyped-def]
        if any(s.request.request_id == "bad" for s in batch):
            raise RuntimeError("injected")
        return execute(batch)

    monkeypatch.setattr(runner, "execute", flaky)

    async def main() -> tuple[list[RequestOutput], list[RequestOutput]]:
        good = collect(engine, llm.encode(PROMPTS[0]), greedy(20))
        bad = collect(engine, llm.encode(PROMPTS[1]), greedy(20), request_id="bad")
        return await asyncio.gather(good, bad)

    good, bad = asyncio.run(main())
    assert good[-1].finish_reason == "length" and len(good) == 20
    assert [(o.finished, o.finish_reason, o.error) for o in bad] == [
        (True, "error", "RuntimeError: injected")]


def test_loop_crash_reaches_every_stream(llm: LLM, engine: AsyncLLMEngine,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    update = llm.engine.scheduler.update
    calls = {"n": 0}

    def broken(out: SchedulerOutput, sampled: dict[str, int],
               stop_ids: frozenset[int]) -> list:  # type: ignore[type-arg]
        calls["n"] += 1
        if calls["n"] == 5:
            raise AssertionError("scheduler bug")
        return update(out, sampled, stop_ids)

    monkeypatch.setattr(llm.engine.scheduler, "update", broken)

    async def main() -> list[BaseException | list[RequestOutput]]:
        streams = [collect(engine, llm.encode(p), greedy(50)) for p in PROMPTS]
        return await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), 10)

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert "scheduler bug" in str(results[0])
    engine.shutdown(timeout=5)  # joins the thread that has already ended
    assert not engine.is_running

    async def after() -> None:
        with pytest.raises(EngineDeadError, match="crashed"):
            await collect(engine, llm.encode(PROMPTS[0]), greedy(2))

    asyncio.run(after())


def test_shutdown_aborts_open_streams_and_refuses_new_ones(llm: LLM,
                                                           engine: AsyncLLMEngine) -> None:
    async def main() -> None:
        got: list[RequestOutput] = []

        async def consume() -> None:
            async for out in engine.generate(llm.encode(PROMPTS[2]), greedy(10_000)):
                got.append(out)

        task = asyncio.create_task(consume())
        while len(got) < 3:
            await asyncio.sleep(0.005)
        await asyncio.to_thread(engine.shutdown, 10)
        await asyncio.wait_for(task, 5)
        assert got[-1].finished and got[-1].finish_reason == "abort"
        with pytest.raises(EngineDeadError, match="shut down"):
            await collect(engine, llm.encode(PROMPTS[0]), greedy(2))

    asyncio.run(main())
    assert not engine.is_running
    assert llm.engine.bm.num_free_blocks == llm.engine.bm.num_blocks


def test_idle_loop_sleeps(llm: LLM, engine: AsyncLLMEngine,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    # every turn of the loop calls engine.step(), also one that finds nothing to schedule
    # (such a step records no stats): a sleeping loop makes no call while idle; in 0.5 s a
    # loop that polls every 10 ms made 49, one that spins over 150,000
    step = llm.engine.step
    calls = {"n": 0}

    def counted() -> list[RequestOutput]:
        calls["n"] += 1
        return step()

    monkeypatch.setattr(llm.engine, "step", counted)

    async def main() -> None:
        await collect(engine, llm.encode(PROMPTS[0]), greedy(3))

    asyncio.run(main())
    busy = calls["n"]
    assert busy >= 3  # the loop steps through the counted method
    time.sleep(0.5)
    idle = calls["n"] - busy
    assert engine.is_running
    assert idle <= 1, f"the idle engine loop stepped {idle} times in 0.5 s"
    # it wakes up for the next request
    outs = asyncio.run(collect(engine, llm.encode(PROMPTS[1]), greedy(2)))
    assert outs[-1].finished and calls["n"] > busy + idle


def test_free_memory_is_returned_after_prompts_not_during_decode(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    # a step with >= 256 prompt tokens that finishes its prompts hands the workspace back
    # once; the decode steps after it do not pay for a malloc_trim each
    import localllm.engine.engine as engine_mod

    calls: list[int] = []
    monkeypatch.setattr(engine_mod, "release_free_memory", lambda: calls.append(1))
    prompt = [1] + [(7 * i) % 200 + 10 for i in range(299)]
    llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0))
    assert calls == [1]
    llm.generate([prompt[:20]], SamplingParams(max_tokens=8, temperature=0))
    assert calls == [1]  # a short prompt leaves little to return

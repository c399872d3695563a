"""`bench serve`'s parts without a model: the workload's lengths and arrivals, the JSONL
dataset, the runner over a scripted client (timelines, concurrency, Ctrl-C), /metrics parsing
and the plot's panels."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from localllm.apps import bench_serve_plot as plot
from localllm.apps.bench_serve_runner import RunResult, parse_metrics, run_workload
from localllm.apps.bench_serve_workload import RequestSpec, arrivals, from_dataset, lengths
from localllm.bench.diagnosis import Finding
from localllm.bench.summary import Slo
from localllm.bench.timeline import EngineSample, RequestTimeline
from localllm.client import Client, Delta, Message, Usage
from localllm.config import SamplingParams
from localllm.errors import LocalLLMError
from localllm.model_card import ModelCard


class Scripted(Client):
    """Streams `max_tokens` one-token deltas `step` seconds apart; counts open streams."""

    def __init__(self, step: float = 0.01) -> None:
        self.step = step
        self.open = 0
        self.most_open = 0
        self.ended = 0  # streams that ran to their end
        self.card = ModelCard("scripted", "", None, "unknown", None, 4096, "here")

    def stream_chat(self, messages: Sequence[Message],
                    params: SamplingParams) -> AsyncIterator[Delta]:
        return self.stream_text(messages[-1]["content"], params)

    async def stream_text(self, prompt: str, params: SamplingParams) -> AsyncIterator[Delta]:
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            for _ in range(params.max_tokens):
                await asyncio.sleep(self.step)
                yield Delta("x", 1)
            self.ended += 1
            yield Delta("", 0, "length", Usage(len(prompt.split()), params.max_tokens, 0))
        finally:
            self.open -= 1

    async def count_tokens(self, text: str) -> int:
        return len(text.split())

    async def aclose(self) -> None:
        pass


def test_lengths_and_arrivals() -> None:
    rng = np.random.default_rng(0)
    assert lengths(rng, 100, 0.0, 3) == [100, 100, 100]
    xs = lengths(rng, 100, 0.5, 2000)
    assert min(xs) == 50 and max(xs) == 150  # uniform over [50, 150], both ends reached
    assert arrivals(rng, 4, float("inf"), 1.0) == [0.0] * 4
    for burstiness in (0.5, 1.0, 4.0):
        t = arrivals(np.random.default_rng(1), 4001, 10.0, burstiness)
        gaps = np.diff(t)
        assert t[0] == 0.0 and np.all(gaps >= 0)
        assert gaps.mean() == pytest.approx(0.1, rel=0.1)  # 10 requests/s
        # a gamma of shape k has coefficient of variation 1 / sqrt(k)
        assert gaps.std() / gaps.mean() == pytest.approx(burstiness ** -0.5, rel=0.15)
    assert arrivals(np.random.default_rng(3), 5, 2.0, 1.0) == arrivals(
        np.random.default_rng(3), 5, 2.0, 1.0)


def test_dataset(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('"plain text prompt"\n{"prompt": "two words", "output_len": 7}\n\n'
                 '{"messages": [{"role": "user", "content": "hi there"}]}\n')
    specs = asyncio.run(from_dataset(Scripted(), f, 4, [5, 5, 5, 5]))
    assert [(s.prompt, s.input_len, s.output_len) for s in specs] == [
        ("plain text prompt", 3, 5), ("two words", 2, 7), (None, 0, 5),
        ("plain text prompt", 3, 5)]  # from the start again
    assert specs[2].messages == [{"role": "user", "content": "hi there"}]
    f.write_text('{"prompt": "ok"}\n{"text": 1}\n')
    with pytest.raises(LocalLLMError, match=r"p.jsonl:2: give a JSON string or an object"):
        asyncio.run(from_dataset(Scripted(), f, 2, [5, 5]))
    f.write_text("{not json\n")
    with pytest.raises(LocalLLMError, match=r"p.jsonl:1: not JSON"):
        asyncio.run(from_dataset(Scripted(), f, 1, [5]))
    with pytest.raises(LocalLLMError, match="--dataset"):
        asyncio.run(from_dataset(Scripted(), tmp_path / "none.jsonl", 1, [5]))


SPECS = [RequestSpec(f"prompt number {i}", None, 3, 4) for i in range(6)]
GREEDY = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def test_runner_records_client_side_timelines() -> None:
    client = Scripted(step=0.01)
    run = asyncio.run(run_workload(client, SPECS, [0.0] * 6, GREEDY, 2, progress=False))
    assert not run.interrupted and client.most_open == 2
    assert [r.index for r in run.records] == list(range(6))
    for r in run.records:
        assert r.ok and r.output_tokens == 4 and r.chunk_tokens == (1, 1, 1, 1)
        assert (r.prompt_tokens, r.cached_tokens, r.finish_reason) == (3, 0, "length")
        assert r.ttft is not None and r.ttft >= 0.01
        assert all(g >= 0.009 for g in r.itls)
    # two slots: requests 2..5 wait for earlier ones to end
    assert run.records[2].sent >= run.records[0].finished - 1e-3  # type: ignore[operator]
    assert run.records[5].wait > 0.05


def test_runner_poisson_arrivals_send_on_time() -> None:
    client = Scripted(step=0.001)
    send_at = [0.0, 0.05, 0.1]
    run = asyncio.run(run_workload(client, SPECS[:3], send_at, GREEDY, None, progress=False))
    for r, t in zip(run.records, send_at):
        assert r.arrival == t and t <= r.sent < t + 0.04


def test_interrupt_reports_what_was_measured() -> None:
    client = Scripted(step=0.05)

    async def main() -> RunResult:
        task = asyncio.create_task(run_workload(client, SPECS, [0.0] * 6, GREEDY, 2,
                                                progress=False))
        while client.ended < 2 or client.open < 2:  # two are done, the next two streaming
            await asyncio.sleep(0.001)
        task.cancel()  # what asyncio.run does on Ctrl-C
        return await task

    run = asyncio.run(main())
    assert run.interrupted
    done = [r for r in run.records if r.ok]
    cut = [r for r in run.records if r.error == "interrupted"]
    assert [r.index for r in done] == [0, 1] and [r.index for r in cut] == [2, 3]
    assert all(len(r.chunk_times) < 4 and r.finished is None for r in cut)


def test_parse_metrics_of_localllm_and_vllm() -> None:
    ours = ("# TYPE localllm_kv_cache_utilization gauge\nlocalllm_kv_cache_utilization 0.25\n"
            "# TYPE localllm_requests_running gauge\nlocalllm_requests_running 3.0\n"
            "# TYPE localllm_requests_waiting gauge\nlocalllm_requests_waiting 2.0\n"
            "# TYPE localllm_preemptions counter\nlocalllm_preemptions_total 5.0\n")
    assert parse_metrics(ours) == (0.25, 3, 2, 5)
    vllm = ('# TYPE vllm:num_requests_running gauge\n'
            'vllm:num_requests_running{model_name="m"} 4.0\n'
            '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="m"} 0.5\n')
    assert parse_metrics(vllm) == (0.5, 4, 0, 0)
    assert parse_metrics("# nothing\nother_metric 1\n") is None


def test_plot_has_the_panels(tmp_path: Path) -> None:
    records = [RequestTimeline(0, 0.0, 0.0, (0.1, 0.2, 0.3), (1, 1, 1), 0.3, 3),
               RequestTimeline(1, 0.0, 0.3, (0.5, 0.6), (1, 1), 0.6, 2)]
    samples = [EngineSample(0.05 * i, 0.1 * i, 1, i % 2, 0) for i in range(12)]
    run = RunResult(records, samples, False, 0.6, 0.5)
    fig = plot.figure(run, [Finding("compute", "it grows", "a bigger machine")], Slo(ttft=0.2))
    titles = [ax.get_title() for ax in fig.axes]
    assert set(plot.TITLES) <= set(titles)
    assert "compute-bound" in fig._suptitle.get_text()
    png = tmp_path / "p.png"
    plot.save(fig, png)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1600, 850)


def test_machine_of_a_remote_run() -> None:
    from localllm.apps.bench_serve_report import machine

    m = machine(Scripted())
    assert m["cores"] and m["cpu"] and m["runs_on"] == "here"
    assert m["backend"] == "none here"  # the model runs in the server
    json.dumps(m)


def test_a_note_explains_bursty_itl() -> None:
    from localllm.apps.bench_serve_report import itl_note
    from localllm.bench.summary import summarize
    from localllm.bench.timeline import RequestTimeline

    def rec(times: tuple[float, ...]) -> RequestTimeline:
        return RequestTimeline(0, 0.0, 0.0, times, (1,) * len(times), times[-1], len(times))

    # 4 tokens a call, a call every 40 ms: the median gap is inside a burst
    bursts = tuple(0.1 + 0.04 * c + 1e-5 * k for c in range(5) for k in range(4))
    note = itl_note(summarize([rec(bursts)]))
    assert note is not None and note.startswith("ITL: tokens arrived in bursts")
    assert "TPOT (8.4 ms mean)" in note  # 160 ms from the first token to the last, 19 more
    # one token a step: no note
    assert itl_note(summarize([rec(tuple(0.1 + 0.01 * i for i in range(20)))])) is None

"""The OpenAI-compatible API of a live `localllm serve` (stories260K, fp32) through the official
`openai` client on the Unix socket and through `curl --unix-socket`: chat and text completions,
streamed and not, usage, n, logprobs, stop strings, 8 concurrent streams, a client that
disconnects mid-stream, /metrics and /health."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from typing import Any

import pytest
from serve_util import ServeProcess

from localllm import LLM, SamplingParams

PROMPTS = ["Once upon a time", "Tom had a big red ball.", "The sun was hot. The dog was sad",
           "Mom made a cake for Sam.", "Lily and Ben went to the park.", "The cat sat",
           "One day, a bird", "There was a little boat"]
MODEL = "stories260K"
GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_chat_completion_and_stream_with_usage(stories_server: ServeProcess) -> None:
    client = stories_server.openai()
    msgs = [{"role": "user", "content": "Tell me a story."}]
    whole = client.chat.completions.create(messages=msgs, max_tokens=12,
                                           **GREEDY)
    assert whole.object == "chat.completion" and whole.model == "stories260K"
    assert whole.choices[0].finish_reason == "length"
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    stream = client.chat.completions.create(messages=msgs, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and set(finals[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert ([getattr(chunks[-1].usage, k) for k in counts]
            == [getattr(whole.usage, k) for k in counts])
    # the second request finds the first one's full prompt blocks in the prefix cache
    block = 16
    details = chunks[-1].usage.prompt_tokens_details
    assert details is not None
    assert details.cached_tokens == (whole.usage.prompt_tokens - 1) // block * block
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_match_the_engine(stories_server: ServeProcess, stories_path: Any) -> None:
    client = stories_server.openai()
    llm = LLM(stories_path, dtype="float32")
    expected = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=20, temperature=0,
                                                         ignore_eos=True))[0]
    whole = client.completions.create(prompt=PROMPTS[0], max_tokens=20,
                                      **GREEDY)
    assert whole.choices[0].text == expected.text
    assert whole.usage is not None and whole.usage.prompt_tokens == len(llm.encode(PROMPTS[0]))
    pieces = list(client.completions.create(prompt=PROMPTS[0], max_tokens=20, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == expected.text
    assert pieces[-1].usage is not None and pieces[-1].usage.completion_tokens == 20
    # several prompts, n choices each, seeded: choice order is prompt-major
    many = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=6,
                                     seed=3, temperature=1.0)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    again = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=6,
                                      seed=3, temperature=1.0)
    assert [c.text for c in many.choices] == [c.text for c in again.choices]
    # stop strings are never shown
    cut = client.completions.create(prompt=PROMPTS[0], max_tokens=20, stop=["girl"], **GREEDY)
    assert "girl" in expected.text and cut.choices[0].text == expected.text.split("girl")[0]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs(stories_server: ServeProcess) -> None:
    client = stories_server.openai()
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for lp in content:
        assert lp.logprob <= 0 and len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0].token == lp.token  # greedy takes the most likely
        assert bytes(lp.bytes).decode(errors="replace") == lp.token
    assert "".join(lp.token for lp in content) == chat.choices[0].message.content
    text = client.completions.create(prompt=PROMPTS[0], max_tokens=3, logprobs=2, **GREEDY)
    lps = text.choices[0].logprobs
    assert len(lps.tokens) == 3 and len(lps.token_logprobs) == 3 and len(lps.top_logprobs) == 3
    assert lps.text_offset[0] == 0 and "".join(lps.tokens) == text.choices[0].text


def test_curl_over_the_unix_socket(stories_server: ServeProcess) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                       "stream": True})
    out = subprocess.run([curl, "-sS", "-N", "--unix-socket", str(stories_server.socket),
                          "http://localhost/v1/chat/completions", "-H",
                          "Content-Type: application/json", "-d", body],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    events = [line.removeprefix("data: ") for line in out.splitlines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}


def test_eight_concurrent_streams_equal_single_runs(stories_server: ServeProcess) -> None:
    lens = [24, 9, 40, 17, 31, 12, 36, 20]
    client = stories_server.openai()
    alone = [client.completions.create(prompt=p, max_tokens=n, **GREEDY).choices[0].text
             for p, n in zip(PROMPTS, lens)]

    async def one(aclient: Any, prompt: str, n: int) -> tuple[str, int]:
        text, chunks = "", 0
        stream = await aclient.completions.create(prompt=prompt, max_tokens=n, stream=True,
                                                  **GREEDY)
        async for chunk in stream:
            text += chunk.choices[0].text
            chunks += 1
        return text, chunks

    async def main() -> list[tuple[str, int]]:
        aclient = stories_server.openai(async_=True)
        async with aclient:
            return await asyncio.gather(*(one(aclient, p, n) for p, n in zip(PROMPTS, lens)))

    before = stories_server.metrics()
    results = asyncio.run(main())
    assert [t for t, _ in results] == alone
    assert all(chunks > 1 for _, chunks in results)  # streamed, not sent whole
    after = stories_server.metrics()
    steps = after["localllm_engine_steps_total"] - before["localllm_engine_steps_total"]
    assert steps < sum(lens)  # the streams shared steps


def test_disconnect_mid_stream_frees_the_blocks(stories_server: ServeProcess) -> None:
    before = stories_server.metrics()
    body = {"prompt": PROMPTS[2], "max_tokens": 1900, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with stories_server.http() as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        busy = stories_server.metrics()
    # the response is closed here, mid-stream
    deadline = time.monotonic() + 10
    while True:
        m = stories_server.metrics()
        if m["localllm_kv_cache_blocks_used"] == 0 and m["localllm_requests_running"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.02)
    assert busy["localllm_kv_cache_blocks_used"] > 0 and busy["localllm_requests_running"] == 1
    key = 'localllm_requests_finished_total{reason="cancelled"}'
    assert m[key] == before.get(key, 0) + 1
    computed = m["localllm_engine_tokens_total"] - before["localllm_engine_tokens_total"]
    assert computed < 1000  # the engine stopped it well before its max_tokens
    # the access log says so (the 200 had gone out before)
    stories_server.wait_for("POST /v1/completions 200 client went away", 10)
    # and the server goes on serving
    out = stories_server.openai().completions.create(prompt="Once", max_tokens=3, **GREEDY)
    assert out.choices[0].finish_reason == "length"


def test_models_health_and_metrics(stories_server: ServeProcess) -> None:
    client = stories_server.openai()
    assert [m.id for m in client.models.list()] == ["stories260K"]
    with stories_server.http() as c:
        assert c.get("/health").json() == {"status": "ok", "model": "stories260K"}
        r = c.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    for name in ("localllm_kv_cache_utilization", "localllm_requests_running",
                 "localllm_requests_waiting", "localllm_requests_preempted",
                 "localllm_prefix_cache_hit_rate", "localllm_time_to_first_token_seconds_bucket",
                 "localllm_inter_token_latency_seconds_bucket",
                 "localllm_e2e_request_latency_seconds_count", "localllm_prompt_tokens_total",
                 "localllm_generation_tokens_total"):
        assert name in r.text, name
    m = stories_server.metrics()
    assert m["localllm_time_to_first_token_seconds_count"] >= 1
    assert m["localllm_prompt_tokens_total"] > 0 and m["localllm_generation_tokens_total"] > 0
    # one access-log line per request, counts but no prompt text
    assert any("POST /v1/completions 200" in line and "prompt_tokens=" in line
               for line in stories_server.lines)
    assert not any(PROMPTS[0] in line for line in stories_server.lines)

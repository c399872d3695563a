"""The server over a scripted engine (its outputs written here, not sampled), live on a Unix
socket in this process: tool calls parsed from the output through both APIs, streamed and not;
a request that fails in the engine answers alone with an error while the others finish; a
shutdown ends an endless stream with "abort" and [DONE]. The model is a tiny synthetic GGUF
(only its tokenizer is used) with the real Qwen2.5 chat template."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gguf_factory import ModelSpec, write_model
from scripted_server import ScriptedEngine, client, running

from localllm import LLM
from localllm.server.runner import make_server
from localllm.server.state import ServeOptions, ServerState
from localllm.text.chat_template import ChatTemplate

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
TEMPLATE = TEMPLATES / "qwen2.5-instruct.jinja"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {
        "type": "string"}}}}}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, ScriptedEngine]]:
    d = tmp_path_factory.mktemp("scripted")
    write_model(d / "tiny.gguf", ModelSpec(keys={"llama.context_length": 4096}))  # tools fit
    llm = LLM(d / "tiny.gguf", dtype="float32")
    engine = ScriptedEngine(llm)
    state = ServerState(llm, engine, "tiny", ServeOptions(shutdown_timeout=0.2),
                        template=ChatTemplate(TEMPLATE.read_text()))
    with running(state, d / "s.sock"):
        yield d / "s.sock", engine


def events(r: httpx.Response) -> list[Any]:
    lines = [x.removeprefix("data: ") for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def ask(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **extra}


def test_tool_calls_openai(served: tuple[Path, ScriptedEngine]) -> None:
    with client(served[0]) as c:
        whole = c.post("/v1/chat/completions", json=ask("weather?", tools=[WEATHER])).json()
        r = c.post("/v1/chat/completions", json=ask("weather?", tools=[WEATHER], stream=True))
        chunks = events(r)
        plain = c.post("/v1/chat/completions", json=ask("weather?")).json()
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check."
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [(tc["index"], tc["function"]["name"]) for tc in calls] == [(0, "get_weather")]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # without tools in the request the text comes back as it was written
    assert plain["choices"][0]["message"]["content"] == "Let me check.\n" + CALL
    assert plain["choices"][0]["finish_reason"] == "stop"


def test_with_tools_but_no_call_the_text_is_whole(served: tuple[Path, ScriptedEngine]) -> None:
    with client(served[0]) as c:
        r = c.post("/v1/chat/completions", json=ask("spaced", tools=[WEATHER], stream=True))
        chunks = events(r)
        whole = c.post("/v1/chat/completions", json=ask("spaced", tools=[WEATHER])).json()
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks)
    assert text == whole["choices"][0]["message"]["content"] == "No tool needed.\n  "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_tool_calls_ollama(served: tuple[Path, ScriptedEngine]) -> None:
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER]}
    with client(served[0]) as c:
        whole = c.post("/api/chat", json={**body, "stream": False}).json()
        lines = [json.loads(x) for x in c.post("/api/chat", json=body).iter_lines() if x]
    assert whole["message"]["tool_calls"] == [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert whole["message"]["content"] == "Let me check." and whole["done"]
    streamed = [tc for x in lines for tc in x["message"].get("tool_calls", [])]
    assert streamed == whole["message"]["tool_calls"]
    assert lines[-1]["done"] and not any(x["done"] for x in lines[:-1])


def test_a_failed_request_answers_alone(served: tuple[Path, ScriptedEngine]) -> None:
    async def main() -> list[httpx.Response]:
        transport = httpx.AsyncHTTPTransport(uds=str(served[0]))
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as c:
            return list(await asyncio.gather(
                c.post("/v1/chat/completions", json=ask("hello")),
                c.post("/v1/chat/completions", json=ask("fail")),
                c.post("/api/generate", json={"prompt": "fail", "stream": False}),
                c.post("/v1/chat/completions", json=ask("hello"))))

    ok, bad, bad_ollama, ok2 = asyncio.run(main())
    assert bad.status_code == 500
    assert bad.json()["error"]["message"] == "generation failed: RuntimeError: boom"
    assert bad_ollama.status_code == 500 and "boom" in bad_ollama.json()["error"]
    for r in (ok, ok2):
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == (
            "Hello there.")
    with client(served[0]) as c:
        chunks = c.post("/v1/chat/completions", json=ask("fail", stream=True))
        lines = [x for x in chunks.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["message"] == (
        "generation failed: RuntimeError: boom")


CALLED = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type":
          "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}


@pytest.mark.parametrize(("messages", "message"), [
    ([{"role": "user"}], "messages[0].content is missing or null; give the user message its "
     "text"),
    ([{"role": "user", "content": None}], "messages[0].content is missing or null"),
    ([{"role": "system", "content": None}, {"role": "user", "content": "hi"}],
     "messages[0].content is missing or null; give the system message its text"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant"}],
     "messages[1].content is missing or null; give the assistant message its text (only an "
     "assistant message with tool_calls may leave it out)"),
    ([{"role": "user", "content": "weather?"}, CALLED,
      {"role": "tool", "tool_call_id": "call_1"}], "messages[2].content is missing or null"),
])
def test_a_message_without_content_is_a_400(served: tuple[Path, ScriptedEngine],
                                            messages: list[Any], message: str) -> None:
    with client(served[0]) as c:
        r = c.post("/v1/chat/completions", json={"messages": messages})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"].startswith(message) and "\n" not in err["message"]
    assert err["type"] == "invalid_request_error" and err["param"].endswith("].content")


def test_an_assistant_tool_call_needs_no_content(served: tuple[Path, ScriptedEngine]) -> None:
    messages = [{"role": "user", "content": "weather?"}, CALLED,
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    with client(served[0]) as c:
        r = c.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repeat_penalty"])
@pytest.mark.parametrize("value", ["NaN", "Infinity"])
def test_sampling_numbers_must_be_finite(served: tuple[Path, ScriptedEngine], field: str,
                                         value: str) -> None:
    body = f'{{"messages": [{{"role": "user", "content": "hi"}}], "{field}": {value}}}'
    ollama = f'{{"prompt": "hi", "stream": false, "options": {{"{field}": {value}}}}}'
    with client(served[0]) as c:
        r = c.post("/v1/chat/completions", content=body.encode(),
                   headers={"Content-Type": "application/json"})
        o = c.post("/api/generate", content=ollama.encode(),
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    shown = "nan" if value == "NaN" else "inf"
    expected = f"{field} must be a finite number, got {shown}"  # named as the client named it
    assert r.json()["error"]["message"] == expected
    assert r.json()["error"]["param"] == field
    assert o.status_code == 400 and o.json()["error"] == expected


def test_shutdown_ends_open_streams_with_abort(tmp_path: Path) -> None:
    write_model(tmp_path / "tiny.gguf")
    llm = LLM(tmp_path / "tiny.gguf", dtype="float32")
    engine = ScriptedEngine(llm)
    state = ServerState(llm, engine, "tiny", ServeOptions(shutdown_timeout=0.3))
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "s.sock"))
    ready = threading.Event()
    server = make_server(state, ready.set)
    thread = threading.Thread(target=lambda: server.run(sockets=[sock]), daemon=True)
    thread.start()
    assert ready.wait(30)
    got: list[Any] = []

    def read() -> None:
        with client(tmp_path / "s.sock") as c, c.stream(
                "POST", "/v1/completions", json={"prompt": "forever", "stream": True}) as r:
            got.extend(events(r))

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 10
    while not engine.aborted and not state.active:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t0 = time.monotonic()
    server.should_exit = True
    reader.join(30)
    thread.join(30)
    assert got[-1]["choices"][0]["finish_reason"] == "abort"
    assert len(engine.aborted) == 1 and time.monotonic() - t0 >= 0.3
    assert not thread.is_alive()


def test_only_a_prompt_too_long_has_code_context_length_exceeded(
        served: tuple[Path, ScriptedEngine]) -> None:
    # clients (LiteLLM, LangChain) shorten the prompt or switch models on that code
    with client(served[0]) as c:
        codes = [c.post("/v1/completions", json={"prompt": p}).json()["error"]["code"]
                 for p in ([5] * 5000, [5, 10**6])]
    assert codes == ["context_length_exceeded", None]


def test_openai_fields_that_change_nothing_are_accepted(
        served: tuple[Path, ScriptedEngine]) -> None:
    # the official client sends these; OpenAI made safety_identifier the successor of user
    extra = {"user": "u", "safety_identifier": "s", "prompt_cache_key": "k",
             "prompt_cache_retention": "24h"}
    with client(served[0]) as c:
        r = c.post("/v1/chat/completions", json=ask("hello", **extra))
    assert r.status_code == 200, r.text


def test_ollama_num_predict_past_the_context_runs_to_its_end(
        served: tuple[Path, ScriptedEngine]) -> None:
    engine = served[1]
    with client(served[0]) as c:
        r = c.post("/api/generate", json={"prompt": "hello", "raw": True, "stream": False,
                                          "options": {"num_predict": 100_000}})
        assert r.status_code == 200, r.text
        prompt = r.json()["prompt_eval_count"]
        assert engine.params[-1].max_tokens == 4096 - prompt
        r = c.post("/api/chat", json={"messages": [{"role": "user", "content": "hello"}],
                                      "stream": False, "options": {"num_predict": 5000}})
        assert r.status_code == 200, r.text


def test_top_k_of_minus_one_is_off(served: tuple[Path, ScriptedEngine]) -> None:
    # vLLM's and llama.cpp's way to turn top-k off
    with client(served[0]) as c:
        r = c.post("/v1/chat/completions", json=ask("hello", top_k=-1))
    assert r.status_code == 200, r.text
    assert served[1].params[-1].top_k == 0


def test_streamed_text_offsets_continue_across_chunks(
        served: tuple[Path, ScriptedEngine]) -> None:
    body = {"prompt": "hello", "logprobs": 1}
    with client(served[0]) as c:
        whole = c.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
        chunks = events(c.post("/v1/completions", json={**body, "stream": True}))
    streamed = [o for ch in chunks if ch["choices"] and ch["choices"][0]["logprobs"]
                for o in ch["choices"][0]["logprobs"]["text_offset"]]
    assert len(whole["text_offset"]) == 3 and whole["text_offset"][1] > 0
    assert streamed == whole["text_offset"]


def test_metrics_name_every_route(served: tuple[Path, ScriptedEngine]) -> None:
    with client(served[0]) as c:
        c.post("/tokenize", json={"prompt": "hello"})
        c.get("/v1/models/tiny")
        c.get("/nowhere")
        text = c.get("/metrics").text
    assert 'route="/tokenize",status="200"' in text
    assert 'route="/v1/models/{model}",status="200"' in text
    assert 'route="other",status="404"' in text


def test_ollama_empty_suffix_on_a_model_without_fim_is_a_plain_prompt(
        served: tuple[Path, ScriptedEngine]) -> None:
    # Ollama fills in the middle only for a non-empty suffix; editors send "" at a file's end
    with client(served[0]) as c:
        r = c.post("/api/generate", json={"prompt": "hello", "suffix": "", "stream": False})
        bad = c.post("/api/generate", json={"prompt": "hello", "suffix": "x", "stream": False})
    assert r.status_code == 200 and r.json()["response"] == "Hello there.", r.text
    assert bad.status_code == 400 and "fill-in-the-middle" in bad.json()["error"]

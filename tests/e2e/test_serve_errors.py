"""Bad input to a live `localllm serve` gets a JSON error with the right 4xx and a message that
says what to fix (OpenAI's shape on /v1, Ollama's on /api), never a 500 or a dropped
connection; TCP without the API key, or with another, gets 401."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from serve_util import KEY, ServeProcess

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
LONG = "the cat sat on the mat and the dog ran to the park " * 300  # > 2048 tokens

CASES: list[tuple[str, str, Any, int, str]] = [
    # (name, path, body (bytes or JSON), status, in the message)
    ("malformed JSON", CHAT, b'{"messages": [', 400, "not valid JSON"),
    ("not an object", CHAT, b"[1, 2]", 400, "should be an object"),
    ("empty body", CHAT, b"", 400, "no body"),
    ("messages of the wrong type", CHAT, {"messages": "hi"}, 400, "messages"),
    ("a number as a string", CHAT, {"messages": MSGS, "temperature": "0.5"}, 400,
     "temperature: input should be a valid number"),
    ("a bool for an int", "/v1/completions", {"prompt": "x", "max_tokens": True}, 400,
     "max_tokens"),
    ("unknown field", CHAT, {"messages": MSGS, "max_token": 5}, 400, "unknown field 'max_token'"),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("no messages", CHAT, {"messages": []}, 400, "messages"),
    ("unknown model", CHAT, {"model": "gpt-4o", "messages": MSGS}, 404,
     "model 'gpt-4o' is not served here"),
    ("prompt longer than the context", "/v1/completions", {"prompt": LONG}, 400, "too many"),
    ("n of 0", CHAT, {"messages": MSGS, "n": 0}, 400, "n must be in 1..16"),
    ("n of 17", CHAT, {"messages": MSGS, "n": 17}, 400, "n must be in 1..16"),
    ("max_tokens of 0", CHAT, {"messages": MSGS, "max_tokens": 0}, 400,
     "max_tokens must be in 1..2048"),
    ("max_tokens past the context", CHAT, {"messages": MSGS, "max_completion_tokens": 5000}, 400,
     "max_completion_tokens must be in 1..2048"),
    ("negative temperature", CHAT, {"messages": MSGS, "temperature": -1}, 400, "temperature"),
    ("top_p of 0", CHAT, {"messages": MSGS, "top_p": 0}, 400, "top_p must be in (0, 1]"),
    ("empty stop string", CHAT, {"messages": MSGS, "stop": [""]}, 400, "stop strings"),
    ("image content part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400,
     "content part type 'image_url' is not supported"),
    ("top_logprobs without logprobs", CHAT, {"messages": MSGS, "top_logprobs": 2}, 400,
     "needs logprobs"),
    ("logit_bias", CHAT, {"messages": MSGS, "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ("JSON mode", CHAT, {"messages": MSGS, "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    ("frequency penalty", CHAT, {"messages": MSGS, "frequency_penalty": 0.5}, 400,
     "repeat_penalty"),
    ("repeat_penalty of 0", CHAT, {"messages": MSGS, "repeat_penalty": 0}, 400,
     "repeat_penalty must be positive"),
    ("repetition_penalty of 0", "/v1/completions", {"prompt": "x", "repetition_penalty": 0},
     400, "repetition_penalty must be positive"),
    ("stream_options without stream", CHAT, {"messages": MSGS, "stream_options": {
        "include_usage": True}}, 400, "stream_options is only allowed with"),
    ("llama.cpp: unsupported option", "/completion", {"prompt": "x", "grammar": "root ::= x"},
     400, "grammar is not supported"),
    ("llama.cpp: infill without FIM tokens", "/infill", {"input_prefix": "a"}, 400,
     "no fill-in-the-middle tokens"),
    ("tools on a template without them", CHAT, {"messages": MSGS, "tools": [
        {"type": "function", "function": {"name": "f"}}]}, 400, "does not take tools"),
    ("suffix without FIM tokens", "/v1/completions", {"prompt": "def f(", "suffix": "\n"}, 400,
     "no fill-in-the-middle tokens"),
    ("empty token prompt", "/v1/completions", {"prompt": [[]]}, 400, "empty list of token ids"),
    ("token id outside the vocabulary", "/v1/completions", {"prompt": [1, 99999]}, 400,
     "outside the vocabulary"),
    ("body over the limit", CHAT, {"messages": [{"role": "user", "content": "x" * 70_000}]}, 413,
     "limit"),
    ("no such route", "/v1/embeddings", {"input": "x"}, 404, "no route /v1/embeddings"),
    ("ollama: wrong type", "/api/chat", {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("ollama: unknown model", "/api/generate", {"model": "llama3", "prompt": "x"}, 404,
     "not served here"),
    ("ollama: images", "/api/generate", {"prompt": "x", "images": ["aGk="]}, 400, "images"),
    ("ollama: suffix without FIM tokens", "/api/generate", {"prompt": "a", "suffix": "b"}, 400,
     "no fill-in-the-middle tokens"),
    ("ollama: option of the wrong type", "/api/generate", {"prompt": "x", "options": {
        "temperature": "hot"}}, 400, "options.temperature"),
    ("ollama: body over the limit", "/api/generate", {"prompt": "x" * 70_000}, 413, "limit"),
]


@pytest.mark.parametrize(("path", "body", "status", "message"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_4xx(stories_server: ServeProcess, path: str, body: Any,
                                    status: int, message: str) -> None:
    with stories_server.http() as c:
        if isinstance(body, bytes):
            r = c.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = c.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    if path.startswith("/api/"):
        assert isinstance(err, str) and message in err
    else:
        assert message in err["message"]
        assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
        assert "\n" not in err["message"]


def test_wrong_method_and_the_server_goes_on(stories_server: ServeProcess) -> None:
    with stories_server.http() as c:
        r = c.get(CHAT)
        assert r.status_code == 405 and "GET is not allowed" in r.json()["error"]["message"]
        ok = c.post(CHAT, json={"messages": MSGS, "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_tcp_needs_the_api_key(stories_server: ServeProcess) -> None:
    for key, why in ((None, "missing API key"), ("wrong-key", "invalid API key")):
        with stories_server.tcp(key) as c:
            for path in ("/v1/models", "/api/tags"):
                r = c.get(path)
                assert r.status_code == 401, (key, path)
                assert r.headers["www-authenticate"] == "Bearer"
                text = r.json()["error"] if path.startswith("/api") else r.json()["error"][
                    "message"]
                assert why in text
            r = c.post(CHAT, json={"messages": MSGS, "max_tokens": 2})
            assert r.status_code == 401
    with stories_server.tcp(KEY) as c:
        assert c.get("/v1/models").status_code == 200
    # the official client with the key as its api_key
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stories_server.port}/v1", api_key=KEY,
                           max_retries=0)
    assert [m.id for m in client.models.list()] == ["stories260K"]
    bad = openai.OpenAI(base_url=f"http://127.0.0.1:{stories_server.port}/v1", api_key="nope",
                        max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_openai_client_raises_the_servers_message(stories_server: ServeProcess) -> None:
    client = stories_server.openai()
    with pytest.raises(openai.BadRequestError, match="n must be in 1..16"):
        client.chat.completions.create(model="stories260K", messages=MSGS, n=40)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="other", messages=MSGS)


def test_chunked_body_over_the_limit(stories_server: ServeProcess) -> None:
    def chunks() -> Any:
        for _ in range(20):
            yield b"x" * 8192

    with stories_server.http() as c:
        r = c.post(CHAT, content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]

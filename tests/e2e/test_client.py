"""The apps' client interface: the in-process engine and a live `serve` (socket and TCP) give
the same greedy text for the same prompt, report usage, and fail with one-line errors."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from serve_util import KEY, ServeProcess

from localllm.client import ClientError, ContextOverflow, collect
from localllm.client.local import LocalClient
from localllm.client.remote import RemoteClient
from localllm.config import SamplingParams
from localllm.errors import LocalLLMError
from localllm.llm import LLM

GREEDY = SamplingParams(max_tokens=12, temperature=0)
PROMPT = "Once upon a time, there was a little"
T = TypeVar("T")


@pytest.fixture(scope="module")
def local(stories_path: Path, one_torch_thread: None) -> Iterator[LocalClient]:
    client = LocalClient(LLM(stories_path, dtype="float32"), num_threads=1)
    yield client
    asyncio.run(client.aclose())


@pytest.fixture(scope="module")
def reference(stories_path: Path, one_torch_thread: None) -> LLM:
    """A second engine for expected outputs: `local`'s engine belongs to its loop thread."""
    return LLM(stories_path, dtype="float32")


def test_local_text_matches_llm_generate(local: LocalClient, reference: LLM) -> None:
    text, last = asyncio.run(collect(local.stream_text(PROMPT, GREEDY)))
    expected = reference.generate([PROMPT], GREEDY)[0]
    assert text == expected.text
    assert last.finish_reason == expected.finish_reason == "length"
    assert last.usage is not None
    assert last.usage.prompt_tokens == len(local.llm.encode(PROMPT))
    assert last.usage.completion_tokens == 12
    assert local.card.context == local.llm.engine.max_model_len
    assert local.card.name == "stories260K"
    assert "cpu backend on cpu" in local.card.banner()


def test_local_refuses_a_prompt_longer_than_the_context(local: LocalClient) -> None:
    long = "tree " * (local.llm.engine.max_model_len + 10)
    with pytest.raises(ContextOverflow, match="context holds"):
        asyncio.run(collect(local.stream_text(long, GREEDY)))


def _remote(endpoint: str, key: str | None = None, model: str | None = None) -> RemoteClient:
    async def connect_and_close() -> RemoteClient:
        client = await RemoteClient.connect(endpoint, key, model)
        await client.aclose()
        return client

    return asyncio.run(connect_and_close())


def _run_remote(endpoint: str, key: str | None, work: Callable[[RemoteClient], Awaitable[T]]
                ) -> T:
    """A client lives on one event loop: connect, work and close in one asyncio.run."""
    async def run() -> T:
        remote = await RemoteClient.connect(endpoint, key)
        try:
            return await work(remote)
        finally:
            await remote.aclose()

    return asyncio.run(run())


def test_remote_over_the_socket_equals_local(reference: LLM,
                                             stories_server: ServeProcess) -> None:
    async def run() -> tuple[tuple[str, object], tuple[str, object], int]:
        remote = await RemoteClient.connect(f"unix:{stories_server.socket}")
        try:
            text = await collect(remote.stream_text(PROMPT, GREEDY))
            chat = await collect(remote.stream_chat([{"role": "user", "content": "Hi"}],
                                                    GREEDY))
            return text, chat, await remote.count_tokens(PROMPT)
        finally:
            await remote.aclose()

    (text, last), (chat_text, chat_last), count = asyncio.run(run())
    expected = reference.generate([PROMPT], GREEDY)[0]
    assert text == expected.text
    assert last.usage.prompt_tokens == len(expected.prompt_token_ids)  # type: ignore[attr-defined]
    assert last.usage.completion_tokens == 12  # type: ignore[attr-defined]
    assert last.usage.cached_tokens is not None  # type: ignore[attr-defined]
    ids = reference.encode_chat([{"role": "user", "content": "Hi"}])
    assert chat_text == reference.generate([ids], GREEDY)[0].text
    assert chat_last.usage.prompt_tokens == len(ids)  # type: ignore[attr-defined]
    assert count == len(reference.tokenizer.encode(PROMPT, add_special=False))  # /tokenize


def test_remote_card_and_context_guard(stories_server: ServeProcess) -> None:
    async def work(remote: RemoteClient) -> None:
        assert remote.card.name == remote.model == "stories260K"
        assert remote.card.context and remote.card.context > 0
        long = "tree " * (remote.card.context + 10)
        with pytest.raises(ContextOverflow):
            await collect(remote.stream_text(long, GREEDY))

    _run_remote(f"unix:{stories_server.socket}", None, work)


def test_remote_over_tcp_needs_the_key(stories_server: ServeProcess) -> None:
    url = f"http://127.0.0.1:{stories_server.port}"

    async def work(remote: RemoteClient) -> str:
        return (await collect(remote.stream_text(PROMPT, GREEDY)))[0]

    assert _run_remote(url, KEY, work)
    with pytest.raises(ClientError):
        _remote(url, "wrong-key")


def test_remote_errors_are_one_line(stories_server: ServeProcess, tmp_path: Path) -> None:
    with pytest.raises(ClientError, match="does not serve 'other'.*stories260K"):
        _remote(f"unix:{stories_server.socket}", model="other")
    with pytest.raises(ClientError, match="cannot reach") as e:
        _remote(f"unix:{tmp_path / 'none.sock'}")
    assert "\n" not in str(e.value)
    with pytest.raises(LocalLLMError, match="unix:/path"):
        _remote("localhost:8080")


def test_tokenize_route(stories_server: ServeProcess, local: LocalClient) -> None:
    with stories_server.http() as http:
        r = http.post("/tokenize", json={"prompt": PROMPT})
        assert r.status_code == 200
        body = r.json()
        assert body["tokens"] == local.llm.tokenizer.encode(PROMPT, add_special=False)
        assert body["count"] == len(body["tokens"])
        assert body["max_model_len"] == local.llm.engine.max_model_len
        with_bos = http.post("/tokenize", json={"content": PROMPT, "add_special": True}).json()
        assert with_bos["tokens"] == local.llm.encode(PROMPT)
        r = http.post("/tokenize", json={"model": "stories260K"})
        assert r.status_code == 400 and "'prompt'" in r.json()["error"]["message"]
        assert http.post("/tokenize", json={"prompt": "x", "model": "other"}).status_code == 404


def test_unix_alone_is_serves_default_socket(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from localllm.client.remote import _split_endpoint

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    expected = tmp_path / "localllm" / "localllm.sock"
    assert _split_endpoint("unix:") == ("http://localhost/v1", str(expected))
    assert _split_endpoint("unix:/x/y.sock") == ("http://localhost/v1", "/x/y.sock")
    with pytest.raises(ClientError, match="cannot reach") as e:  # no serve there
        _remote("unix:")
    assert str(expected) in str(e.value)

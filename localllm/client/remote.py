"""`Client` over an OpenAI-compatible server, through the official `openai` client.

`endpoint` is `unix:/path/to.sock` (our `serve`'s socket; `unix:` alone: the socket `serve`
listens on by default) or an `http(s)://host:port` URL, with
or without the trailing `/v1`. llama.cpp's and vLLM's sampling fields (`top_k`, `min_p`,
`repetition_penalty`) travel in the request body where they differ from their neutral values.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import httpx2
import openai

from localllm.client.base import Client, ClientError, ContextOverflow, Delta, Message, Usage
from localllm.config import SamplingParams
from localllm.errors import LocalLLMError
from localllm.model_card import ModelCard


def _split_endpoint(endpoint: str) -> tuple[str, str | None]:
    """(base URL ending in /v1, Unix socket path or None)."""
    if endpoint.startswith("unix:"):
        path = endpoint.removeprefix("unix:").removeprefix("//")
        if not path:  # serve's default socket
            from localllm.server.transport import default_socket_path

            path = str(default_socket_path())
        return "http://localhost/v1", path
    if not endpoint.startswith(("http://", "https://")):
        raise LocalLLMError(f"--endpoint {endpoint!r}: give an http(s):// URL or "
                            f"unix:/path/to.sock")
    base = endpoint.rstrip("/")
    return (base if base.endswith("/v1") else base + "/v1"), None


def _body(params: SamplingParams) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if params.top_k:
        extra["top_k"] = params.top_k
    if params.min_p:
        extra["min_p"] = params.min_p
    if params.repetition_penalty != 1.0:
        extra["repetition_penalty"] = params.repetition_penalty
    if params.ignore_eos:
        extra["ignore_eos"] = True
    return extra


def _usage(u: Any) -> Usage | None:
    if u is None:
        return None
    details = getattr(u, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    return Usage(u.prompt_tokens, u.completion_tokens, cached)


def _failure(e: openai.APIError) -> LocalLLMError:
    msg = getattr(e, "message", None) or str(e)
    body = getattr(e, "body", None)
    code = body.get("code") if isinstance(body, dict) else None
    if isinstance(e, openai.BadRequestError) and (
            code == "context_length_exceeded" or "context" in msg.lower()):
        return ContextOverflow(msg)
    if isinstance(e, openai.APIConnectionError):
        return ClientError(f"cannot reach the server: {msg}")
    return ClientError(msg)


class RemoteClient(Client):
    """`model`: the server's model name (default: the first one /v1/models lists). Build with
    `await RemoteClient.connect(...)`, which asks the server what it serves."""

    def __init__(self, endpoint: str, api_key: str | None, model: str | None,
                 timeout: float = 600.0, extra_body: dict[str, Any] | None = None) -> None:
        self.endpoint = endpoint
        self.extra_body = dict(extra_body or {})  # more JSON fields for every request
        base, uds = _split_endpoint(endpoint)
        self._where = f"unix:{uds}" if uds else base  # for errors
        transport = httpx2.AsyncHTTPTransport(uds=uds) if uds else None
        self._http = openai.DefaultAsyncHttpxClient(transport=transport, timeout=timeout)
        self.api = openai.AsyncOpenAI(base_url=base, api_key=api_key or "unused",
                                      http_client=self._http, max_retries=0)
        self.model = model or ""
        self._root = base.removesuffix("/v1")
        self._tokenize: bool | None = None  # None: not asked yet
        self.card = ModelCard(self.model, "", None, "unknown", None, None, f"at {endpoint}")

    @classmethod
    async def connect(cls, endpoint: str, api_key: str | None = None,
                      model: str | None = None,
                      extra_body: dict[str, Any] | None = None) -> RemoteClient:
        client = cls(endpoint, api_key, model, extra_body=extra_body)
        try:
            await client._describe()
        except BaseException:
            await client.aclose()
            raise
        return client

    async def _describe(self) -> None:
        try:
            listing = await self.api.models.list()
        except openai.APIConnectionError as e:
            raise ClientError(f"cannot reach the server at {self._where}: {e.message} (is it "
                              f"running? `localllm serve` prints where it listens)") from None
        except openai.APIError as e:
            raise _failure(e) from None
        entries = list(listing.data)
        if not entries:
            raise ClientError(f"{self.endpoint} serves no model (/v1/models is empty)")
        entry = next((m for m in entries if m.id == self.model), None)
        if entry is None and self.model:
            names = ", ".join(m.id for m in entries)
            raise ClientError(f"{self.endpoint} does not serve {self.model!r} (it serves: "
                              f"{names}); pass one of those with --model")
        entry = entry or entries[0]
        self.model = entry.id
        extra = entry.model_extra or {}
        raw_meta = extra.get("meta")
        meta: dict[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
        context = extra.get("max_model_len") or meta.get("n_ctx_train")
        self.card = ModelCard(self.model, "", meta.get("n_params"), "unknown",
                              meta.get("size"), int(context) if context else None,
                              f"served at {self.endpoint}")

    def stream_chat(self, messages: Sequence[Message],
                    params: SamplingParams) -> AsyncGenerator[Delta, None]:
        return self._stream(True, list(messages), params)

    def stream_text(self, prompt: str, params: SamplingParams) -> AsyncGenerator[Delta, None]:
        return self._stream(False, prompt, params)

    async def _stream(self, chat: bool, prompt: Any, params: SamplingParams
                      ) -> AsyncGenerator[Delta, None]:
        common: dict[str, Any] = dict(
            model=self.model, stream=True, stream_options={"include_usage": True},
            max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
            extra_body={**_body(params), **self.extra_body})
        if params.seed is not None:
            common["seed"] = params.seed
        if params.stop:
            common["stop"] = list(params.stop)
        try:
            if chat:
                stream = await self.api.chat.completions.create(messages=prompt, **common)
            else:
                stream = await self.api.completions.create(prompt=prompt, **common)
            async with contextlib.aclosing(self._deltas(chat, stream)) as deltas:
                async for d in deltas:
                    yield d
        except openai.APIError as e:
            raise _failure(e) from None

    async def _deltas(self, chat: bool, stream: Any) -> AsyncGenerator[Delta, None]:
        reason: str | None = None
        tokens = 0
        try:
            async for chunk in stream:
                if chunk.choices:
                    choice = chunk.choices[0]
                    text = (choice.delta.content if chat else choice.text) or ""
                    reason = choice.finish_reason or reason
                    if text:
                        tokens += 1
                        yield Delta(text, 1)
                if chunk.usage is not None:
                    yield Delta("", 0, reason or "stop", _usage(chunk.usage))
                    return
            yield Delta("", 0, reason or "stop", Usage(None, tokens, None))
        finally:
            await stream.close()

    async def count_tokens(self, text: str) -> int:
        if self._tokenize is not False:
            try:
                r = await self._http.post(f"{self._root}/tokenize",
                                          json={"model": self.model, "prompt": text,
                                                "content": text, "add_special": False},
                                          headers={"Authorization":
                                                   f"Bearer {self.api.api_key}"})
                if r.status_code == 200:
                    data = r.json()
                    self._tokenize = True
                    if "count" in data:
                        return int(data["count"])
                    return len(data["tokens"])
            except (httpx2.HTTPError, ValueError, KeyError):
                pass
            self._tokenize = False
        return len(text.encode()) // 3 + 1

    async def get_text(self, path: str) -> str | None:
        """GET `path` at the server's root (e.g. `/metrics`): the body, or None where the
        server has no such route or cannot be reached."""
        try:
            r = await self._http.get(f"{self._root}{path}", headers={
                "Authorization": f"Bearer {self.api.api_key}"})
        except httpx2.HTTPError:
            return None
        return r.text if r.status_code == 200 else None

    async def aclose(self) -> None:
        await self.api.close()

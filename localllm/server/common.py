"""Pieces the route modules share: streamed bodies (server-sent events, NDJSON), running a
request to completion while watching for the client to go away, choice bookkeeping, checks of
fields this server cannot honour, and the access-log facts a route leaves for the middleware.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

from localllm.engine.engine import RequestOutput, TokenLogprobs
from localllm.server.errors import APIError

T = TypeVar("T")
SSE_DONE = b"data: [DONE]\n\n"
LOG_KEY = "localllm.log"  # scope key of the dict the access log reads


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def ndjson(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def event_stream(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def ndjson_stream(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(body, media_type="application/x-ndjson")


def access_log(request: Request) -> dict[str, Any]:
    """The dict whose entries the access-log line of this request shows."""
    return request.scope.setdefault(LOG_KEY, {})  # type: ignore[no-any-return]


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; when the client goes away first, `work` is cancelled (which aborts its
    engine requests) and APIError 499 is raised (nobody reads the answer)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise APIError(499, "the client closed the connection")
    return task.result()


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cached_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.cached_tokens = out.cached_tokens
        self.text += out.text
        self.token_ids += out.token_ids
        if out.logprobs:
            self.logprobs += out.logprobs
        if out.finished:
            self.finish_reason = out.finish_reason
            self.error = out.error

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


def failed(choices: list[ChoiceState]) -> None:
    """A choice that failed in the engine fails the whole (non-streamed) request: a 500."""
    for c in choices:
        if c.finish_reason == "error":
            raise APIError(500, f"generation failed: {c.error or 'unknown error'}")


def usage(prompt_tokens: int, choices: list[ChoiceState]) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: prompt tokens taken from
    the prefix cache (the most over the choices)."""
    completion = sum(c.tokens for c in choices)
    cached = max((c.cached_tokens for c in choices), default=0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def refuse_unsupported(body: Any) -> None:
    """OpenAI fields this server accepts only at their neutral values."""
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(body, name, None)
        if value not in (None, 0, 0.0):
            raise APIError(400, f"{name} is not supported; use repeat_penalty (a multiplicative "
                           f"penalty, 1.0 = off) instead", name)
    if getattr(body, "logit_bias", None):
        raise APIError(400, "logit_bias is not supported", "logit_bias")
    fmt = getattr(body, "response_format", None)
    if fmt and fmt.get("type", "text") != "text":
        raise APIError(400, f"response_format {fmt.get('type')!r} is not supported: this server "
                       f"does not constrain output to JSON", "response_format")
    modalities = getattr(body, "modalities", None)
    if modalities and any(m != "text" for m in modalities):
        raise APIError(400, "only the 'text' modality is supported", "modalities")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with \"stream\": true",
                       "stream_options")
    if body.repeat_penalty is not None and body.repetition_penalty is not None:
        raise APIError(400, "give repeat_penalty or repetition_penalty, not both",
                       "repetition_penalty")


def penalty_of(body: Any) -> tuple[float | None, str]:
    """The repetition penalty a chat or text completion asked for, and the field it used."""
    if body.repetition_penalty is not None:
        return body.repetition_penalty, "repetition_penalty"
    return body.repeat_penalty, "repeat_penalty"


def error_event(message: str, kind: str = "server_error") -> bytes:
    return sse({"error": {"message": message, "type": kind, "param": None, "code": None}})

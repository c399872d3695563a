"""Ollama's `POST /api/chat` and `POST /api/generate` (with `suffix` for fill-in-the-middle):
NDJSON streams by default (`"stream": false` for one object), as the official `ollama` client,
Continue and Zed expect. Durations are in nanoseconds, as Ollama reports them.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from localllm.engine.async_engine import EngineDeadError
from localllm.errors import RequestError, TemplateError
from localllm.server.common import (
    ChoiceState,
    access_log,
    ndjson,
    ndjson_stream,
    unless_disconnected,
)
from localllm.server.errors import APIError, parse_body
from localllm.server.ollama_schemas import ChatRequest, GenerateRequest, Options
from localllm.server.openai_completions import no_fim_message
from localllm.server.openai_schemas import Tool
from localllm.server.params import Sampling, sampling_params
from localllm.server.state import ServerState
from localllm.server.tools import ToolCall, ToolCallParser
from localllm.text.chat_encode import encode_chat
from localllm.text.fim import fim_prompt


def now_iso() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _common_checks(state: ServerState, body: ChatRequest | GenerateRequest) -> None:
    state.check_model(body.model)
    if body.format:
        raise APIError(400, "format is not supported: this server does not constrain output "
                       "to JSON")
    if body.think not in (None, False):
        raise APIError(400, f"'{state.model_name}' does not support thinking")


def _params(state: ServerState, options: Options | None, prompt_len: int) -> Any:
    """As Ollama, `num_predict` left out, negative or past the context runs to the context's
    end (clients send their own default, such as 4096, whatever the model's context)."""
    o = options or Options()
    n = o.num_predict
    past_end = n is None or n < 0 or n > state.max_model_len
    max_tokens = None if past_end else state.max_tokens(n, prompt_len, "num_predict")
    return sampling_params(Sampling(
        state.max_tokens(max_tokens, prompt_len), o.temperature, o.top_p, o.top_k, o.min_p,
        o.repeat_penalty, o.seed, o.stop), 1)[0]


def _chat_messages(body: ChatRequest) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(body.messages):
        if m.images:
            raise APIError(400, f"messages[{i}].images: images are not supported (this server "
                           f"reads text only)")
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            msg["tool_calls"] = [{"type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments}}
                for c in m.tool_calls]
        if m.tool_name:
            msg["name"] = m.tool_name
        out.append(msg)
    return out


def _tools(state: ServerState, body: ChatRequest) -> list[dict[str, Any]] | None:
    if not body.tools:
        return None
    if not state.chat_template.takes_tools:
        raise APIError(400, f"'{state.model_name}' does not support tools (its chat template "
                       f"does not take them)")
    tools = []
    for i, t in enumerate(body.tools):
        try:
            tools.append(Tool.model_validate(t, strict=True).model_dump(exclude_none=True))
        except ValueError:
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                           f"{{\"name\": ..., \"parameters\": ...}}}}") from None
    return tools


def _done(start: float, prompt_len: int, c: ChoiceState,
          first: float | None) -> dict[str, Any]:
    end = time.perf_counter()
    first = first or end
    return {"done": True, "done_reason": c.finish_reason,
            "total_duration": int((end - start) * 1e9), "load_duration": 0,
            "prompt_eval_count": prompt_len,
            "prompt_eval_duration": int((first - start) * 1e9), "eval_count": c.tokens,
            "eval_duration": int((end - first) * 1e9)}


async def _run(request: Request, state: ServerState, ids: list[int], params: Any, stream: bool,
               piece: Callable[[str], list[dict[str, Any]]],
               final: Callable[[ChoiceState, str, dict[str, Any]], list[dict[str, Any]]],
               merge: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> Response:
    """Run one request: `piece(text)` gives the stream objects of new text, `final(choice,
    last text, done fields)` the last ones; unstreamed, `merge` makes one object of them all."""
    start = time.perf_counter()
    rid = state.new_id("ollama")
    log = access_log(request)
    log["prompt_tokens"] = len(ids)

    async def objects() -> AsyncIterator[dict[str, Any]]:
        c = ChoiceState()
        first = None
        try:
            async with contextlib.aclosing(state.generate([(ids, params)], rid)) as gen:
                async for _, out in gen:
                    c.add(out)
                    if out.token_ids and first is None:
                        first = time.perf_counter()
                    if out.finish_reason == "error":
                        yield {"error": f"generation failed: {out.error}"}
                        return
                    if not out.finished:
                        for obj in piece(out.text) if out.text else []:
                            yield obj
                        continue
                    log.update(completion_tokens=c.tokens, finish=c.finish_reason)
                    for obj in final(c, out.text, _done(start, len(ids), c, first)):
                        yield obj
        except EngineDeadError as e:
            yield {"error": str(e)}

    if stream:
        async def body() -> AsyncIterator[bytes]:
            async for obj in objects():
                yield ndjson(obj)

        return ndjson_stream(body())

    async def collect() -> list[dict[str, Any]]:
        return [obj async for obj in objects()]

    objs = await unless_disconnected(request, collect())
    if "error" in objs[-1]:
        raise APIError(500, objs[-1]["error"])
    return JSONResponse(merge(objs))


async def chat(request: Request) -> Response:
    state: ServerState = request.app.state.serve
    body = await parse_body(request, ChatRequest)
    _common_checks(state, body)
    if not body.messages:  # a client loading the model
        return JSONResponse({"model": state.model_name, "created_at": now_iso(), "message":
                             {"role": "assistant", "content": ""}, "done_reason": "load",
                             "done": True})
    messages = _chat_messages(body)
    tools = _tools(state, body)
    try:
        ids = encode_chat(state.llm.tokenizer, state.chat_template, messages, tools=tools)
    except (TemplateError, RequestError) as e:
        raise APIError(400, str(e)) from None
    state.check_prompt(ids)
    access_log(request)["prompt"] = messages
    params = _params(state, body.options, len(ids))
    parser = ToolCallParser() if tools else None

    def message(text: str, calls: list[ToolCall] | None = None) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            msg["tool_calls"] = [{"function": {"name": c.name,
                                               "arguments": json.loads(c.arguments)}}
                                 for c in calls]
        return {"model": state.model_name, "created_at": now_iso(), "message": msg,
                "done": False}

    def piece(text: str) -> list[dict[str, Any]]:
        if parser is None:
            return [message(text)]
        content, calls = parser.feed(text)
        return [message(content, calls)] if content or calls else []

    def final(c: ChoiceState, text: str, done: dict[str, Any]) -> list[dict[str, Any]]:
        out = piece(text) if text else []
        if parser is not None:
            content, calls = parser.finish()
            if content or calls:
                out.append(message(content, calls))
            if parser.calls:
                done = {**done, "done_reason": "stop"}
        return [*out, {**message(""), **done}]

    def merge(objs: list[dict[str, Any]]) -> dict[str, Any]:
        calls = [c for o in objs for c in o["message"].get("tool_calls", [])]
        content = "".join(o["message"]["content"] for o in objs)
        msg: dict[str, Any] = {"role": "assistant", "content": content.strip() if calls
                               else content}
        if calls:
            msg["tool_calls"] = calls
        return {**objs[-1], "message": msg}

    return await _run(request, state, ids, params, body.stream, piece, final, merge)


async def generate(request: Request) -> Response:
    state: ServerState = request.app.state.serve
    body = await parse_body(request, GenerateRequest)
    _common_checks(state, body)
    if body.images:
        raise APIError(400, "images are not supported (this server reads text only)")
    if body.template:
        raise APIError(400, "template is not supported; the model's chat template is used "
                       "(or none with raw)")
    tok = state.llm.tokenizer
    if body.suffix == "" and state.fim is None:
        body.suffix = None  # as Ollama: an empty suffix asks for no fill-in-the-middle
    if not body.prompt and body.suffix is None:  # a client loading the model
        return JSONResponse({"model": state.model_name, "created_at": now_iso(), "response": "",
                             "done_reason": "load", "done": True})
    if body.suffix is not None:
        if state.fim is None:
            raise APIError(400, no_fim_message(state))
        ids = fim_prompt(tok, state.fim, body.prompt, body.suffix)
    elif body.raw:
        ids = state.llm.encode(body.prompt)
    else:
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
            {"role": "user", "content": body.prompt}]
        try:
            ids = encode_chat(tok, state.chat_template, messages)
        except (TemplateError, RequestError) as e:
            raise APIError(400, str(e)) from None
    if body.context:
        ids = list(body.context) + (ids[1:] if tok.add_bos and ids[:1] == [tok.bos_id] else ids)
    state.check_prompt(ids)
    access_log(request)["prompt"] = body.prompt
    params = _params(state, body.options, len(ids))

    def obj(text: str) -> dict[str, Any]:
        return {"model": state.model_name, "created_at": now_iso(), "response": text,
                "done": False}

    def final(c: ChoiceState, text: str, done: dict[str, Any]) -> list[dict[str, Any]]:
        return [{**obj(text), **done, "context": ids + c.token_ids}]

    def merge(objs: list[dict[str, Any]]) -> dict[str, Any]:
        return {**objs[-1], "response": "".join(o["response"] for o in objs)}

    return await _run(request, state, ids, params, body.stream, lambda t: [obj(t)], final,
                      merge)

"""`POST /v1/chat/completions`: messages through the chat template (tools where the template
renders them), answered whole or as server-sent events ending in `data: [DONE]`.

With tools, Hermes-style `<tool_call>` blocks in the output become OpenAI `tool_calls` (each
sent whole in one delta when streaming) and the finish reason is "tool_calls".
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from localllm.engine.async_engine import EngineDeadError
from localllm.errors import RequestError, TemplateError
from localllm.server.common import (
    SSE_DONE,
    ChoiceState,
    access_log,
    error_event,
    event_stream,
    failed,
    penalty_of,
    refuse_unsupported,
    sse,
    unless_disconnected,
    usage,
)
from localllm.server.errors import APIError, parse_body
from localllm.server.openai_schemas import ChatCompletionRequest, ChatMessage
from localllm.server.params import Sampling, sampling_params
from localllm.server.state import ServerState
from localllm.server.tools import ToolCall, ToolCallParser
from localllm.text.chat_encode import encode_chat
from localllm.text.tokenizer import Tokenizer


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates read them (HF conventions: tool-call arguments as
    objects, `developer` as `system`); refuses content parts that are not text."""
    out = []
    for i, m in enumerate(messages):
        content: Any = m.content
        if content is None and not (m.role == "assistant" and m.tool_calls):
            # as OpenAI: only an assistant message that calls tools may go without content
            only = (" (only an assistant message with tool_calls may leave it out)"
                    if m.role == "assistant" else "")
            raise APIError(400, f"messages[{i}].content is missing or null; give the {m.role} "
                           f"message its text{only}", f"messages[{i}].content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"content part type '{part.type}' is not supported: "
                                   f"this server reads text parts only",
                                   f"messages[{i}].content[{j}]")
            content = "".join(p.text or "" for p in content)
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                args = c.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise APIError(400, "tool call arguments must be a JSON object",
                                       f"messages[{i}].tool_calls") from None
                if not isinstance(args, dict):
                    raise APIError(400, "tool call arguments must be a JSON object",
                                   f"messages[{i}].tool_calls")
                calls.append({"id": c.id or "", "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _tools(state: ServerState, body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    choice = body.tool_choice
    if not body.tools or choice == "none":
        return None
    if choice is not None and choice != "auto":
        raise APIError(400, "tool_choice supports 'auto' and 'none' here (the model decides "
                       "whether to call a tool)", "tool_choice")
    if not state.chat_template.takes_tools:
        raise APIError(400, f"the chat template of '{state.model_name}' does not take tools; "
                       f"send the request without them", "tools")
    return [t.model_dump(exclude_none=True) for t in body.tools]


def token_logprobs(tok: Tokenizer, lps: list[Any]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        raw = tok.token_to_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob,
                "bytes": list(raw)}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(i, v) for i, v in lp.top]} for lp in lps]}


def tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.serve
    body = await parse_body(request, ChatCompletionRequest)
    state.check_model(body.model)
    refuse_unsupported(body)
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
        raise APIError(400, f"top_logprobs must be in 0..20, got {body.top_logprobs}",
                       "top_logprobs")
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
    tools = _tools(state, body)
    messages = template_messages(body.messages)
    try:
        ids = encode_chat(state.llm.tokenizer, state.chat_template, messages, tools=tools)
    except (TemplateError, RequestError) as e:
        raise APIError(400, str(e), "messages") from None
    state.check_prompt(ids)
    log = access_log(request)
    log.update(prompt_tokens=len(ids), prompt=messages)
    requested = (body.max_completion_tokens if body.max_completion_tokens is not None
                 else body.max_tokens)
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    penalty, penalty_field = penalty_of(body)
    params = sampling_params(Sampling(
        state.max_tokens(requested, len(ids), name), body.temperature, body.top_p, body.top_k,
        body.min_p, penalty, body.seed, body.stop, body.n, body.ignore_eos,
        (body.top_logprobs or 0) if body.logprobs else None, penalty_field), state.options.max_n)
    rid = state.new_id("chatcmpl")
    meta = {"id": rid, "created": int(time.time()), "model": state.model_name}
    if body.stream:
        include = bool(body.stream_options and body.stream_options.include_usage)
        return event_stream(_stream(state, ids, params, meta, tools is not None, include,
                                    bool(body.logprobs), log))
    choices = [ChoiceState() for _ in params]

    async def collect() -> None:
        async with contextlib.aclosing(state.generate([(ids, p) for p in params], rid)) as gen:
            async for i, out in gen:
                choices[i].add(out)

    await unless_disconnected(request, collect())
    failed(choices)
    result = []
    for i, c in enumerate(choices):
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        reason = c.finish_reason
        if tools is not None:
            parser = ToolCallParser()
            content = parser.feed(c.text)[0] + parser.finish()[0]
            if parser.calls:
                message = {"role": "assistant", "content": content.strip() or None,
                           "tool_calls": [tool_call_json(t) for t in parser.calls]}
                reason = "tool_calls"
        result.append({"index": i, "message": message, "finish_reason": reason,
                       "logprobs": token_logprobs(state.llm.tokenizer, c.logprobs)
                       if body.logprobs else None})
    log.update(completion_tokens=sum(c.tokens for c in choices),
               finish=",".join(str(c.finish_reason) for c in choices))
    return JSONResponse({**meta, "object": "chat.completion", "choices": result,
                         "usage": usage(len(ids), choices)})


async def _stream(state: ServerState, ids: list[int], params: list[Any], meta: dict[str, Any],
                  with_tools: bool, include_usage: bool, logprobs: bool,
                  log: dict[str, Any]) -> AsyncIterator[bytes]:
    tok = state.llm.tokenizer
    choices = [ChoiceState() for _ in params]
    parsers = [ToolCallParser() for _ in params] if with_tools else []
    pending = [""] * len(params)  # whitespace held back while tool calls may follow
    extra = {"usage": None} if include_usage else {}

    def chunk(i: int, delta: dict[str, Any], reason: str | None = None,
              lps: Any = None) -> bytes:
        return sse({**meta, "object": "chat.completion.chunk", **extra, "choices": [
            {"index": i, "delta": delta, "logprobs": lps, "finish_reason": reason}]})

    def content_delta(i: int, text: str, calls: list[ToolCall], lps: Any = None) -> list[bytes]:
        out = []
        if with_tools:
            text, pending[i] = pending[i] + text, ""
            if not text.strip():
                pending[i], text = text, ""
        if text or lps is not None:
            out.append(chunk(i, {"content": text}, None, lps))
        first = len(parsers[i].calls) - len(calls) if with_tools else 0
        for k, call in enumerate(calls):
            out.append(chunk(i, {"tool_calls": [tool_call_json(call, first + k)]}))
        return out

    for i in range(len(params)):
        yield chunk(i, {"role": "assistant", "content": ""})
    try:
        async with contextlib.aclosing(state.generate([(ids, p) for p in params],
                                                      meta["id"])) as gen:
            async for i, out in gen:
                c = choices[i]
                c.add(out)
                text, calls = parsers[i].feed(out.text) if with_tools else (out.text, [])
                lps = token_logprobs(tok, out.logprobs) if logprobs and out.logprobs else None
                for piece in content_delta(i, text, calls, lps):
                    yield piece
                if not out.finished:
                    continue
                if out.finish_reason == "error":
                    yield error_event(f"generation failed: {out.error or 'unknown error'}")
                    yield SSE_DONE
                    return
                reason = out.finish_reason
                if with_tools:
                    text, calls = parsers[i].finish()
                    if parsers[i].calls:  # whitespace around tool calls is dropped
                        pending[i] = ""
                        for piece in content_delta(i, "" if not text.strip() else text, calls):
                            yield piece
                        reason = "tool_calls"
                    elif pending[i] + text:
                        yield chunk(i, {"content": pending[i] + text})
                yield chunk(i, {}, reason)
    except EngineDeadError as e:
        yield error_event(str(e))
        yield SSE_DONE
        return
    log.update(completion_tokens=sum(c.tokens for c in choices),
               finish=",".join(str(c.finish_reason) for c in choices))
    if include_usage:
        yield sse({**meta, "object": "chat.completion.chunk", "choices": [],
                   "usage": usage(len(ids), choices)})
    yield SSE_DONE

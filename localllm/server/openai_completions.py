"""`POST /v1/completions`: raw-text (or token-id) prompts, one or several, `n` choices each;
with `suffix`, a fill-in-the-middle prompt built from the model's FIM tokens."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from localllm.engine.async_engine import EngineDeadError
from localllm.engine.engine import TokenLogprobs
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
from localllm.server.openai_schemas import CompletionRequest
from localllm.server.params import Sampling, sampling_params
from localllm.server.state import ServerState
from localllm.text.fim import fim_prompt
from localllm.text.tokenizer import Tokenizer


def no_fim_message(state: ServerState, what: str = "`suffix`",
                   otherwise: str = ", or send the prompt without a suffix") -> str:
    return (f"'{state.model_name}' has no fill-in-the-middle tokens (its vocabulary declares no "
            f"<fim_prefix>/<fim_suffix>/<fim_middle>), so {what} cannot be used; serve a code "
            f"model trained for infilling{otherwise}")


def prompts_of(state: ServerState, body: CompletionRequest) -> tuple[list[list[int]], list[str]]:
    """Prompt ids and prompt texts (for echo) of every prompt in the request."""
    tok = state.llm.tokenizer
    p = body.prompt
    texts: list[str] = []
    ids: list[list[int]] = []
    if isinstance(p, str):
        texts = [p]
    elif p and isinstance(p[0], str):
        texts = [x for x in p if isinstance(x, str)]
    elif p and isinstance(p[0], int):
        ids = [[x for x in p if isinstance(x, int)]]
    elif p and isinstance(p[0], list):
        ids = [x for x in p if isinstance(x, list)]
    if not texts and not ids:
        raise APIError(400, "prompt must be a string, a list of strings, or token ids (not "
                       "empty)", "prompt")
    if ids:
        if any(not x for x in ids):
            raise APIError(400, "prompt holds an empty list of token ids", "prompt")
        if body.suffix is not None:
            raise APIError(400, "suffix needs a text prompt, not token ids", "suffix")
        for x in ids:
            state.check_prompt(x, "prompt")
        return ids, [tok.decode(x) for x in ids]
    if body.suffix is not None:
        if state.fim is None:
            raise APIError(400, no_fim_message(state), "suffix")
        return [fim_prompt(tok, state.fim, t, body.suffix) for t in texts], texts
    return [state.llm.encode(t) for t in texts], texts


def completion_logprobs(tok: Tokenizer, lps: list[TokenLogprobs],
                        start: int = 0) -> dict[str, Any]:
    """OpenAI's `logprobs` of a choice; `text_offset` counts from `start` (where these tokens
    begin in the choice's text: a streamed chunk continues from the ones before it)."""
    def text(token_id: int) -> str:
        return tok.token_to_bytes(token_id).decode("utf-8", errors="replace")

    tokens = [text(lp.token_id) for lp in lps]
    offsets, pos = [], start
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{text(i): v for i, v in lp.top} for lp in lps],
            "text_offset": offsets}


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.serve
    body = await parse_body(request, CompletionRequest)
    state.check_model(body.model)
    refuse_unsupported(body)
    if body.best_of not in (None, body.n):
        raise APIError(400, "best_of is not supported (only best_of = n)", "best_of")
    if body.logprobs is not None and not 0 <= body.logprobs <= 20:
        raise APIError(400, f"logprobs must be in 0..20, got {body.logprobs}", "logprobs")
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported (no prompt logprobs)", "echo")
    prompts, texts = prompts_of(state, body)
    for ids in prompts:
        state.check_prompt(ids, "prompt")
    log = access_log(request)
    log.update(prompt_tokens=sum(len(x) for x in prompts), prompt=texts)
    jobs: list[tuple[list[int], Any]] = []
    penalty, penalty_field = penalty_of(body)
    for ids in prompts:
        params = sampling_params(Sampling(
            state.max_tokens(body.max_tokens, len(ids)), body.temperature, body.top_p,
            body.top_k, body.min_p, penalty, body.seed, body.stop, body.n, body.ignore_eos,
            body.logprobs, penalty_field), state.options.max_n)
        jobs += [(ids, p) for p in params]
    echo = [texts[k // body.n] if body.echo else "" for k in range(len(jobs))]
    prompt_tokens = sum(len(ids) for ids, _ in jobs)
    rid = state.new_id("cmpl")
    meta = {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": state.model_name}
    if body.stream:
        include = bool(body.stream_options and body.stream_options.include_usage)
        return event_stream(_stream(state, jobs, echo, meta, include, body.logprobs is not None,
                                    prompt_tokens, log))
    choices = [ChoiceState() for _ in jobs]

    async def collect() -> None:
        async with contextlib.aclosing(state.generate(jobs, rid)) as gen:
            async for i, out in gen:
                choices[i].add(out)

    await unless_disconnected(request, collect())
    failed(choices)
    tok = state.llm.tokenizer
    result = [{"index": i, "text": echo[i] + c.text, "finish_reason": c.finish_reason,
               "logprobs": completion_logprobs(tok, c.logprobs)
               if body.logprobs is not None else None} for i, c in enumerate(choices)]
    log.update(completion_tokens=sum(c.tokens for c in choices),
               finish=",".join(str(c.finish_reason) for c in choices))
    return JSONResponse({**meta, "choices": result, "usage": usage(prompt_tokens, choices)})


async def _stream(state: ServerState, jobs: list[tuple[list[int], Any]], echo: list[str],
                  meta: dict[str, Any], include_usage: bool, logprobs: bool, prompt_tokens: int,
                  log: dict[str, Any]) -> AsyncIterator[bytes]:
    tok = state.llm.tokenizer
    choices = [ChoiceState() for _ in jobs]
    offset = [0] * len(jobs)  # text_offset of each choice's next token
    extra = {"usage": None} if include_usage else {}

    def chunk(i: int, text: str, reason: str | None = None, lps: Any = None) -> bytes:
        return sse({**meta, **extra, "choices": [
            {"index": i, "text": text, "logprobs": lps, "finish_reason": reason}]})

    for i, text in enumerate(echo):
        if text:
            yield chunk(i, text)
    try:
        async with contextlib.aclosing(state.generate(jobs, meta["id"])) as gen:
            async for i, out in gen:
                choices[i].add(out)
                if out.finish_reason == "error":
                    yield error_event(f"generation failed: {out.error or 'unknown error'}")
                    yield SSE_DONE
                    return
                lps = None
                if logprobs and out.logprobs:
                    lps = completion_logprobs(tok, out.logprobs, offset[i])
                    offset[i] += sum(len(t) for t in lps["tokens"])
                if out.text or lps is not None or out.finished:
                    yield chunk(i, out.text, out.finish_reason if out.finished else None, lps)
    except EngineDeadError as e:
        yield error_event(str(e))
        yield SSE_DONE
        return
    log.update(completion_tokens=sum(c.tokens for c in choices),
               finish=",".join(str(c.finish_reason) for c in choices))
    if include_usage:
        yield sse({**meta, "choices": [], "usage": usage(prompt_tokens, choices)})
    yield SSE_DONE

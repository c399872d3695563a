"""llama-server's own routes: `POST /completion` (raw prompts) and `POST /infill` (code
completion between a prefix and a suffix, with extra context from other files), as llama.vim,
llama.vscode and other llama.cpp clients call them.

Answers have llama-server's fields (`content`, `stop`, `stop_type`, `tokens_predicted`,
`tokens_cached`, `truncated`, `timings`, ...); `response_fields` picks some of them, a path such
as `timings/prompt_n` becoming a key of its own. Streamed (`"stream": true`), each piece of
text is one server-sent event and the last event (`"stop": true`, its `content` empty) carries
the other fields; no `[DONE]` follows, as in llama-server.

Sampling takes llama-server's defaults. `samplers`, when given, names the samplers that apply
(`top_k`, `top_p`, `min_p`, `temperature`, `penalties`, or their letters `k p m t e`); the rest
are off, and names this server has no sampler for (`infill`, `dry`, `xtc`, ...) are ignored.
`temperature` <= 0 is greedy either way. `n_predict` 0 prefills the prompt into the prefix
cache and generates nothing (editors warm the cache with their extra context that way).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from localllm.config import SamplingParams
from localllm.engine.async_engine import EngineDeadError
from localllm.server.common import access_log, error_event, event_stream, sse, unless_disconnected
from localllm.server.errors import APIError, parse_body
from localllm.server.line_rules import LineRules
from localllm.server.llamacpp_schemas import (
    UNSUPPORTED,
    CompletionBody,
    InfillBody,
    LlamaOptions,
)
from localllm.server.openai_completions import no_fim_message
from localllm.server.params import Sampling, sampling_params
from localllm.server.state import ServerState
from localllm.text.fim import ExtraFile, infill_prompt

LOCAL_BUDGET = 2048  # prefix and suffix tokens at most (3/4 and 1/4), as llama-server's batch
RESERVE_SHARE = 8  # the context's 1/8 is kept from extra files for the completion
RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's seed for "pick one"
_LETTERS = {"k": "top_k", "p": "top_p", "m": "min_p", "t": "temperature", "e": "penalties"}
_NAMES = {"top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "temperature": "temperature",
          "temp": "temperature", "penalties": "penalties"}


def _samplers(value: list[str] | str | None) -> set[str] | None:
    """The samplers that apply; None: all."""
    if value is None:
        return None
    if isinstance(value, str):
        return {_LETTERS[c] for c in value if c in _LETTERS}
    return {_NAMES[n] for n in value if n in _NAMES}


def _check_options(body: LlamaOptions) -> None:
    defaults = LlamaOptions()
    for name in UNSUPPORTED:
        value = getattr(body, name)
        if value not in (getattr(defaults, name), None, [], {}, ""):
            raise APIError(400, f"{name} is not supported by this server; leave it out",
                           name)
    if body.n_indent < 0 or body.t_max_predict_ms < 0:
        raise APIError(400, "n_indent and t_max_predict_ms must be >= 0 (0: off)")


def _n_predict(body: LlamaOptions) -> int:
    n = body.n_predict if body.n_predict is not None else body.max_tokens
    return -1 if n is None or n < 0 else n


def _params(state: ServerState, body: LlamaOptions, prompt_len: int,
            end_ids: tuple[int, ...] = ()) -> SamplingParams:
    n = _n_predict(body)
    room = max(1, state.max_model_len - prompt_len)
    use = _samplers(body.samplers)

    def on(name: str) -> bool:
        return use is None or name in use

    greedy = body.temperature <= 0
    p = sampling_params(Sampling(
        room if n < 0 else min(max(n, 1), room),
        0.0 if greedy else body.temperature if on("temperature") else 1.0,
        body.top_p if on("top_p") else 1.0, body.top_k if on("top_k") else 0,
        body.min_p if on("min_p") else 0.0,
        body.repeat_penalty if on("penalties") else 1.0,
        None if body.seed < 0 or body.seed == RANDOM_SEED else body.seed, body.stop, 1,
        body.ignore_eos), 1)[0]
    return dataclasses.replace(p, stop_token_ids=end_ids) if end_ids else p


def _settings(body: LlamaOptions, params: SamplingParams) -> dict[str, Any]:
    return {"n_predict": _n_predict(body), "temperature": params.temperature,
            "top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p,
            "repeat_penalty": params.repetition_penalty, "seed": body.seed,
            "stop": list(params.stop), "ignore_eos": params.ignore_eos,
            "n_indent": body.n_indent, "t_max_predict_ms": body.t_max_predict_ms,
            "stream": body.stream}


def _pick(result: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    """llama-server's `response_fields`: each path present in `result`, under its path."""
    if not fields:
        return result
    out: dict[str, Any] = {}
    for path in fields:
        value: Any = result
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


@dataclass
class _Job:
    """One prompt of a request and what it has produced."""

    ids: list[int]
    params: SamplingParams
    rules: LineRules
    prefill_only: bool
    content: str = ""
    token_ids: list[int] = field(default_factory=list)
    cached: int = 0
    first: float | None = None
    end: float | None = None
    reason: str | None = None  # the engine's finish reason, or "rule"
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.end is not None

    def add(self, text: str, token_ids: list[int], finished: bool, reason: str | None,
            error: str | None, cached: int) -> str:
        """Take one engine output; the text that can go to the client now."""
        now = time.perf_counter()
        self.cached = cached
        if self.done:
            return ""
        if token_ids and self.first is None:
            self.first = now
        self.token_ids += token_ids
        out = "" if self.prefill_only else self.rules.feed(text, now) if text else ""
        if self.rules.stopped:
            self.reason = "rule"
        elif finished:
            self.reason, self.error = reason, error
            out += "" if self.prefill_only else self.rules.finish()
        if self.reason is not None:
            self.end = now
        self.content += out
        return out


def _stop_type(job: _Job, stop: tuple[str, ...], state: ServerState) -> tuple[str, str]:
    """llama-server's `stop_type` and `stopping_word`."""
    if job.prefill_only or job.reason in ("rule", "length"):
        return "limit", ""
    if job.reason != "stop":
        return "none", ""
    if job.token_ids and job.token_ids[-1] in (*state.llm.tokenizer.stop_ids,
                                               *job.params.stop_token_ids):
        return "eos", ""
    rest = state.llm.tokenizer.decode(job.token_ids)[len(job.content):]
    return "word", next((s for s in stop if s in rest), "")


def _result(state: ServerState, body: LlamaOptions, job: _Job, index: int, start: float,
            prompt_text: str, truncated: bool) -> dict[str, Any]:
    first = job.first or job.end or start
    end = job.end or first
    predicted = 0 if job.prefill_only else len(job.token_ids)
    prompt_n = len(job.ids) - job.cached
    prompt_ms = (first - start) * 1000
    predicted_ms = (end - first) * 1000
    stop_type, word = _stop_type(job, job.params.stop, state)
    return {
        "index": index, "content": job.content,
        "tokens": job.token_ids if body.return_tokens and not job.prefill_only else [],
        "id_slot": -1, "stop": True, "model": state.model_name,
        "tokens_predicted": predicted, "tokens_evaluated": len(job.ids),
        "generation_settings": _settings(body, job.params), "prompt": prompt_text,
        "has_new_line": "\n" in job.content, "truncated": truncated, "stop_type": stop_type,
        "stopping_word": word, "tokens_cached": len(job.ids) + predicted,  # held in the KV
        "timings": {
            "cache_n": job.cached, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n / prompt_ms * 1000 if prompt_ms > 0 else 0.0,
            "predicted_n": predicted, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / predicted if predicted else 0.0,
            "predicted_per_second": predicted / predicted_ms * 1000 if predicted_ms > 0
            else 0.0}}


async def _run(request: Request, state: ServerState, body: LlamaOptions, jobs: list[_Job],
               prompt_texts: list[str], truncated: bool) -> Response:
    log = access_log(request)
    log["prompt_tokens"] = sum(len(j.ids) for j in jobs)
    rid = state.new_id("llama")
    start = time.perf_counter()

    async def events() -> AsyncIterator[tuple[int, str, dict[str, Any] | None]]:
        """(job, new text, its final result once done)."""
        async with contextlib.aclosing(state.generate(
                [(j.ids, j.params) for j in jobs], rid)) as gen:
            async for i, out in gen:
                job = jobs[i]
                was_done = job.done
                text = job.add(out.text, out.token_ids, out.finished, out.finish_reason,
                               out.error, out.cached_tokens)
                if job.done and not was_done:
                    if not out.finished:  # a rule ended it: the engine stops it
                        state.abort_job(rid, i)
                    yield i, text, _result(state, body, job, i, start, prompt_texts[i],
                                           truncated)
                elif text:
                    yield i, text, None
                if all(j.done for j in jobs):
                    break

    def note() -> None:
        log.update(completion_tokens=sum(len(j.token_ids) for j in jobs),
                   finish=",".join(str(j.reason) for j in jobs))

    if body.stream:
        async def stream() -> AsyncIterator[bytes]:
            try:
                async for i, text, final in events():
                    if final is None:
                        yield sse({"index": i, "content": text, "tokens": [], "stop": False,
                                   "id_slot": -1})
                        continue
                    if jobs[i].reason == "error":
                        yield error_event(f"generation failed: {jobs[i].error}")
                        return
                    if text:  # every piece of text comes in a partial event, as llama-server
                        yield sse({"index": i, "content": text, "tokens": [], "stop": False,
                                   "id_slot": -1})
                    yield sse(_pick({**final, "content": ""}, body.response_fields))
            except EngineDeadError as e:
                yield error_event(str(e))
            note()

        return event_stream(stream())

    results: list[dict[str, Any]] = [{} for _ in jobs]

    async def collect() -> None:
        async for i, _, final in events():
            if final is not None:
                results[i] = final

    await unless_disconnected(request, collect())
    note()
    for j in jobs:
        if j.reason == "error":
            raise APIError(500, f"generation failed: {j.error or 'unknown error'}")
    picked = [_pick(r, body.response_fields) for r in results]
    return JSONResponse(picked[0] if len(picked) == 1 else picked)  # as llama-server


def _prompt_ids(state: ServerState, prompt: str | list[Any] | None) -> list[list[int]]:
    """llama-server's prompt forms: a text, token ids (used as they are), ids mixed with texts
    (BOS first where the first is a text), or a list of texts and id lists (several prompts).
    The prompt is raw, as in llama-server: the text of a control token (`<|im_start|>`,
    `<|fim_prefix|>`...) in it is that token, so that a script can write its own template."""
    tok = state.llm.tokenizer
    if prompt is None or prompt == "" or prompt == []:
        raise APIError(400, "prompt is required (a text, token ids, or a list of prompts)",
                       "prompt")
    if isinstance(prompt, str):
        return [tok.encode(prompt, add_special=True, parse_special=True)]
    if all(isinstance(x, (str, list)) for x in prompt):
        return [y for x in prompt for y in _prompt_ids(state, x)]
    bos = tok.add_bos and tok.bos_id is not None and isinstance(prompt[0], str)
    ids = [tok.bos_id] if bos and tok.bos_id is not None else []
    for x in prompt:
        if isinstance(x, bool) or not isinstance(x, (int, str)):
            raise APIError(400, "prompt: a list must hold token ids and texts, or prompts",
                           "prompt")
        ids += [x] if isinstance(x, int) else tok.encode(x, add_special=False,
                                                         parse_special=True)
    return [ids]


def _jobs(state: ServerState, body: LlamaOptions, prompts: list[list[int]],
          end_ids: tuple[int, ...] = ()) -> list[_Job]:
    jobs = []
    for ids in prompts:
        state.check_prompt(ids, "prompt")
        jobs.append(_Job(ids, _params(state, body, len(ids), end_ids),
                         LineRules(body.n_indent, body.t_max_predict_ms),
                         _n_predict(body) == 0))
    return jobs


async def completion(request: Request) -> Response:
    state: ServerState = request.app.state.serve
    body = await parse_body(request, CompletionBody)
    state.check_model(body.model)
    _check_options(body)
    prompts = _prompt_ids(state, body.prompt)
    jobs = _jobs(state, body, prompts)
    texts = [state.llm.tokenizer.decode(ids) for ids in prompts]
    access_log(request)["prompt"] = texts
    return await _run(request, state, body, jobs, texts, False)


async def infill(request: Request) -> Response:
    state: ServerState = request.app.state.serve
    body = await parse_body(request, InfillBody)
    state.check_model(body.model)
    _check_options(body)
    fim = state.fim
    if fim is None:
        raise APIError(400, no_fim_message(state, "/infill", " (such as Qwen2.5-Coder)"))
    tok = state.llm.tokenizer
    capacity = state.prompt_capacity
    # fixed budgets, whatever this request's text and n_predict: the prefix and suffix, then
    # the extra files in what the completion's share leaves, so that an editor's warm-up
    # (n_predict 0) keeps the same files as the completions after it, which then reuse its
    # cached blocks; +4: BOS and the three FIM tokens
    local = min(LOCAL_BUDGET, capacity // 2)
    extra = [ExtraFile(c.filename, c.text) for c in body.input_extra]
    built = infill_prompt(tok, fim, body.input_prefix, body.input_suffix, body.prompt, extra,
                          local, capacity - capacity // RESERVE_SHARE - local - 4)
    access_log(request)["prompt"] = body.input_prefix + "<HOLE>" + body.input_suffix
    jobs = _jobs(state, body, [built.ids], fim.end_ids)
    return await _run(request, state, body, jobs, [tok.decode(built.ids)], built.dropped > 0)

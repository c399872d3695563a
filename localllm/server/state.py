"""What every route shares: the served model, the engine, options, metrics, and the requests in
flight (so that a shutdown can end them).

`ServerState.generate` runs (prompt, params) jobs as engine requests at once (OpenAI's `n`,
several prompts) and yields `(job index, RequestOutput)` as each arrives. Closing it early (the
client went away, the handler failed) aborts every request it started; their blocks are freed
at the engine's next step. It records the request metrics as the outputs stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from localllm.config import SamplingParams
from localllm.engine.engine import RequestOutput
from localllm.engine.metrics import EngineSnapshot
from localllm.errors import PromptTooLong, RequestError
from localllm.llm import LLM
from localllm.server.errors import APIError
from localllm.server.metrics import ServerMetrics
from localllm.text.chat_template import ChatTemplate
from localllm.text.fim import FimTokens

log = logging.getLogger("localllm.serve")
_ids = itertools.count()


class Engine(Protocol):
    """What the server needs of an engine (`AsyncLLMEngine` has it)."""

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 request_id: str | None = None) -> AsyncGenerator[RequestOutput, None]: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineSnapshot: ...


@dataclass(frozen=True)
class ServeOptions:
    api_key: str | None = None  # required on TCP connections
    log_prompts: bool = False
    max_body_bytes: int = 8 << 20
    shutdown_timeout: float = 10.0  # seconds open streams may run on after SIGTERM/SIGINT
    max_n: int = 16
    cors_origins: tuple[str, ...] = ()  # web origins browsers may call from ("*": any)


@dataclass
class ServerState:
    llm: LLM
    engine: Engine
    model_name: str
    options: ServeOptions = field(default_factory=ServeOptions)
    template: ChatTemplate | None = None  # default: the model's own
    fim: FimTokens | None = None
    metadata: dict[str, Any] = field(default_factory=dict)  # GGUF keys shown by /api/show
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if self.template is None:
            self.template = self.llm.template
        self.metrics = ServerMetrics(self.engine.stats)
        self.active: set[str] = set()
        self.closing = False

    @property
    def chat_template(self) -> ChatTemplate:
        assert self.template is not None
        return self.template

    @property
    def max_model_len(self) -> int:
        return self.llm.engine.max_model_len

    @property
    def prompt_capacity(self) -> int:
        """Tokens a prompt and its completion can take together: the context, or the KV cache
        where that is smaller."""
        e = self.llm.engine
        return min(e.max_model_len, e.num_blocks * e.block_size)

    # ----------------------------------------------------------------- requests
    def check_model(self, name: str | None, param: str = "model") -> None:
        """A request may name the served model (with or without an Ollama `:tag`) or none."""
        if not name or name in (self.model_name, f"{self.model_name}:latest"):
            return
        raise APIError(404, f"model '{name}' is not served here; this server serves "
                       f"'{self.model_name}' (see /v1/models)", param, "model_not_found")

    def check_prompt(self, prompt_ids: list[int], param: str = "messages") -> None:
        """APIError 400 for a prompt the engine would refuse (empty, longer than the context,
        ids outside the vocabulary), with code "context_length_exceeded" only when it is too
        long (clients shorten the prompt on that code); 503 once the server is shutting down."""
        if self.closing:
            raise APIError(503, "the server is shutting down")
        try:
            self.llm.engine.check_prompt(prompt_ids)
        except RequestError as e:
            code = "context_length_exceeded" if isinstance(e, PromptTooLong) else None
            raise APIError(400, str(e), param, code) from None

    def max_tokens(self, requested: int | None, prompt_len: int, param: str = "max_tokens") -> int:
        """The tokens to generate at most: as requested (1 to the context length; generation
        stops at the context's end), or by default up to the context's end."""
        if requested is None:
            return max(1, self.max_model_len - prompt_len)
        if not 1 <= requested <= self.max_model_len:
            raise APIError(400, f"{param} must be in 1..{self.max_model_len} (the context "
                           f"length), got {requested}", param)
        return requested

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{time.strftime('%H%M%S')}{next(_ids):06d}"

    def begin_shutdown(self) -> None:
        """Refuse new requests; after `shutdown_timeout` seconds abort those still running
        (their streams end with finish reason "abort")."""
        self.closing = True
        loop = asyncio.get_running_loop()
        loop.call_later(self.options.shutdown_timeout, self.abort_all)

    def abort_job(self, request_id: str, index: int) -> None:
        """End job `index` of `generate(jobs, request_id)` while the others run on (its stream
        then ends with finish reason "abort")."""
        self.engine.abort(f"{request_id}-{index}")

    def abort_all(self) -> None:
        for rid in list(self.active):
            self.engine.abort(rid)

    # ----------------------------------------------------------------- generation
    async def generate(self, jobs: Sequence[tuple[list[int], SamplingParams]],
                       request_id: str) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Run each (prompt ids, params) job as an engine request, all at once; yield
        (job index, output) as outputs arrive."""
        self.metrics.prompt_tokens.inc(sum(len(ids) for ids, _ in jobs))
        if len(jobs) == 1:
            ids, params = jobs[0]
            async with contextlib.aclosing(self._one(ids, params, f"{request_id}-0")) as stream:
                async for out in stream:
                    yield 0, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, ids: list[int], p: SamplingParams) -> None:
            try:
                async with contextlib.aclosing(self._one(ids, p, f"{request_id}-{i}")) as stream:
                    async for out in stream:
                        queue.put_nowait((i, out))
                queue.put_nowait((i, None))
            except BaseException as e:  # cancelled included: the consumer hears of it
                queue.put_nowait((i, e))
                raise

        tasks = [asyncio.create_task(pump(i, ids, p)) for i, (ids, p) in enumerate(jobs)]
        try:
            left = len(tasks)
            while left:
                i, item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, prompt_ids: list[int], params: SamplingParams,
                   rid: str) -> AsyncGenerator[RequestOutput, None]:
        m = self.metrics
        start = last = time.perf_counter()
        first = True
        done = False
        self.active.add(rid)
        try:
            async with contextlib.aclosing(self.engine.generate(prompt_ids, params, rid)) as s:
                async for out in s:
                    now = time.perf_counter()
                    if out.token_ids:
                        (m.ttft if first else m.itl).observe(now - last)
                        first = False
                        last = now
                        m.generation_tokens.inc(len(out.token_ids))
                    if out.finished:
                        done = True
                        m.e2e.observe(now - start)
                        m.finished.labels(out.finish_reason or "unknown").inc()
                    yield out
        finally:
            self.active.discard(rid)
            if not done:  # the client went away (or the handler failed): aborted
                m.finished.labels("cancelled").inc()

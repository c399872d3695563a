"""`Client` over the in-process engine: an `LLM` stepped by an `AsyncLLMEngine` thread."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence

from localllm.client.base import Client, ClientError, ContextOverflow, Delta, Message, Usage
from localllm.config import SamplingParams
from localllm.engine.async_engine import AsyncLLMEngine
from localllm.errors import RequestError
from localllm.llm import LLM
from localllm.model_card import gguf_scalars, local_card


class LocalClient(Client):
    """Owns `llm` from here on: `aclose()` stops the engine thread and closes the LLM.
    `num_threads`: torch threads of the engine thread (see AsyncLLMEngine)."""

    def __init__(self, llm: LLM, num_threads: int | None = None,
                 quantize: str | None = None) -> None:
        self.llm = llm
        self.engine = AsyncLLMEngine(llm.engine, num_threads=num_threads)
        runs_on = f"{llm.backend.name} backend on {llm.backend.device.type}"
        self.card = local_card(llm.path, llm.config, gguf_scalars(llm.path),
                               llm.engine.max_model_len, runs_on, quantize)

    def stream_chat(self, messages: Sequence[Message],
                    params: SamplingParams) -> AsyncGenerator[Delta, None]:
        return self._stream(self.llm.encode_chat(messages), params)

    def stream_text(self, prompt: str, params: SamplingParams) -> AsyncGenerator[Delta, None]:
        return self._stream(self.llm.encode(prompt), params)

    async def count_tokens(self, text: str) -> int:
        return len(self.llm.tokenizer.encode(text, add_special=False))

    async def chat_tokens(self, messages: Sequence[Message]) -> int | None:
        return len(self.llm.encode_chat(messages))

    async def _stream(self, ids: list[int], params: SamplingParams) -> AsyncGenerator[Delta, None]:
        limit = self.llm.engine.max_model_len
        if len(ids) >= limit:
            raise ContextOverflow(f"the prompt has {len(ids)} tokens; the context holds "
                                  f"{limit}")
        tokens = 0
        try:
            async with contextlib.aclosing(self.engine.generate(ids, params)) as stream:
                async for out in stream:
                    if out.error:
                        raise ClientError(out.error)
                    tokens += len(out.token_ids)
                    usage = (Usage(len(ids), tokens, out.cached_tokens) if out.finished
                             else None)
                    yield Delta(out.text, len(out.token_ids), out.finish_reason, usage)
        except RequestError as e:
            raise ClientError(str(e)) from None

    async def aclose(self) -> None:
        self.engine.shutdown()
        self.llm.close()

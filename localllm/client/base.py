"""The one interface the apps talk to: stream a chat reply or a text completion.

Two implementations: `LocalClient` (the in-process engine) and `RemoteClient` (any
OpenAI-compatible server: our `serve` over its Unix socket or TCP, vLLM, SGLang, llama-server).
Both are async: `chat`, `summarize` and `bench serve` run many requests at once on one event loop.

    async with contextlib.aclosing(client.stream_chat(messages, params)) as stream:
        async for delta in stream:
            print(delta.text, end="")
        # the last delta has finish_reason set and, where known, usage

Leaving a stream early (break, cancellation, Ctrl-C) aborts its request. A client lives on one
event loop: connect, use and `aclose()` it there (e.g. one `asyncio.Runner` for a REPL).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import NamedTuple

from localllm.config import SamplingParams
from localllm.errors import LocalLLMError
from localllm.model_card import ModelCard

Message = dict[str, str]


class ContextOverflow(LocalLLMError):
    """The prompt (with room for the reply) does not fit the model's context."""


class ClientError(LocalLLMError):
    """The engine or server failed the request (a one-line reason)."""


class Usage(NamedTuple):
    prompt_tokens: int | None  # None: the server did not say
    completion_tokens: int
    cached_tokens: int | None  # prompt tokens whose K/V came from a prefix cache


class Delta(NamedTuple):
    text: str  # text since the previous delta
    tokens: int = 0  # tokens since the previous delta (remote: counts deltas that carry text)
    finish_reason: str | None = None  # set on the last delta
    usage: Usage | None = None  # on the last delta, where known


class Client(ABC):
    """`card` says what model answers (name, size, quantization, context, where it runs)."""

    card: ModelCard

    @property
    def context(self) -> int | None:
        return self.card.context

    @abstractmethod
    def stream_chat(self, messages: Sequence[Message],
                    params: SamplingParams) -> AsyncGenerator[Delta, None]:
        """The reply to `messages` through the model's chat template. ContextOverflow when the
        conversation does not fit; ClientError when the request fails."""

    @abstractmethod
    def stream_text(self, prompt: str, params: SamplingParams) -> AsyncGenerator[Delta, None]:
        """A raw completion of `prompt` (no chat template)."""

    @abstractmethod
    async def count_tokens(self, text: str) -> int:
        """Tokens of `text` as the model reads it (remote: the server's /tokenize where it
        has one, else an upper estimate of one token per 3 bytes)."""

    async def chat_tokens(self, messages: Sequence[Message]) -> int | None:
        """Prompt tokens of a chat, where the client can know before sending (local)."""
        return None

    @abstractmethod
    async def aclose(self) -> None:
        """Release the engine or connection (the local engine's prefix cache reaches disk)."""


async def collect(stream: AsyncIterator[Delta]) -> tuple[str, Delta]:
    """Drain a stream: (whole text, last delta)."""
    text, last = [], Delta("")
    async for d in stream:
        text.append(d.text)
        last = d
    return "".join(text), last

"""Summaries over the client: a text longer than the context is split on token counts at
paragraph boundaries (blank lines: paragraphs, and functions or blocks in source), then
lines, then words; its parts are summarized and their summaries combined, in rounds until
one summary is left (map-reduce).

Token counts come from `client.count_tokens`; each part leaves room in the context for the
prompt around it and for a reply of `max_tokens`. A server that still refuses a part as too
long gets it again in halves.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import NamedTuple, cast

from localllm.client.base import Client, ClientError, ContextOverflow, Delta, Message
from localllm.config import SamplingParams
from localllm.errors import LocalLLMError

Count = Callable[[str], Awaitable[int]]

# blank lines, then line ends, then whitespace: each piece keeps its separator at its end
_LEVELS = (re.compile(r"\n[ \t]*\n\s*"), re.compile(r"\n"), re.compile(r"\s+"))
_MARGIN = 8  # tokens of slack for the template's and the tokenizer's seams


def default_instruction(max_words: int) -> str:
    return (f"You write summaries. Summarize the text the user sends in at most {max_words} "
            f"words. Reply with the summary only.")


class Summary(NamedTuple):
    text: str
    parts: int  # the pieces the input was split into (1: it fit in one request)
    rounds: int  # rounds of combining part summaries
    prompt_tokens: int
    output_tokens: int
    requests: int


def _split_after(text: str, pattern: re.Pattern[str]) -> list[str]:
    out, start = [], 0
    for m in pattern.finditer(text):
        if m.end() > start:
            out.append(text[start:m.end()])
            start = m.end()
    if start < len(text):
        out.append(text[start:])
    return out


async def pack(text: str, budget: int, count: Count, level: int = 0) -> list[str]:
    """`text` cut into consecutive pieces of at most `budget` tokens each (joined, they give
    `text` back), cut at the coarsest boundary that makes them fit."""
    n = await count(text)
    if n <= budget:
        return [text]
    if level == len(_LEVELS):  # one word longer than the budget: cut it by characters
        step = max(1, len(text) * budget // (n + 1))
        return [c for i in range(0, len(text), step)
                for c in await pack(text[i:i + step], budget, count, level)]
    pieces = _split_after(text, _LEVELS[level])
    if len(pieces) == 1:
        return await pack(text, budget, count, level + 1)
    chunks: list[str] = []
    cur, cur_n = "", 0
    for piece in pieces:
        m = await count(piece)
        if m > budget:
            if cur:
                chunks.append(cur)
            chunks += await pack(piece, budget, count, level + 1)
            cur, cur_n = "", 0
        elif cur and cur_n + m > budget - _MARGIN and await count(cur + piece) > budget:
            chunks.append(cur)
            cur, cur_n = piece, m
        else:
            cur, cur_n = cur + piece, cur_n + m
    if cur:
        chunks.append(cur)
    return chunks


class Summarizer:
    """Summaries of whole inputs through `client.stream_chat`; at most `slots` requests at
    once (shared by every input, so the parts of a long file batch with other files).
    `output_tokens` counts every generated token so far (for the progress line)."""

    def __init__(self, client: Client, instruction: str, params: SamplingParams,
                 slots: int) -> None:
        self.client = client
        self.instruction = instruction
        self.params = params
        self.slots = asyncio.Semaphore(slots)
        self.output_tokens = 0

    def messages(self, user: str) -> list[Message]:
        return [{"role": "system", "content": self.instruction},
                {"role": "user", "content": user}]

    @staticmethod
    def whole(name: str, text: str) -> str:
        return f"File: {name}\n\n{text}"

    @staticmethod
    def part(name: str, i: int, n: int, text: str) -> str:
        return f"File: {name} (part {i} of {n})\n\n{text}"

    @staticmethod
    def combined(name: str, summaries: Sequence[str]) -> str:
        body = "\n\n".join(summaries)
        return f"File: {name} (summaries of its consecutive parts, in order)\n\n{body}"

    async def budget(self, name: str) -> int | None:
        """Tokens of text one request can carry for `name`; None: the context is unknown."""
        context = self.client.context
        if not context:
            return None
        frame = self.messages(self.combined(name, ["", ""]) + self.part(name, 999, 999, ""))
        overhead = await self.client.chat_tokens(frame)
        if overhead is None:  # remote: the text's tokens plus room for the template
            overhead = await self.client.count_tokens(
                "\n".join(m["content"] for m in frame)) + 32
        budget = context - overhead - self.params.max_tokens - _MARGIN
        if budget < 2 * self.params.max_tokens + _MARGIN:
            raise LocalLLMError(
                f"the context ({context} tokens) leaves {max(budget, 0)} tokens of text per "
                f"request, too few to combine summaries of up to {self.params.max_tokens} "
                f"tokens: lower --max-words/--max-tokens (or raise --max-model-len where it is "
                f"below the model's context)")
        return budget

    async def ask(self, user: str, tally: list[int]) -> str:
        """One reply; `tally` gains [prompt tokens, output tokens, requests]."""
        async with self.slots:
            text: list[str] = []
            prompt = output = 0
            stream = cast(AsyncGenerator[Delta, None],
                          self.client.stream_chat(self.messages(user), self.params))
            async with contextlib.aclosing(stream) as deltas:
                async for d in deltas:
                    text.append(d.text)
                    output += d.tokens
                    self.output_tokens += d.tokens
                    if d.usage is not None:
                        prompt = d.usage.prompt_tokens or 0
        tally[0] += prompt
        tally[1] += output
        tally[2] += 1
        return "".join(text).strip()

    async def summarize(self, name: str, text: str) -> Summary:
        budget = await self.budget(name)
        tally = [0, 0, 0]
        while True:
            try:
                return await self._map_reduce(name, text, budget, tally)
            except ContextOverflow:
                n = budget or await self.client.count_tokens(text)
                if n < 2 * self.params.max_tokens + 2 * _MARGIN:
                    raise
                budget = n // 2

    async def _map_reduce(self, name: str, text: str, budget: int | None,
                          tally: list[int]) -> Summary:
        count = self.client.count_tokens
        chunks = [text] if budget is None else await pack(text, budget, count)
        if len(chunks) == 1:
            return Summary(await self.ask(self.whole(name, text), tally), 1, 0, *tally)
        assert budget is not None
        summaries = list(await asyncio.gather(*(
            self.ask(self.part(name, i + 1, len(chunks), c), tally)
            for i, c in enumerate(chunks))))
        rounds = 0
        while len(summaries) > 1:
            rounds += 1
            groups = await _groups(summaries, budget, count)
            if len(groups) == len(summaries):
                raise ClientError(f"the part summaries of {name} do not shrink: each fills a "
                                  f"request alone; lower --max-words or --max-tokens")
            summaries = list(await asyncio.gather(*(
                self.ask(self.combined(name, g), tally) if len(g) > 1 else _same(g[0])
                for g in groups)))
        return Summary(summaries[0], len(chunks), rounds, *tally)


async def _same(text: str) -> str:
    return text


async def _groups(summaries: Sequence[str], budget: int, count: Count) -> list[list[str]]:
    """Consecutive summaries grouped so that each group, joined, fits the budget."""
    groups: list[list[str]] = []
    cur: list[str] = []
    for s in summaries:
        if cur and await count("\n\n".join([*cur, s])) > budget:
            groups.append(cur)
            cur = []
        cur.append(s)
    if cur:
        groups.append(cur)
    return groups

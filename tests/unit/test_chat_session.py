"""`ChatSession` on a scripted `Client`: a failing request and a server that refuses long
prompts are said on stderr, stdout keeps only replies, and the REPL goes on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from localllm.apps.chat import ChatSession
from localllm.apps.chat_store import Conversation, Store
from localllm.client import Client, ClientError, ContextOverflow, Delta, Message, Usage
from localllm.config import SamplingParams
from localllm.model_card import ModelCard


class Scripted(Client):
    """Replies "ok" to prompts of at most `fits` messages, refuses longer ones as a remote
    server does, and fails after one delta when the last message is "fail"."""

    def __init__(self, fits: int = 100) -> None:
        self.card = ModelCard("scripted", "", None, "unknown", None, None, "here")
        self.fits = fits
        self.seen: list[int] = []

    async def stream_chat(self, messages: Sequence[Message], params: SamplingParams
                          ) -> AsyncIterator[Delta]:
        self.seen.append(len(messages))
        if len(messages) > self.fits:
            raise ContextOverflow("this model's maximum context length is 64 tokens")
        yield Delta("o", 1)
        if messages[-1]["content"] == "fail":
            raise ClientError("the server closed the connection")
        yield Delta("k", 1, "stop", Usage(10, 2, 0))

    def stream_text(self, prompt: str, params: SamplingParams) -> AsyncIterator[Delta]:
        raise NotImplementedError

    async def count_tokens(self, text: str) -> int:
        return len(text)

    async def aclose(self) -> None:
        pass


def _session(tmp_path: Path, client: Client) -> tuple[ChatSession, asyncio.Runner]:
    runner = asyncio.Runner()
    conv = Conversation("t", "sys")
    return ChatSession(runner, client, conv, SamplingParams(), Store(tmp_path)), runner


def test_a_failed_reply_is_said_and_not_kept(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    session, runner = _session(tmp_path, Scripted())
    with runner:
        session.send("hi")
        session.send("fail")
        session.send("again")
    out, err = capsys.readouterr()
    assert out == "ok\no\nok\n"  # the shown part of the failed reply ends its line
    assert "[error: the server closed the connection]" in err
    assert "[no reply came" not in err and err.count("not kept") == 0
    contents = [m["content"] for m in session.conv.messages]
    assert contents == ["hi", "ok", "fail", "o", "again", "ok"]
    assert session.conv.messages[3]["interrupted"] is True
    assert session.last is not None and session.last.prompt_tokens == 10


def test_a_refused_prompt_drops_the_oldest_turns(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    client = Scripted(fits=4)  # the system prompt and three messages
    session, runner = _session(tmp_path, client)
    with runner:
        for text in ["one", "two", "three"]:
            session.send(text)
    out, err = capsys.readouterr()
    assert out == "ok\n" * 3
    assert client.seen == [2, 4, 6, 4]  # the third prompt was refused, then sent without turn 1
    assert "[context full (this model's maximum context length is 64 tokens)" in err
    assert session.conv.prompt()[0] == {"role": "system", "content": "sys"}
    assert len(session.conv.messages) == 6 and session.conv.start == 2
    assert Store(tmp_path).load("t").start == 2

    tight = Scripted(fits=1)  # not even the system prompt and one message
    session, runner = _session(tmp_path, tight)
    with runner:
        session.send("alone")
    out, err = capsys.readouterr()
    assert out == "" and "does not fit the context" in err and "not kept" in err
    assert session.conv.messages == []

"""A scripted engine (its outputs written here, not sampled) and an in-process server over it on
a Unix socket, for tests of the routes' own logic."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncGenerator, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from localllm import LLM, SamplingParams
from localllm.engine.engine import RequestOutput, TokenLogprobs
from localllm.engine.metrics import EngineSnapshot
from localllm.server.runner import make_server
from localllm.server.state import ServerState

SCRIPTS = {
    "weather": ["Let me ", "check.", "\n<tool", "_call>\n{\"name\": \"get_", "weather\", ",
                "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"],
    "hello": ["Hel", "lo ", "there."],
    "fail": ["Par", "tial"],
    "spaced": ["No tool ", "needed.", "\n", "  "],
    "indented": ["x = 1\n", "    y ", "= 2\n  ", "  z = 3\n", "w = 4\n"],
}


class ScriptedEngine:
    """Answers from SCRIPTS by a keyword of the prompt; 'fail' ends in an engine error,
    'forever' (words) and 'newlines' (lines) run until aborted."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.aborted: set[str] = set()
        self.params: list[SamplingParams] = []  # of every request, in order
        self.prompts: list[list[int]] = []  # likewise

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        rid = request_id or "x"
        self.params.append(params)
        self.prompts.append(list(prompt_ids))
        text = self.llm.tokenizer.decode(prompt_ids)
        key = next((k for k in ("spaced", "fail", "forever", "newlines", "indented", "weather")
                    if k in text), "hello")
        pieces = SCRIPTS.get(key, [])
        lps = None if params.logprobs is None else [TokenLogprobs(5, -0.5, ((5, -0.5),))]
        for piece in pieces:
            await asyncio.sleep(0.002)
            yield RequestOutput(rid, piece, [5], False, None, None, lps)
        while key in ("forever", "newlines") and rid not in self.aborted:
            await asyncio.sleep(0.005)
            yield RequestOutput(rid, "la\n" if key == "newlines" else "la ", [5], False, None,
                                None)
        reason = {"fail": "error", "forever": "abort", "newlines": "abort"}.get(key, "stop")
        yield RequestOutput(rid, "", [], True, reason,
                            "RuntimeError: boom" if key == "fail" else None)

    def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    def stats(self) -> EngineSnapshot:
        return EngineSnapshot(1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)




@contextmanager
def running(state: ServerState, path: Path) -> Iterator[threading.Thread]:
    """`state` served on a Unix socket at `path` in this process until the block ends."""
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    ready = threading.Event()
    server = make_server(state, ready.set)
    thread = threading.Thread(target=lambda: server.run(sockets=[sock]), daemon=True)
    thread.start()
    assert ready.wait(30)
    try:
        yield thread
    finally:
        server.should_exit = True
        thread.join(30)


def client(path: Path) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://x",
                        timeout=30)

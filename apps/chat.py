"""`localllm chat`: a terminal chat REPL that streams replies and keeps the conversation.

Commands: /help, /reset (forget the conversation), /system TEXT (set the system prompt and
reset), /exit. Ctrl-C stops a reply mid-stream (what was shown is kept); Ctrl-D exits.
Without a terminal (piped input), one line is one user message.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Callable

from localllm.config import SamplingParams
from localllm.engine.async_engine import AsyncLLMEngine
from localllm.errors import LocalLLMError
from localllm.llm import LLM, Message

HELP = ("/reset  forget the conversation\n/system TEXT  set the system prompt (and reset)\n"
        "/exit  quit (or Ctrl-D)\nCtrl-C stops a reply; the part shown is kept.")


class Conversation:
    def __init__(self, system: str | None) -> None:
        self.system = system
        self.messages: list[Message] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []


def _line_reader(tty: bool) -> Callable[[], str]:
    if not tty:
        def read_plain() -> str:
            line = sys.stdin.readline()
            if not line:
                raise EOFError
            return line.rstrip("\n")
        return read_plain
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, InMemoryHistory

    try:
        from pathlib import Path

        from platformdirs import user_state_dir

        hist_path = Path(user_state_dir("localllm")) / "chat_history"
        hist_path.parent.mkdir(parents=True, exist_ok=True)
        history: FileHistory | InMemoryHistory = FileHistory(str(hist_path))
    except OSError:
        history = InMemoryHistory()
    session: PromptSession[str] = PromptSession(history=history)
    return lambda: session.prompt(">>> ")


class _Reply:
    """Text and timing of one streamed reply."""

    def __init__(self) -> None:
        self.text = ""
        self.tokens = 0
        self.start = time.perf_counter()
        self.first: float | None = None


async def _stream_reply(engine: AsyncLLMEngine, ids: list[int], params: SamplingParams,
                        rep: _Reply) -> None:
    async with contextlib.aclosing(engine.generate(ids, params)) as stream:
        async for out in stream:
            if out.token_ids and rep.first is None:
                rep.first = time.perf_counter()
            rep.tokens += len(out.token_ids)
            rep.text += out.text
            sys.stdout.write(out.text)
            sys.stdout.flush()
            if out.error:
                print(f"\n[error: {out.error}]", file=sys.stderr)


def reply(llm: LLM, engine: AsyncLLMEngine, conv: Conversation, params: SamplingParams) -> str:
    """Stream one assistant reply to stdout; returns its text (partial if interrupted)."""
    ids = llm.encode_chat(conv.messages)
    limit = llm.engine.max_model_len - min(params.max_tokens, llm.engine.max_model_len // 2)
    first_turn = 1 if conv.system else 0
    while len(ids) > limit and len(conv.messages) > first_turn + 1:
        del conv.messages[first_turn]  # forget the oldest turn to fit the context
        ids = llm.encode_chat(conv.messages)
    rep = _Reply()
    try:
        asyncio.run(_stream_reply(engine, ids, params, rep))
    except KeyboardInterrupt:  # the stream was closed on the way out: the request is aborted
        print("\n[stopped]", file=sys.stderr)
    except LocalLLMError as e:
        print(f"[error: {e}]", file=sys.stderr)
    t1 = time.perf_counter()
    sys.stdout.write("\n")
    if rep.first is not None:
        n = rep.tokens
        rate = (n - 1) / (t1 - rep.first) if n > 1 and t1 > rep.first else 0.0
        print(f"[{n} tokens, first after {rep.first - rep.start:.2f} s, {rate:.1f} tokens/s]",
              file=sys.stderr)
    return rep.text


def run_chat(args: argparse.Namespace, llm: LLM, params: SamplingParams,
             threads: int | None = None) -> int:
    engine = AsyncLLMEngine(llm.engine, num_threads=threads)
    try:
        return _repl(args, llm, engine, params)
    finally:
        engine.shutdown()
        llm.close()  # the prefix cache's last blocks reach the disk


def _repl(args: argparse.Namespace, llm: LLM, engine: AsyncLLMEngine,
          params: SamplingParams) -> int:
    tty = sys.stdin.isatty() and sys.stdout.isatty()
    read = _line_reader(tty)
    conv = Conversation(args.system)
    if tty:
        name = llm.config.name or llm.path.name
        print(f"localllm chat — {name}. /help for commands, Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = read()
        except EOFError:
            return 0
        except KeyboardInterrupt:
            continue
        if not line.strip():
            continue
        cmd, _, rest = line.strip().partition(" ")
        if cmd in ("/exit", "/quit"):
            return 0
        if cmd == "/help":
            print(HELP, file=sys.stderr)
            continue
        if cmd == "/reset":
            conv.reset()
            print("[conversation cleared]", file=sys.stderr)
            continue
        if cmd == "/system":
            conv.system = rest.strip() or None
            conv.reset()
            print("[system prompt set; conversation cleared]", file=sys.stderr)
            continue
        conv.messages.append({"role": "user", "content": line})
        text = reply(llm, engine, conv, params)
        conv.messages.append({"role": "assistant", "content": text})

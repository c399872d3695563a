"""Where `localllm chat`'s messages come from: a prompt-toolkit session on a terminal (history,
completion, multi-line keys), or plain lines from a pipe.

Both read one message per call and raise EOFError when the user leaves. A message is one line,
or a block from a line starting with `\"\"\"` to a line ending with `\"\"\"` (the quotes are
taken off).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

QUOTES = '"""'
PROMPT = ">>> "
LEAVE_HINT = "[Ctrl-C again, Ctrl-D or /exit leaves]"


def open_block(text: str) -> bool:
    """True while `text` is a \"\"\" block that has not been closed yet."""
    s = text.lstrip()
    return s.startswith(QUOTES) and not (len(s.rstrip()) >= 6 and s.rstrip().endswith(QUOTES))


def unquote(text: str) -> str:
    s = text.strip()
    if s.startswith(QUOTES):
        s = s.removeprefix(QUOTES).removesuffix(QUOTES).strip("\n")
    return s


class PipeInput:
    """Messages from a non-terminal stdin."""

    def read(self) -> str:
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        text = line.rstrip("\n")
        while open_block(text):
            more = sys.stdin.readline()
            if not more:
                break
            text += "\n" + more.rstrip("\n")
        return unquote(text)


class TerminalInput:
    """A prompt-toolkit session on the chat's event loop (`runner`). Ctrl-C clears the line;
    at an empty prompt it says how to leave, and a second one leaves."""

    def __init__(self, runner: asyncio.Runner, history: Path | None,
                 saved_names: Callable[[], Iterable[str]]) -> None:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.filters import Condition
        from prompt_toolkit.history import FileHistory, History, InMemoryHistory
        from prompt_toolkit.key_binding import KeyBindings

        from localllm.apps.chat_commands import completer

        self.runner = runner
        self._empty_interrupt = False  # the last Ctrl-C came at an empty prompt
        keys = KeyBindings()

        @keys.add("escape", "enter")
        def _newline(event: Any) -> None:
            event.current_buffer.insert_text("\n")

        @keys.add("enter", filter=Condition(lambda: open_block(self.session.default_buffer.text)))
        def _block_newline(event: Any) -> None:
            event.current_buffer.insert_text("\n")

        @keys.add("c-c")
        def _interrupt(event: Any) -> None:
            self._empty_interrupt = not event.current_buffer.text.strip()
            event.app.exit(exception=KeyboardInterrupt())

        hist: History = InMemoryHistory()
        if history is not None:
            try:
                history.parent.mkdir(parents=True, exist_ok=True)
                hist = FileHistory(str(history))
            except OSError as e:
                print(f"[input history off: {e}]", file=sys.stderr)
        self.session: Any = PromptSession(
            history=hist, key_bindings=keys, completer=completer(saved_names),
            complete_while_typing=False, prompt_continuation="... ")

    def read(self) -> str:
        armed = False
        while True:
            try:
                text = self.runner.run(self.session.prompt_async(PROMPT))
            except KeyboardInterrupt:
                if not self._empty_interrupt:
                    armed = False
                    continue
                if armed:
                    raise EOFError from None
                armed = True
                print(LEAVE_HINT, file=sys.stderr)
                continue
            return unquote(str(text))

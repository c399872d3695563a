"""Running `localllm chat` in tests: its environment (every user folder in a temporary one),
the real REPL in a pseudo-terminal (pexpect), piped runs, and the greedy replies to expect."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pexpect
from serve_util import interruptible

STORIES_ARGS = ["--dtype", "float32", "--temperature", "0", "--threads", "1",
                "--kv-cache-memory", "0.05"]
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]")
STATS = re.compile(r"\[(\d+) tokens, first after [\d.]+ s, [\d.]+ tokens/s\]")


def chat_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCALLLM_MODEL", "LOCALLLM_CHAT_DIR")}
    for name in ("DATA", "STATE", "CONFIG", "CACHE"):
        env[f"XDG_{name}_HOME"] = str(tmp / name.lower())
    env.update(OMP_NUM_THREADS="1", PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm")
    env.update(extra)
    return env


def saved(tmp: Path, name: str | None = None) -> dict[str, Any]:
    """A saved conversation (the only one when `name` is None)."""
    folder = tmp / "data" / "localllm" / "conversations"
    files = [folder / f"{name}.json"] if name else list(folder.glob("*.json"))
    assert len(files) == 1, files
    data: dict[str, Any] = json.loads(files[0].read_text())
    return data


def clean(text: str) -> str:
    """Terminal output as a person reads it: no escape sequences, \\n line ends."""
    return _ANSI.sub("", text).replace("\r\n", "\n").replace("\r", "")


def pipe_chat(args: Sequence[str], stdin: str, env: dict[str, str], timeout: float = 120
              ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "localllm.apps.cli", "chat", *args],
                          input=stdin, capture_output=True, text=True, timeout=timeout,
                          env=env)


class Repl:
    """`localllm chat` in a pseudo-terminal, read the way a person reads it. prompt-toolkit
    turns bracketed paste on as a prompt starts and off as it takes the input: those two
    sequences frame each command's output."""

    STARTED, TAKEN = r"\x1b\[\?2004h", r"\x1b\[\?2004l"

    def __init__(self, args: Sequence[str], env: dict[str, str], timeout: float = 90) -> None:
        self.p = pexpect.spawn(sys.executable, ["-m", "localllm.apps.cli", "chat", *args],
                               env=env, encoding="utf-8", timeout=timeout,
                               dimensions=(50, 300), preexec_fn=interruptible)
        self.banner = self.prompt()

    def prompt(self) -> str:
        """Everything shown until the next prompt, cleaned."""
        self.p.expect(self.STARTED)
        return clean(self.p.before)

    def send(self, text: str) -> None:
        """Type `text` (Esc-Enter for each newline in it) and Enter; return once it is taken."""
        self.p.send(text.replace("\n", "\x1b\r") + "\r")
        self.p.expect(self.TAKEN)

    def ask(self, text: str) -> tuple[str, int]:
        """Send a message; (the reply shown, its token count from the stats line)."""
        self.send(text)
        return self.reply()

    def reply(self) -> tuple[str, int]:
        shown = self.prompt()
        m = STATS.search(shown)
        assert m is not None, shown
        return shown[:m.start()].strip("\n"), int(m.group(1))

    def command(self, line: str) -> str:
        """Run a slash command; what it printed."""
        self.send(line)
        return self.prompt()

    def leave(self, keys: str = "\x04") -> int:
        self.p.send(keys)
        self.p.expect(pexpect.EOF)
        self.p.close()
        return int(self.p.exitstatus if self.p.exitstatus is not None else -1)

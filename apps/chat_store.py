"""`localllm chat`'s conversations on disk and its input history.

One JSON file per conversation in the user data directory (`~/.local/share/localllm/
conversations` on Linux: platformdirs, so `$XDG_DATA_HOME` moves it; `$LOCALLLM_CHAT_DIR`
replaces it), written to a temporary file and renamed, so a crash leaves the old file or the new
one. The input history lives in the user state directory (`$XDG_STATE_HOME/localllm/
chat_history`).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localllm.client import Message
from localllm.errors import LocalLLMError

ENV_DIR = "LOCALLLM_CHAT_DIR"
FORMAT = 1
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def conversations_dir() -> Path:
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    from platformdirs import user_data_dir

    return Path(user_data_dir("localllm")) / "conversations"


def history_path() -> Path:
    from platformdirs import user_state_dir

    return Path(user_state_dir("localllm")) / "chat_history"


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise LocalLLMError(f"conversation name {name!r}: use letters, digits, '.', '-' and "
                            f"'_' (starting with a letter or digit)")
    return name


@dataclass
class Conversation:
    """The chat's one conversation: `messages` are the user and assistant turns (no system
    message); the model sees the system prompt and `messages[start:]` (the context guard moves
    `start` past the oldest turns). An assistant message cut short (Ctrl-C, a failed
    request) has `"interrupted": true`."""

    name: str
    system: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    start: int = 0
    model: str = ""

    def prompt(self) -> list[Message]:
        head: list[Message] = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": m["role"], "content": m["content"]}
                       for m in self.messages[self.start:]]

    def clear(self) -> None:
        self.messages.clear()
        self.start = 0

    def drop_oldest_turn(self) -> int:
        """Stop sending the oldest user turn (and its reply); returns how many messages went,
        0 when only the last user message is left."""
        user_turns = [i for i in range(self.start, len(self.messages))
                      if self.messages[i]["role"] == "user"]
        if len(user_turns) < 2:
            return 0
        gone = user_turns[1] - self.start
        self.start = user_turns[1]
        return gone

    def pop_turn(self) -> dict[str, Any] | None:
        """Remove the last user message and everything after it; returns that message."""
        for i in range(len(self.messages) - 1, -1, -1):
            if self.messages[i]["role"] == "user":
                user = self.messages[i]
                del self.messages[i:]
                self.start = min(self.start, len(self.messages))
                return user
        return None

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "name": self.name, "model": self.model,
                "system": self.system, "start": self.start, "messages": self.messages,
                "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    @classmethod
    def from_json(cls, data: dict[str, Any], name: str) -> Conversation:
        msgs = data.get("messages")
        if not isinstance(msgs, list) or not all(
                isinstance(m, dict) and m.get("role") in ("user", "assistant")
                and isinstance(m.get("content"), str) for m in msgs):
            raise ValueError("'messages' is not a list of user and assistant messages")
        start = data.get("start", 0)
        return cls(name=name, system=data.get("system") or None, messages=msgs,
                   start=start if isinstance(start, int) and 0 <= start <= len(msgs) else 0,
                   model=str(data.get("model") or ""))


class Store:
    """The folder of saved conversations."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or conversations_dir()

    def path(self, name: str) -> Path:
        return self.root / f"{check_name(name)}.json"

    def save(self, conv: Conversation) -> Path:
        path = self.path(conv.name)
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{conv.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(conv.to_json(), f, ensure_ascii=False, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    def load(self, name: str) -> Conversation:
        path = self.path(name)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            return Conversation.from_json(data, name)
        except FileNotFoundError:
            raise LocalLLMError(f"no saved conversation {name!r} in {self.root}") from None
        except (OSError, ValueError) as e:
            raise LocalLLMError(f"cannot read conversation {path}: {e}") from None

    def names(self) -> list[str]:
        """Saved conversations, the most recently saved first."""
        if not self.root.is_dir():
            return []
        files = [p for p in self.root.glob("*.json") if _NAME.fullmatch(p.stem)]
        files.sort(key=lambda p: p.stat().st_mtime_ns, reverse=True)
        return [p.stem for p in files]

    def new_name(self) -> str:
        """A name for a new conversation: its start time, made unique."""
        base = time.strftime("%Y-%m-%d-%H%M%S")
        name, n = base, 1
        while self.path(name).exists():
            n += 1
            name = f"{base}-{n}"
        return name

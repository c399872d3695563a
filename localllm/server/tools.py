"""Tool calls in generated text: Hermes-style `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` blocks (Qwen2.5, Hermes, SmolLM3 and others), found while the text streams.

`ToolCallParser.feed` takes each new piece of text and returns the text that is plain content
(holding back an end that may begin `<tool_call>`) and the calls completed so far; `finish`
flushes the rest at the end of the stream. A block whose body is not a JSON object with a
`name` stays in the content as it was written.
"""

from __future__ import annotations

import json
import secrets
from typing import NamedTuple

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class ToolCall(NamedTuple):
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parse_call(body: str) -> ToolCall | None:
    """A call from the JSON between the tags (`arguments`, or Llama-style `parameters`)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def _open_tail(text: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of OPEN."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0


class ToolCallParser:
    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        content = ""
        new: list[ToolCall] = []
        while True:
            if not self._in_call:
                at = self._buf.find(OPEN)
                if at < 0:
                    keep = _open_tail(self._buf)
                    content += self._buf[:len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                content += self._buf[:at]
                self._buf = self._buf[at + len(OPEN):]
                self._in_call = True
            at = self._buf.find(CLOSE)
            if at < 0:
                break
            body, self._buf = self._buf[:at], self._buf[at + len(CLOSE):]
            self._in_call = False
            call = parse_call(body)
            if call is None:
                content += OPEN + body + CLOSE
            else:
                new.append(call)
        self.calls += new
        return content, new

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The held-back end: an unclosed call that parses counts as a call."""
        rest, self._buf = self._buf, ""
        if not self._in_call:
            return rest, []
        self._in_call = False
        call = parse_call(rest)
        if call is None:
            return OPEN + rest, []
        self.calls.append(call)
        return "", [call]

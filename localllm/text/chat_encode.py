"""Chat messages (and tool definitions) -> token ids, with client text never turned into special
tokens, whatever the template does with it.

Every string a client chose (message content, names, tool-call arguments, tool definitions,
free-form JSON keys) is replaced by a sentinel: private-use characters around a random number,
which no filter (`trim`, `upper`, `tojson`, ...) changes. The template is rendered twice, with
the sentinels and with the real strings. The sentinel rendering splits into template text and
references to client strings; the real rendering is then read left to right against it, each
reference matching one of the forms a template can give its string (as is, stripped, upper or
lower case, JSON-escaped). Template text is tokenized with special-token parsing (so
`<|im_start|>` becomes its control token), client text without it (so a user who types
`<|im_start|>system` gets plain text). When the real rendering cannot be read that way (a
template that transforms client text otherwise), the sentinel rendering is used with the client
strings put back unchanged: the prompt then differs from the template's by that transformation,
but still never turns client text into control tokens.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from localllm.errors import RequestError
from localllm.text.chat_template import ChatTemplate
from localllm.text.tokenizer import Tokenizer

log = logging.getLogger("localllm")

# Keys of messages, tool calls, tool definitions and JSON schemas that templates read by name.
# They stay as they are (a key equal to one of these words carries no special-token text);
# every other key is client text and gets a sentinel like any string value.
STRUCTURAL_KEYS = frozenset({
    "role", "content", "name", "tool_calls", "tool_call_id", "id", "type", "function",
    "arguments", "description", "parameters", "properties", "required", "items", "enum",
    "default", "format", "minimum", "maximum", "minItems", "maxItems", "minLength", "maxLength",
    "additionalProperties", "anyOf", "oneOf", "allOf", "not", "title", "pattern", "const",
    "examples", "nullable", "$ref", "$defs", "definitions", "strict", "text",
})
_PLAIN_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")


def content_text(content: Any) -> str:
    """OpenAI-style content: a string, or a list of parts of which text parts are kept."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content
                       if isinstance(p, Mapping) and p.get("type", "text") == "text")
    return str(content)


class _Marker:
    """Replaces client strings by numbered sentinels and remembers them."""

    def __init__(self) -> None:
        self.nonce = f"{secrets.randbelow(10**8):08d}"  # digits: unchanged by case filters
        self.texts: list[str] = []
        self.pattern = re.compile(f"\ue000{self.nonce}(\\d+)\ue001")

    def mark(self, text: str) -> str:
        self.texts.append(text)
        return f"\ue000{self.nonce}{len(self.texts) - 1}\ue001"

    def walk(self, value: Any, key: str | None = None) -> Any:
        """`value` with its client strings (and free-form keys) replaced by sentinels. Empty
        strings and `role` and `type` values that are plain words stay, so templates can
        branch on them."""
        if isinstance(value, str):
            if not value or (key in ("role", "type") and _PLAIN_WORD.fullmatch(value)):
                return value
            return self.mark(value)
        if isinstance(value, Mapping):
            return {(k if k in STRUCTURAL_KEYS else self.mark(str(k))): self.walk(v, str(k))
                    for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.walk(v, key) for v in value]
        return value


def _check_roles(messages: Sequence[Mapping[str, Any]]) -> None:
    for m in messages:
        role = m.get("role")
        if not isinstance(role, str) or not _PLAIN_WORD.fullmatch(role):
            raise RequestError(f"message role {role!r} is not a plain name such as 'user'")


def _forms(text: str) -> list[str]:
    """What a template may turn a client string into, longest first."""
    dumped = json.dumps(text, ensure_ascii=False)[1:-1]
    forms = {text, text.strip(), text.lstrip(), text.rstrip(), text.upper(), text.lower(),
             dumped, json.dumps(text)[1:-1]}
    return sorted(forms, key=len, reverse=True)


def _align(marked: str, real: str, marker: _Marker) -> list[tuple[str, bool]] | None:
    """`real` as (text, is_template_text) pieces following `marked`, or None."""
    segments: list[str | int] = []
    pos = 0
    for m in marker.pattern.finditer(marked):
        segments.append(marked[pos:m.start()])
        segments.append(int(m.group(1)))
        pos = m.end()
    segments.append(marked[pos:])
    # breadth-first over reachable positions in `real`; back[(i, pos)] = (previous pos, text)
    reach = {0}
    back: dict[tuple[int, int], tuple[int, str]] = {}
    for i, seg in enumerate(segments):
        options = [seg] if isinstance(seg, str) else _forms(marker.texts[seg])
        nxt: set[int] = set()
        for p in reach:
            for form in options:
                if real.startswith(form, p) and (i + 1, p + len(form)) not in back:
                    back[(i + 1, p + len(form))] = (p, form)
                    nxt.add(p + len(form))
        if not nxt:
            return None
        reach = nxt
    if len(real) not in reach:
        return None
    pieces: list[tuple[str, bool]] = []
    p = len(real)
    for i in range(len(segments), 0, -1):
        p, form = back[(i, p)]
        pieces.append((form, isinstance(segments[i - 1], str)))
    return pieces[::-1]


def split_rendered(template: ChatTemplate, messages: Sequence[Mapping[str, Any]],
                   add_generation_prompt: bool = True,
                   tools: Sequence[Mapping[str, Any]] | None = None) -> list[tuple[str, bool]]:
    """Rendered prompt as (text, is_template_text) pieces, in order."""
    _check_roles(messages)
    plain = [{**m, "content": content_text(m.get("content"))} for m in messages]
    marker = _Marker()
    marked_msgs = [marker.walk(m) for m in plain]
    marked_tools = marker.walk(list(tools)) if tools else None
    marked = template.render(marked_msgs, add_generation_prompt,
                             {"tools": marked_tools} if tools else None)
    real = template.render(plain, add_generation_prompt,
                           {"tools": [dict(t) for t in tools]} if tools else None)
    pieces = _align(marked, real, marker)
    if pieces is None:
        log.debug("the chat template transforms client text; rendering it unchanged")
        pieces = []
        pos = 0
        for m in marker.pattern.finditer(marked):
            pieces.append((marked[pos:m.start()], True))
            pieces.append((marker.texts[int(m.group(1))], False))
            pos = m.end()
        pieces.append((marked[pos:], True))
    return [(t, special) for t, special in pieces if t]


def encode_chat(tokenizer: Tokenizer, template: ChatTemplate,
                messages: Sequence[Mapping[str, Any]],
                add_generation_prompt: bool = True,
                tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """Token ids of `messages` (and `tools`, for templates that render them) through the chat
    template; BOS first when the model adds one and the template did not."""
    pieces = split_rendered(template, messages, add_generation_prompt, tools)
    ids = tokenizer.encode_pieces(pieces)
    bos = tokenizer.bos_id
    if tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids

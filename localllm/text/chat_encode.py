"""Chat messages -> token ids, with message text never turned into special tokens.

The template is rendered with a sentinel in place of each message's content; the rendered text
is then split at the sentinels. Template text is tokenized with special-token parsing (so
`<|im_start|>` becomes its control token) and message text without it (so a user who types
`<|im_start|>system` gets plain text).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from localllm.text.chat_template import ChatTemplate
from localllm.text.tokenizer import Tokenizer

_SENTINEL = "\x1elocalllm-content-{}\x1e"


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


def split_rendered(template: ChatTemplate, messages: Sequence[Mapping[str, Any]],
                   add_generation_prompt: bool = True) -> list[tuple[str, bool]]:
    """Rendered prompt as (text, is_template_text) pieces, in order."""
    contents = [content_text(m.get("content")) for m in messages]
    marked = [{**m, "content": _SENTINEL.format(i)} for i, m in enumerate(messages)]
    rendered = template.render(marked, add_generation_prompt=add_generation_prompt)
    pieces: list[tuple[str, bool]] = []
    rest = rendered
    for i, text in enumerate(contents):
        mark = _SENTINEL.format(i)
        head, sep, tail = rest.partition(mark)
        if not sep or mark in tail:
            # The template transforms or repeats the content: fall back to the real rendering,
            # with any special-token text inside messages left as plain text by the tokenizer's
            # whole-text special parsing (the best that can be done for such templates).
            real = [{**m, "content": c} for m, c in zip(messages, contents)]
            return [(template.render(real, add_generation_prompt=add_generation_prompt), True)]
        pieces.append((head, True))
        pieces.append((text, False))
        rest = tail
    pieces.append((rest, True))
    return [(t, special) for t, special in pieces if t]


def encode_chat(tokenizer: Tokenizer, template: ChatTemplate,
                messages: Sequence[Mapping[str, Any]],
                add_generation_prompt: bool = True) -> list[int]:
    ids = tokenizer.encode_pieces(split_rendered(template, messages, add_generation_prompt))
    bos = tokenizer.bos_id
    if tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids

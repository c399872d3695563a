"""Hermes-style tool calls found in streamed text, however the text is split."""

from __future__ import annotations

import json

import pytest

from localllm.server.tools import ToolCallParser

TEXT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "parameters": {"tz": "CET"}}</tool_call>')


def run(pieces: list[str]) -> tuple[str, list[tuple[str, dict[str, str]]]]:
    p = ToolCallParser()
    content = ""
    for piece in pieces:
        text, _ = p.feed(piece)
        content += text
    content += p.finish()[0]
    return content, [(c.name, json.loads(c.arguments)) for c in p.calls]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, len(TEXT)])
def test_calls_found_whatever_the_split(size: int) -> None:
    content, calls = run([TEXT[i:i + size] for i in range(0, len(TEXT), size)])
    assert content == "Let me check. \n"
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]


def test_text_that_only_looks_like_a_tag_is_content() -> None:
    content, calls = run(["a <tool", "_ca", "ll? no: <tool_cal", "x> b <"])
    assert calls == [] and content == "a <tool_call? no: <tool_calx> b <"


def test_a_block_that_is_not_a_call_stays_as_written() -> None:
    text = 'x <tool_call>{"nome": 1}</tool_call> <tool_call>not json</tool_call>'
    assert run([text]) == (text, [])


def test_unclosed_call_at_the_end() -> None:
    assert run(['<tool_call>{"name": "f", "arguments": {}}'])[1] == [("f", {})]
    assert run(["<tool_call>{\"name\": "]) == ('<tool_call>{"name": ', [])


def test_held_back_text_is_released_when_it_is_not_a_tag() -> None:
    p = ToolCallParser()
    assert p.feed("a <tool") == ("a ", [])
    assert p.feed(" x") == ("<tool x", [])
    assert p.calls == []

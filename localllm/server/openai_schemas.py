"""Request bodies of the OpenAI-compatible routes, validated strictly: a wrong type is an error
(no "0.5" for a number) and so is a field OpenAI's API does not have.

Fields beyond OpenAI's, as llama.cpp and vLLM name them: `top_k`, `min_p`, `repeat_penalty`
(or `repetition_penalty`), `ignore_eos`. Fields OpenAI has that change nothing here are accepted
(`user`, `safety_identifier`, `prompt_cache_key`, `metadata`, `store`, ...); those this server
cannot honour are accepted only at their neutral value and refused otherwise by the routes
(`frequency_penalty`, `logit_bias`, ...).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's padding of stream chunks; not sent here


class FunctionCall(_Strict):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None


class ContentPart(BaseModel):
    """A part of a message's content; only text parts are read (the routes refuse others)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None or left out: only for an assistant message with tool_calls (the route refuses others)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: dict[str, Any]


class _Sampling(_Strict):
    """Fields shared by chat and text completions."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None
    safety_identifier: str | None = None  # OpenAI's successor of `user`
    prompt_cache_key: str | None = None  # a hint for OpenAI's cache routing
    prompt_cache_retention: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    suffix: str | None = None
    max_tokens: int | None = 16  # OpenAI's default for text completions
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None

"""Request bodies of the Ollama-compatible routes (the fields the official `ollama` client,
Continue and Zed send). Unknown top-level fields are refused; unknown keys inside `options` are
ignored, as Ollama does (its clients send runner options such as `num_ctx` or `num_gpu` that
mean nothing here), but a known option of the wrong type is an error.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Options(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    num_predict: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    num_ctx: int | None = None


class OllamaFunction(_Strict):
    name: str
    arguments: dict[str, Any] = {}
    index: int | None = None


class OllamaToolCall(_Strict):
    function: OllamaFunction
    id: str | None = None


class OllamaMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class _Common(_Strict):
    model: str | None = None
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: str | int | float | None = None
    think: bool | str | None = None


class ChatRequest(_Common):
    messages: list[OllamaMessage] = []
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Common):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None


class ShowRequest(_Strict):
    model: str | None = None
    name: str | None = None  # older clients
    verbose: bool | None = None

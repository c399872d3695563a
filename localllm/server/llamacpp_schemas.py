"""Request bodies of llama.cpp's own routes, `/completion` and `/infill`, as llama-server takes
them (the fields llama.vim and llama.vscode send, with llama-server's defaults).

As llama-server does, unknown fields are ignored: its clients send options of its own slots
and caches (`id_slot`, `cache_prompt`, `t_max_prompt_ms`, ...), and a field sent as null takes
its default. Known fields are typed strictly. Sampling options this server does not have are
accepted only at their neutral values (`UNSUPPORTED`); the routes refuse others with a 400 that
names the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        """A field sent as null takes its default, as in llama-server."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class ExtraChunk(_Lenient):
    """One piece of extra context (llama.vim also sends a `time`, ignored)."""

    text: str = ""
    filename: str = "tmp"


class LlamaOptions(_Lenient):
    model: str | None = None
    stream: bool = False
    n_predict: int | None = None  # -1 or left out: to the end of the context; 0: prefill only
    max_tokens: int | None = None  # llama-server's other name for n_predict
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64  # accepted; the penalty here covers the prompt and the output
    seed: int = -1  # negative (or 2^32 - 1, llama.cpp's "default"): a random seed
    stop: str | list[str] = []
    ignore_eos: bool = False
    n_indent: int = 0
    t_max_predict_ms: int = 0
    samplers: list[str] | str | None = None
    response_fields: list[str] = []
    return_tokens: bool = False
    # options this server does not have: accepted at these (neutral) values only
    n_probs: int = 0
    mirostat: int = 0
    grammar: str = ""
    json_schema: dict[str, Any] | None = None
    logit_bias: list[Any] | dict[str, Any] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    typical_p: float = 1.0
    dry_multiplier: float = 0.0
    xtc_probability: float = 0.0
    dynatemp_range: float = 0.0
    top_n_sigma: float = -1.0


UNSUPPORTED = ("n_probs", "mirostat", "grammar", "json_schema", "logit_bias", "presence_penalty",
               "frequency_penalty", "typical_p", "dry_multiplier", "xtc_probability",
               "dynatemp_range", "top_n_sigma")


class CompletionBody(LlamaOptions):
    prompt: str | list[Any] | None = None  # text, token ids, a mix, or a list of prompts


class InfillBody(LlamaOptions):
    prompt: str = ""  # the cursor's line up to the cursor: the model writes on from it
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = []

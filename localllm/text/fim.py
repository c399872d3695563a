"""Fill-in-the-middle prompts from a vocabulary's FIM tokens.

The tokens are those the GGUF declares (`tokenizer.ggml.fim_{pre,suf,mid}_token_id`, or the
older `tokenizer.ggml.{prefix,suffix,middle}_token_id`), else the first family of known token
texts the vocabulary has as special tokens (`<|fim_prefix|>`, `<fim_prefix>`, `<PRE>`, ...), as
llama.cpp looks for them. The prompt is prefix-suffix-middle, as llama.cpp's infill builds it:
`[BOS] <fim_prefix> PREFIX <fim_suffix> SUFFIX <fim_middle>`, the code tokenized as plain text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from localllm.text.tokenizer import Tokenizer

_KEYS = (("fim_pre", "fim_suf", "fim_mid"), ("prefix", "suffix", "middle"))
_TEXTS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, StarCoder2
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
    ("<PRE>", "<SUF>", "<MID>"),  # Code Llama
    ("<|fim▁begin|>", "<|fim▁hole|>", "<|fim▁end|>"),  # DeepSeek-Coder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
)


class FimTokens(NamedTuple):
    prefix: int
    suffix: int
    middle: int


def _special_id(tokenizer: Tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special=False, parse_special=True)
    if len(ids) == 1 and tokenizer.token_text(ids[0]) == text:
        return ids[0]
    return None


def find_fim_tokens(tokenizer: Tokenizer,
                    metadata: Mapping[str, Any] | None = None) -> FimTokens | None:
    """The vocabulary's FIM tokens, or None when it has no complete set."""
    meta = metadata or {}
    for keys in _KEYS:
        ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in keys]
        if all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size for i in ids):
            return FimTokens(*ids)  # type: ignore[arg-type]
    for texts in _TEXTS:
        found = [_special_id(tokenizer, t) for t in texts]
        if all(i is not None for i in found):
            return FimTokens(*found)  # type: ignore[arg-type]
    return None


def fim_prompt(tokenizer: Tokenizer, fim: FimTokens, prefix: str, suffix: str) -> list[int]:
    """Prompt ids that ask the model for the text between `prefix` and `suffix`."""
    ids = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    ids.append(fim.prefix)
    ids += tokenizer.encode(prefix, add_special=False, parse_special=False)
    ids.append(fim.suffix)
    ids += tokenizer.encode(suffix, add_special=False, parse_special=False)
    ids.append(fim.middle)
    return ids

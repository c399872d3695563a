"""A tiny test model whose vocabulary has fill-in-the-middle control tokens."""

from __future__ import annotations

from pathlib import Path

import gguf
from gguf_factory import ModelSpec, vocab, write_model

from localllm.text.fim import FimTokens

FIM_TEXTS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
REPO_TEXTS = ("<|repo_name|>", "<|file_sep|>")


def write_fim_model(path: Path, repo: bool = False, declared: bool = True,
                    context: int = 256) -> FimTokens:
    """The tiny test model with three FIM control tokens (and, with `repo`, the two of
    repository-level prompts), declared in its metadata or (not `declared`) found by their
    texts."""
    tokens, scores, types = vocab()
    first = len(tokens)
    added = FIM_TEXTS + (REPO_TEXTS if repo else ())
    tokens += added
    scores += [0.0] * len(added)
    types += [int(gguf.TokenType.CONTROL)] * len(added)
    n = len(tokens)
    keys: dict[str, object] = {
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types, "llama.vocab_size": n,
        "llama.context_length": context}
    if declared:
        keys |= {"tokenizer.ggml.fim_pre_token_id": first,
                 "tokenizer.ggml.fim_suf_token_id": first + 1,
                 "tokenizer.ggml.fim_mid_token_id": first + 2}
        if repo:
            keys |= {"tokenizer.ggml.fim_rep_token_id": first + 3,
                     "tokenizer.ggml.fim_sep_token_id": first + 4}
    write_model(path, ModelSpec(keys=keys,
                                shapes={"token_embd.weight": (n, 32), "output.weight": (n, 32)}))
    if repo:
        return FimTokens(first, first + 1, first + 2, first + 3, first + 4)
    return FimTokens(first, first + 1, first + 2)

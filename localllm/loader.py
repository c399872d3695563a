"""Load a model and its tokenizer from a GGUF file."""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from localllm.config import ModelConfig
from localllm.errors import ModelLoadError
from localllm.gguf.reader import GGUFFile
from localllm.gguf.tensors import dequantize, module_name
from localllm.models.llama import LlamaForCausalLM
from localllm.models.registry import model_class
from localllm.text.tokenizer import Tokenizer

ProgressFn = Callable[[int, int], None]


class LoadedModel(NamedTuple):
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path
    fingerprint: str  # identifies the weights: file contents and size (not the dtype)


def file_fingerprint(path: Path) -> str:
    """A fast content fingerprint: size plus sha256 of the first and last 4 MiB."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(4 << 20))
        if size > 8 << 20:
            f.seek(size - (4 << 20))
            h.update(f.read())
    return h.hexdigest()[:32]


def stderr_progress(label: str) -> ProgressFn:
    """A progress callback printing `label: done/total` on one refreshed stderr line."""
    tty = sys.stderr.isatty()

    def report(done: int, total: int) -> None:
        if tty:
            end = "\n" if done == total else ""
            print(f"\r{label}: {done}/{total} tensors", end=end, file=sys.stderr, flush=True)

    return report


def load_gguf(path: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16,
              progress: ProgressFn | None = None) -> LoadedModel:
    gf = GGUFFile(path)
    src = str(gf.path)
    try:
        cfg = ModelConfig.from_gguf_metadata(gf.metadata,
                                             has_output="output.weight" in gf.tensors)
        tokenizer = Tokenizer.from_gguf_metadata(gf.metadata, source=src)
    except ModelLoadError as e:
        raise ModelLoadError(f"{src}: {e}") from None
    model = model_class(cfg.arch)(cfg, dtype)
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: set[str] = set()
    infos = list(gf)
    for i, info in enumerate(infos):
        name = module_name(info.name)
        if name == "rope.freq_factors":
            model.rope.set_freq_factors(dequantize(info, src).flatten(), cfg)
        elif name is not None and name in params:
            p = params[name]
            w = dequantize(info, src)
            if tuple(w.shape) != tuple(p.shape):
                raise ModelLoadError(
                    f"{src}: tensor {info.name!r} has shape {tuple(w.shape)}, the config "
                    f"expects {tuple(p.shape)}"
                )
            p.data.copy_(w)
            filled.add(name)
        if progress is not None:
            progress(i + 1, len(infos))
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = sorted(set(params) - filled - tied)
    if missing:
        raise ModelLoadError(f"{src}: missing tensors for {', '.join(missing[:3])}"
                             + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelLoadError(f"{src}: tokenizer has {tokenizer.vocab_size} tokens but the "
                             f"embedding only {cfg.vocab_size}")
    model.eval()
    return LoadedModel(model, tokenizer, cfg, gf.path, file_fingerprint(gf.path))

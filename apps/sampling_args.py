"""The sampling options of generate, chat and summarize, and the SamplingParams they make:
a value SamplingParams refuses is named by its option (`--top-p must be in (0, 1]`), and is
refused before a model loads."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from localllm.errors import RequestError

if TYPE_CHECKING:
    from localllm.config import SamplingParams

# SamplingParams' field -> the option that sets it
_OPTIONS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p",
            "top_k": "--top-k", "min_p": "--min-p", "repetition_penalty": "--repeat-penalty",
            "stop strings": "--stop strings"}


def add_sampling_args(p: argparse.ArgumentParser, temperature: float,
                      max_tokens: str = "256") -> None:
    """The sampling options; `max_tokens`: how --help states its default."""
    p.add_argument("--max-tokens", type=int, default=256,
                   help=f"tokens to generate at most (default: {max_tokens})")
    p.add_argument("--temperature", type=float, default=temperature,
                   help=f"0: greedy (default: {temperature:g})")
    # llama.cpp's defaults: without truncation a small model samples from the long tail
    p.add_argument("--top-p", type=float, default=0.95,
                   help="nucleus sampling: the smallest set of tokens holding this much "
                   "probability (default: 0.95)")
    p.add_argument("--top-k", type=int, default=40, help="the k most likely tokens; 0: off "
                   "(default: 40)")
    p.add_argument("--min-p", type=float, default=0.05,
                   help="drop tokens below this share of the likeliest one's probability "
                   "(default: 0.05)")
    p.add_argument("--repeat-penalty", type=float, default=1.0,
                   help="penalize tokens already in the context (a positive logit is divided "
                   "by it, a negative one multiplied); 1: off (default: 1.0)")
    p.add_argument("--seed", type=int, default=None,
                   help="the same seed, prompt and settings give the same text (default: "
                   "random)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace, max_tokens: int | None = None) -> SamplingParams:
    """SamplingParams from the options (`max_tokens` in place of --max-tokens where given)."""
    from localllm.config import SamplingParams

    try:
        return SamplingParams(
            max_tokens=max_tokens or args.max_tokens, temperature=args.temperature,
            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            repetition_penalty=args.repeat_penalty, seed=args.seed, stop=tuple(args.stop))
    except RequestError as e:
        text = str(e)
        for field, option in _OPTIONS.items():
            if text.startswith(field + " "):
                text = option + text[len(field):]
                break
        raise RequestError(text) from None

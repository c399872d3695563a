"""Sampling parameters of one API request, with the defaults of `localllm generate` for the
fields a client leaves out (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, as llama.cpp)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from localllm.config import SamplingParams
from localllm.errors import RequestError
from localllm.server.errors import APIError

MAX_STOP = 16
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
            "repeat_penalty": 1.0}


class Sampling(NamedTuple):
    """What a client asked for; None: the default."""

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    n: int = 1
    ignore_eos: bool = False
    logprobs: int | None = None
    penalty_field: str = "repeat_penalty"  # the name the client gave the penalty


def _pick(value: float | int | None, name: str) -> float:
    return DEFAULTS[name] if value is None else value


def sampling_params(s: Sampling, max_n: int) -> list[SamplingParams]:
    """One SamplingParams per choice (seeds seed, seed+1, ...; a negative top_k is 0, off);
    APIError 400 when out of range."""
    if not 1 <= s.n <= max_n:
        raise APIError(400, f"n must be in 1..{max_n}, got {s.n}", "n")
    stop = (s.stop,) if isinstance(s.stop, str) else tuple(s.stop or ())
    if len(stop) > MAX_STOP:
        raise APIError(400, f"stop takes at most {MAX_STOP} strings, got {len(stop)}", "stop")
    try:
        return [SamplingParams(
            max_tokens=s.max_tokens, temperature=_pick(s.temperature, "temperature"),
            top_k=max(0, int(_pick(s.top_k, "top_k"))),  # -1: off, as in vLLM and llama.cpp
            top_p=_pick(s.top_p, "top_p"),
            min_p=_pick(s.min_p, "min_p"),
            repetition_penalty=_pick(s.repeat_penalty, "repeat_penalty"),
            seed=None if s.seed is None else s.seed + i, stop=stop, ignore_eos=s.ignore_eos,
            logprobs=s.logprobs) for i in range(s.n)]
    except RequestError as e:
        message = str(e).replace("repetition_penalty", s.penalty_field)
        raise APIError(400, message, message.split()[0]) from None

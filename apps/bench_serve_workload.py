"""The requests of `bench serve`: prompts of the wanted lengths, output lengths, arrival times.

Synthetic prompts are words drawn at random (seeded) and trimmed until the client counts the
wanted number of tokens: exact on the in-process engine, as exact as the server's `/tokenize`
remotely, else an estimate (the prompt tokens the server reports are what the results use).
With `--shared-prefix F`, every prompt starts with the same words covering F of the mean input
length, so a prefix cache can serve them. `--dataset FILE.jsonl` takes the prompts from a file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from localllm.client import Client, Message
from localllm.errors import LocalLLMError

WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education river garden window bread music stone winter summer light paper table market "
    "green quiet slow bright cold warm early late small large open simple clear strong"
).split()


class RequestSpec(NamedTuple):
    prompt: str | None  # a raw completion prompt, or
    messages: list[Message] | None  # a chat (dataset lines with "messages")
    input_len: int  # prompt tokens as counted here
    output_len: int  # max tokens (reached exactly with ignore_eos)


def lengths(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> list[int]:
    """`n` lengths uniform in [mean * (1 - r), mean * (1 + r)] (at least 1); r = 0: all `mean`."""
    lo = max(1, math.floor(mean * (1 - range_ratio)))
    hi = max(lo, math.ceil(mean * (1 + range_ratio)))
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def arrivals(rng: np.random.Generator, n: int, rate: float, burstiness: float) -> list[float]:
    """Send times in seconds: all at 0 for an infinite rate, else gaps drawn from a gamma
    distribution of shape `burstiness` and mean 1 / rate (shape 1: a Poisson process; below 1
    burstier, above 1 more even)."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return [float(x) for x in np.cumsum(gaps)]


async def _text_of(client: Client, rng: np.random.Generator, tokens: int) -> str:
    """Random words that the client counts as `tokens` tokens (or the fewest above it)."""
    words = list(rng.choice(WORDS, size=tokens + 8))
    while await client.count_tokens(" ".join(words)) < tokens:
        words += list(rng.choice(WORDS, size=tokens))
    lo, hi = 1, len(words)  # the fewest words reaching `tokens`
    while lo < hi:
        mid = (lo + hi) // 2
        if await client.count_tokens(" ".join(words[:mid])) >= tokens:
            hi = mid
        else:
            lo = mid + 1
    return " ".join(words[:lo])


async def synthetic(client: Client, n: int, input_lens: list[int], output_lens: list[int],
                    shared_prefix: float, rng: np.random.Generator) -> list[RequestSpec]:
    shared = round(shared_prefix * sum(input_lens) / len(input_lens)) if input_lens else 0
    prefix = await _text_of(client, rng, shared) + " " if shared else ""
    specs = []
    for i in range(n):
        own = await _text_of(client, rng, max(1, input_lens[i] - shared))
        specs.append(RequestSpec(prefix + own, None, shared + await client.count_tokens(own),
                                 output_lens[i]))
    return specs


def _line(raw: str, where: str) -> tuple[str | None, list[Message] | None, int | None]:
    try:
        obj: Any = json.loads(raw)
    except json.JSONDecodeError as e:
        raise LocalLLMError(f"{where}: not JSON ({e.msg}); each line must be a JSON string or "
                            "an object with \"prompt\" or \"messages\"") from None
    if isinstance(obj, str):
        return obj, None, None
    if not isinstance(obj, dict) or not isinstance(obj.get("prompt", obj.get("messages")),
                                                   (str, list)):
        raise LocalLLMError(f"{where}: give a JSON string or an object with \"prompt\" (text) "
                            "or \"messages\" (a chat)")
    out = obj.get("output_len", obj.get("max_tokens"))
    if out is not None and (not isinstance(out, int) or out < 1):
        raise LocalLLMError(f"{where}: output_len must be a positive integer, got {out!r}")
    if "messages" in obj:
        return None, list(obj["messages"]), out
    return str(obj["prompt"]), None, out


async def from_dataset(client: Client, path: Path, n: int, output_lens: list[int]
                       ) -> list[RequestSpec]:
    """The first `n` prompts of a JSONL file (from its start again if it has fewer); a line's
    own output_len (or max_tokens) beats --output-len."""
    try:
        raw = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    except OSError as e:
        raise LocalLLMError(f"--dataset {path}: {e.strerror or e}") from None
    if not raw:
        raise LocalLLMError(f"--dataset {path} has no prompts")
    lines = [_line(ln, f"{path}:{i + 1}") for i, ln in enumerate(raw)]
    specs = []
    for i in range(n):
        prompt, messages, out = lines[i % len(lines)]
        count = (await client.count_tokens(prompt) if prompt is not None
                 else await client.chat_tokens(messages or []) or 0)
        specs.append(RequestSpec(prompt, messages, count, out or output_lens[i]))
    return specs

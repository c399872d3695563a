"""Token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seeds.

Order per row: repetition penalty -> temperature -> top-k -> top-p -> min-p -> draw. Each
request draws from its own seeded generator, so its output does not depend on its batch.

Logits stay on the backend's device: greedy rows take the device's argmax and only the ids come
back; a draw with top-k copies back its k candidates (the rest of the filtering and the draw
run on the CPU, with the request's generator); only a draw without top-k copies its row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from localllm.engine.request import Request
from localllm.layers.backend import Backend


def apply_repetition_penalty(logits: torch.Tensor, token_ids: Sequence[int],
                             penalty: float) -> torch.Tensor:
    # logits: [vocab]; as in CTRL / transformers: divide positive logits, multiply negative ones
    if penalty == 1.0 or not token_ids:
        return logits
    idx = torch.tensor(sorted(set(token_ids)), dtype=torch.long, device=logits.device)
    vals = logits[idx]
    logits = logits.clone()
    logits[idx] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Set excluded tokens to -inf. logits: [vocab] fp32, already divided by temperature."""
    if top_k > 0 and top_k < logits.shape[-1]:
        top = torch.topk(logits, top_k)  # exactly k, even when values tie
        logits = torch.full_like(logits, float("-inf")).scatter(-1, top.indices, top.values)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[0] = False
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


class Sampler:
    """Samples each request's next token from its logits row, with the backend's argmax and
    top-k."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request],
                 best: Sequence[int] | None = None) -> list[int]:
        # logits: [num_seqs, vocab] fp32; best: the rows' argmax when the caller has it
        if all(r.params.greedy and r.params.repetition_penalty == 1.0 for r in requests):
            return self.backend.argmax(logits).tolist() if best is None else list(best)
        out: list[int] = []
        for row, req in zip(logits, requests):
            p = req.params
            row = apply_repetition_penalty(row, req.all_token_ids, p.repetition_penalty)
            if p.greedy:
                out.append(int(self.backend.argmax(row[None])[0]))
                continue
            out.append(self._draw(row / p.temperature, p.top_k, p.top_p, p.min_p,
                                  req.generator))
        return out


    def _draw(self, logits: torch.Tensor, top_k: int, top_p: float, min_p: float,
              generator: torch.Generator | None) -> int:
        # logits: [vocab] fp32, divided by temperature
        if 0 < top_k < logits.shape[-1]:
            # filter and draw among the k candidates only: the same distribution as filtering
            # the whole vocabulary (top-p and min-p see the renormalized top-k mass either
            # way), at ~0.1 ms instead of ~2.5 ms a token (sorts and softmaxes over 49k)
            idx = self.backend.top_k(logits[None], top_k)[0]
            kept = filter_logits(logits[idx].cpu(), 0, top_p, min_p)
            return int(idx[int(torch.multinomial(kept.softmax(-1), 1, generator=generator))])
        row = filter_logits(logits.cpu(), top_k, top_p, min_p)
        return int(torch.multinomial(row.softmax(-1), 1, generator=generator))

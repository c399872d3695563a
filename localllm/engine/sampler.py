"""Token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seeds.

Order per row: repetition penalty -> top-k -> temperature, top-p, min-p and the draw
(`draw_index`). Each request draws from its own stream (`DrawStream`: its seed's, else random),
draw n a number of its own, so its output does not depend on its batch, nor on whether a step
drew it here or in the CPU's native multi-step call, which draws the same way.

Logits stay on the backend's device: greedy rows take the device's argmax and only the ids come
back; a draw with top-k copies back its k candidates (the rest of the draw runs in Python);
only a draw without top-k copies its row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from localllm.config import SamplingParams
from localllm.engine.draw import draw_index, draw_sorted
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


class Sampler:
    """Samples each request's next token from its logits row, with the backend's argmax and
    top-k and the request's `DrawStream` (localllm/engine/draw.py)."""

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
            if p.greedy or req.draws is None:
                out.append(int(self.backend.argmax(row[None])[0]))
                continue
            out.append(self._draw(row, p, req.draws.next()))
        return out

    def _draw(self, row: torch.Tensor, p: SamplingParams, u: float) -> int:
        # row: [vocab] fp32 logits
        if 0 < p.top_k < row.shape[-1]:
            # among the k candidates only: the same distribution as filtering the whole
            # vocabulary (top-p and min-p see the renormalized top-k mass either way), at
            # ~0.1 ms instead of ~2.5 ms a token (sorts and softmaxes over 49k)
            idx = self.backend.top_k(row[None], p.top_k)[0]
            candidates = row[idx].tolist()
            return int(idx[draw_index(candidates, p.temperature, p.top_p, p.min_p, u)])
        values, order = torch.sort(row.float().cpu(), descending=True, stable=True)
        return int(order[draw_sorted(values, p.temperature, p.top_p, p.min_p, u)])

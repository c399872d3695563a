"""`Backend`: what the layers, the model runner and the sampler ask of a device.

One backend is chosen at load (`localllm.backends.make_backend`: `--device auto|cpu|cuda`,
`--backend auto|cpu|triton|torch`) and owns everything that differs by device: how quantized
weights are packed at load and multiplied (`pack_linear`), the small fused ops, paged attention
with its per-step metadata, KV pool allocation, and an optional whole-step fast path. Models
only declare modules; layers call the backend they were built with; `ModelRunner` holds it.
Implementations live in `localllm/backends/` (`cpu/`: native C kernels with PyTorch ops as
fallback; `triton/`: our Triton kernels; `pytorch/`: PyTorch ops on any device), the only code
that imports kernels. The ops part, what layers call, is `localllm.layers.ops.LayerOps`.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from localllm.layers.attention import AttentionMetadata, KVCache
from localllm.layers.ops import LayerOps
from localllm.layers.stack import DecoderLayout

# the model's own step: (input_ids, positions, caches, meta) -> final hidden states
# [num_tokens, hidden]
Forward = Callable[[torch.Tensor, torch.Tensor, list[KVCache], AttentionMetadata],
                   torch.Tensor]


@dataclass(frozen=True)
class StepLogits:
    """A decode step whose fast path ran the model's LM head too: fp32 logits [num_seqs, vocab]
    as the model's `compute_logits` gives them, each row's argmax (ties to the lower id) and
    that logit."""
    logits: torch.Tensor
    best: list[int]
    best_logit: list[float]


# a fast path for decode-only steps: (input_ids, positions, caches, meta, head) -> the final
# hidden states, or with head=True the step's `StepLogits` where the path runs the model's head
# (the hidden states where it does not); None when this step is not one it takes
WholeStep = Callable[[torch.Tensor, torch.Tensor, list[KVCache], AttentionMetadata, bool],
                     torch.Tensor | StepLogits | None]


@dataclass(frozen=True)
class StepTokens:
    """Several decode steps run in one call: best[j][i] is row i's token after step j, the input
    of step j + 1: its argmax (ties to the lower id), or for a row that samples its draw;
    best_logit[j][i] the row's largest logit."""
    best: list[list[int]]
    best_logit: list[list[float]]


@dataclass(frozen=True)
class RowDraw:
    """How a row of a several-steps call draws its tokens, as the engine's Sampler would
    (localllm/engine/draw.py): among its top_k logits, with draw count + j of stream `key` at
    step j."""
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    key: int
    count: int


# several decode steps of a decode-only batch in one call: (input_ids, positions, caches, meta,
# steps, draws) -> `StepTokens`, each later step's K/V slots taken from the block tables in
# `meta` (which must already hold them); draws: per row, None (greedy) or its `RowDraw`; None
# when this batch is not one it takes
StepsRun = Callable[[torch.Tensor, torch.Tensor, list[KVCache], AttentionMetadata, int,
                     list[RowDraw | None]], StepTokens | None]


@dataclass(frozen=True)
class DecodeSteps:
    """A backend's fast path for several decode steps in one call."""
    run: StepsRun
    max_seqs: int  # the most sequences one call takes
    max_top_k: int  # a sampling row's largest top_k (1 .. this); 0: greedy rows only


class Backend(LayerOps):
    name: str  # as the load line prints it
    device: torch.device

    @abstractmethod
    def allocate_kv(self, num_layers: int, num_blocks: int, block_size: int,
                    num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> list[KVCache]:
        """One K and one V pool per layer, [num_blocks, block_size, num_kv_heads, head_dim];
        unwritten slots read as 0."""

    @abstractmethod
    def kv_memory_available(self) -> int:
        """Bytes of this device's memory free for a KV pool now."""

    def settle_weights(self, model: torch.nn.Module) -> None:
        """Called once a model's weights are loaded, packed and fused, before its first step:
        lay them out where this backend reads them fastest. The default leaves them."""

    # ---------------------------------------------------------------- steps
    @abstractmethod
    def decoding_rows(self, n: int) -> AbstractContextManager[None]:
        """Within this block the first `n` rows of the batch are decoding tokens (one per
        sequence), which this backend may compute as it computes a lone row, so that a
        request's tokens do not depend on what shares its step."""

    def step_rows(self, meta: AttentionMetadata) -> AbstractContextManager[None]:
        """Within this block the batch is the step `meta` describes: a backend may compute each
        prompt's rows as their prompt would alone (its whole length choosing how), whatever
        else shares the step. The default: `decoding_rows` of its leading decoding rows."""
        return self.decoding_rows(meta.leading_decodes())

    @abstractmethod
    def whole_step(self, layout: DecoderLayout, forward: Forward) -> WholeStep | None:
        """A fast path running decode-only steps of the model `layout` describes, whose own
        step is `forward` (built once, after loading; the weights must not change after), or
        None."""

    def decode_steps(self, layout: DecoderLayout) -> DecodeSteps | None:
        """A fast path running several decode steps of the model `layout` describes in one
        call, greedy or sampled with top-k, with the tokens one step at a time (and the
        engine's Sampler) would give (built once, after loading), or None (the default: one
        step a call)."""
        return None

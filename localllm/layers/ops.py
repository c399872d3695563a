"""`LayerOps`: what the layers ask of the backend they were built with (the ops part of
`localllm.layers.backend.Backend`), and `QuantWeight`, the interface of a weight the backend
packed."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from localllm.quant.formats import Int4Weight, Int8Weight

if TYPE_CHECKING:
    from localllm.layers.attention import AttentionMetadata, AttentionSpec, KVCache

# rows start..end of a quantized weight, as the loader reads them from the file
RowSource = Callable[[int, int], Int4Weight | Int8Weight]


class QuantWeight(Protocol):
    """A weight [out_features, in_features] in a backend's packed layout."""

    in_features: int
    out_features: int

    @property
    def nbytes(self) -> int: ...

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] in the compute dtype -> x @ W.T [rows, out]."""

    def silu_gated(self, x: torch.Tensor) -> torch.Tensor:
        """For a weight stacking gate and up: silu(x Wg^T) * (x Wu^T) [rows, out / 2]."""

    @property
    def fine_logits(self) -> bool:
        """Whether `logits` are far finer than the compute dtype's rounding (fp32 sums of
        16-bit or finer x), so that fewer of the best need recomputing exactly."""

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """An LM head's x @ W.T in fp32 [rows, out]: at least as accurate as `matmul`."""

    def refine_logits(self, logits: torch.Tensor, x: torch.Tensor, k: int) -> bool:
        """The k best of each row of `logits` (fp32 [rows, out]) recomputed in place in fp32
        from x [rows, in] and the exact `rows`, in one call; False when this weight has no such
        path (the caller then does it with `rows`)."""

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W in fp32 [len(ids), in]."""

    def dense_t(self) -> torch.Tensor:
        """W.T [in, out] in the compute dtype, dequantized for one call."""

    @staticmethod
    def stack(parts: Sequence[object]) -> QuantWeight | None:
        """The weights stacked along `out`, or None when their layouts cannot be stacked."""


class LayerOps(ABC):
    # ---------------------------------------------------------------- weights
    @abstractmethod
    def pack_linear(self, source: RowSource, out_features: int, dtype: torch.dtype,
                    exact_rows: bool) -> QuantWeight | None:
        """A quantized weight of `out_features` rows, handed over a slice of rows at a time by
        `source(start, end)`, packed in this backend's layout; None when this backend has no
        packed form for its format and `dtype` (the loader then stores it dense).
        `exact_rows`: rows are read one by one (an embedding), so `rows` must return exactly
        the source format's dequantized values."""

    # ---------------------------------------------------------------- small ops
    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [..., dim] -> RMSNorm(x) * weight, statistics in fp32."""

    @abstractmethod
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual) * weight, x + residual) for x, residual [num_tokens, dim];
        the sum is rounded to x's dtype and may be written into `residual` in place."""

    @abstractmethod
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[num_tokens, 2 * inter] (gate | up) -> silu(gate) * up, [num_tokens, inter]."""

    @abstractmethod
    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[num_tokens, 2 * inter] (gate | up) -> gelu_tanh(gate) * up (Gemma's MLP)."""

    @abstractmethod
    def rope_(self, x: torch.Tensor, heads: int, head_dim: int, rope_dim: int,
              cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
              neox: bool) -> bool:
        """Rotates the first `heads` heads of each row of x ([T, >= heads * head_dim], heads
        side by side) in place with fused kernel calls, and says whether it did; False leaves
        x untouched, for the layer's own PyTorch rotation. cos, sin: fp32 [positions,
        rope_dim / 2]."""

    @abstractmethod
    def top_k(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """fp32 [rows, n] -> int64 [rows, k], the indices of the k largest, largest first."""

    @abstractmethod
    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 [rows, n] -> int64 [rows], the first index of each row's maximum (NaN never
        wins)."""

    # ---------------------------------------------------------------- attention and KV
    @abstractmethod
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                  meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
        """Stores this step's k, v at `meta.slot_mapping` in `cache`, then attends as `spec`
        says (scale, soft-cap, sliding window): q [num_tokens, num_heads, head_dim], k, v
        [num_tokens, num_kv_heads, head_dim] -> [num_tokens, num_heads, head_dim]. With a
        window, block-table entries of positions before every query's window are never
        read."""

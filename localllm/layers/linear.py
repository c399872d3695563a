"""Linear layers: `Linear` holds a dense weight; `QuantLinear` a quantized weight that the
backend packed at load.

Models declare `Linear` modules and know nothing of quantization. The loader fills a dense
weight in place (`weight.data.copy_`), or asks the backend to pack a quantized one
(`LayerOps.pack_linear`) and swaps a `QuantLinear` holding it in for the `Linear`
(`replace_module`, as gpt-fast's quantization does).

`fuse_linears` stacks layers that read the same input (q/k/v, gate/up) into one, so a decode
step makes one matmul where it made several.

A linear layer also serves as an embedding table (`embed`), so that a tied embedding and LM
head are one module holding one copy of the weight, quantized or not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from localllm.layers.ops import LayerOps, QuantWeight, RowSource
from localllm.quant.formats import Int4Weight, Int8Weight, slice_rows

EMBED_ROWS = 64  # embedding rows unpacked at a time
TopK = Callable[[torch.Tensor, int], torch.Tensor]  # fp32 [rows, n], k -> int64 [rows, k]


class LinearBase(nn.Module):
    """y = x @ W^T (+ b), W [out_features, in_features]."""

    in_features: int
    out_features: int
    dtype: torch.dtype
    bias: nn.Parameter | None

    def dense_weight(self) -> torch.Tensor:
        """The weight in the compute dtype, [out, in] (dequantized when held quantized)."""
        raise NotImplementedError

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [num_tokens] -> rows of W [num_tokens, in_features] in the compute dtype."""
        raise NotImplementedError

    def rows_fp32(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [n] -> rows of W [n, in_features] in fp32."""
        raise NotImplementedError

    def silu_gated(self, x: torch.Tensor) -> torch.Tensor:
        """For a layer stacking gate and up (`fuse_linears`): x [num_tokens, in_features] ->
        silu(gate) * up [num_tokens, out_features / 2]."""
        raise NotImplementedError

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """As an LM head: x [num_seqs, in_features] -> fp32 [num_seqs, out_features], at least
        as accurate as `forward` (a quantized weight may have a path of its own for them)."""
        return self(x).float()

    @property
    def fine_logits(self) -> bool:
        """Whether `logits` are far finer than the compute dtype's rounding."""
        return False

    def refine_logits(self, logits: torch.Tensor, x: torch.Tensor, top_k: TopK, k: int) -> None:
        """As an LM head: the k best of each row of `logits` (fp32 [num_seqs, out_features],
        chosen by `top_k`) recomputed in place in fp32 from x [num_seqs, in_features] and the
        weight's fp32 rows (a quantized one's: exactly as its source dequantizes)."""
        top = top_k(logits, k)  # [seqs, k]
        rows = self.rows_fp32(top.flatten()).view(*top.shape, -1)  # [seqs, k, in_features]
        exact = torch.bmm(rows, x.float().unsqueeze(-1)).squeeze(-1)  # [seqs, k]
        if self.bias is not None:
            exact = exact + self.bias.float()[top]
        logits.scatter_(1, top, exact)


class Linear(LinearBase):
    """A dense weight in the compute dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 backend: LayerOps, exact_rows: bool = False) -> None:
        super().__init__()
        # rows are read one by one (an embedding, an LM head's refined logits): a quantized
        # weight packed for this layer keeps its source scales so that they come out exact
        self.exact_rows = exact_rows
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype
        self.backend = backend
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                   requires_grad=False)  # [out_features, in_features]
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)

    def pack(self, source: RowSource) -> QuantLinear | None:
        """This layer with its weight quantized: `source(start, end)` hands the weight's rows
        over a slice at a time, the backend packs them (`LayerOps.pack_linear`); None when the
        backend has no packed form for the format (the weight then stays dense here). The
        bias is shared. Swap the result in with `replace_module`."""
        qw = self.backend.pack_linear(source, self.out_features, self.dtype, self.exact_rows)
        if qw is None:
            return None
        if (qw.out_features, qw.in_features) != (self.out_features, self.in_features):
            raise ValueError(f"weight shape {(qw.out_features, qw.in_features)} does not "
                             f"match {(self.out_features, self.in_features)}")
        return QuantLinear(qw, self.bias, self.dtype, self.backend)

    def dense_weight(self) -> torch.Tensor:
        return self.weight

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def rows_fp32(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids].float()

    def silu_gated(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.silu_mul(self(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features]
        return F.linear(x, self.weight, self.bias)


class QuantLinear(LinearBase):
    """A weight the backend packed (`LayerOps.pack_linear`), with an optional dense bias."""

    def __init__(self, qweight: QuantWeight, bias: nn.Parameter | None, dtype: torch.dtype,
                 backend: LayerOps) -> None:
        super().__init__()
        self.qweight = qweight
        self.backend = backend
        self.in_features = qweight.in_features
        self.out_features = qweight.out_features
        self.dtype = dtype
        self.bias = bias

    def dense_weight(self) -> torch.Tensor:
        return self.qweight.dense_t().t()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        # a few rows at a time: unpacking a 512-token prompt's rows at once held 8 MB of fp32
        # temporaries, the largest allocation of its step
        out = torch.empty(len(ids), self.in_features, dtype=self.dtype, device=ids.device)
        for start in range(0, len(ids), EMBED_ROWS):
            out[start:start + EMBED_ROWS] = self.qweight.rows(ids[start:start + EMBED_ROWS])
        return out

    def rows_fp32(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight.rows(ids)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        y = self.qweight.logits(x)
        return y if self.bias is None else y + self.bias.float()

    @property
    def fine_logits(self) -> bool:
        return self.qweight.fine_logits

    def refine_logits(self, logits: torch.Tensor, x: torch.Tensor, top_k: TopK, k: int) -> None:
        if self.bias is not None or not self.qweight.refine_logits(logits, x, k):
            super().refine_logits(logits, x, top_k, k)

    def silu_gated(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return self.qweight.silu_gated(x)
        return self.backend.silu_mul(self(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features]
        y = self.qweight.matmul(x)
        return y if self.bias is None else y + self.bias


def fuse_linears(parts: Sequence[LinearBase]) -> LinearBase | None:
    """One layer computing `cat([p(x) for p in parts], dim=-1)`, or None when the parts'
    weights cannot be stacked (mixed quantized and dense, or incompatible packed layouts)."""
    first = parts[0]
    if any(p.in_features != first.in_features or p.dtype != first.dtype
           or (p.bias is None) != (first.bias is None) for p in parts):
        return None
    bias = None
    if first.bias is not None:
        bias = nn.Parameter(torch.cat([p.bias.data for p in parts if p.bias is not None]),
                            requires_grad=False)
    if all(isinstance(p, Linear) for p in parts):
        dense = [p for p in parts if isinstance(p, Linear)]
        fused = Linear(first.in_features, sum(p.out_features for p in parts), False,
                       first.dtype, dense[0].backend)
        fused.weight.data = torch.cat([p.weight.data for p in dense])
        fused.bias = bias
        return fused
    if not all(isinstance(p, QuantLinear) for p in parts):
        return None
    quant = [p for p in parts if isinstance(p, QuantLinear)]
    stacked = quant[0].qweight.stack([p.qweight for p in quant])
    return None if stacked is None else QuantLinear(stacked, bias, first.dtype,
                                                    quant[0].backend)


def row_source(w: Int4Weight | Int8Weight) -> RowSource:
    """A whole weight as a `RowSource` (views of its rows, no copies)."""
    return lambda start, end: slice_rows(w, start, end)


def replace_module(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Puts `new` wherever `model` holds `old` (under every name: a tied embedding and LM head
    are one module)."""
    names = [name for name, m in model.named_modules(remove_duplicate=False) if m is old]
    for name in names:
        model.set_submodule(name, new)

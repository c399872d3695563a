"""Linear layers: dense weights, or weights that stay quantized.

Models declare `Linear` modules; the loader fills in their weights, either dense
(`weight.data.copy_`) or through `set_quantized`, which keeps an int4 or int8 weight packed for
PyTorch's CPU weight-only kernels (`localllm.layers.cpu_packed`): few rows (decode) run the
packed kernel, many rows (prefill) dequantize the weight for that call and run one dense
matmul. `quantized_cpu_supported` says which weights take this path; others are stored dense.

`fuse_linears` stacks layers that read the same input (q/k/v, gate/up) into one, so a decode
step makes one kernel call where it made several.

A Linear also serves as an embedding table (`embed`), so that a tied embedding and LM head
are one module holding one copy of the weight, quantized or not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from localllm.layers.activation import silu_and_mul_fused
from localllm.layers.cpu_packed import (
    CpuPackedWeight,
    CpuQuantWeight,
    RowSource,
    cpu_packable,
    cpu_quant_weight,
)
from localllm.quant.formats import Int4Weight, Int8Weight

EMBED_ROWS = 64  # embedding rows unpacked at a time


def quantized_cpu_supported(w: Int4Weight | Int8Weight, dtype: torch.dtype) -> bool:
    """Whether `Linear.set_quantized` can keep `w` packed for compute dtype `dtype`."""
    return cpu_packable(w, dtype)


class Linear(nn.Module):
    """y = x @ W^T (+ b)."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 dtype: torch.dtype, exact_rows: bool = False) -> None:
        super().__init__()
        # rows are read one by one (an embedding, an LM head's refined logits): a quantized
        # weight keeps its source scales so that they come out exact
        self.exact_rows = exact_rows
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype
        # [out_features, in_features]; None once the weight is held quantized
        self.weight: nn.Parameter | None = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)
        self.qweight: CpuQuantWeight | None = None

    @property
    def quantized(self) -> bool:
        return self.qweight is not None

    def set_quantized(self, w: Int4Weight | Int8Weight) -> None:
        if not quantized_cpu_supported(w, self.dtype):
            raise ValueError("this weight format has no quantized CPU path")
        if (w.out_features, w.in_features) != (self.out_features, self.in_features):
            raise ValueError(f"weight shape {(w.out_features, w.in_features)} does not match "
                             f"{(self.out_features, self.in_features)}")
        self.qweight = cpu_quant_weight(w, self.dtype, exact_rows=self.exact_rows)
        self.weight = None

    def set_quantized_rows(self, source: RowSource) -> None:
        """Like `set_quantized`, with the weight handed over a slice of rows at a time by
        `source(start, end)` (see `CpuPackedWeight.from_rows`): loading a large tensor this
        way never holds a second copy of it."""
        first = source(0, min(self.out_features, 64))
        if not quantized_cpu_supported(first, self.dtype):
            raise ValueError("this weight format has no quantized CPU path")
        if first.in_features != self.in_features:
            raise ValueError(f"weight rows of {first.in_features} values do not match "
                             f"{self.in_features}")
        if isinstance(first, Int8Weight) and first.per_channel:
            self.set_quantized(source(0, self.out_features))
            return
        self.qweight = CpuPackedWeight.from_rows(source, self.out_features, self.dtype,
                                                 self.exact_rows)
        self.weight = None

    def dense_weight(self) -> torch.Tensor:
        """The weight in the compute dtype, [out, in] (dequantized if held quantized)."""
        if self.weight is not None:
            return self.weight
        assert self.qweight is not None
        return self.qweight.dense_t().t()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [num_tokens] -> rows of W [num_tokens, in_features] in the compute dtype
        if self.weight is not None:
            return F.embedding(ids, self.weight)
        assert self.qweight is not None
        # a few rows at a time: unpacking a 512-token prompt's rows at once held 8 MB of fp32
        # temporaries, the largest allocation of its step
        out = torch.empty(len(ids), self.in_features, dtype=self.dtype)
        for start in range(0, len(ids), EMBED_ROWS):
            out[start:start + EMBED_ROWS] = self.qweight.rows(ids[start:start + EMBED_ROWS])
        return out

    def rows_fp32(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [n] -> rows of W [n, in_features] in fp32 (exact with `exact_rows`)
        if self.weight is not None:
            return self.weight[ids].float()
        assert self.qweight is not None
        return self.qweight.rows(ids)

    def silu_gated(self, x: torch.Tensor) -> torch.Tensor:
        # a layer stacking gate and up (`fuse_linears`): x [num_tokens, in_features] ->
        # silu(gate) * up [num_tokens, out_features / 2]
        if self.bias is None and isinstance(self.qweight, CpuPackedWeight):
            return self.qweight.silu_gated(x)
        return silu_and_mul_fused(self(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features]
        if self.qweight is not None:
            y = self.qweight.matmul(x)
            return y if self.bias is None else y + self.bias
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)


def fuse_linears(parts: list[Linear]) -> Linear | None:
    """One Linear computing `cat([p(x) for p in parts], dim=-1)`, or None when the parts'
    weights cannot be stacked (mixed quantized and dense, or incompatible packed layouts)."""
    first = parts[0]
    if any(p.in_features != first.in_features or p.dtype != first.dtype
           or (p.bias is None) != (first.bias is None) for p in parts):
        return None
    fused = Linear(first.in_features, sum(p.out_features for p in parts),
                   first.bias is not None, first.dtype)
    if all(p.weight is not None for p in parts):
        assert fused.weight is not None
        fused.weight.data = torch.cat([p.weight.data for p in parts if p.weight is not None])
    else:
        packed = [p.qweight for p in parts]
        if not all(isinstance(q, CpuPackedWeight) for q in packed):
            return None
        stacked = CpuPackedWeight.concat([q for q in packed if isinstance(q, CpuPackedWeight)])
        if stacked is None:
            return None
        fused.qweight, fused.weight = stacked, None
    if fused.bias is not None:
        fused.bias.data = torch.cat([p.bias.data for p in parts if p.bias is not None])
    return fused

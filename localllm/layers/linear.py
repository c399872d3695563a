"""Linear layers: dense weights, or weights that stay quantized.

Models declare `Linear` modules; the loader fills in their weights, either dense
(`weight.data.copy_`) or through `set_quantized`, which keeps an int4 weight packed for
PyTorch's CPU weight-only kernel:

    decode (few rows):   y = int4pack_mm(x, packed, group, scales_and_zeros)
                         w = (q - 8) * scale + zero  with  zero = offset + 8 * scale
    prefill (many rows): the weight is dequantized to the compute dtype for this call only
                         from the nibble-packed codes (no dense copy is kept), then one
                         dense matmul

`quantized_cpu_supported` says which weights take this path; others are stored dense.

NOTE: the LM head stays dense on purpose. A per-channel int8 copy for decode was 1.3 ms a step
faster, but a request's tokens then depended on how many others shared its step (1 row: int8
head, 8 rows: bf16 head): 5 of 8 greedy sequences changed when batched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from localllm.quant.formats import Int4Weight, Int8Weight

# At or below this many rows the packed int4 kernel beats dequantize-then-dense-matmul on CPU
# (default model shapes: the kernel costs about 25 us + 11 us per row, dequantizing about
# 1 ms + a dense matmul; 512 rows: 5.2 ms vs 1.4 ms).
INT4_KERNEL_MAX_ROWS = 64


def quantized_cpu_supported(w: Int4Weight | Int8Weight, dtype: torch.dtype) -> bool:
    """Whether `Linear.set_quantized` can keep `w` packed for compute dtype `dtype`."""
    return (isinstance(w, Int4Weight) and w.codebook is None and w.group_size == 32
            and dtype == torch.bfloat16 and w.in_features % 32 == 0)


class Linear(nn.Module):
    """y = x @ W^T (+ b)."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype
        # [out_features, in_features]; None once the weight is held quantized
        self.weight: nn.Parameter | None = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)
        self.packed: torch.Tensor | None = None  # int4pack layout, [out, in / 2] uint8
        self.scales_zeros: torch.Tensor | None = None  # [in / 32, out, 2] compute dtype
        # int8 [out, in / 2]: Int4Weight's bytes with each nibble's top bit flipped, so that an
        # arithmetic shift yields the signed code q - 8 directly
        self.nibbles: torch.Tensor | None = None
        self.group_scales: torch.Tensor | None = None  # [out, in / 32, 1] compute dtype
        self.group_offsets: torch.Tensor | None = None  # [out, in / 32, 1] zero points

    @property
    def quantized(self) -> bool:
        return self.packed is not None

    def set_quantized(self, w: Int4Weight) -> None:
        if not quantized_cpu_supported(w, self.dtype):
            raise ValueError("this weight format has no quantized CPU path")
        if (w.out_features, w.in_features) != (self.out_features, self.in_features):
            raise ValueError(f"weight shape {(w.out_features, w.in_features)} does not match "
                             f"{(self.out_features, self.in_features)}")
        codes = w.codes()  # uint8 [out, in]
        scales = w.scales.float()  # [out, in / 32]
        offsets = (w.offsets.float() if w.offsets is not None
                   else torch.full_like(scales, -8.0) * scales)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32), 1)
        self.scales_zeros = torch.stack(
            [scales.t(), (offsets + 8.0 * scales).t()], dim=-1).to(self.dtype).contiguous()
        self.nibbles = (w.qweight ^ 0x88).view(torch.int8)
        # NOTE: the same rounded scale and zero point as the kernel's, so that prefill and
        # decode compute with the same effective weights
        self.group_scales = self.scales_zeros[..., 0].t().contiguous().unsqueeze(-1)
        self.group_offsets = self.scales_zeros[..., 1].t().contiguous().unsqueeze(-1)
        self.weight = None

    def dense_weight(self) -> torch.Tensor:
        """The weight in the compute dtype, [out, in] (dequantized if held quantized)."""
        if self.weight is not None:
            return self.weight
        assert self.nibbles is not None and self.group_scales is not None
        assert self.group_offsets is not None
        # column 2j is the low nibble of byte j, column 2j+1 the high nibble
        n = self.nibbles
        codes = torch.stack(((n << 4) >> 4, n >> 4), dim=-1)  # q - 8, int8
        codes = codes.view(self.out_features, -1, 32).to(self.dtype)  # [out, in / 32, 32]
        w = torch.addcmul(self.group_offsets, codes, self.group_scales)  # (q - 8) * s + z
        return w.view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features]
        if self.packed is not None and x.shape[0] <= INT4_KERNEL_MAX_ROWS:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, 32,
                                                            self.scales_zeros)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.dense_weight(), self.bias)

"""Quantized weights of the Triton backend: the runtime formats uploaded to the device and
repacked once into the layout `triton_qmatmul` reads (`QMatrix`); every product dequantizes in
registers, so no dense copy of a weight is ever held."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from localllm.kernels import triton_ops, triton_qmatmul
from localllm.kernels.triton_qmatmul import QMatrix
from localllm.quant.formats import Int4Weight, Int8Weight


def to_qmatrix(w: Int4Weight | Int8Weight, device: torch.device) -> QMatrix:
    """`w` on `device`, in the kernel's layout."""
    w = w.to(device)
    bits = 4 if isinstance(w, Int4Weight) else 8
    codebook = w.codebook if isinstance(w, Int4Weight) else None
    return triton_qmatmul.pack(w.qweight, w.scales, w.offsets, codebook, bits, w.group_size)


class TritonQuantWeight:
    """A `QuantWeight` (localllm.layers.ops) of the Triton backend."""

    def __init__(self, m: QMatrix, dtype: torch.dtype) -> None:
        self.m = m
        self.dtype = dtype  # the compute dtype
        self.in_features = m.in_features
        self.out_features = m.out_features

    @property
    def nbytes(self) -> int:
        return self.m.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in] -> [rows, out]
        return triton_qmatmul.qmatmul(x, self.m)

    def silu_gated(self, x: torch.Tensor) -> torch.Tensor:
        return triton_ops.silu_mul(self.matmul(x))

    fine_logits = False

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x).float()

    def refine_logits(self, logits: torch.Tensor, x: torch.Tensor, k: int) -> bool:
        return False

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return triton_qmatmul.dequantize_rows(self.m, ids)

    def dense_t(self) -> torch.Tensor:
        return triton_qmatmul.dequantize(self.m).t().to(self.dtype)

    @staticmethod
    def stack(parts: Sequence[object]) -> TritonQuantWeight | None:
        weights = [p for p in parts if isinstance(p, TritonQuantWeight)]
        if len(weights) != len(parts) or len({p.dtype for p in weights}) != 1:
            return None
        m = triton_qmatmul.stack([p.m for p in weights])
        return None if m is None else TritonQuantWeight(m, weights[0].dtype)

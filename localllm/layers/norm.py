"""RMSNorm, with fp32 statistics whatever the activation dtype.

PyTorch's CPU kernel computes bf16 inputs in fp32 and rounds once at the end (after the weight,
as llama.cpp does; transformers rounds before multiplying by the weight). One fused call:
at batch 1 this layer is all per-op overhead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]
        return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.eps)

"""RMSNorm, with fp32 statistics whatever the activation dtype (the backend's op).

PyTorch's CPU kernel computes bf16 inputs in fp32 and rounds once at the end (after the weight,
as llama.cpp does; transformers rounds before multiplying by the weight); the backends' fused
kernels do the same.

With `residual`, the layer first adds its input into the residual stream (`residual = x +
residual`, rounded to the activation dtype) and normalizes the sum: the decoder passes the
stream along this way, so that the add and the norm are one call.
"""

from __future__ import annotations

import torch
from torch import nn

from localllm.layers.ops import LayerOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, backend: LayerOps) -> None:
        super().__init__()
        self.eps = eps
        self.backend = backend
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]
        return self.backend.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor,
                    residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); x, residual: [num_tokens, dim]. The sum may be
        written into `residual` in place."""
        return self.backend.add_rms_norm(x, residual, self.weight, self.eps)

"""RMSNorm, with fp32 statistics whatever the activation dtype.

PyTorch's CPU kernel computes bf16 inputs in fp32 and rounds once at the end (after the weight,
as llama.cpp does; transformers rounds before multiplying by the weight). At batch 1 this layer
is all per-op overhead, so bf16 rows go through one native call (`kernels/cpu_native.py`,
same math) when it is available.

With `residual`, the layer first adds its input into the residual stream (`residual = x +
residual`, rounded to the activation dtype) and normalizes the sum: the decoder passes the
stream along this way, so that the add and the norm are one call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from localllm.kernels import cpu_native


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def _native(self, x: torch.Tensor) -> bool:
        return (x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous()
                and x.device.type == "cpu" and cpu_native.available())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]
        if self._native(x):
            return cpu_native.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.eps)

    def add_forward(self, x: torch.Tensor,
                    residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); x, residual: [num_tokens, dim]. The sum may be
        written into `residual` in place."""
        if self._native(x) and residual.is_contiguous() and residual.dtype == x.dtype:
            return cpu_native.rms_norm(x, self.weight, self.eps, residual), residual
        residual = x + residual
        return F.rms_norm(residual, (x.shape[-1],), self.weight, eps=self.eps), residual

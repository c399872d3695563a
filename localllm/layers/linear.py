"""Linear layers. Weight formats plug in behind `LinearBase.forward`.

Models declare `Linear` modules; the loader fills in their weights. A quantized weight format
replaces the module's `weight` with its own packed tensors and overrides `forward`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x @ W^T (+ b), with W stored dense in the compute dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        # [out_features, in_features]
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features]
        return F.linear(x, self.weight, self.bias)

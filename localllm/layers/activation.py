"""Activation functions of the MLP, in PyTorch ops (backends fuse them where it pays)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    # gate, up: [num_tokens, intermediate]
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    # gate, up: [num_tokens, intermediate]
    return F.gelu(gate, approximate="tanh") * up

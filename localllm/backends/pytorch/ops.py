"""The small ops in PyTorch, on any device: RMSNorm (with the residual add), SiLU-and-mul,
top-k and argmax over logits (`localllm.backends.cpu.ops` has the same functions, native where
the kernels run)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localllm.layers.activation import gelu_tanh_and_mul, silu_and_mul


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., dim]
    return F.rms_norm(x, (x.shape[-1],), weight, eps=eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # x, residual: [num_tokens, dim]
    residual = x + residual
    return F.rms_norm(residual, (x.shape[-1],), weight, eps=eps), residual


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [num_tokens, 2 * intermediate] (gate | up) -> [num_tokens, intermediate]
    gate, up = gate_up.chunk(2, dim=-1)
    return silu_and_mul(gate, up)


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [num_tokens, 2 * intermediate] (gate | up) -> [num_tokens, intermediate]
    gate, up = gate_up.chunk(2, dim=-1)
    return gelu_tanh_and_mul(gate, up)


def rope_(x: torch.Tensor, heads: int, head_dim: int, rope_dim: int, cos: torch.Tensor,
          sin: torch.Tensor, positions: torch.Tensor, neox: bool) -> bool:
    # no fused rotation: the RoPE layer rotates with PyTorch ops itself
    return False


def top_k(x: torch.Tensor, k: int) -> torch.Tensor:
    # x: fp32 [rows, n] -> int64 [rows, k], largest first (ties in the order torch.topk likes)
    return torch.topk(x, k, dim=-1).indices


def argmax(logits: torch.Tensor) -> torch.Tensor:
    # [num_seqs, vocab] fp32 -> [num_seqs] int64, the first index of each row's maximum
    return logits.nan_to_num(float("-inf")).argmax(-1)

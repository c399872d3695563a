"""The small ops on the CPU: one native call each for bf16 rows where the kernels run (at
batch 1 these ops are all per-op overhead in PyTorch; RMSNorm alone is 10 aten ops), the
PyTorch ops (`localllm.backends.pytorch.ops`) otherwise. Same math either way."""

from __future__ import annotations

import torch

from localllm.backends.pytorch import ops as torch_ops
from localllm.kernels import cpu_native, cpu_ops

NATIVE_MAX_K = 64  # the native top-k's largest k


def _bf16_rows(x: torch.Tensor) -> bool:
    """bf16 CPU rows with unit stride, where the native kernels run."""
    return (x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1
            and x.device.type == "cpu" and cpu_native.available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _bf16_rows(x) and x.is_contiguous():
        return cpu_ops.rms_norm(x, weight, eps)
    return torch_ops.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if (_bf16_rows(x) and x.is_contiguous() and residual.is_contiguous()
            and residual.dtype == x.dtype):
        return cpu_ops.rms_norm(x, weight, eps, residual), residual
    return torch_ops.add_rms_norm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if _bf16_rows(gate_up):
        return cpu_ops.silu_mul(gate_up)
    return torch_ops.silu_mul(gate_up)


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # no native kernel: PyTorch's
    return torch_ops.gelu_mul(gate_up)


def rope_(x: torch.Tensor, heads: int, head_dim: int, rope_dim: int, cos: torch.Tensor,
          sin: torch.Tensor, positions: torch.Tensor, neox: bool) -> bool:
    if not _bf16_rows(x):
        return False
    cpu_ops.rope_(x, heads, head_dim, rope_dim, cos, sin, positions, neox)
    return True


def _native_scan(x: torch.Tensor, k: int) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and x.stride(-1) == 1 and 0 < k <= min(NATIVE_MAX_K, x.shape[-1])
            and cpu_native.available())


def top_k(x: torch.Tensor, k: int) -> torch.Tensor:
    """x: fp32 [rows, n] -> int64 [rows, k], largest first, ties to the lower index on the
    native path (about 10x faster than `torch.topk` over a 49k vocabulary)."""
    if _native_scan(x, k):
        return cpu_ops.top_k(x, k)
    return torch_ops.top_k(x, k)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    if _native_scan(logits, 1):
        return cpu_ops.top_k(logits, 1)[:, 0]
    return torch_ops.argmax(logits)

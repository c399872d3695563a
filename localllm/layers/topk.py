"""Indices of the largest values of each row: the LM head's refinement, greedy decoding and
top-k sampling. On the CPU a native scan (`kernels/cpu_native.top_k`) is about 10x faster
than `torch.topk` over a 49k vocabulary."""

from __future__ import annotations

import torch

from localllm.kernels import cpu_native

NATIVE_MAX_K = 64


def _native(x: torch.Tensor, k: int) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and x.stride(-1) == 1 and 0 < k <= min(NATIVE_MAX_K, x.shape[-1])
            and cpu_native.available())


def top_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """x: fp32 [rows, n] -> int64 [rows, k], largest first, ties to the lower index on the
    native path (`torch.topk` orders ties as it likes)."""
    if _native(x, k):
        return cpu_native.top_k(x, k)
    return torch.topk(x, k, dim=-1).indices


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[num_seqs, vocab] fp32 -> [num_seqs] int64, the first index of each row's maximum
    (NaN never wins)."""
    if _native(logits, 1):
        return cpu_native.top_k(logits, 1)[:, 0]
    return logits.nan_to_num(float("-inf")).argmax(-1)

"""`TorchBackend`: PyTorch ops on any device (the CUDA device until the Triton backend lands).

Weights are dense in the compute dtype (`pack_linear` keeps nothing packed: the loader
dequantizes quantized tensors at load), attention is `TorchPagedAttention` (SDPA over the
paged pools), KV pools are zeroed tensors on the device. There is no whole-step fast path.
"""

from __future__ import annotations

import contextlib
import os
from contextlib import AbstractContextManager

import torch

from localllm.backends.pytorch import ops
from localllm.backends.pytorch.attention import TorchPagedAttention
from localllm.layers.attention import AttentionMetadata, AttentionSpec, KVCache
from localllm.layers.backend import Backend, Forward, WholeStep
from localllm.layers.ops import QuantWeight, RowSource
from localllm.layers.stack import DecoderLayout


def host_memory_available() -> int:
    """MemAvailable of /proc/meminfo (free pages where it is absent), bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._attention = TorchPagedAttention()
        self._ops = ops  # the small ops, one module of functions (the CPU backend has its own)

    def pack_linear(self, source: RowSource, out_features: int, dtype: torch.dtype,
                    exact_rows: bool) -> QuantWeight | None:
        return None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self._ops.add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._ops.silu_mul(gate_up)

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._ops.gelu_mul(gate_up)

    def rope_(self, x: torch.Tensor, heads: int, head_dim: int, rope_dim: int,
              cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
              neox: bool) -> bool:
        return self._ops.rope_(x, heads, head_dim, rope_dim, cos, sin, positions, neox)

    def top_k(self, x: torch.Tensor, k: int) -> torch.Tensor:
        return self._ops.top_k(x, k)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.argmax(x)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                  meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
        return self._attention.forward(q, k, v, cache, meta, spec)

    def allocate_kv(self, num_layers: int, num_blocks: int, block_size: int,
                    num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> list[KVCache]:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return [KVCache(torch.zeros(shape, dtype=dtype, device=self.device),
                        torch.zeros(shape, dtype=dtype, device=self.device))
                for _ in range(num_layers)]

    def kv_memory_available(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.mem_get_info(self.device)[0])
        return host_memory_available()

    def decoding_rows(self, n: int) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def whole_step(self, layout: DecoderLayout, forward: Forward) -> WholeStep | None:
        return None

"""`TritonBackend`: the model's ops through our Triton kernels, on a CUDA GPU or, with
TRITON_INTERPRET=1, on CPU tensors through Triton's interpreter (slow; for testing).

- Weights: int4/int8 runtime formats (every GGUF type that repacks into them) uploaded and
  repacked at load (`weights.TritonQuantWeight`), multiplied by `triton_qmatmul` (a GEMV /
  split-K path for a few rows, a tiled GEMM for prompts). Other tensors, and every weight with
  fp32 compute (the exact reference mode), are dense and run through PyTorch.
- Small ops: RMSNorm with the residual add, RoPE on the fused q/k heads, SiLU-and-mul
  (`triton_ops`); top-k and argmax through PyTorch on the device, so sampling copies back
  only the chosen ids (or a request's top-k candidates).
- Attention: `attention.paged_attention` (the KV store, then paged decode or extend).
- KV pools: zeroed on the device, sized from its free memory.
- Decode-only steps of up to 16 sequences replay CUDA graphs on a GPU (`graphs.py`).
"""

from __future__ import annotations

import os

import torch

from localllm.backends.pytorch.backend import TorchBackend
from localllm.backends.triton import weights
from localllm.backends.triton.attention import paged_attention
from localllm.backends.triton.graphs import StaticDecodeStep
from localllm.kernels import triton_ops
from localllm.layers.attention import AttentionMetadata, AttentionSpec, KVCache
from localllm.layers.backend import Forward, WholeStep
from localllm.layers.ops import QuantWeight, RowSource
from localllm.layers.stack import DecoderLayout
from localllm.quant.formats import Int4Weight

PACKED_DTYPES = (torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class TritonBackend(TorchBackend):
    name = "triton"

    def __init__(self, device: torch.device) -> None:
        if device.type == "cpu" and not interpreting():
            raise ValueError("the Triton backend runs on the CPU only under Triton's "
                             "interpreter (TRITON_INTERPRET=1)")
        super().__init__(device)

    def pack_linear(self, source: RowSource, out_features: int, dtype: torch.dtype,
                    exact_rows: bool) -> QuantWeight | None:
        # every row comes out exact (`dequantize_rows`), so `exact_rows` asks nothing more
        if dtype not in PACKED_DTYPES:
            return None
        w = source(0, out_features)
        if isinstance(w, Int4Weight) and w.group_size not in (16, 32):
            return None
        return weights.TritonQuantWeight(weights.to_qmatrix(w, self.device), dtype)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2 and x.stride(1) == 1:
            return triton_ops.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if (x.dim() == 2 and x.stride(1) == 1 and residual.is_contiguous()
                and residual.shape == x.shape):
            return triton_ops.add_rms_norm(x, residual, weight, eps)
        return super().add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() == 2 and gate_up.stride(1) == 1:
            return triton_ops.silu_mul(gate_up)
        return super().silu_mul(gate_up)

    def rope_(self, x: torch.Tensor, heads: int, head_dim: int, rope_dim: int,
              cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
              neox: bool) -> bool:
        if x.dim() != 2 or x.stride(1) != 1:
            return False
        triton_ops.rope_(x, heads, head_dim, rope_dim, cos, sin, positions, neox)
        return True

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                  meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
        return paged_attention(q, k, v, cache, meta, spec)

    def whole_step(self, layout: DecoderLayout, forward: Forward) -> WholeStep | None:
        # CUDA graphs on a GPU (LOCALLLM_CUDA_GRAPHS=0 turns them off); none in the
        # interpreter, where launches cost nothing next to the kernels
        if self.device.type != "cuda" or os.environ.get("LOCALLLM_CUDA_GRAPHS", "1") == "0":
            return None
        return StaticDecodeStep(layout, forward, capture=True)

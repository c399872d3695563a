"""`DecoderLayout`: a decoder model's layers as data, for a backend's whole-step fast path
(`Backend.whole_step`), so that the backend never walks a model's internals."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localllm.layers.linear import LinearBase
from localllm.layers.norm import RMSNorm
from localllm.layers.rope import RotaryEmbedding


@dataclass(frozen=True)
class LayerParts:
    input_norm: RMSNorm
    post_norm: RMSNorm
    qkv: LinearBase | None  # q | k | v stacked; None when they could not be fused
    o: LinearBase
    gate_up: LinearBase | None  # gate | up stacked; None when they could not be fused
    down: LinearBase
    qk_norm: bool  # Q and K are normalized per head before RoPE


@dataclass(frozen=True)
class DecoderLayout:
    embed: LinearBase  # embed(ids) -> the first layer's input
    rope: RotaryEmbedding
    layers: list[LayerParts]
    final_norm: RMSNorm
    dtype: torch.dtype  # the compute dtype
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    scale: float  # attention's softmax scale

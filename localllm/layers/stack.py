"""`DecoderLayout`: a decoder model's layers as data, for a backend's whole-step fast path
(`Backend.whole_step`), so that the backend never walks a model's internals. A fast path takes
the layers it can compute exactly and declines the rest (returns None from `whole_step`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localllm.layers.attention import AttentionSpec
from localllm.layers.linear import LinearBase
from localllm.layers.norm import RMSNorm
from localllm.layers.rope import RotaryEmbedding


@dataclass(frozen=True)
class LayerParts:
    input_norm: RMSNorm
    post_norm: RMSNorm  # the MLP's input norm
    qkv: LinearBase | None  # q | k | v stacked; None when they could not be fused
    o: LinearBase
    gate_up: LinearBase | None  # gate | up stacked; None when they could not be fused
    down: LinearBase
    qk_norm: bool  # Q and K are normalized per head before RoPE
    attn: AttentionSpec  # scale, soft-cap, sliding window
    rope: RotaryEmbedding  # this layer's (sliding layers of Gemma 3 have their own)
    attn_out_norm: RMSNorm | None = None  # on the attention output (Gemma 2/3)
    mlp_out_norm: RMSNorm | None = None  # on the MLP output (Gemma 2/3)
    activation: str = "silu"  # the MLP gate's: silu | gelu_tanh


@dataclass(frozen=True)
class DecoderLayout:
    embed: LinearBase  # embed(ids) * embed_scale -> the first layer's input
    rope: RotaryEmbedding  # the first layer's
    layers: list[LayerParts]
    final_norm: RMSNorm
    dtype: torch.dtype  # the compute dtype
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    embed_scale: float = 1.0
    # the LM head as the model's `compute_logits` runs it: its logits, then the `refine_top`
    # best recomputed (`LinearBase.refine_logits`; 0: none, an fp32 model), then a soft-cap
    lm_head: LinearBase | None = None
    refine_top: int = 0
    final_softcap: float = 0.0

    def ropes(self) -> list[RotaryEmbedding]:
        """Every distinct RoPE module of the layers."""
        out: list[RotaryEmbedding] = []
        for layer in self.layers:
            if all(r is not layer.rope for r in out):
                out.append(layer.rope)
        return out or [self.rope]

    def plain(self) -> bool:
        """Whether every layer is a Llama-style one: SiLU MLP, no post-norms, attention
        without soft-cap or window, one RoPE and one softmax scale, unscaled embeddings."""
        return (self.embed_scale == 1.0 and len(self.ropes()) == 1
                and len({layer.attn.scale for layer in self.layers}) <= 1
                and all(layer.attn.plain and layer.activation == "silu"
                        and layer.attn_out_norm is None and layer.mlp_out_norm is None
                        for layer in self.layers))

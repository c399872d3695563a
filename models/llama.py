"""Llama-family decoder (Llama, SmolLM, Mistral, Qwen2, Qwen3 through config flags).

Only declares modules and the forward graph; weights are filled in by the loader and the
attention math lives behind `localllm.layers.attention.AttentionBackend`.
"""

from __future__ import annotations

import torch
from torch import nn

from localllm.config import ModelConfig
from localllm.layers.activation import silu_and_mul
from localllm.layers.attention import AttentionBackend, AttentionMetadata, KVCache
from localllm.layers.linear import Linear
from localllm.layers.norm import RMSNorm
from localllm.layers.rope import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * self.hd, cfg.attn_bias, dtype)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv * self.hd, cfg.attn_bias, dtype)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv * self.hd, cfg.attn_bias, dtype)
        self.o_proj = Linear(self.n_heads * self.hd, cfg.hidden_size, False, dtype)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.rope = rope
        self.scale = self.hd ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        # x: [num_tokens, hidden]
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.n_heads, self.hd)
        k = self.k_proj(x).view(t, self.n_kv, self.hd)
        v = self.v_proj(x).view(t, self.n_kv, self.hd)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(positions, q, k)
        o = backend.forward(q, k, v, cache, meta, self.scale)  # [num_tokens, n_heads, head_dim]
        return self.o_proj(o.reshape(t, self.n_heads * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, False, dtype)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, False, dtype)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, rope, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        # _weight skips the random init: the loader fills every parameter
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size,
            _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), _freeze=True)
        self.rope = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rope, dtype)
                                    for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                caches: list[KVCache], meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        # input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden]
        x = self.embed_tokens(input_ids)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, positions, cache, meta, backend)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [num_seqs, hidden] -> [num_seqs, vocab] fp32
        return self.lm_head(hidden).float()

"""Arithmetic of a model from its config: parameters by module, KV bytes, FLOPs per token, and
the decode speed that memory bandwidth allows (what `localllm info` prints).

FLOPs count the matrix products only (2 per multiply-add): the linear layers and attention's
two products (Q K^T and P V, `4 * n_heads * head_dim` FLOPs per cached position per layer).
Norms, RoPE, SiLU and softmax are left out (under 1% of a step for these models). The engine
computes logits only at a prompt's last position, so a prompt pays for the LM head once.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import torch

from localllm.config import ModelConfig
from localllm.engine.model_runner import kv_bytes_per_token


class ParamCounts(NamedTuple):
    embeddings: int
    attention: int  # q, k, v, o projections (and their biases)
    mlp: int  # gate, up, down
    norms: int  # the RMSNorm weights (per layer, final, and Qwen3's per-head q/k norms)
    head: int  # the LM head; 0 when tied to the embedding (counted once, there)

    @property
    def total(self) -> int:
        return self.embeddings + self.attention + self.mlp + self.norms + self.head


MODULES = ("embeddings", "attention", "mlp", "norms", "head")


def module_of(param: str) -> str | None:
    """Which `ParamCounts` field a model parameter name (`layers.0.mlp.up_proj.weight`)
    belongs to, or None for names that are not weights of the model."""
    if param.startswith("embed_tokens."):
        return "embeddings"
    if param.startswith("lm_head."):
        return "head"
    if param.endswith(("layernorm.weight", "_norm.weight")) or param == "norm.weight":
        return "norms"
    if ".self_attn." in param:
        return "attention"
    if ".mlp." in param:
        return "mlp"
    return None


def param_counts(cfg: ModelConfig) -> ParamCounts:
    h, hd, layers = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if cfg.attn_bias else 0)
    norms = 2 * h + (2 * hd if cfg.qk_norm else 0)
    embed = cfg.vocab_size * h
    return ParamCounts(embeddings=embed, attention=layers * attn,
                       mlp=layers * 3 * h * cfg.intermediate_size,
                       norms=layers * norms + h,
                       head=0 if cfg.tie_word_embeddings else embed)


class Flops(NamedTuple):
    linear: float  # per token, the layers' linear products (LM head apart)
    head: float  # the LM head's product for one position
    attention: float  # per token, attention's two products at this context
    total: float  # per token


def attended_positions(cfg: ModelConfig, context: int) -> int:
    """Positions a new token at `context` (itself included) reads, summed over the layers: a
    sliding-window layer reads at most its window."""
    return sum(min(context, cfg.layer_window(i) or context) for i in range(cfg.num_layers))


def _mean_attended(window: int, prompt: int) -> float:
    """Mean over positions i < prompt of min(i + 1, window) (window 0: i + 1)."""
    if not window or prompt <= window:
        return (prompt + 1) / 2
    return (window * (window + 1) / 2 + (prompt - window) * window) / prompt


def decode_flops(cfg: ModelConfig, context: int) -> Flops:
    """One decode step of a sequence whose new token attends to `context` positions (itself
    included; a sliding-window layer to at most its window)."""
    p = param_counts(cfg)
    linear = 2.0 * (p.attention + p.mlp)
    head = 2.0 * cfg.vocab_size * cfg.hidden_size
    attn = 4.0 * cfg.num_heads * cfg.head_dim * attended_positions(cfg, context)
    return Flops(linear, head, attn, linear + head + attn)


def prefill_flops(cfg: ModelConfig, prompt: int) -> Flops:
    """Per token of a `prompt`-token prefill from an empty cache: position i attends to i + 1
    positions, (prompt + 1) / 2 on average (a sliding-window layer: min(i + 1, window));
    logits of the last position only."""
    p = param_counts(cfg)
    linear = 2.0 * (p.attention + p.mlp)
    head = 2.0 * cfg.vocab_size * cfg.hidden_size / prompt
    attended = sum(_mean_attended(cfg.layer_window(i), prompt) for i in range(cfg.num_layers))
    attn = 4.0 * cfg.num_heads * cfg.head_dim * attended
    return Flops(linear, head, attn, linear + head + attn)


class KVFit(NamedTuple):
    bytes_per_token: int
    budget: int  # bytes left for the KV pool: the memory less the weights
    tokens: int  # tokens of KV in whole blocks that fit the budget
    context: int  # the longest context one session gets: tokens, at most the model's
    sessions: int  # concurrent sessions of `session_len` tokens that fit


def kv_fit(cfg: ModelConfig, dtype: torch.dtype, memory: int, weight_bytes: int,
           session_len: int, block_size: int = 16) -> KVFit:
    """What fits in `memory` bytes beside `weight_bytes` of weights, with the paged pool's
    whole blocks of `block_size` tokens (a session of L tokens holds ceil(L / block) blocks)."""
    per_token = kv_bytes_per_token(cfg, dtype)
    budget = max(0, memory - weight_bytes)
    blocks = budget // (per_token * block_size)
    tokens = blocks * block_size
    sessions = blocks // math.ceil(session_len / block_size) if session_len > 0 else 0
    return KVFit(per_token, budget, tokens, min(tokens, cfg.context_length), sessions)


def decode_bound(bytes_per_step: float, bandwidth: float) -> float:
    """Tokens/s of batch-1 decode if each step only had to read `bytes_per_step` bytes at
    `bandwidth` bytes/s (an upper bound: every weight and the cached K/V are read once)."""
    return bandwidth / bytes_per_step if bytes_per_step > 0 else math.inf


def measure_bandwidth(nbytes: int = 256 << 20, repeat: int = 5) -> float:
    """Memory bandwidth of this machine in bytes/s: the best of `repeat` copies of an
    `nbytes` buffer (larger than the caches) into another, counting its read and its write."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages first
    best = math.inf
    for _ in range(repeat):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best

"""Frozen configuration objects, validated on construction."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from localllm.errors import ModelLoadError, RequestError

SUPPORTED_ARCHS = ("gemma2", "gemma3", "llama", "mistral", "phi3", "qwen2", "qwen3")
MAX_LOGPROBS = 20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROPE_KINDS = ("none", "linear", "llama3", "yarn", "longrope")
ACTIVATIONS = ("silu", "gelu_tanh")


def unsupported_architecture(name: str, supported: Sequence[str] = SUPPORTED_ARCHS) -> str:
    """The one-line error for an architecture localllm does not run."""
    return f"unsupported architecture {name!r} (supported: {', '.join(sorted(supported))})"


def number(value: Any, kind: type, where: str) -> Any:
    """`value` as `kind` (int or float), or a one-line error naming `where` it came from."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or (kind is int and int(value) != value):
        raise ModelLoadError(f"{where} has {value!r}, expected "
                             f"{'an integer' if kind is int else 'a number'}")
    return kind(value)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. kind: none | linear | llama3 | yarn | longrope.

    yarn: NTK-by-parts between `beta_fast` and `beta_slow` rotations over `original_context`;
    longrope (Phi-3): per-pair divisors, `long_factors` when the model's context exceeds
    `original_context`, else `short_factors` (a GGUF file carries them as tensors instead).
    `attention_factor` scales cos and sin; 0 means the default of the kind (yarn:
    0.1 ln(factor) + 1; longrope: sqrt(1 + ln(factor) / ln(original_context)))."""

    kind: str = "none"
    factor: float = 1.0
    original_context: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions
    attention_factor: float = 0.0
    short_factors: tuple[float, ...] = ()
    long_factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ModelLoadError(f"unsupported RoPE scaling type {self.kind!r} (supported: "
                                 f"{', '.join(ROPE_KINDS)})")
        if self.factor <= 0:
            raise ModelLoadError(f"RoPE scaling factor must be positive, got {self.factor}")
        if self.attention_factor < 0 or self.beta_fast <= 0 or self.beta_slow <= 0:
            raise ModelLoadError("RoPE scaling: attention factor and YaRN betas must be "
                                 "positive")


@dataclass(frozen=True)
class ModelConfig:
    """One decoder family over flags (see `localllm.models.llama`). Built from GGUF metadata
    (`localllm.gguf.config.config_from_gguf`) or a Hugging Face config.json
    (`localllm.hf.config.config_from_hf`)."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_dim: int
    context_length: int
    rope_neox: bool  # True: rotate halves (NEOX/HF); False: adjacent pairs (GGUF llama)
    tie_word_embeddings: bool
    attn_bias: bool = False  # Q/K/V projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on Q and K before RoPE (Qwen3, Gemma 3)
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    name: str = ""
    hidden_act: str = "silu"  # the MLP's gate activation: silu | gelu_tanh (Gemma)
    embed_scale: float = 1.0  # embeddings are multiplied by it (Gemma: sqrt(hidden_size))
    post_norms: bool = False  # RMSNorm on the attention and MLP outputs too (Gemma 2/3)
    query_scale: float = 0.0  # attention's softmax scale; 0: head_dim ** -0.5
    attn_softcap: float = 0.0  # scores become c * tanh(s / c); 0: off (Gemma 2)
    final_softcap: float = 0.0  # the same on the logits (Gemma 2)
    sliding_window: int = 0  # sliding layers attend to the last this many positions; 0: none
    # per layer, whether it is a sliding-window layer; () with a window: every layer is
    sliding_layers: tuple[bool, ...] = ()
    rope_theta_local: float = 0.0  # RoPE base of sliding layers, unscaled (Gemma 3); 0: none
    fused_projections: bool = False  # the checkpoint stores qkv and gate|up stacked (Phi-3)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ModelLoadError(unsupported_architecture(self.arch))
        for attr in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "rope_dim", "context_length"):
            if getattr(self, attr) <= 0:
                raise ModelLoadError(f"model config: {attr} must be positive, got "
                                     f"{getattr(self, attr)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"model config: {self.num_heads} attention heads are not a "
                                 f"multiple of {self.num_kv_heads} KV heads")
        if self.rope_dim > self.head_dim or self.rope_dim % 2:
            raise ModelLoadError(f"model config: RoPE dimension {self.rope_dim} does not fit head "
                                 f"dimension {self.head_dim}")
        if self.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"model config: activation {self.hidden_act!r} is not "
                                 f"supported (supported: {', '.join(ACTIVATIONS)})")
        if min(self.sliding_window, self.attn_softcap, self.final_softcap,
               self.query_scale) < 0:
            raise ModelLoadError("model config: sliding window, soft-caps and query scale "
                                 "must not be negative")
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise ModelLoadError(f"model config: {len(self.sliding_layers)} layer types for "
                                 f"{self.num_layers} layers")

    def layer_window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (0: it attends to everything before)."""
        if not self.sliding_window or (self.sliding_layers
                                       and not self.sliding_layers[layer]):
            return 0
        return self.sliding_window

    def kv_window(self) -> int:
        """The positions every layer of a sequence may still read back: the window when all
        layers slide, else 0 (some layer keeps everything)."""
        windows = [self.layer_window(i) for i in range(self.num_layers)]
        return 0 if 0 in windows else max(windows)


DEFAULT_PREFIX_CACHE_BYTES = 4 << 30


@dataclass(frozen=True)
class CacheConfig:
    """The KV pool, and the on-disk prefix store behind it (`localllm.engine.prefix_store`)."""

    block_size: int = 16
    num_blocks: int = 0  # 0: size from memory_bytes
    memory_bytes: int = 0  # 0: enough for max_model_len tokens of every running sequence
    # the on-disk prefix store: True / False, or None: on unless $LOCALLLM_PREFIX_CACHE=0
    prefix_cache: bool | None = None
    prefix_cache_dir: str | None = None  # None: $LOCALLLM_PREFIX_CACHE_DIR, else the user cache
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES  # size budget of the whole directory

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks < 0 or self.memory_bytes < 0:
            raise ValueError("num_blocks and memory_bytes must not be negative")
        if self.prefix_cache_bytes <= 0:
            raise ValueError(f"prefix_cache_bytes must be positive, got {self.prefix_cache_bytes}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16  # running requests at once
    max_num_batched_tokens: int = 512  # token budget of one step
    max_model_len: int = 0  # 0: the model's context length
    enable_chunked_prefill: bool = True
    # decode steps one call may run back to back where every running request decodes greedily
    # or samples with a top-k the path takes, none waits for KV room and the backend has the
    # path (the CPU's native stack) (`LLMEngine._call_steps`); 1: one
    decode_steps: int = 4

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.decode_steps < 1:
            raise ValueError("decode_steps must be at least 1")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must not be negative (0: the model's context "
                             f"length), got {self.max_model_len}")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # with each sampled token: its log-probability and this many top

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value):  # NaN passes every comparison below
                raise RequestError(f"{name} must be a finite number, got {value}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise RequestError(
                f"repetition_penalty must be positive, got {self.repetition_penalty}"
            )
        if any(not s for s in self.stop):
            raise RequestError("stop strings must not be empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise RequestError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        # a temperature this small only overflows the division; it means greedy
        return self.temperature < 1e-5 or self.top_k == 1

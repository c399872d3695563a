"""Frozen configuration objects, validated on construction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from localllm.errors import ModelLoadError, RequestError

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
MAX_LOGPROBS = 20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _number(value: Any, kind: type, where: str) -> Any:
    """`value` as `kind` (int or float), or a one-line error naming `where` it came from."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or (kind is int and int(value) != value):
        raise ModelLoadError(f"{where} has {value!r}, expected "
                             f"{'an integer' if kind is int else 'a number'}")
    return kind(value)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. kind: none | linear | llama3 | yarn."""

    kind: str = "none"
    factor: float = 1.0
    original_context: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def __post_init__(self) -> None:
        if self.kind not in ("none", "linear", "llama3", "yarn"):
            raise ModelLoadError(f"unsupported RoPE scaling type {self.kind!r}")
        if self.factor <= 0:
            raise ModelLoadError(f"RoPE scaling factor must be positive, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
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
    qk_norm: bool = False  # per-head RMSNorm on Q and K before RoPE (Qwen3)
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    name: str = ""

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ModelLoadError(
                f"unsupported architecture {self.arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})"
            )
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

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], n_vocab_fallback: int = 0,
                           has_output: bool = True) -> ModelConfig:
        """Build from GGUF metadata with the defaults llama.cpp applies to missing keys."""
        arch = meta.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError("GGUF metadata has no general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise ModelLoadError(
                f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})"
            )

        def get(key: str, default: Any = None, required: bool = False,
                kind: type = int) -> Any:
            full = f"{arch}.{key}"
            if full not in meta:
                if required:
                    raise ModelLoadError(f"GGUF metadata lacks required key {full!r}")
                return default
            value = meta[full]
            return value if kind is str else _number(value, kind, f"GGUF key {full!r}")

        hidden = get("embedding_length", required=True)
        num_heads = get("attention.head_count", required=True)
        if num_heads <= 0 or hidden <= 0:
            raise ModelLoadError(f"GGUF metadata gives {num_heads} attention heads and hidden "
                                 f"size {hidden}; both must be positive")
        num_kv_heads = get("attention.head_count_kv", num_heads)
        head_dim = get("attention.key_length", hidden // num_heads)
        vocab = get("vocab_size", None)
        if vocab is None:
            tokens = meta.get("tokenizer.ggml.tokens")
            vocab = (len(tokens) if isinstance(tokens, Sequence) and not isinstance(tokens, str)
                     else n_vocab_fallback)
        scaling = RopeScaling()
        kind = get("rope.scaling.type", "none", kind=str)
        if kind in ("linear", "yarn"):
            scaling = RopeScaling(
                kind=kind, factor=get("rope.scaling.factor", 1.0, kind=float),
                original_context=get("rope.scaling.original_context_length", 0),
            )
        elif kind not in ("none", None):
            raise ModelLoadError(f"unsupported RoPE scaling type {kind!r}")
        name = meta.get("general.name", "")
        return cls(
            arch=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length", required=True),
            num_layers=get("block_count", required=True),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5, kind=float),
            rope_theta=get("rope.freq_base", 10000.0, kind=float),
            rope_dim=get("rope.dimension_count", head_dim),
            context_length=get("context_length", 2048),
            rope_neox=arch in ("qwen2", "qwen3"),
            tie_word_embeddings=not has_output,
            attn_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            rope_scaling=scaling,
            name=str(name),
        )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json (transformers 4.x `rope_theta`/`rope_scaling`
        or 5.x `rope_parameters`). Checkpoints in HF layout rotate halves (NEOX RoPE)."""
        archs = cfg.get("architectures")
        if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
            raise ModelLoadError("config.json names no architecture ('architectures' is missing)")
        arch = HF_ARCHITECTURES.get(archs[0])
        if arch is None:
            raise ModelLoadError(f"unsupported architecture {archs[0]!r} (supported: "
                                 f"{', '.join(HF_ARCHITECTURES)})")

        def get(key: str, default: Any = None, kind: type = int) -> Any:
            value = cfg.get(key)
            if value is None:
                if default is None:
                    raise ModelLoadError(f"config.json lacks required key {key!r}")
                return default
            return _number(value, kind, f"config.json key {key!r}")

        for key, bad in (("attention_bias", True), ("mlp_bias", True)):
            if cfg.get(key) is bad and not (arch == "qwen2" and key == "attention_bias"):
                raise ModelLoadError(f"config.json: {key}=true is not supported for {archs[0]}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"config.json: activation {act!r} is not supported (only silu)")
        hidden = get("hidden_size")
        num_heads = get("num_attention_heads")
        head_dim = get("head_dim", hidden // num_heads if num_heads > 0 else 0)
        context = get("max_position_embeddings", 2048)
        window = cfg.get("sliding_window")
        if isinstance(window, int) and window > 0 and (arch == "mistral"
                                                       or cfg.get("use_sliding_window")):
            context = min(context, window)  # NOTE: exact up to the window; no sliding attention
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ModelLoadError(f"config.json: unreadable RoPE parameters {rope!r}")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        if not isinstance(theta, (int, float)) or theta <= 0:
            raise ModelLoadError(f"config.json: bad rope_theta {theta!r}")
        return cls(
            arch=arch,
            vocab_size=get("vocab_size"),
            hidden_size=hidden,
            intermediate_size=get("intermediate_size"),
            num_layers=get("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=get("num_key_value_heads", num_heads),
            head_dim=head_dim,
            rms_norm_eps=get("rms_norm_eps", 1e-6, kind=float),
            rope_theta=float(theta),
            rope_dim=head_dim,
            context_length=context,
            rope_neox=True,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attn_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            rope_scaling=_hf_rope_scaling(rope, cfg.get("original_max_position_embeddings")
                                        or get("max_position_embeddings", 2048)),
            name=str(cfg.get("_name_or_path", "")),
        )


def _hf_rope_scaling(rope: dict[str, Any], original: Any) -> RopeScaling:
    """RoPE scaling from HF `rope_parameters` / `rope_scaling`; unsupported variants raise."""
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind == "default":
        return RopeScaling()
    if kind not in ("linear", "llama3", "yarn"):
        raise ModelLoadError(f"unsupported RoPE scaling type {kind!r}")
    factor = rope.get("factor")
    if not isinstance(factor, (int, float)):
        raise ModelLoadError(f"RoPE scaling {kind!r} needs a numeric factor, got {factor!r}")
    original = rope.get("original_max_position_embeddings") or original or 0
    if kind == "yarn":
        custom = [k for k, default in (("beta_fast", 32), ("beta_slow", 1),
                                       ("attention_factor", None), ("truncate", True))
                  if rope.get(k) not in (None, default)]
        if rope.get("mscale") and rope.get("mscale_all_dim"):
            custom.append("mscale")
        if custom:
            raise ModelLoadError(f"YaRN RoPE with custom {', '.join(custom)} is not supported")
    return RopeScaling(kind=kind, factor=float(factor), original_context=int(original),
                       low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                       high_freq_factor=float(rope.get("high_freq_factor", 4.0)))


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

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")


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

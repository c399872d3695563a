"""GGUF metadata -> `ModelConfig`, with the keys and defaults llama.cpp uses
(`src/llama-model.cpp`, `load_hparams`).

Per architecture:
- `llama`, `mistral`: adjacent-pair RoPE (the converters permute Q/K rows); linear or YaRN
  scaling from `{arch}.rope.scaling.*`; Llama-3 scaling comes as the `rope_freqs.weight`
  tensor. `{arch}.attention.sliding_window` makes every layer a sliding one.
- `qwen2`, `qwen3`: NEOX RoPE; Q/K/V biases (qwen2), Q/K norms (qwen3).
- `gemma2`: window 4096 unless the key says otherwise, every other layer sliding (layer 0
  first), attention soft-cap 50 and final soft-cap 30 unless the keys say otherwise.
- `gemma3`: a window only where the key gives one, then 5 sliding layers to 1 global; sliding
  layers use RoPE base 10000 (`{arch}.rope.freq_base_swa` where present) without scaling.
- gemma2/gemma3: embeddings scaled by sqrt(hidden), GELU-tanh MLP, post-norms; the converter
  already stored the norm weights as 1 + w; the softmax scale is head_dim ** -0.5 except for the
  27B models (46 / 62 layers), whose scale is (hidden / heads) ** -0.5.
- `phi3`: fused `attn_qkv` and `ffn_up` (gate | up); LongRoPE through the tensors
  `rope_factors_long` / `rope_factors_short` and `{arch}.rope.scaling.attn_factor`; a
  `sliding_window` key applies to every layer (as transformers does; llama.cpp ignores it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from localllm.config import (
    SUPPORTED_ARCHS,
    ModelConfig,
    RopeScaling,
    number,
    unsupported_architecture,
)
from localllm.errors import ModelLoadError

if TYPE_CHECKING:
    from localllm.gguf.reader import GGUFFile

NEOX_ARCHS = ("gemma2", "gemma3", "phi3", "qwen2", "qwen3")
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}  # every n-th layer (the last of each n) is global


def config_of_file(gf: GGUFFile) -> ModelConfig:
    """The config of an opened GGUF file (`config_from_gguf`); an error names the file."""
    try:
        return config_from_gguf(gf.metadata, has_output="output.weight" in gf.tensors)
    except ModelLoadError as e:
        raise ModelLoadError(f"{gf.path}: {e}") from None


def config_from_gguf(meta: dict[str, Any], n_vocab_fallback: int = 0,
                     has_output: bool = True) -> ModelConfig:
    """Build from GGUF metadata with the defaults llama.cpp applies to missing keys."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError("GGUF metadata has no general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(unsupported_architecture(arch))

    def get(key: str, default: Any = None, required: bool = False, kind: type = int) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            if required:
                raise ModelLoadError(f"GGUF metadata lacks required key {full!r}")
            return default
        value = meta[full]
        return value if kind is str else number(value, kind, f"GGUF key {full!r}")

    hidden = get("embedding_length", required=True)
    num_heads = get("attention.head_count", required=True)
    if num_heads <= 0 or hidden <= 0:
        raise ModelLoadError(f"GGUF metadata gives {num_heads} attention heads and hidden "
                             f"size {hidden}; both must be positive")
    num_kv_heads = get("attention.head_count_kv", num_heads)
    head_dim = get("attention.key_length", hidden // num_heads)
    num_layers = get("block_count", required=True)
    context = get("context_length", 2048)
    vocab = get("vocab_size", None)
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = (len(tokens) if isinstance(tokens, Sequence) and not isinstance(tokens, str)
                 else n_vocab_fallback)
    gemma = arch in ("gemma2", "gemma3")
    window = get("attention.sliding_window", 4096 if arch == "gemma2" else 0)
    sliding = _sliding_layers(meta.get(f"{arch}.attention.sliding_window_pattern"), arch,
                              num_layers) if window else ()
    scale = 0.0
    if gemma and num_layers == GEMMA_27B_LAYERS[arch]:
        scale = (hidden / num_heads) ** -0.5
    name = meta.get("general.name", "")
    return ModelConfig(
        arch=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length", required=True),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5, kind=float),
        rope_theta=get("rope.freq_base", 10000.0, kind=float),
        rope_dim=get("rope.dimension_count", head_dim),
        context_length=context,
        rope_neox=arch in NEOX_ARCHS,
        tie_word_embeddings=not has_output,
        attn_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "gemma3"),
        rope_scaling=_scaling(arch, get, context),
        name=str(name),
        hidden_act="gelu_tanh" if gemma else "silu",
        embed_scale=math.sqrt(hidden) if gemma else 1.0,
        post_norms=gemma,
        query_scale=scale,
        attn_softcap=get("attn_logit_softcapping", 50.0 if arch == "gemma2" else 0.0,
                         kind=float),
        final_softcap=get("final_logit_softcapping", 30.0 if arch == "gemma2" else 0.0,
                          kind=float),
        sliding_window=window,
        sliding_layers=sliding,
        rope_theta_local=(get("rope.freq_base_swa", 10000.0, kind=float)
                          if arch == "gemma3" and window else 0.0),
        fused_projections=arch == "phi3",
    )


def _sliding_layers(pattern: Any, arch: str, num_layers: int) -> tuple[bool, ...]:
    """Per layer, whether it slides; () = every layer. `pattern` is the key's value: n (the
    last layer of every n is global), a list of per-layer flags, or None (the arch's own)."""
    key = f"GGUF key '{arch}.attention.sliding_window_pattern'"
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != num_layers:
            raise ModelLoadError(f"{key} has {len(pattern)} entries for {num_layers} layers")
        return tuple(bool(x) for x in pattern)
    n = SLIDING_PATTERN.get(arch, 1) if pattern is None else number(pattern, int, key)
    return tuple(i % n < n - 1 for i in range(num_layers)) if n > 1 else ()


def _scaling(arch: str, get: Any, context: int) -> RopeScaling:
    kind = get("rope.scaling.type", "none", kind=str)
    original = get("rope.scaling.original_context_length", 0)
    if arch == "phi3" and original and context > original:
        # LongRoPE: the factors are tensors (`rope_factors_long` / `_short`), read at load
        return RopeScaling(kind="longrope", factor=context / original,
                           original_context=original,
                           attention_factor=get("rope.scaling.attn_factor", 0.0, kind=float))
    if kind in ("none", None):
        return RopeScaling()
    if kind not in ("linear", "yarn"):
        raise ModelLoadError(f"unsupported RoPE scaling type {kind!r} (supported: none, "
                             f"linear, yarn; Llama-3 scaling comes as rope_freqs.weight)")
    factor = get("rope.scaling.factor", 1.0, kind=float)
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor)
    # yarn_attn_factor: the converter writes transformers' `attention_factor` there, the
    # total magnitude on cos and sin (absent: 0.1 ln(factor) + 1)
    return RopeScaling(kind="yarn", factor=factor, original_context=original,
                       beta_fast=get("rope.scaling.yarn_beta_fast", 32.0, kind=float),
                       beta_slow=get("rope.scaling.yarn_beta_slow", 1.0, kind=float),
                       attention_factor=get("rope.scaling.yarn_attn_factor", 0.0, kind=float))

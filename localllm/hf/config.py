"""A Hugging Face config.json -> `ModelConfig` (transformers 4.x `rope_theta`/`rope_scaling` or
5.x `rope_parameters`, per layer type for Gemma 3). Checkpoints in HF layout rotate halves
(NEOX RoPE).

Sliding windows follow transformers: `layer_types` where the config lists them, else Mistral's
and Phi-3's `sliding_window` on every layer, Qwen2's from `max_window_layers` on with
`use_sliding_window`, Gemma 2's every other layer and Gemma 3's 5 of 6.
"""

from __future__ import annotations

import math
from typing import Any

from localllm.config import ModelConfig, RopeScaling, number, unsupported_architecture
from localllm.errors import ModelLoadError

HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                    "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
                    "Phi3ForCausalLM": "phi3"}
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
# Gemma3TextConfig's defaults: a multimodal Gemma 3 config.json lists only what differs
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256,
    hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072, rms_norm_eps=1e-6,
    rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, query_pre_attn_scalar=256,
    sliding_window=4096, sliding_window_pattern=6)
MULTIMODAL = {"Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", GEMMA3_TEXT_DEFAULTS)}


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """The model's config; of a multimodal checkpoint (Gemma 3 4B+), its text model's (the
    loader reads the text model's tensors only)."""
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ModelLoadError("config.json names no architecture ('architectures' is missing)")
    if archs[0] in MULTIMODAL:
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ModelLoadError(f"config.json: {archs[0]} without a text_config")
        causal, defaults = MULTIMODAL[archs[0]]
        tied = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
        cfg = {**defaults, **text, "architectures": [causal], "tie_word_embeddings": tied,
               "_name_or_path": cfg.get("_name_or_path", "")}
        archs = cfg["architectures"]
    arch = HF_ARCHITECTURES.get(archs[0])
    if arch is None:
        raise ModelLoadError(unsupported_architecture(archs[0], [*HF_ARCHITECTURES,
                                                                 *MULTIMODAL]))
    gemma = arch in _GEMMA_PATTERN

    def get(key: str, default: Any = None, kind: type = int) -> Any:
        value = cfg.get(key)
        if value is None:
            if default is None:
                raise ModelLoadError(f"config.json lacks required key {key!r}")
            return default
        return number(value, kind, f"config.json key {key!r}")

    for key, bad in (("attention_bias", True), ("mlp_bias", True)):
        if cfg.get(key) is bad and not (arch == "qwen2" and key == "attention_bias"):
            raise ModelLoadError(f"config.json: {key}=true is not supported for {archs[0]}")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act not in ("silu", *GELU_TANH):
        raise ModelLoadError(f"config.json: activation {act!r} is not supported (supported: "
                             f"silu, {', '.join(GELU_TANH)})")
    hidden = get("hidden_size")
    num_heads = get("num_attention_heads")
    num_layers = get("num_hidden_layers")
    head_dim = get("head_dim", hidden // num_heads if num_heads > 0 else 0)
    context = get("max_position_embeddings", 2048)
    window, sliding = _sliding(cfg, arch, num_layers)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ModelLoadError(f"config.json: unreadable RoPE parameters {rope!r}")
    local_theta = 0.0
    if arch == "gemma3":  # per layer type, or the 4.x keys
        local = rope.get("sliding_attention") or {}
        rope = rope.get("full_attention") or (rope if "rope_type" in rope else {})
        local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError("config.json: scaled RoPE on Gemma 3's sliding layers is not "
                                 "supported")
    theta = rope.get("rope_theta", cfg.get("rope_theta", 1e6 if arch == "gemma3" else 10000.0))
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ModelLoadError(f"config.json: bad rope_theta {theta!r}")
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    rope_dim = int(head_dim * float(partial))
    softcap = cfg.get("attn_logit_softcapping") if gemma else None
    final = cfg.get("final_logit_softcapping") if gemma else None
    qscale = cfg.get("query_pre_attn_scalar") if gemma else None
    return ModelConfig(
        arch=arch,
        vocab_size=get("vocab_size"),
        hidden_size=hidden,
        intermediate_size=get("intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=get("num_key_value_heads", num_heads),
        head_dim=head_dim,
        rms_norm_eps=get("rms_norm_eps", 1e-6, kind=float),
        rope_theta=float(theta),
        rope_dim=rope_dim - rope_dim % 2,
        context_length=context,
        rope_neox=True,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        attn_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "gemma3"),
        rope_scaling=_rope_scaling(rope, cfg.get("original_max_position_embeddings")
                                   or context, context),
        name=str(cfg.get("_name_or_path", "")),
        hidden_act="gelu_tanh" if act in GELU_TANH else "silu",
        embed_scale=math.sqrt(hidden) if gemma else 1.0,
        post_norms=gemma,
        query_scale=number(qscale, float, "config.json key 'query_pre_attn_scalar'") ** -0.5
        if qscale else 0.0,
        attn_softcap=number(softcap, float, "config.json key 'attn_logit_softcapping'")
        if softcap else 0.0,
        final_softcap=number(final, float, "config.json key 'final_logit_softcapping'")
        if final else 0.0,
        sliding_window=window,
        sliding_layers=sliding,
        rope_theta_local=local_theta if window and any(sliding) else 0.0,
        fused_projections=arch == "phi3",
    )


def _sliding(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[int, tuple[bool, ...]]:
    """(window, per-layer sliding flags; () = every layer) as transformers builds its masks."""
    window = cfg.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return 0, ()
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == num_layers:
        flags = tuple(t == "sliding_attention" for t in types)
        return (window, flags) if any(flags) else (0, ())
    if arch in _GEMMA_PATTERN:
        n = cfg.get("sliding_window_pattern") or _GEMMA_PATTERN[arch]
        return window, tuple(bool((i + 1) % n) for i in range(num_layers))
    if arch == "qwen2":
        if not cfg.get("use_sliding_window"):
            return 0, ()
        first = cfg.get("max_window_layers", num_layers)
        flags = tuple(i >= first for i in range(num_layers))
        return (window, flags) if any(flags) else (0, ())
    if arch in ("mistral", "phi3"):
        return window, ()
    return 0, ()


def _rope_scaling(rope: dict[str, Any], original: Any, context: int) -> RopeScaling:
    """RoPE scaling from HF `rope_parameters` / `rope_scaling`; unsupported variants raise."""
    kind = rope.get("rope_type", rope.get("type")) or "default"
    kind = {"su": "longrope"}.get(kind, kind)  # early Phi-3-128k configs
    if kind == "default":
        return RopeScaling()
    if kind not in ("linear", "llama3", "yarn", "longrope"):
        raise ModelLoadError(f"unsupported RoPE scaling type {kind!r} (supported: default, "
                             f"linear, llama3, yarn, longrope)")
    original = rope.get("original_max_position_embeddings") or original or 0
    factor = rope.get("factor")
    if factor is None and kind in ("yarn", "longrope") and original:
        factor = context / original  # as transformers: the ratio of the two lengths
    if not isinstance(factor, (int, float)):
        raise ModelLoadError(f"RoPE scaling {kind!r} needs a numeric factor, got {factor!r}")
    attention = rope.get("attention_factor")
    if kind == "yarn" and attention is None:
        mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and all_dim:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim)
    short, long = rope.get("short_factor") or (), rope.get("long_factor") or ()
    if kind == "longrope" and not (short and long):
        raise ModelLoadError("config.json: LongRoPE needs short_factor and long_factor")
    return RopeScaling(kind=kind, factor=float(factor), original_context=int(original),
                       low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                       high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                       beta_fast=float(rope.get("beta_fast") or 32.0),
                       beta_slow=float(rope.get("beta_slow") or 1.0),
                       truncate=bool(rope.get("truncate", True)),
                       attention_factor=float(attention or 0.0),
                       short_factors=tuple(float(x) for x in short),
                       long_factors=tuple(float(x) for x in long))


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

"""GGUF metadata -> ModelConfig for the variant architectures: llama.cpp's defaults where keys
are missing, its keys where present."""

from __future__ import annotations

import math

import pytest

from localllm.errors import ModelLoadError
from localllm.gguf.config import config_from_gguf


def _meta(arch: str, layers: int = 4, **keys: object) -> dict[str, object]:
    meta: dict[str, object] = {
        "general.architecture": arch, f"{arch}.embedding_length": 64,
        f"{arch}.attention.head_count": 4, f"{arch}.attention.head_count_kv": 2,
        f"{arch}.attention.key_length": 16, f"{arch}.feed_forward_length": 128,
        f"{arch}.block_count": layers, f"{arch}.vocab_size": 100,
    }
    meta.update({f"{arch}.{k}": v for k, v in keys.items()})
    return meta


def test_gemma2_defaults() -> None:
    cfg = config_from_gguf(_meta("gemma2"), has_output=False)
    assert (cfg.sliding_window, cfg.attn_softcap, cfg.final_softcap) == (4096, 50.0, 30.0)
    assert cfg.sliding_layers == (True, False, True, False) and cfg.kv_window() == 0
    assert cfg.rope_neox and cfg.post_norms and cfg.hidden_act == "gelu_tanh"
    assert cfg.embed_scale == math.sqrt(64) and cfg.tie_word_embeddings
    assert cfg.query_scale == 0.0  # head_dim ** -0.5
    keyed = config_from_gguf(_meta("gemma2", **{"attention.sliding_window": 8,
                                                "attn_logit_softcapping": 20.0,
                                                "final_logit_softcapping": 10.0}))
    assert (keyed.sliding_window, keyed.attn_softcap, keyed.final_softcap) == (8, 20.0, 10.0)
    # the 27B model (46 layers) scales queries by (hidden / heads) ** -0.5
    assert config_from_gguf(_meta("gemma2", layers=46)).query_scale == (64 / 4) ** -0.5


def test_gemma3_windows_and_rope_bases() -> None:
    cfg = config_from_gguf(_meta("gemma3", layers=12, **{"attention.sliding_window": 512,
                                                         "rope.freq_base": 1e6}))
    assert cfg.sliding_layers == ((True,) * 5 + (False,)) * 2
    assert (cfg.rope_theta, cfg.rope_theta_local, cfg.qk_norm) == (1e6, 10000.0, True)
    assert cfg.attn_softcap == 0 and cfg.final_softcap == 0
    none = config_from_gguf(_meta("gemma3"))  # no window key: every layer global
    assert none.sliding_window == 0 and none.layer_window(0) == 0
    flags = config_from_gguf(_meta("gemma3", **{"attention.sliding_window": 8,
                                                "attention.sliding_window_pattern":
                                                [True, False, True, True]}))
    assert flags.sliding_layers == (True, False, True, True)
    with pytest.raises(ModelLoadError, match="3 entries for 4 layers"):
        config_from_gguf(_meta("gemma3", **{"attention.sliding_window": 8,
                                            "attention.sliding_window_pattern": [1, 0, 1]}))


def test_mistral_window_everywhere_and_yarn_keys() -> None:
    cfg = config_from_gguf(_meta("mistral", **{
        "attention.sliding_window": 4096, "context_length": 32768,
        "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
        "rope.scaling.original_context_length": 8192, "rope.scaling.yarn_beta_fast": 16.0,
        "rope.scaling.yarn_beta_slow": 2.0, "rope.scaling.yarn_attn_factor": 1.2}))
    assert cfg.kv_window() == 4096 and cfg.context_length == 32768 and not cfg.rope_neox
    sc = cfg.rope_scaling
    assert (sc.kind, sc.factor, sc.original_context) == ("yarn", 4.0, 8192)
    assert (sc.beta_fast, sc.beta_slow, sc.attention_factor) == (16.0, 2.0, 1.2)


def test_phi3_longrope_and_fused_projections() -> None:
    cfg = config_from_gguf(_meta("phi3", **{"context_length": 131072,
                                            "rope.scaling.original_context_length": 4096,
                                            "rope.scaling.attn_factor": 1.19}))
    sc = cfg.rope_scaling
    assert (sc.kind, sc.original_context, sc.attention_factor) == ("longrope", 4096, 1.19)
    assert cfg.fused_projections and cfg.rope_neox
    short = config_from_gguf(_meta("phi3", **{"context_length": 4096}))  # Phi-3-mini-4k
    assert short.rope_scaling.kind == "none"

"""GGUF tensor names -> module parameter names, and GGML type names."""

from __future__ import annotations

import re

from localllm.gguf.types import GGMLType

_GLOBAL = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope.freq_factors",
    "rope_factors_long.weight": "rope.long_factors",
    "rope_factors_short.weight": "rope.short_factors",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_qkv": "self_attn.qkv_proj",  # phi3: q | k | v stacked
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# where an architecture's tensors fill other modules than Llama's
_BLOCK_BY_ARCH = {
    # ffn_norm is the MLP's input norm, post_attention_norm the attention output's
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # gate | up stacked
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def module_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The model parameter a GGUF tensor of architecture `arch` fills, or None for tensors
    the model does not use (`rope.*` names: factors the RoPE tables are divided by)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m is None:
        return None
    module = _BLOCK_BY_ARCH.get(arch, {}).get(m.group(2)) or _BLOCK.get(m.group(2))
    return None if module is None else f"layers.{m.group(1)}.{module}.{m.group(3)}"


def qtype_name(qtype: int) -> str:
    """The GGML name of a type id ("Q4_K"), or "unknown type N" for an id not in `GGMLType`."""
    try:
        return GGMLType(qtype).name
    except ValueError:
        return f"unknown type {qtype}"

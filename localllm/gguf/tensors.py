"""GGUF tensor names -> module parameter names, and GGML type names."""

from __future__ import annotations

import re

from localllm.gguf.types import GGMLType

_GLOBAL = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope.freq_factors",
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
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def module_name(gguf_name: str) -> str | None:
    """The model parameter a GGUF tensor fills, or None for tensors the model does not use."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK:
        return None
    return f"layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"


def qtype_name(qtype: int) -> str:
    """The GGML name of a type id ("Q4_K"), or "unknown type N" for an id not in `GGMLType`."""
    try:
        return GGMLType(qtype).name
    except ValueError:
        return f"unknown type {qtype}"

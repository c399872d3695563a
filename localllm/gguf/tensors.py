"""GGUF tensor names -> module parameter names, and dequantization to torch tensors."""

from __future__ import annotations

import re

import numpy as np
import torch

from localllm.errors import ModelLoadError
from localllm.gguf.reader import TensorInfo
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


def dequantize(info: TensorInfo, source: str = "") -> torch.Tensor:
    """Dequantize one tensor to fp32, shaped as PyTorch expects ([out, in] for matrices).

    Types with a runtime format go through `localllm.quant.repack` (exact, vectorized); the
    rest through `gguf.quants.dequantize`.
    """
    from localllm.quant.repack import repack

    try:
        packed = repack(info)
    except ValueError as e:
        raise ModelLoadError(f"{source}: tensor {info.name!r} cannot be decoded ({e})") from None
    if packed is not None:
        w = packed if isinstance(packed, torch.Tensor) else packed.dequantize()
        return w.float().reshape(info.shape)
    return _dequantize_gguf(info, source)


def _dequantize_gguf(info: TensorInfo, source: str) -> torch.Tensor:
    import gguf
    import gguf.quants

    try:
        qt = gguf.GGMLQuantizationType(info.qtype)
    except ValueError:
        raise ModelLoadError(
            f"{source}: tensor {info.name!r} has unknown GGML type {info.qtype}; the file is "
            "corrupt or needs a newer localllm"
        ) from None
    try:
        if qt in (GGMLType.F32, GGMLType.F16):
            arr = np.asarray(info.data, dtype=np.float32)
        else:
            arr = gguf.quants.dequantize(info.data, qt)
    except NotImplementedError:
        raise ModelLoadError(
            f"{source}: tensor {info.name!r} uses quant type {qt.name}, which localllm cannot "
            "load; requantize the model to Q4_K, Q5_K, Q6_K or Q8_0"
        ) from None
    except Exception as e:
        raise ModelLoadError(
            f"{source}: tensor {info.name!r} ({qt.name}) cannot be decoded ({e})"
        ) from None
    n = int(np.prod(info.shape))
    if arr.size != n:
        raise ModelLoadError(
            f"{source}: tensor {info.name!r} holds {arr.size} values, expected {n}"
        )
    arr = arr.reshape(info.shape)
    if not arr.flags.writeable or not arr.flags.c_contiguous:
        arr = np.array(arr, dtype=np.float32, order="C")  # out of the read-only memory map
    return torch.from_numpy(arr)

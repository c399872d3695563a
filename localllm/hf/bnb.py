"""Checkpoints saved by transformers with bitsandbytes weights (`quantization_config` with
`quant_method: bitsandbytes`).

    8-bit (LLM.int8):  W.weight int8 [out, in], W.SCB fp32 [out] (row absmax), W.weight_format;
                       w = q * SCB / 127  -> an Int8Weight, per output channel
    4-bit (NF4/FP4):   W.weight uint8 [out * in / 2, 1] (flattened, first value in the high
                       nibble), W.weight.absmax (uint8 when double-quantized), W.weight.quant_map,
                       W.weight.nested_absmax, W.weight.nested_quant_map and
                       W.weight.quant_state.bitsandbytes__nf4 (JSON: shape, dtype, blocksize)

8-bit weights decode here without bitsandbytes; 4-bit weights are dequantized with
`bitsandbytes.functional.dequantize_4bit`, which runs on the CPU, so they need bitsandbytes.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from localllm.errors import ModelLoadError
from localllm.hf.weights import SafetensorsFolder
from localllm.quant.formats import Int8Weight

STATE_KEYS = ("quant_state.bitsandbytes__nf4", "quant_state.bitsandbytes__fp4")
INSTALL_HINT = "pip install bitsandbytes"


def bnb_method(qcfg: Any) -> str | None:
    """'4bit' or '8bit' for a bitsandbytes `quantization_config`, None when there is none;
    other quantization methods raise."""
    if qcfg is None:
        return None
    method = qcfg.get("quant_method") if isinstance(qcfg, dict) else None
    if method != "bitsandbytes":
        raise ModelLoadError(f"weights quantized with {method!r} are not supported "
                             f"(bitsandbytes, or fp16/bf16/fp32 safetensors, are)")
    if qcfg.get("load_in_4bit") or qcfg.get("_load_in_4bit"):
        return "4bit"
    if qcfg.get("load_in_8bit") or qcfg.get("_load_in_8bit"):
        return "8bit"
    raise ModelLoadError("bitsandbytes quantization_config has neither load_in_4bit nor "
                         "load_in_8bit")


def _state_key(st: SafetensorsFolder, name: str) -> str | None:
    return next((f"{name}.{k}" for k in STATE_KEYS if f"{name}.{k}" in st), None)


def _scb_key(name: str) -> str:
    return name.removesuffix(".weight") + ".SCB"


def is_bnb_weight(st: SafetensorsFolder, name: str) -> bool:
    return _state_key(st, name) is not None or _scb_key(name) in st


def bnb_shape(st: SafetensorsFolder, name: str) -> tuple[int, ...]:
    """The dense shape of a bitsandbytes weight, read without dequantizing it."""
    key = _state_key(st, name)
    if key is None:
        return st.shape(name)
    try:
        state = json.loads(bytes(st.get(key).numpy().tobytes()).decode("utf-8"))
        return tuple(int(n) for n in state["shape"])
    except (ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{st.folder}: unreadable bitsandbytes state {key!r} ({e})") from None


def int8_weight(st: SafetensorsFolder, name: str) -> Int8Weight:
    q = st.get(name)
    fmt_key = name + "_format"
    if fmt_key in st and int(st.get(fmt_key).item()) != 0:
        raise ModelLoadError(f"{st.folder}: {name!r} uses a bitsandbytes weight_format other "
                             f"than 'row', which is not supported")
    scb = st.get(_scb_key(name)).float()  # [out]
    if q.dtype != torch.int8 or q.dim() != 2 or scb.shape != (q.shape[0],):
        raise ModelLoadError(f"{st.folder}: {name!r} is not an LLM.int8 weight with row SCB")
    return Int8Weight(q.contiguous(), (scb / 127).unsqueeze(1).contiguous(), None, q.shape[1])


def dequantize_4bit(st: SafetensorsFolder, name: str) -> torch.Tensor:
    key = _state_key(st, name)
    assert key is not None
    try:
        import logging

        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
        import bitsandbytes.functional as bnb_f
    except Exception as e:
        raise ModelLoadError(f"bitsandbytes checkpoints need the bitsandbytes package "
                             f"({INSTALL_HINT}); importing it failed ({e})") from None
    prefix = name + "."
    stats = {k[len(prefix):]: st.get(k) for k in st.names() if k.startswith(prefix)}
    try:
        state = bnb_f.QuantState.from_dict(stats, device=torch.device("cpu"))
        return bnb_f.dequantize_4bit(st.get(name), state).float()
    except Exception as e:  # bitsandbytes raises assorted errors for malformed states
        raise ModelLoadError(f"{st.folder}: cannot dequantize bitsandbytes weight {name!r} "
                             f"({type(e).__name__}: {e})") from None


def dequantize_bnb(st: SafetensorsFolder, name: str) -> torch.Tensor:
    """fp32 [out, in] of a bitsandbytes weight (see `is_bnb_weight`)."""
    if _state_key(st, name) is not None:
        return dequantize_4bit(st, name)
    return int8_weight(st, name).dequantize()

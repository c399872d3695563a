"""Quantize-on-load: dense float weights [out, in] -> the runtime formats of `formats.py`.

    int4:  asymmetric, groups of 32 along `in`:  w ~ scale * q + offset,  q in 0..15,
           offset = group min, scale = (max - min) / 15  (GGUF Q4_1's convention; fp16 scales)
    int8:  symmetric, per output channel (default) or groups of 16/32:  w ~ scale * q,
           scale = absmax / 127, q in -127..127 (fp16 scales)
    nf4:   4-bit codes into the 16-entry NF4 codebook, blocks of 32 scaled by their absmax:
           w ~ NF4_CODEBOOK[q] * absmax  (fp32 scales, as bitsandbytes keeps them)

Codes are always computed against the scales as stored (after rounding them to their dtype), so
`dequantize()` gives the nearest representable value of each weight. NF4 uses bitsandbytes'
`quantize_4bit` when bitsandbytes is installed (and converts its layout), else the same
nearest-codebook rounding implemented here; both give the same codes except on exact ties.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from localllm.quant.formats import NF4_CODEBOOK, Int4Weight, Int8Weight, pack_nibbles

QUANTIZE_MODES = ("int8", "int4", "nf4")
_FP16_MAX = 65504.0


def _check(w: torch.Tensor, group: int, name: str) -> torch.Tensor:
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"{name}: expected a float matrix [out, in], got {w.dtype} "
                         f"{tuple(w.shape)}")
    if w.shape[1] % group:
        raise ValueError(f"{name}: in_features {w.shape[1]} is not a multiple of {group}")
    return w.float()


def _scale_dtype(w: torch.Tensor) -> torch.dtype:
    """fp16 scales unless a group's min or scale would overflow it."""
    return torch.float16 if float(w.abs().max()) < _FP16_MAX / 2 else torch.float32


def quantize_int4(w: torch.Tensor, group: int = 32) -> Int4Weight:
    """Asymmetric 4-bit: per group of `group` columns, scale * q + offset with q in 0..15."""
    w = _check(w, group, "quantize_int4")
    out, in_ = w.shape
    wg = w.view(out, in_ // group, group)  # [out, n_groups, group]
    lo, hi = wg.amin(-1), wg.amax(-1)
    sd = _scale_dtype(w)
    scales = ((hi - lo) / 15).to(sd)
    offsets = lo.to(sd)
    s = scales.float().unsqueeze(-1)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round((wg - offsets.float().unsqueeze(-1)) / safe).clamp_(0, 15)
    q = torch.where(s > 0, q, torch.zeros_like(q))
    return Int4Weight(pack_nibbles(q.view(out, in_).to(torch.uint8)).contiguous(),
                      scales.contiguous(), offsets.contiguous(), group)


def quantize_int8(w: torch.Tensor, group: int | None = None) -> Int8Weight:
    """Symmetric 8-bit: scale = absmax / 127 per output channel (`group=None`) or per group."""
    g = w.shape[-1] if group is None else group
    w = _check(w, g, "quantize_int8")
    out, in_ = w.shape
    wg = w.view(out, in_ // g, g)
    scales = (wg.abs().amax(-1) / 127).to(_scale_dtype(w))  # [out, n_groups]
    s = scales.float().unsqueeze(-1)
    q = torch.round(wg / torch.where(s > 0, s, torch.ones_like(s))).clamp_(-127, 127)
    return Int8Weight(q.view(out, in_).to(torch.int8).contiguous(), scales.contiguous(), None, g)


def nf4_codebook() -> torch.Tensor:
    return torch.tensor(NF4_CODEBOOK, dtype=torch.float32)


def _bnb_functional() -> ModuleType | None:
    """`bitsandbytes.functional`, or None where it is not installed or has no backend."""
    try:
        # bitsandbytes logs a warning about optional CPU kernels at import; keep it quiet
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
        import bitsandbytes.functional as bnb_f
    except Exception:  # not installed, or no backend for this machine
        return None
    return bnb_f


def nf4_codes_torch(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """NF4 in PyTorch, where bitsandbytes is absent: (codes uint8 [out, in], absmax fp32
    [out, in / group])."""
    w = _check(w, group, "quantize_nf4")
    out, in_ = w.shape
    wg = w.view(out, in_ // group, group)
    absmax = wg.abs().amax(-1)  # [out, n_groups]
    x = wg / torch.where(absmax > 0, absmax, torch.ones_like(absmax)).unsqueeze(-1)
    cb = nf4_codebook()
    # nearest codebook entry through the midpoints between neighbours (as bitsandbytes does)
    mids = (cb[1:] + cb[:-1]) / 2  # [15]
    codes = torch.bucketize(x.contiguous(), mids)
    return codes.view(out, in_).to(torch.uint8), absmax


def _nf4_codes_bnb(bnb_f, w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    out, in_ = w.shape
    packed, state = bnb_f.quantize_4bit(w.float().contiguous(), blocksize=group,
                                        quant_type="nf4")
    # bitsandbytes: the flattened matrix, element 2i in the HIGH nibble of byte i
    packed = packed.flatten()
    codes = torch.stack((packed >> 4, packed & 0x0F), dim=-1).flatten()[: out * in_]
    return codes.view(out, in_), state.absmax.float().view(out, in_ // group)


def quantize_nf4(w: torch.Tensor, group: int = 32, use_bnb: bool | None = None) -> Int4Weight:
    """NF4 with blocks of `group` (absmax scaling): an Int4Weight carrying the NF4 codebook.
    `use_bnb` (default: when bitsandbytes imports) picks bitsandbytes' quantizer."""
    _check(w, group, "quantize_nf4")
    bnb_f = _bnb_functional() if use_bnb in (None, True) else None
    if use_bnb and bnb_f is None:
        raise RuntimeError("bitsandbytes is not installed or does not work here")
    codes, absmax = (_nf4_codes_bnb(bnb_f, w, group) if bnb_f is not None
                     else nf4_codes_torch(w, group))
    return Int4Weight(pack_nibbles(codes).contiguous(), absmax.contiguous(), None, group,
                      codebook=nf4_codebook())


def quantize(w: torch.Tensor, mode: str) -> Int4Weight | Int8Weight:
    """Quantize one weight matrix with `mode` in QUANTIZE_MODES."""
    if mode == "int4":
        return quantize_int4(w)
    if mode == "int8":
        return quantize_int8(w)
    if mode == "nf4":
        return quantize_nf4(w)
    raise ValueError(f"unknown quantization {mode!r} (choose from {', '.join(QUANTIZE_MODES)})")

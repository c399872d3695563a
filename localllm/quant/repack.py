"""Lossless repacking of GGUF tensors into the runtime formats (`Int4Weight`, `Int8Weight`).

    Q4_0, Q4_1, Q2_K, Q3_K, Q4_K -> Int4Weight       Q8_0, Q5_0, Q5_1, Q5_K, Q6_K -> Int8Weight
    IQ4_NL, IQ4_XS -> Int4Weight with a codebook     F32, F16, BF16 -> dense tensor (stored dtype)

Every mapping reproduces `gguf.quants.dequantize` exactly: fp16 scales are kept as fp16, and
K-quant scales (fp16 super-block scale x small integer sub-block scale) are multiplied out in
fp32, where the product is exact. Offsets are stored already negated (`-dmin * m`), and
`dequantize` uses gguf's operation order, so even the final rounding matches.

Block layouts follow `gguf/quants.py` (one block = `block_size` values in `type_size` bytes,
from `GGMLType`); every function below sees all blocks at once as uint8 [rows, n_blocks,
type_size] and uses only whole-array numpy operations, never a Python loop over blocks.

Types without a lossless mapping (IQ1_*, IQ2_*, IQ3_* lattice codebooks, TQ1_0/TQ2_0, MXFP4,
NVFP4, the integer types, types unknown to this version) make `repack` return None instead of
raising: the caller then falls back to dense dequantization (`localllm.quant.dequant`), and the
loader warns once per type with what it costs, so a model with one odd tensor still loads.
Malformed input (a byte count that does not match the shape) raises ValueError.

A tensor with more than two dimensions is repacked as a matrix [prod(shape[:-1]), shape[-1]].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import prod

import numpy as np
import torch

from localllm.gguf.reader import TensorInfo
from localllm.gguf.types import GGMLType
from localllm.quant.formats import IQ4_NL_CODEBOOK, Int4Weight, Int8Weight

Repacked = Int4Weight | Int8Weight | torch.Tensor
_U4 = np.uint8(4)


def _f16(field: np.ndarray) -> np.ndarray:
    """uint8 [..., 2] little-endian half floats -> float16 [...]."""
    return np.array(field, copy=True).view(np.float16)[..., 0]  # never a view of the input


def _halves_to_pairs(qs: np.ndarray, half: int) -> np.ndarray:
    """GGUF nibble order -> ours. In each chunk of `half` bytes, byte j holds value j (low
    nibble) and value half + j (high nibble); the result holds values 2j, 2j+1 in byte j."""
    c = qs.reshape(*qs.shape[:-1], -1, half // 2, 2)
    even, odd = c[..., 0], c[..., 1]
    lo = (even & 0x0F) | (odd << _U4)  # values 0 .. half-1
    hi = (even >> _U4) | (odd & 0xF0)  # values half .. 2*half-1
    return np.concatenate((lo, hi), axis=-1).reshape(qs.shape)


def _pack(q: np.ndarray) -> np.ndarray:
    """uint8 codes [..., 2m] in 0..15 -> [..., m], value 2j low nibble, 2j+1 high nibble."""
    return q[..., 0::2] | (q[..., 1::2] << _U4)


def _bits(field: np.ndarray, width: int, count: int) -> np.ndarray:
    """uint8 [..., n] -> [..., count, n]: field >> (width * i) & mask for i < count."""
    shifts = (np.arange(count, dtype=np.uint8) * np.uint8(width)).reshape(count, 1)
    return (field[..., None, :] >> shifts) & np.uint8((1 << width) - 1)


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 12-byte field [..., 12] -> 6-bit (scales, mins) [..., 8] each.

    byte 0-3: mm ssssss  (s0..s3 low 6 bits; top 2 bits = high bits of s4..s7)
    byte 4-7: mm mmmmmm  (m0..m3 low 6 bits; top 2 bits = high bits of m4..m7)
    byte 8-11: mmmm ssss (low 4 bits of m4..m7 | low 4 bits of s4..s7)
    """
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), axis=-1)
    mn = np.concatenate((m & 0x3F, (md >> _U4) | ((m >> 2) & 0x30)), axis=-1)
    return sc, mn


def _flat(a: np.ndarray, rows: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).reshape(rows, -1))


def _int4(codes_packed: np.ndarray, scales: np.ndarray, offsets: np.ndarray | None, group: int,
          codebook: tuple[float, ...] | None = None) -> Int4Weight:
    rows = codes_packed.shape[0]
    cb = None if codebook is None else torch.tensor(codebook, dtype=torch.float32)
    off = None if offsets is None else _flat(offsets, rows)
    return Int4Weight(_flat(codes_packed, rows), _flat(scales, rows), off, group, cb)


def _int8(q: np.ndarray, scales: np.ndarray, offsets: np.ndarray | None,
          group: int) -> Int8Weight:
    rows = q.shape[0]
    off = None if offsets is None else _flat(offsets, rows)
    return Int8Weight(_flat(q.view(np.int8), rows), _flat(scales, rows), off, group)


def _q4_0(b: np.ndarray) -> Int4Weight:  # d f16 | qs[16]: w = d * (q - 8)
    return _int4(_halves_to_pairs(b[..., 2:], 16), _f16(b[..., 0:2]), None, 32)


def _q4_1(b: np.ndarray) -> Int4Weight:  # d f16 | m f16 | qs[16]: w = d * q + m
    return _int4(_halves_to_pairs(b[..., 4:], 16), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 32)


def _iq4_nl(b: np.ndarray) -> Int4Weight:  # d f16 | qs[16]: w = d * kvalues[q]
    return _int4(_halves_to_pairs(b[..., 2:], 16), _f16(b[..., 0:2]), None, 32,
                 IQ4_NL_CODEBOOK)


def _q5_values(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """qh [..., 4] (bit i = bit 4 of value i) | qs [..., 16] (split nibbles) -> [..., 32]."""
    lo = np.concatenate((qs & 0x0F, qs >> _U4), axis=-1)
    hi = np.unpackbits(qh, axis=-1, bitorder="little")
    return lo | (hi << _U4)


def _q5_0(b: np.ndarray) -> Int8Weight:  # d f16 | qh u32 | qs[16]: w = d * (q - 16)
    q = _q5_values(b[..., 2:6], b[..., 6:]).view(np.int8) - np.int8(16)
    return _int8(q, _f16(b[..., 0:2]), None, 32)


def _q5_1(b: np.ndarray) -> Int8Weight:  # d f16 | m f16 | qh u32 | qs[16]: w = d * q + m
    q = _q5_values(b[..., 4:8], b[..., 8:])
    return _int8(q, _f16(b[..., 0:2]), _f16(b[..., 2:4]), 32)


def _q8_0(b: np.ndarray) -> Int8Weight:  # d f16 | qs int8[32]: w = d * q
    return _int8(np.array(b[..., 2:], copy=True), _f16(b[..., 0:2]), None, 32)


def _q2_k(b: np.ndarray) -> Int4Weight:
    # scales[16] (lo 4 bits scale, hi 4 bits min) | qs[64] | d f16 | dmin f16
    # value 128h + 32s + j = bits 2s..2s+1 of qs[32h + j]; w = d*sc * q - dmin*mn, groups of 16
    rows, nb = b.shape[:2]
    q = _bits(b[..., 16:80].reshape(rows, nb, 2, 32), 2, 4).reshape(rows, nb, 256)
    sc = b[..., 0:16]
    d, dmin = _f16(b[..., 80:82]).astype(np.float32), _f16(b[..., 82:84]).astype(np.float32)
    scale = d[..., None] * (sc & 0x0F).astype(np.float32)
    offset = -(dmin[..., None] * (sc >> _U4).astype(np.float32))
    return _int4(_pack(q), scale, offset, 16)


def _q3_k(b: np.ndarray) -> Int4Weight:
    # hmask[32] | qs[64] | scales[12] (6-bit, biased by 32) | d f16, groups of 16
    # low 2 bits as in Q2_K; bit 2 of value 32i + j is bit i of hmask[j], and a CLEAR bit means
    # subtract 4: q = lo + 4 * hbit - 4 in -4..3, stored with bias 8 as code 4..11.
    rows, nb = b.shape[:2]
    lo = _bits(b[..., 32:96].reshape(rows, nb, 2, 32), 2, 4).reshape(rows, nb, 256)
    hbit = _bits(b[..., 0:32], 1, 8).reshape(rows, nb, 256)
    codes = lo + (hbit << np.uint8(2)) + _U4
    s = b[..., 96:108]
    low = np.concatenate((s[..., 0:8] & 0x0F, s[..., 0:8] >> _U4), axis=-1)  # [.., 16]
    high = _bits(s[..., 8:12], 2, 4).reshape(rows, nb, 16)
    sc = (low | (high << _U4)).astype(np.float32) - 32.0
    scale = _f16(b[..., 108:110]).astype(np.float32)[..., None] * sc
    return _int4(_pack(codes), scale, None, 16)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K header (d f16 | dmin f16 | 12 bytes) -> fp32 scale, offset [rows, nb, 8]."""
    d, dmin = _f16(b[..., 0:2]).astype(np.float32), _f16(b[..., 2:4]).astype(np.float32)
    sc, mn = _k_scale_min(b[..., 4:16])
    return d[..., None] * sc.astype(np.float32), -(dmin[..., None] * mn.astype(np.float32))


def _q4_k(b: np.ndarray) -> Int4Weight:
    # d | dmin | scales[12] | qs[128]: chunk c of 32 bytes holds sub-block 2c in its low
    # nibbles and 2c+1 in its high nibbles; w = d*sc * q - dmin*m, groups of 32
    scale, offset = _k_scales(b)
    return _int4(_halves_to_pairs(b[..., 16:], 32), scale, offset, 32)


def _q5_k(b: np.ndarray) -> Int8Weight:
    # d | dmin | scales[12] | qh[32] (bit i of qh[j]: bit 4 of value 32i + j) | qs[128] as Q4_K
    rows, nb = b.shape[:2]
    qs = b[..., 48:].reshape(rows, nb, 4, 1, 32)
    lo = np.concatenate((qs & 0x0F, qs >> _U4), axis=-2).reshape(rows, nb, 256)
    hi = _bits(b[..., 16:48], 1, 8).reshape(rows, nb, 256)
    scale, offset = _k_scales(b)
    return _int8(lo | (hi << _U4), scale, offset, 32)


def _q6_k(b: np.ndarray) -> Int8Weight:
    # ql[128] | qh[64] | scales int8[16] | d f16; groups of 16, w = d*sc * (q - 32)
    # value 128h + 32s + j: low 4 bits from ql[64h + 32(s%2) + j] (nibble s//2),
    # high 2 bits from bits 2s..2s+1 of qh[32h + j]
    rows, nb = b.shape[:2]
    lo = _bits(b[..., 0:128].reshape(rows, nb, 2, 64), 4, 2).reshape(rows, nb, 256)
    hi = _bits(b[..., 128:192].reshape(rows, nb, 2, 32), 2, 4).reshape(rows, nb, 256)
    q = (lo | (hi << _U4)).view(np.int8) - np.int8(32)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    scale = _f16(b[..., 208:210]).astype(np.float32)[..., None] * sc
    return _int8(q, scale, None, 16)


def _iq4_xs(b: np.ndarray) -> Int4Weight:
    # d f16 | scales_h u16 (2 bits per sub-block) | scales_l[4] (nibbles) | qs[128] with
    # 16-byte chunks as IQ4_NL; w = d * (sc - 32) * kvalues[q], groups of 32
    rows, nb = b.shape[:2]
    sl = b[..., 4:8]
    low = np.stack((sl & 0x0F, sl >> _U4), axis=-1).reshape(rows, nb, 8)
    # sub-block 4k + i <- bits 2i..2i+1 of scales_h byte k
    high = _bits(b[..., 2:4], 2, 4).transpose(0, 1, 3, 2).reshape(rows, nb, 8)
    sc = (low | (high << _U4)).astype(np.float32) - 32.0
    scale = _f16(b[..., 0:2]).astype(np.float32)[..., None] * sc
    return _int4(_halves_to_pairs(b[..., 8:], 16), scale, None, 32, IQ4_NL_CODEBOOK)


_INT4_REPACKERS: dict[GGMLType, Callable[[np.ndarray], Int4Weight]] = {
    GGMLType.Q4_0: _q4_0, GGMLType.Q4_1: _q4_1, GGMLType.Q2_K: _q2_k, GGMLType.Q3_K: _q3_k,
    GGMLType.Q4_K: _q4_k, GGMLType.IQ4_NL: _iq4_nl, GGMLType.IQ4_XS: _iq4_xs,
}
_INT8_REPACKERS: dict[GGMLType, Callable[[np.ndarray], Int8Weight]] = {
    GGMLType.Q5_0: _q5_0, GGMLType.Q5_1: _q5_1, GGMLType.Q8_0: _q8_0, GGMLType.Q5_K: _q5_k,
    GGMLType.Q6_K: _q6_k,
}
# each repacker sees uint8 blocks [rows, n_blocks, type.type_size]
_REPACKERS: dict[GGMLType, Callable[[np.ndarray], Int4Weight | Int8Weight]] = {
    **_INT4_REPACKERS, **_INT8_REPACKERS,
}
INT4_TYPES = frozenset(_INT4_REPACKERS)
INT8_TYPES = frozenset(_INT8_REPACKERS)
DENSE_TYPES = frozenset({GGMLType.F32, GGMLType.F16, GGMLType.BF16})


def _dense(raw: np.ndarray, qtype: GGMLType, shape: tuple[int, ...]) -> torch.Tensor:
    n = prod(shape)
    if qtype == GGMLType.F32:
        arr = np.asarray(raw).view(np.float32) if raw.dtype == np.uint8 else raw
    else:
        arr = np.asarray(raw).view(np.uint16) if raw.dtype != np.float16 else raw
    if arr.size != n:
        raise ValueError(f"{arr.size} values for shape {shape}")
    arr = np.array(arr.reshape(shape), copy=True)  # out of the read-only memory map
    if qtype == GGMLType.F32:
        return torch.from_numpy(arr.astype(np.float32, copy=False))
    if qtype == GGMLType.F16:
        return torch.from_numpy(arr.view(np.float16))
    return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)


def repack(info_or_raw: TensorInfo | np.ndarray, qtype: int | None = None,
           shape: Sequence[int] | None = None) -> Repacked | None:
    """One GGUF tensor -> Int4Weight | Int8Weight (shaped [rows, cols]) or a dense tensor;
    None when its type has no lossless runtime format (see the module docstring).

    `info_or_raw` is a `TensorInfo` (qtype and shape then default to its own) or the raw data:
    uint8 bytes (any shape whose size is right) or a typed float array for F32/F16.
    """
    if isinstance(info_or_raw, TensorInfo):
        raw = info_or_raw.data
        qtype = info_or_raw.qtype if qtype is None else qtype
        shape = info_or_raw.shape if shape is None else shape
    else:
        raw = np.asarray(info_or_raw)
    if qtype is None or shape is None:
        raise ValueError("repack of raw data needs qtype and shape")
    try:
        gtype = GGMLType(qtype)
    except ValueError:  # a type unknown to this version
        return None
    shape = tuple(int(s) for s in shape)
    if gtype in DENSE_TYPES:
        return _dense(raw, gtype, shape)
    if gtype not in _REPACKERS or not shape:
        return None
    block, type_size, fn = gtype.block_size, gtype.type_size, _REPACKERS[gtype]
    cols = shape[-1]
    rows = prod(shape[:-1])
    if cols % block:
        raise ValueError(f"rows of {cols} values are not a multiple of the block size {block}")
    nbytes = rows * (cols // block) * type_size
    if raw.nbytes != nbytes:
        raise ValueError(f"{raw.nbytes} bytes for shape {shape}, expected {nbytes}")
    blocks = raw.view(np.uint8).reshape(rows, cols // block, type_size)
    return fn(blocks)

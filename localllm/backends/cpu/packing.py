"""Offline packing: int4/int8 runtime weights -> the packed layout of PyTorch's CPU int4 kernel.

`torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_zeros)` computes
`x @ W.T` with `W[n, k] = (c[n, k] - 8) * scale[g, n] + zero[g, n]`, `g = k // 32`, codes `c` in
0..15 and bf16 scales/zeros. The native kernels read its AVX-512 layout
(`cpu_int4.NATIVE_LAYOUT`), which interleaves rows in tiles of 64: byte `j` of column `k` in
tile `t` holds row `64t + j` in its low nibble and row `64t + 32 + j` in its high nibble:

    packed.view(N / 64, K, 32)[t, k, j]:   bit 7           4 3           0
                                              [ c[64t+32+j, k] | c[64t+j, k] ]

PyTorch's kernel reads another layout where it was dispatched to AVX2 or to no vectors at all
(tiles of 32 rows, `cpu_int4.LAYOUTS`); `torch_layout` finds out which, and a weight packed
without the native kernels takes that one (`pack_layout`), so that PyTorch's kernel runs it.

Both runtime formats with groups of 32 map onto it exactly (up to bf16 scales), and so do
groups of 16 (Q2_K, Q3_K, Q6_K), which only the native kernel (`kernels/cpu_int4*.c`) runs:

    Int4Weight (one plane):  c = q,  zero = offset + 8 * scale  (offset = -8 * scale if none)
    Int8Weight (two planes): q = 16 * h + l with h = q >> 4 in -8..7 and l = q & 15 in 0..15;
        plane H: c = h + 8, scale 16 * s, zero = offset (0 if none)
        plane L: c = l,     scale s,      zero = 8 * s
        stacked along K, so `[x, x] @ [W_H, W_L].T = x @ (W_H + W_L).T = x @ W.T`

With the native kernels, a symmetric weight whose file stores fp16 scales (Q4_0, Q5_0, Q8_0,
IQ4_NL: no offsets) keeps those scales alone, fp16 [in / group_size, out_padded], with the zeros
above implied (`half`): half the bytes of the bf16 (scale, zero) pairs, a quarter for two
planes (the default model's Q8_0 head: 30 MB instead of 37), and exact.

With the native kernels, the bf16 (scale, zero) pairs are kept tile by tile, [out_padded / 64,
planes * in / group_size, 64, 2] (`cpu_int4.tile_scales`): a thread then reads the scales of
its tiles in one run beside their codes, not in one run per group (decode's matmuls 11% faster
from memory). PyTorch's kernel gets them back in its own form (`cpu_int4.untile_scales`).

Rows are padded to a multiple of 64 with zero weights. Int8 weights with one scale per output
channel use `_weight_int8pack_mm` instead (`CpuInt8ChannelWeight`).
"""

from __future__ import annotations

import functools

import torch

from localllm.kernels import cpu_native
from localllm.kernels.cpu_int4 import LAYOUTS, NATIVE_LAYOUT, TILE, NibbleLayout
from localllm.quant.formats import Int4Weight, Int8Weight, unpack_nibbles

GROUP = 32  # the group size PyTorch's int4 kernel and the native one share
PACK_ROWS = 1024  # rows converted to the packed layout at a time (a multiple of TILE)


def packed_group_sizes() -> tuple[int, ...]:
    """Group sizes a packed weight may have here: 32 (PyTorch's int4 kernel and the native
    one), and 16 (Q2_K, Q3_K, Q6_K) where the native kernels run."""
    return (GROUP, 16) if cpu_native.available() else (GROUP,)


def cpu_packable(w: Int4Weight | Int8Weight, dtype: torch.dtype) -> bool:
    """Whether `w` can be held packed for CPU compute in `dtype` (bf16 only). Codebook
    weights (IQ4_NL, IQ4_XS, NF4) need the native kernels."""
    if dtype != torch.bfloat16 or w.in_features % GROUP:
        return False
    if isinstance(w, Int4Weight):
        if w.codebook is not None and not cpu_native.available():
            return False
        return w.group_size in packed_group_sizes()
    return w.group_size in packed_group_sizes() or (w.per_channel and w.offsets is None)


def kernel_codes(w: Int4Weight | Int8Weight, rows: int) -> torch.Tensor:
    """Kernel codes 0..15 of w's rows, padded to `rows` (padding: code 8, weight 0):
    uint8 [rows, planes * in]."""
    if isinstance(w, Int4Weight):
        codes = unpack_nibbles(w.qweight)
    else:
        # planes H | L: h + 8 for h = q >> 4 in -8..7 is the two's-complement high nibble
        # with its top bit flipped
        u = w.qweight.view(torch.uint8)
        codes = torch.cat(((u >> 4) ^ 8, u & 15), dim=1)
    if w.out_features < rows:
        codes = torch.cat((codes, codes.new_full((rows - w.out_features, codes.shape[1]), 8)))
    return codes


def pack_tiles(codes: torch.Tensor, layout: NibbleLayout = NATIVE_LAYOUT) -> torch.Tensor:
    """uint8 codes [rows, K2] (rows a multiple of 64) -> the packed `layout` [rows, K2 / 2]:
    what `torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)` returns where
    `layout` is PyTorch's (tested), in uint8 throughout (3.6x faster: no int32 copy)."""
    rows, k2 = codes.shape
    t, half = layout.tile, layout.tile // 2
    if layout.split:
        v = codes.view(rows // t, 2, half, k2)  # [tiles, low/high nibble, tile / 2, K2]
        low, high = v[:, 0], v[:, 1]
    else:
        v = codes.view(rows // t, half, 2, k2)  # [tiles, tile / 2, low/high nibble, K2]
        low, high = v[:, :, 0], v[:, :, 1]
    return (low | (high << 4)).transpose(1, 2).contiguous().view(rows, k2 // 2)


@functools.cache
def torch_layout() -> NibbleLayout | None:
    """The packed layout PyTorch's int4 CPU kernel reads in this process (it follows the
    vector width ATen dispatches to), found by packing a probe both ways; None if it is none
    of `LAYOUTS` (that kernel is then not used)."""
    codes = torch.randint(0, 16, (TILE, 2 * TILE), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(0))
    try:
        want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    except (AttributeError, RuntimeError):  # a PyTorch without it
        return None
    for layout in LAYOUTS:
        got = pack_tiles(codes, layout)
        if got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want):
            return layout
    return None


def pack_layout() -> NibbleLayout:
    """The layout a weight packed now takes: the native kernels', or without them the one
    PyTorch's int4 kernel reads (the native one if that kernel's is unknown)."""
    if cpu_native.available():
        return NATIVE_LAYOUT
    return torch_layout() or NATIVE_LAYOUT


def half_scales(w: Int4Weight | Int8Weight) -> bool:
    """Whether `w` keeps its fp16 scales alone (see the module docstring)."""
    return w.offsets is None and w.scales.dtype == torch.float16 and cpu_native.available()


def kernel_scales_zeros(w: Int4Weight | Int8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's fp32 scales and zeros of each row and group, planes side by side:
    [out, planes * in / group_size] each (see the module docstring)."""
    s = w.scales.float()  # [out, in / group_size]
    if isinstance(w, Int4Weight) and w.codebook is not None:  # codebook[c] * scale
        return s, torch.zeros_like(s)
    if isinstance(w, Int4Weight):
        zeros = (w.offsets.float() + 8.0 * s) if w.offsets is not None else torch.zeros_like(s)
        return s, zeros
    hi_zero = w.offsets.float() if w.offsets is not None else torch.zeros_like(s)
    return torch.cat((16.0 * s, s), dim=1), torch.cat((hi_zero, 8.0 * s), dim=1)

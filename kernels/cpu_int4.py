"""The int4 weight-only matmuls and dequantization of `cpu_int4*.c`, beside their references.

Weights are in `NATIVE_LAYOUT`, the packed layout PyTorch's int4 CPU kernel reads where it
runs AVX-512 (see `localllm/backends/cpu/packing.py`): uint8 [out_padded, planes * in / 2],
with bf16 (scale, zero) pairs (as PyTorch's kernel takes them, or tile by tile) or the fp16
scales alone of a symmetric weight (`scales_layout`). Call `cpu_native.available()` first;
`int4_gemm` also needs `cpu_native.gemm_available()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localllm.kernels import cpu_native
from localllm.kernels.cpu_ops import silu_mul_ref, top_k_ref

TILE = 64  # rows per tile of the packed layout


@dataclass(frozen=True)
class NibbleLayout:
    """Which rows share a byte of a packed weight: `packed.view(N / tile, K2, tile / 2)[t, k, j]`
    holds column k of two rows of tile t, in its low and high nibble: rows `j` and
    `j + tile / 2` of the tile (`split`), or rows `2j` and `2j + 1`. The native kernels read
    `NATIVE_LAYOUT`; PyTorch's int4 kernel reads one of `LAYOUTS`, which one by the vector
    width it was dispatched to (`localllm.backends.cpu.packing.torch_layout`)."""

    tile: int
    split: bool

    def nibble_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where rows `ids` sit: (tile, byte within the tile's column, high nibble?)."""
        within = ids % self.tile
        half = self.tile // 2
        if self.split:
            return ids // self.tile, within % half, within >= half
        return ids // self.tile, within // 2, within % 2 == 1


NATIVE_LAYOUT = NibbleLayout(TILE, True)
# PyTorch 2.x: AVX-512 (64, split), AVX2 (32, split), and without vectors 32 or 16 adjacent
LAYOUTS = (NATIVE_LAYOUT, NibbleLayout(32, True), NibbleLayout(32, False),
           NibbleLayout(16, False))
GROUP_SIZES = (32, 16)  # the kernels' groups of columns; the scales' shape tells which


def codebook_lut(codebook: torch.Tensor) -> torch.Tensor:
    """The kernels' form of a 16-entry codebook: bf16 [32], its bf16 rounding hi and the
    remainder lo = bf16(v - hi) (zero for integer codebooks such as IQ4_NL's), so that
    hi + lo holds values such as NF4's to about 2^-17. The kernels take one product per weight
    when lo is zero, two (hi and lo) otherwise."""
    v = codebook.float().reshape(16)
    hi = v.bfloat16()
    return torch.cat((hi, (v - hi.float()).bfloat16())).contiguous()


def lut_values(lut: torch.Tensor) -> torch.Tensor:
    """fp32 [16] codebook values hi + lo of a `codebook_lut`."""
    return lut[:16].float() + lut[16:].float()


def _lut_ptr(lut: torch.Tensor | None) -> int | None:
    if lut is None:
        return None
    if lut.shape != (32,) or lut.dtype != torch.bfloat16 or not lut.is_contiguous():
        raise ValueError("a codebook must be bf16 [32] (codebook_lut), contiguous")
    return lut.data_ptr()


def int4_mm(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
            out_features: int, planes: int, lut: torch.Tensor | None = None,
            tiles: bool = False) -> torch.Tensor:
    """x @ W.T for a packed int4 weight (`CpuPackedWeight` layout); call `available()` first.
    `tiles`: a prompt's rows, on AMX tiles where `gemm_available()` (groups of 32 without a
    codebook), whatever `amx_enabled` says.

    x: bf16 [M, in] with unit stride along `in`; packed: uint8 [out_padded, planes * in / 2];
    scales_zeros: bf16 [planes * in / gs, out_padded, 2] for groups of gs = 32 or 16 columns
    (or those pairs tile by tile, `tile_scales`), or fp16 [in / gs, out_padded], the scales
    alone of a symmetric weight (`scales_layout`);
    lut: None, or the `codebook_lut` of a codebook weight (weights v[c] s + z instead of
    (c - 8) s + z) -> bf16 [M, out_features]."""
    lib = cpu_native.library()
    assert lib is not None, "native kernels are not available"
    m, k, n_pad, layout = _matmul_operands("int4_mm", x, packed, scales_zeros, out_features,
                                           planes)
    y = torch.empty(m, out_features, dtype=torch.bfloat16)
    fn = lib.int4_mm_tiles if tiles and cpu_native.gemm_available() else lib.int4_mm
    if m and fn(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), scales_zeros.data_ptr(),
                out_features, n_pad, planes, y.data_ptr(), out_features, layout[0],
                _lut_ptr(lut), layout[1]):
        raise MemoryError("int4_mm: out of memory")
    return y


def int8_logits(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                out_features: int) -> torch.Tensor:
    """fp32 x @ W.T for a grouped int8 weight in two planes with fp16 scales (an LM head in
    Q8_0; `scales_layout` half, groups of 32), for logits: x rounded per group of 32 columns to
    16-bit integers, integer products summed exactly (`int8_logits_ref`; both builds give the
    same logits). Call `cpu_native.available()` first. x: bf16 [M, in]; packed: uint8
    [out_padded, in]; scales: fp16 [in / 32, out_padded] -> fp32 [M, out_features]."""
    lib = cpu_native.library()
    assert lib is not None, "native kernels are not available"
    m, k, n_pad, layout = _matmul_operands("int8_logits", x, packed, scales, out_features, 2)
    if layout != (32, HALF):
        raise ValueError("int8_logits: the weight needs fp16 scales for groups of 32")
    y = torch.empty(m, out_features, dtype=torch.float32)
    if m and lib.int8_logits(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(),
                             scales.data_ptr(), out_features, n_pad, y.data_ptr(),
                             out_features):
        raise MemoryError("int8_logits: out of memory")
    return y


def round_groups_i16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] rounded per group of 32 columns as `int8_logits` rounds it: integers v in
    -32767..32767 (fp32 [M, K]) and the groups' scales sx = max |x| / 32767 (fp32 [M, K / 32])."""
    xf = x.float().view(x.shape[0], -1, 32)
    a = xf.abs().amax(-1)  # [M, K / 32]
    inv = torch.where(a > 0, torch.tensor(32767.0) / a, torch.zeros_like(a))
    v = torch.round(xf * inv.unsqueeze(-1))
    return v.view(x.shape), a / 32767.0


def int8_logits_ref(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                    out_features: int) -> torch.Tensor:
    # the same formula in float64: per group the exact integer sum A = sum_k q v, then the
    # logits sum_g A * (s * sx) over the groups (the kernel's fp32 sums differ by rounding)
    v, sx = round_groups_i16(x)
    q = packed_row_ints(packed, torch.arange(out_features), 2).double()  # int8 weights [out, K]
    a = torch.einsum("mgk,ngk->mng", v.double().view(len(x), -1, 32), q.view(out_features, -1, 32))
    w = scales[:, :out_features].t().double()  # [out, K / 32]
    return (a * w.unsqueeze(0) * sx.double().unsqueeze(1)).sum(-1).float()


def _matmul_operands(name: str, x: torch.Tensor, packed: torch.Tensor,
                     scales_zeros: torch.Tensor, out_features: int, planes: int,
                     gated: bool = False) -> tuple[int, int, int, tuple[int, int]]:
    """(rows, in, out_padded, scales_layout) of a packed matmul's operands, or a ValueError."""
    m, k = x.shape
    n_pad = packed.shape[0]
    layout = scales_layout(scales_zeros, planes * k, planes, n_pad)
    if (x.dtype != torch.bfloat16 or x.stride(1) != 1 or packed.dtype != torch.uint8
            or not packed.is_contiguous() or packed.shape[1] * 2 != planes * k or k % 32
            or n_pad % TILE or layout is None or not 0 < out_features <= n_pad
            or (gated and out_features % (2 * TILE))):
        raise ValueError(f"{name}: bad operands x {tuple(x.shape)} {x.dtype}, packed "
                         f"{tuple(packed.shape)}, scales {tuple(scales_zeros.shape)} "
                         f"{scales_zeros.dtype}, planes {planes}, out {out_features}")
    return m, k, n_pad, layout


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
              out_features: int, planes: int, lut: torch.Tensor | None = None,
              gated: bool = False) -> torch.Tensor:
    """x @ W.T over many rows on AMX tiles (check `gemm_available()`), with W's bf16 weights
    those of `int4_dequant_t`; operands as for `int4_mm`. `gated`: W stacks gate and up
    (out_features = 2 I, I a multiple of 64) and the result is silu(x Wg^T) * (x Wu^T),
    bf16 [M, I]; else bf16 [M, out_features]."""
    lib = cpu_native.library()
    assert lib is not None and cpu_native.gemm_available(), "int4_gemm needs the kernels and AMX"
    m, k, n_pad, layout = _matmul_operands("int4_gemm", x, packed, scales_zeros,
                                           out_features, planes, gated)
    n = out_features // 2 if gated else out_features
    y = torch.empty(m, n, dtype=torch.bfloat16)
    if m and lib.int4_gemm(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(),
                           scales_zeros.data_ptr(), out_features, n_pad, planes, y.data_ptr(),
                           n, layout[0], _lut_ptr(lut), layout[1], int(gated)):
        raise MemoryError("int4_gemm: out of memory")
    return y


def int4_gemm_ref(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
                  out_features: int, planes: int, lut: torch.Tensor | None = None,
                  gated: bool = False) -> torch.Tensor:
    """Plain-PyTorch reference of `int4_gemm`: bf16 weights, fp32 sums, bf16 products."""
    wt = int4_dequant_t_ref(packed, scales_zeros, planes, lut)[:, :out_features]
    y = (x.float() @ wt.float()).to(torch.bfloat16)
    return silu_mul_ref(y) if gated else y


# the forms of a packed weight's scales (`scales_layout`; SCALES_* in cpu_int4_groups.h)
PAIRS, HALF, TILED = 0, 1, 2


def scales_form(scales: torch.Tensor) -> int:
    """Which form a packed weight's scales claim by dtype and rank: HALF (fp16), TILED (4-D)
    or PAIRS; `scales_layout` checks that they fit it."""
    return HALF if scales.dtype == torch.float16 else TILED if scales.dim() == 4 else PAIRS


def scales_layout(scales: torch.Tensor, k2: int, planes: int, n_pad: int
                  ) -> tuple[int, int] | None:
    """(group size, form) of a packed weight's scales, or None when they fit no form:
    PAIRS, bf16 (scale, zero) pairs [K2 / gs, n_pad, 2]; TILED, the same pairs tile by tile,
    [n_pad / 64, K2 / gs, 64, 2] (`tile_scales`: what the native kernels read fastest); HALF,
    the fp16 scales alone of a symmetric weight, [K2 / planes / gs, n_pad] (zeros implied, see
    cpu_int4.h)."""
    form = scales_form(scales)
    half = form == HALF
    if not scales.is_contiguous() or scales.dim() != {PAIRS: 3, HALF: 2, TILED: 4}[form]:
        return None
    if not half and (scales.dtype != torch.bfloat16 or scales.shape[-1] != 2
                     or (form == TILED and scales.shape[2] != TILE)):
        return None
    groups = scales.shape[1] if form == TILED else scales.shape[0]
    rows = scales.shape[0] * TILE if form == TILED else scales.shape[1]
    k = k2 // planes if half else k2
    gs = k // groups if groups and k % groups == 0 else 0
    if gs not in GROUP_SIZES or rows != n_pad:
        return None
    return gs, form


def tile_scales(pairs: torch.Tensor) -> torch.Tensor:
    """bf16 pairs [K2 / gs, n_pad, 2] -> the TILED form [n_pad / 64, K2 / gs, 64, 2]."""
    g, n_pad = pairs.shape[0], pairs.shape[1]
    return pairs.view(g, n_pad // TILE, TILE, 2).transpose(0, 1).contiguous()


def untile_scales(scales: torch.Tensor) -> torch.Tensor:
    """The PAIRS form [K2 / gs, n_pad, 2] of PAIRS or TILED scales (a copy of TILED ones)."""
    if scales.dim() != 4:
        return scales
    t, g = scales.shape[0], scales.shape[1]
    return scales.transpose(0, 1).reshape(g, t * TILE, 2)


def int4_dequant_t(packed: torch.Tensor, scales_zeros: torch.Tensor, planes: int,
                   lut: torch.Tensor | None = None) -> torch.Tensor:
    """W.T of a packed int4 weight in bf16, [in, out_padded] (padded rows are 0): for one dense
    matmul over many rows. Planes are summed in fp32 and rounded once."""
    lib = cpu_native.library()
    assert lib is not None
    n_pad, k2 = packed.shape[0], packed.shape[1] * 2
    layout = scales_layout(scales_zeros, k2, planes, n_pad) if planes in (1, 2) else None
    if not (packed.dtype == torch.uint8 and packed.is_contiguous() and n_pad % TILE == 0
            and layout is not None and k2 % (planes * 32) == 0):
        raise ValueError("int4_dequant_t: bad operands")
    k = k2 // planes
    wt = torch.empty(k, n_pad, dtype=torch.bfloat16)
    lib.int4_dequant_t(packed.data_ptr(), scales_zeros.data_ptr(), k, n_pad, planes,
                       wt.data_ptr(), layout[0], _lut_ptr(lut), layout[1])
    return wt


def int4_dequant_t_ref(packed: torch.Tensor, scales_zeros: torch.Tensor, planes: int,
                       lut: torch.Tensor | None = None) -> torch.Tensor:
    k2 = packed.shape[1] * 2
    w = _dequant_fp32(packed, scales_zeros, planes, lut)  # [n_pad, K2]
    k = k2 // planes
    return w.view(-1, planes, k).sum(dim=1).t().to(torch.bfloat16)  # planes summed in fp32


def int4_rows_half(packed: torch.Tensor, scales: torch.Tensor, planes: int,
                   ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a packed weight with fp16 scales (`scales_layout` half; no codebook), in
    fp32, as the source format dequantizes them (scale * q, one rounding): fp32 [len(ids), in].
    packed: uint8 [out_padded, planes * in / 2]; scales: fp16 [in / gs, out_padded]; ids:
    int64 [T], each below the weight's rows."""
    lib = cpu_native.library()
    assert lib is not None
    n_pad, k2 = packed.shape[0], packed.shape[1] * 2
    layout = scales_layout(scales, k2, planes, n_pad) if planes in (1, 2) else None
    if not (packed.dtype == torch.uint8 and packed.is_contiguous() and n_pad % TILE == 0
            and layout is not None and layout[1] == HALF and scales.is_contiguous()
            and ids.dtype == torch.int64 and ids.dim() == 1):
        raise ValueError("int4_rows_half: bad operands")
    ids = ids.contiguous()
    if len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < n_pad:
        raise IndexError("int4_rows_half: a row id is out of range")
    k = k2 // planes
    out = torch.empty(len(ids), k, dtype=torch.float32)
    lib.int4_rows_half(packed.data_ptr(), scales.data_ptr(), k, n_pad, planes, layout[0],
                       ids.data_ptr(), len(ids), out.data_ptr())
    return out


REFINE_MAX = 64  # int4_refine_half's most rows and candidates per row


def int4_refine_half(logits: torch.Tensor, x: torch.Tensor, packed: torch.Tensor,
                     scales: torch.Tensor, planes: int, k: int) -> None:
    """The k largest logits of each row (`top_k`'s choice, ties to the lower index) recomputed
    in place as fp32 dot products of x's row with the weight's rows as `int4_rows_half` gives
    them (`int4_refine_half_ref`; the sums in another fixed order). logits: fp32 [M, out]
    (M <= 64, unit stride along out); x: bf16 [M, in]; packed, scales as for `int4_rows_half`;
    k <= 64."""
    lib = cpu_native.library()
    assert lib is not None
    n_pad, k2 = packed.shape[0], packed.shape[1] * 2
    m, n = logits.shape
    layout = scales_layout(scales, k2, planes, n_pad) if planes in (1, 2) else None
    if not (logits.dtype == torch.float32 and logits.stride(1) == 1 and x.dtype == torch.bfloat16
            and x.stride(1) == 1 and x.shape == (m, k2 // planes) and packed.is_contiguous()
            and layout is not None and layout[1] == HALF and 0 < k <= min(n, REFINE_MAX)
            and n <= n_pad and m <= REFINE_MAX and x.shape[1] % 16 == 0
            and x.shape[1] <= 16384):
        raise ValueError("int4_refine_half: bad operands")
    if m:
        lib.int4_refine_half(logits.data_ptr(), logits.stride(0), m, n, x.data_ptr(),
                             x.stride(0), packed.data_ptr(), scales.data_ptr(), k2 // planes,
                             n_pad, planes, layout[0], k)


def int4_refine_half_ref(logits: torch.Tensor, x: torch.Tensor, packed: torch.Tensor,
                         scales: torch.Tensor, planes: int, k: int) -> None:
    top = top_k_ref(logits, k)
    rows = int4_rows_half_ref(packed, scales, planes, top.flatten()).view(*top.shape, -1)
    logits.scatter_(1, top, torch.bmm(rows, x.float().unsqueeze(-1)).squeeze(-1))


def packed_row_codes(packed: torch.Tensor, ids: torch.Tensor,
                     layout: NibbleLayout = NATIVE_LAYOUT) -> torch.Tensor:
    """The 4-bit codes of rows `ids` of a packed weight, planes side by side: fp32 [T, K2]."""
    k2 = packed.shape[1] * 2
    tile, byte, high = layout.nibble_rows(ids)
    b = packed.view(-1, k2, layout.tile // 2)[tile, :, byte]  # [T, K2]
    return torch.where(high.unsqueeze(1), b >> 4, b & 15).float()


def packed_row_ints(packed: torch.Tensor, ids: torch.Tensor, planes: int) -> torch.Tensor:
    """The integer weights of rows `ids` of a symmetric packed weight (no codebook): c - 8 of
    one plane, q = 16 (h - 8) + l of two; fp32 [T, in]."""
    k = packed.shape[1] * 2 // planes
    c = packed_row_codes(packed, ids)
    return (c[:, :k] - 8.0) * 16.0 + c[:, k:] if planes == 2 else c - 8.0


def int4_rows_half_ref(packed: torch.Tensor, scales: torch.Tensor, planes: int,
                       ids: torch.Tensor) -> torch.Tensor:
    k = packed.shape[1] * 2 // planes
    q = packed_row_ints(packed, ids, planes)
    gs = k // scales.shape[0]
    # the operation order of Int4Weight / Int8Weight.dequantize: scale * q
    return (q.view(len(ids), -1, gs) * scales[:, ids].t().float().unsqueeze(-1)).view(-1, k)


def group_scales_zeros(scales_zeros: torch.Tensor, planes: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (scale, zero) [K2 / gs, n_pad] each of any scales form (`scales_layout`)."""
    if scales_zeros.dtype != torch.float16:
        sz = untile_scales(scales_zeros).float()
        return sz[..., 0], sz[..., 1]
    s = scales_zeros.float()  # [K / gs, n_pad]
    if planes == 1:
        return s, torch.zeros_like(s)
    return torch.cat((16.0 * s, s)), torch.cat((torch.zeros_like(s), 8.0 * s))


def _dequant_fp32(packed: torch.Tensor, scales_zeros: torch.Tensor, planes: int,
                  lut: torch.Tensor | None = None) -> torch.Tensor:
    """[n_pad, K2] fp32 weights of the packed layout, planes side by side."""
    n_pad, k2 = packed.shape[0], packed.shape[1] * 2
    b = packed.view(n_pad // TILE, k2, TILE // 2)
    codes = torch.stack((b & 15, b >> 4), dim=2)  # [tiles, K2, 2, 32]: rows 64t + 32h + j
    codes = codes.permute(0, 2, 3, 1).reshape(n_pad, k2).float()
    scale, zero = group_scales_zeros(scales_zeros, planes)  # [K2 / gs, n_pad]
    gs = k2 // scale.shape[0]
    values = codes - 8.0 if lut is None else lut_values(lut)[codes.long()]
    return (values * scale.t().repeat_interleave(gs, dim=1)
            + zero.t().repeat_interleave(gs, dim=1))


def int4_mm_ref(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
                out_features: int, planes: int, lut: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-PyTorch reference of `int4_mm`: dequantize to fp32, multiply, round to bf16."""
    w = _dequant_fp32(packed, scales_zeros, planes, lut)
    xin = x.float() if planes == 1 else torch.cat([x.float()] * planes, dim=1)
    return (xin @ w.t())[:, :out_features].to(torch.bfloat16)

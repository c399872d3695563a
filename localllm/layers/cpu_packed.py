"""Quantized weights kept packed for PyTorch's CPU weight-only int4 kernel.

`torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_zeros)` computes
`x @ W.T` with `W[n, k] = (c[n, k] - 8) * scale[g, n] + zero[g, n]`, `g = k // 32`, codes `c` in
0..15 and bf16 scales/zeros. Its packed layout interleaves rows in tiles of 64: byte `j` of
column `k` in tile `t` holds row `64t + j` in its low nibble and row `64t + 32 + j` in its high
nibble:

    packed.view(N / 64, K, 32)[t, k, j]:   bit 7           4 3           0
                                              [ c[64t+32+j, k] | c[64t+j, k] ]

Both runtime formats with groups of 32 map onto it exactly (up to bf16 scales), and so do
groups of 16 (Q2_K, Q3_K, Q6_K), which only the native kernel (`kernels/cpu_int4.c`) runs:

    Int4Weight (one plane):  c = q,  zero = offset + 8 * scale  (offset = -8 * scale if none)
    Int8Weight (two planes): q = 16 * h + l with h = q >> 4 in -8..7 and l = q & 15 in 0..15;
        plane H: c = h + 8, scale 16 * s, zero = offset (0 if none)
        plane L: c = l,     scale s,      zero = 8 * s
        stacked along K, so `[x, x] @ [W_H, W_L].T = x @ (W_H + W_L).T = x @ W.T`

With the native kernels, a symmetric weight whose file stores fp16 scales (Q4_0, Q5_0, Q8_0,
IQ4_NL: no offsets) keeps those scales alone, fp16 [in / group_size, out_padded], with the zeros
above implied (`half`): half the bytes of the bf16 (scale, zero) pairs, a quarter for two
planes (the default model's Q8_0 head: 30 MB instead of 37), and exact.

Rows are padded to a multiple of 64 with zero weights. Int8 weights with one scale per output
channel use `_weight_int8pack_mm` instead (`CpuInt8ChannelWeight`).

The few-rows kernel's cost grows with the rows of `x`, so above `max_kernel_rows` rows a
prompt runs as a dense matmul: on AMX tiles straight from the packed weight where the CPU has
them (`cpu_native.int4_gemm`, up to GEMM_MAX_ROWS rows), else with the weight dequantized for
the call and PyTorch's bf16 matmul -- except for the leading rows
that the step marks as decoding tokens (`decode_rows`): those always take the kernel, which
computes every row the same way whatever else shares its batch, so a request's tokens do not
depend on its neighbours, even when a long prompt shares the step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from localllm.kernels import cpu_native
from localllm.layers.activation import silu_and_mul_fused
from localllm.quant.formats import Int4Weight, Int8Weight, unpack_nibbles

TILE = 64  # rows per tile of the packed layout
GROUP = 32  # the group size PyTorch's int4 kernel and the native one share
# At or below this many rows the few-rows kernel beats dequantize + dense matmul. Default model
# shapes, 2 cores: the native kernel on the 3072x576 gate/up weight 205 us at 8 rows, 395 us at
# 16, 578 us at 24 vs 460 us dequantized; PyTorch's int4 kernel (per plane) 1.4 ms at 512 rows
# vs 5.2 ms, 28 us at 1 row.
NATIVE_KERNEL_MAX_ROWS = 16
TORCH_KERNEL_MAX_ROWS = 64
# With AMX, a prompt's rows leave the few-rows kernel above TILES_KERNEL_MAX_ROWS for AMX tiles
# on the packed codes (int4_mm(tiles=True): groups of 32 without a codebook) up to
# TILES_MAX_ROWS, then for int4_gemm (tiles on dequantized weight tiles) up to GEMM_MAX_ROWS;
# weights the first cannot take leave the kernel above GEMM_KERNEL_MAX_ROWS. All 120 matrices
# of the default model, ms (kernel / codes on tiles / int4_gemm): 3 rows 8.8 / 8.6 / 15.5,
# 8 rows 16.3 / 11.1 / 16.1, 32 rows 55.8 / 20.9 / 21.1, 64 rows 109 / 40.0 / 27.7.
# Decoding rows stay on the kernel at any count.
TILES_KERNEL_MAX_ROWS = 4
TILES_MAX_ROWS = 32
GEMM_KERNEL_MAX_ROWS = 8
# Above this many rows dequantize + PyTorch's matmul is faster than int4_gemm (default model
# gate/up: 1.23 vs 1.25 ms at 512 rows, 3.0 vs 1.9 at 1024; int4_gemm's time grows linearly
# with the rows, and running K in L1-sized passes did not change that)
GEMM_MAX_ROWS = 768

# how many leading rows of the batch in flight are decoding tokens (see the module docstring)
_DECODE_ROWS: ContextVar[int] = ContextVar("decode_rows", default=0)


@contextmanager
def decode_rows(n: int) -> Iterator[None]:
    """Within this block, the first `n` rows of every packed matmul are decoding tokens: they
    take the few-rows kernel whatever the batch size; the rest take it up to
    `CpuPackedWeight._kernel_max_rows` rows."""
    token = _DECODE_ROWS.set(n)
    try:
        yield
    finally:
        _DECODE_ROWS.reset(token)


def kernel_max_rows(planes: int) -> int:
    """Rows up to which a packed weight of `planes` planes runs the few-rows kernel (beyond,
    all but the step's decoding rows run dense), where there are no AMX tiles."""
    if cpu_native.available():
        return NATIVE_KERNEL_MAX_ROWS
    return TORCH_KERNEL_MAX_ROWS // planes


def split_matmul(x: torch.Tensor, kernel: Callable[[torch.Tensor], torch.Tensor],
                 dense: Callable[[torch.Tensor], torch.Tensor], max_rows: int,
                 out_features: int) -> torch.Tensor:
    """x @ W.T through `kernel` for few rows and for the step's decoding rows, and through
    `dense` (a many-rows matmul) for the other rows of a large batch."""
    m = x.shape[0]
    if m <= max_rows:
        return kernel(x)
    d = min(_DECODE_ROWS.get(), m)
    if d == m:
        return kernel(x)
    if d == 0:
        return dense(x)
    y = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    y[:d] = kernel(x[:d])
    y[d:] = dense(x[d:])
    return y


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


def _codes(w: Int4Weight | Int8Weight, rows: int) -> torch.Tensor:
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


def pack_tiles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [rows, K2] (rows a multiple of 64) -> the packed layout [rows, K2 / 2]:
    what `torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)` returns (tested),
    in uint8 throughout (3.6x faster: no int32 copy of the codes)."""
    rows, k2 = codes.shape
    v = codes.view(rows // TILE, 2, TILE // 2, k2)  # [tiles, low/high nibble, 32, K2]
    return (v[:, 0] | (v[:, 1] << 4)).transpose(1, 2).contiguous().view(rows, k2 // 2)


def slice_rows(w: Int4Weight | Int8Weight, start: int, end: int) -> Int4Weight | Int8Weight:
    """Rows start..end of a weight, as a weight of the same format (views, no copies)."""
    offs = None if w.offsets is None else w.offsets[start:end]
    if isinstance(w, Int4Weight):
        return Int4Weight(w.qweight[start:end], w.scales[start:end], offs, w.group_size,
                          w.codebook)
    return Int8Weight(w.qweight[start:end], w.scales[start:end], offs, w.group_size)


RowSource = Callable[[int, int], Int4Weight | Int8Weight]


def _half_scales(w: Int4Weight | Int8Weight) -> bool:
    """Whether `w` keeps its fp16 scales alone (see the module docstring)."""
    return w.offsets is None and w.scales.dtype == torch.float16 and cpu_native.available()


def _scales_zeros(w: Int4Weight | Int8Weight) -> tuple[torch.Tensor, torch.Tensor]:
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


class CpuPackedWeight:
    """An int4 or grouped int8 weight [out, in] in the int4 kernel's packed layout."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, out_features: int,
                 in_features: int, planes: int,
                 exact: tuple[torch.Tensor, torch.Tensor | None] | None = None,
                 group_size: int = GROUP, codebook: torch.Tensor | None = None) -> None:
        self.packed = packed  # uint8 [out_padded, planes * in / 2]
        # bf16 [planes * in / group_size, out_padded, 2], or (half) fp16 [in / group_size,
        # out_padded]: see the module docstring
        self.scales_zeros = scales_zeros
        self.half = scales_zeros.dtype == torch.float16
        # the source's own scales and offsets [out, in / group_size], for exact `rows` (half
        # scales are the source's already)
        self.exact = exact
        self.group_size = group_size  # 32, or 16 (native kernels only)
        # the source's fp32 codebook of an IQ4 or NF4 weight (native kernels only), and its
        # two-term bf16 form for the kernels (`cpu_native.codebook_lut`)
        self.codebook = codebook
        self.lut = None if codebook is None else cpu_native.codebook_lut(codebook)
        self.out_features = out_features
        self.in_features = in_features
        self.planes = planes

    @classmethod
    def from_weight(cls, w: Int4Weight | Int8Weight, dtype: torch.dtype,
                    exact_rows: bool = False) -> CpuPackedWeight:
        """`exact_rows` keeps the source's scales (a few % more memory), so that `rows`
        returns exactly the dequantized weight rather than bf16-rounded scales times codes
        (an embedding table: its rows enter the residual stream as they are)."""
        return cls.from_rows(lambda start, end: slice_rows(w, start, end), w.out_features,
                             dtype, exact_rows)

    @classmethod
    def from_rows(cls, source: RowSource, out_features: int, dtype: torch.dtype,
                  exact_rows: bool = False) -> CpuPackedWeight:
        """Packs a weight of `out_features` rows that `source(start, end)` hands over
        PACK_ROWS rows at a time (sliced from a file while loading, say), so that only the
        packed result and one slice are ever in memory. See `from_weight`."""
        out = out_features
        n_pad = out + (-out % TILE)
        packed = sz = None
        exact: tuple[torch.Tensor, torch.Tensor | None] | None = None
        planes, group_size, half = 1, GROUP, False
        codebook: torch.Tensor | None = None
        # tiles of 64 rows pack independently: converting a few at a time keeps the int32
        # codes the kernel's converter takes small (a whole 49152-row head would be 226 MB)
        for r in range(0, n_pad, PACK_ROWS):
            end = min(r + PACK_ROWS, n_pad)
            w = source(r, min(end, out))
            if not cpu_packable(w, dtype) or w.group_size not in packed_group_sizes():
                raise ValueError("this weight format has no packed int4 CPU layout")
            if packed is None or sz is None:
                planes = 1 if isinstance(w, Int4Weight) else 2
                group_size = w.group_size
                codebook = w.codebook if isinstance(w, Int4Weight) else None
                groups = w.in_features // group_size
                packed = torch.empty(n_pad, planes * w.in_features // 2, dtype=torch.uint8)
                half = _half_scales(w)
                # padding rows: scale (and zero) 0, so weight 0
                sz = (torch.zeros(groups, n_pad, dtype=torch.float16) if half
                      else torch.zeros(planes * groups, n_pad, 2, dtype=dtype))
                if exact_rows and not half:
                    exact = (w.scales.new_empty(out, groups),
                             None if w.offsets is None else w.offsets.new_empty(out, groups))
            elif (1 if isinstance(w, Int4Weight) else 2) != planes \
                    or packed.shape[1] * 2 != planes * w.in_features \
                    or w.group_size != group_size or _half_scales(w) != half \
                    or (isinstance(w, Int4Weight) and codebook is not None
                        and (w.codebook is None or not torch.equal(w.codebook, codebook))):
                raise ValueError("the rows of one weight changed format")
            packed[r:end] = pack_tiles(_codes(w, end - r))
            stop = r + w.out_features
            if half:
                sz[:, r:stop] = w.scales.t()
            else:
                scales, zeros = _scales_zeros(w)  # [rows, planes * in / group_size] each
                sz[:, r:stop, 0] = scales.t()
                sz[:, r:stop, 1] = zeros.t()
            if exact is not None:
                exact[0][r:stop] = w.scales
                if exact[1] is not None and w.offsets is not None:
                    exact[1][r:stop] = w.offsets
        assert packed is not None and sz is not None
        return cls(packed, sz, out, packed.shape[1] * 2 // planes, planes, exact, group_size,
                   codebook)

    @staticmethod
    def concat(parts: list[CpuPackedWeight]) -> CpuPackedWeight | None:
        """The weights stacked along `out` (one kernel call instead of several), or None when
        their layouts cannot be stacked (padded rows, different planes or input sizes)."""
        first = parts[0]
        if any(p.planes != first.planes or p.in_features != first.in_features
               or p.group_size != first.group_size or p.half != first.half
               or p.out_features % TILE
               or (p.codebook is None) != (first.codebook is None)
               or (p.codebook is not None and first.codebook is not None
                   and not torch.equal(p.codebook, first.codebook)) for p in parts):
            return None
        return CpuPackedWeight(torch.cat([p.packed for p in parts]),
                               torch.cat([p.scales_zeros for p in parts], dim=1),
                               sum(p.out_features for p in parts), first.in_features,
                               first.planes, group_size=first.group_size,
                               codebook=first.codebook)

    @property
    def nbytes(self) -> int:
        return (self.packed.numel() * self.packed.element_size()
                + self.scales_zeros.numel() * self.scales_zeros.element_size())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in] bf16 -> [rows, out]
        return split_matmul(x, self._kernel, self._dense, self._kernel_max_rows(),
                            self.out_features)

    @property
    def _tiles_take_codes(self) -> bool:
        return self.group_size == GROUP and self.lut is None

    def _kernel_max_rows(self) -> int:
        if cpu_native.available() and cpu_native.gemm_available():
            return TILES_KERNEL_MAX_ROWS if self._tiles_take_codes else GEMM_KERNEL_MAX_ROWS
        return kernel_max_rows(self.planes)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        # a prompt's rows: AMX tiles straight from the packed weight, or one bf16 matmul with
        # the weight dequantized for this call (see TILES_MAX_ROWS)
        m = x.shape[0]
        if cpu_native.gemm_available():
            if m <= TILES_MAX_ROWS and self._tiles_take_codes:
                return cpu_native.int4_mm(x, self.packed, self.scales_zeros, self.out_features,
                                          self.planes, tiles=True)
            if m <= GEMM_MAX_ROWS:
                return cpu_native.int4_gemm(x, self.packed, self.scales_zeros,
                                            self.out_features, self.planes, self.lut)
        return x @ self.dense_t()

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_native.available():
            return cpu_native.int4_mm(x, self.packed, self.scales_zeros, self.out_features,
                                      self.planes, self.lut)
        if self.group_size != GROUP or self.lut is not None or self.half:  # beyond PyTorch's
            return x @ self.dense_t()
        xin = x if self.planes == 1 else torch.cat((x, x), dim=1)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xin, self.packed, GROUP,
                                                        self.scales_zeros)
        return y if y.shape[1] == self.out_features else y[:, :self.out_features]

    def dense_t(self) -> torch.Tensor:
        """W.T [in, out] in the compute dtype, dequantized for one call."""
        if cpu_native.available():  # one pass, planes summed in fp32 (3-5x faster)
            wt = cpu_native.int4_dequant_t(self.packed, self.scales_zeros, self.planes,
                                           self.lut)
            n = self.out_features
            return wt if wt.shape[1] == n else wt[:, :n]
        if self.lut is not None or self.half:  # the native kernels went away after packing
            wt = cpu_native.int4_dequant_t_ref(self.packed, self.scales_zeros, self.planes,
                                               self.lut)
            return wt[:, :self.out_features]
        n_pad, k2 = self.packed.shape[0], self.packed.shape[1] * 2
        half = TILE // 2
        # flipping each nibble's top bit turns code c into c - 8 under an arithmetic shift
        b = (self.packed ^ 0x88).view(torch.int8).view(n_pad // TILE, k2, half)
        # W.T[k, 64t + j] is the low nibble of b[t, k, j] for j < 32, the high one above
        wt = torch.empty(k2, n_pad // TILE, 2, half, dtype=self.scales_zeros.dtype)
        wt[:, :, 0].copy_(((b << 4) >> 4).permute(1, 0, 2))
        wt[:, :, 1].copy_((b >> 4).permute(1, 0, 2))
        gs = self.group_size
        groups = wt.view(k2 // gs, gs, n_pad)
        # contiguous copies of the (small) scales and zeros: strided ones make addcmul 3x slower
        scale = self.scales_zeros[..., 0].unsqueeze(1).contiguous()  # [K / gs, 1, out_padded]
        zero = self.scales_zeros[..., 1].unsqueeze(1).contiguous()
        torch.addcmul(zero, groups, scale, out=groups)  # (c - 8) * scale + zero
        w = wt.view(k2, n_pad)
        if self.planes == 2:
            w = w[:self.in_features] + w[self.in_features:]
        return w if n_pad == self.out_features else w[:, :self.out_features]

    def silu_gated(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x W_gate^T) * (x W_up^T) for a weight stacking gate and up (its first and second
        halves of rows): x [rows, in] -> [rows, out / 2]. A prompt's rows on AMX compute the
        activation tile by tile (`cpu_native.int4_gemm`), so the [rows, out] product is never
        held whole."""
        inter, m = self.out_features // 2, x.shape[0]
        d = m if m <= self._kernel_max_rows() else min(_DECODE_ROWS.get(), m)
        if (d == m or inter % TILE or not TILES_MAX_ROWS < m - d <= GEMM_MAX_ROWS
                or not cpu_native.gemm_available()):
            return silu_and_mul_fused(self.matmul(x))
        act = cpu_native.int4_gemm(x[d:], self.packed, self.scales_zeros, self.out_features,
                                   self.planes, self.lut, gated=True)
        if d == 0:
            return act
        return torch.cat((silu_and_mul_fused(self._kernel(x[:d])), act))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W [len(ids), in], dequantized in fp32 (an embedding lookup); equal to
        the source format's `dequantize()` rows when built with `exact_rows` or half scales."""
        t, k2 = len(ids), self.packed.shape[1] * 2
        half_tile = TILE // 2
        b = self.packed.view(-1, k2, half_tile)[ids // TILE, :, ids % half_tile]  # [T, K2]
        c = torch.where((ids % TILE < half_tile).unsqueeze(1), b & 15, b >> 4).float()
        gs = self.group_size
        if self.exact is None and not self.half:
            sz = self.scales_zeros[:, ids].float().permute(1, 0, 2)  # [T, planes * in / gs, 2]
            vals = c - 8.0 if self.codebook is None else self.codebook.float()[c.long()]
            w = (vals.view(t, k2 // gs, gs) * sz[..., :1] + sz[..., 1:]).view(t, k2)
            return w if self.planes == 1 else w[:, :self.in_features] + w[:, self.in_features:]
        if self.half:
            scales, offsets = self.scales_zeros[:, ids].t(), None  # [T, in / gs]
        else:
            assert self.exact is not None
            scales = self.exact[0][ids]
            offsets = None if self.exact[1] is None else self.exact[1][ids]
        if self.planes == 2:
            q = (c[:, :self.in_features] - 8.0) * 16.0 + c[:, self.in_features:]
        elif self.codebook is not None:
            q = self.codebook.float()[c.long()]
        else:
            q = c if offsets is not None else c - 8.0
        # the operation order of Int4Weight / Int8Weight.dequantize: scale * q (+ offset)
        w = q.view(t, -1, gs) * scales.float().unsqueeze(-1)
        if offsets is not None:
            w = w + offsets.float().unsqueeze(-1)
        return w.view(t, self.in_features)


class CpuInt8ChannelWeight:
    """An int8 weight with one scale per output channel, for `_weight_int8pack_mm`."""

    def __init__(self, w: Int8Weight, dtype: torch.dtype) -> None:
        if not (w.per_channel and w.offsets is None and dtype == torch.bfloat16):
            raise ValueError("only symmetric per-channel int8 weights take the int8 CPU kernel")
        self.qweight = w.qweight  # int8 [out, in]
        self.scales = w.scales.view(-1).to(dtype)  # [out]
        self.exact_scales = w.scales.view(-1)  # [out], the source's, for exact `rows`
        self.out_features = w.out_features
        self.in_features = w.in_features
        self.max_kernel_rows = TORCH_KERNEL_MAX_ROWS

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in] bf16 -> [rows, out]
        return split_matmul(x, self._kernel, lambda rows: rows @ self.dense_t(),
                            self.max_kernel_rows, self.out_features)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)

    def dense_t(self) -> torch.Tensor:
        return (self.qweight.to(self.scales.dtype) * self.scales.unsqueeze(1)).t()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight[ids].float() * self.exact_scales[ids].float().unsqueeze(1)


CpuQuantWeight = CpuPackedWeight | CpuInt8ChannelWeight


def cpu_quant_weight(w: Int4Weight | Int8Weight, dtype: torch.dtype,
                     exact_rows: bool = False) -> CpuQuantWeight:
    """The CPU-packed form of `w` (check `cpu_packable` first)."""
    if isinstance(w, Int8Weight) and w.per_channel and w.offsets is None:
        return CpuInt8ChannelWeight(w, dtype)
    return CpuPackedWeight.from_weight(w, dtype, exact_rows)

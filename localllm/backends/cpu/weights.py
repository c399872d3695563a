"""The CPU backend's quantized weights: `CpuPackedWeight` (int4 and grouped int8 in the packed
layout of `packing.py`, multiplied by the path `dispatch.ROW_POLICY` picks for each batch) and
`CpuInt8ChannelWeight` (per-channel int8 for PyTorch's int8 kernel). Both have the interface
`localllm.layers.linear.QuantWeight` that `QuantLinear` calls."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from localllm.backends.cpu.dispatch import (
    GATED_BLOCK,
    GATED_MIN_ROWS,
    ROW_POLICY,
    MatmulPath,
    Policy,
    packed_policy,
    row_groups,
    split_matmul,
    step_planned,
)
from localllm.backends.cpu.ops import silu_mul
from localllm.backends.cpu.packing import (
    GROUP,
    PACK_ROWS,
    TILE,
    cpu_packable,
    half_scales,
    kernel_codes,
    kernel_scales_zeros,
    pack_layout,
    pack_tiles,
    packed_group_sizes,
    torch_layout,
)
from localllm.kernels import cpu_int4, cpu_native
from localllm.kernels.cpu_int4 import NATIVE_LAYOUT, NibbleLayout
from localllm.layers.ops import RowSource
from localllm.quant.formats import Int4Weight, Int8Weight, slice_rows


class CpuPackedWeight:
    """An int4 or grouped int8 weight [out, in] in the int4 kernel's packed layout."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, out_features: int,
                 in_features: int, planes: int,
                 exact: tuple[torch.Tensor, torch.Tensor | None] | None = None,
                 group_size: int = GROUP, codebook: torch.Tensor | None = None,
                 layout: NibbleLayout = NATIVE_LAYOUT) -> None:
        self.packed = packed  # uint8 [out_padded, planes * in / 2]
        # which rows share a byte of `packed`: the native kernels' layout, or PyTorch's where
        # this weight was packed without them (`packing.pack_layout`)
        self.layout = layout
        # bf16 pairs [planes * in / group_size, out_padded, 2] (TILED with the native kernels:
        # [out_padded / 64, planes * in / group_size, 64, 2]), or (half) fp16 [in / group_size,
        # out_padded]: see the module docstring and `cpu_int4.scales_layout`
        self.scales_zeros = scales_zeros
        self.half = scales_zeros.dtype == torch.float16
        # the source's own scales and offsets [out, in / group_size], for exact `rows` (half
        # scales are the source's already)
        self.exact = exact
        self.group_size = group_size  # 32, or 16 (native kernels only)
        # the source's fp32 codebook of an IQ4 or NF4 weight (native kernels only), and its
        # two-term bf16 form for the kernels (`cpu_int4.codebook_lut`)
        self.codebook = codebook
        self.lut = None if codebook is None else cpu_int4.codebook_lut(codebook)
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
        layout = pack_layout()
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
                half = half_scales(w)
                # padding rows: scale (and zero) 0, so weight 0
                sz = (torch.zeros(groups, n_pad, dtype=torch.float16) if half
                      else torch.zeros(planes * groups, n_pad, 2, dtype=dtype))
                if exact_rows and not half:
                    exact = (w.scales.new_empty(out, groups),
                             None if w.offsets is None else w.offsets.new_empty(out, groups))
            elif (1 if isinstance(w, Int4Weight) else 2) != planes \
                    or packed.shape[1] * 2 != planes * w.in_features \
                    or w.group_size != group_size or half_scales(w) != half \
                    or (isinstance(w, Int4Weight) and codebook is not None
                        and (w.codebook is None or not torch.equal(w.codebook, codebook))):
                raise ValueError("the rows of one weight changed format")
            packed[r:end] = pack_tiles(kernel_codes(w, end - r), layout)
            stop = r + w.out_features
            if half:
                sz[:, r:stop] = w.scales.t()
            else:
                scales, zeros = kernel_scales_zeros(w)  # [rows, planes * in / group_size] each
                sz[:, r:stop, 0] = scales.t()
                sz[:, r:stop, 1] = zeros.t()
            if exact is not None:
                exact[0][r:stop] = w.scales
                if exact[1] is not None and w.offsets is not None:
                    exact[1][r:stop] = w.offsets
        assert packed is not None and sz is not None
        if not half and cpu_native.available():  # what the native kernels read fastest
            sz = cpu_int4.tile_scales(sz)
        return cls(packed, sz, out, packed.shape[1] * 2 // planes, planes, exact, group_size,
                   codebook, layout)

    @staticmethod
    def stack(parts: Sequence[object]) -> CpuPackedWeight | None:
        """The weights stacked along `out` (one kernel call instead of several), or None when
        their layouts cannot be stacked (padded rows, different planes or input sizes)."""
        if not all(isinstance(p, CpuPackedWeight) for p in parts):
            return None
        packed = [p for p in parts if isinstance(p, CpuPackedWeight)]
        first = packed[0]
        if any(p.planes != first.planes or p.in_features != first.in_features
               or p.layout != first.layout
               or p.group_size != first.group_size or p.half != first.half
               or p.out_features % TILE
               or (p.codebook is None) != (first.codebook is None)
               or (p.codebook is not None and first.codebook is not None
                   and not torch.equal(p.codebook, first.codebook)) for p in packed):
            return None
        tiled = [cpu_int4.scales_form(p.scales_zeros) == cpu_int4.TILED for p in packed]
        scales = (torch.cat([p.scales_zeros for p in packed]) if all(tiled)  # tile by tile
                  else torch.cat([cpu_int4.untile_scales(p.scales_zeros) for p in packed], dim=1))
        return CpuPackedWeight(torch.cat([p.packed for p in packed]), scales,
                               sum(p.out_features for p in packed), first.in_features,
                               first.planes, group_size=first.group_size,
                               codebook=first.codebook, layout=first.layout)

    @property
    def nbytes(self) -> int:
        return (self.packed.numel() * self.packed.element_size()
                + self.scales_zeros.numel() * self.scales_zeros.element_size())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in] bf16 -> [rows, out]
        return split_matmul(x, self._policy(), self._kernel, self._rest, self.out_features)

    @property
    def fine_logits(self) -> bool:
        """Whether `logits` of bf16 x come from `int8_logits`: a Q8_0 head (two planes, fp16
        scales) in fp32 from 16-bit x, within about 2e-3 of the exact products on the default
        model where bf16-rounded logits are off by up to 0.125 (and faster than `int4_mm` at 8
        rows, and at 1 row in the AVX2 build; the same path at any batch)."""
        return (self.planes == 2 and self.half and self.codebook is None
                and self.group_size == GROUP and self._native())

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in] bf16 -> fp32 [rows, out]
        if self.fine_logits and x.dtype == torch.bfloat16:
            return cpu_int4.int8_logits(x, self.packed, self.scales_zeros, self.out_features)
        return self.matmul(x).float()

    def refine_logits(self, logits: torch.Tensor, x: torch.Tensor, k: int) -> bool:
        # fp16 scales (Q8_0, Q4_0, Q5_0): the top-k, the rows and their dot products in one
        # native call (five PyTorch calls and a [rows, k, in] fp32 copy of the rows otherwise)
        if not (self.half and self.codebook is None and self._native()
                and x.dtype == torch.bfloat16 and len(x) <= cpu_int4.REFINE_MAX
                and self.in_features % 16 == 0):
            return False
        cpu_int4.int4_refine_half(logits, x, self.packed, self.scales_zeros, self.planes, k)
        return True

    def _native(self) -> bool:
        """Whether the native kernels run this weight (they read `NATIVE_LAYOUT` alone)."""
        return self.layout == NATIVE_LAYOUT and cpu_native.available()

    def _policy(self) -> Policy:
        # AMX tiles read the codes of groups of 32 without a codebook directly
        return packed_policy(self.group_size == GROUP and self.lut is None, self.planes,
                             self._native())

    def _rest(self, x: torch.Tensor, path: MatmulPath) -> torch.Tensor:
        # a prompt's rows: AMX tiles straight from the packed weight, or one bf16 matmul with
        # the weight dequantized for this call (see `dispatch.ROW_POLICY`)
        if path is MatmulPath.TILES:
            return cpu_int4.int4_mm(x, self.packed, self.scales_zeros, self.out_features,
                                    self.planes, tiles=True)
        if path is MatmulPath.GEMM:
            return cpu_int4.int4_gemm(x, self.packed, self.scales_zeros, self.out_features,
                                      self.planes, self.lut)
        return x @ self.dense_t()

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self._native():
            return cpu_int4.int4_mm(x, self.packed, self.scales_zeros, self.out_features,
                                    self.planes, self.lut)
        if (self.group_size != GROUP or self.lut is not None or self.half  # beyond PyTorch's
                or self.layout != torch_layout()):  # packed for kernels that went away
            return x @ self.dense_t()
        xin = x if self.planes == 1 else torch.cat((x, x), dim=1)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xin, self.packed, GROUP,
                                                        cpu_int4.untile_scales(self.scales_zeros))
        return y if y.shape[1] == self.out_features else y[:, :self.out_features]

    def dense_t(self) -> torch.Tensor:
        """W.T [in, out] in the compute dtype, dequantized for one call."""
        if self._native():  # one pass, planes summed in fp32 (3-5x faster)
            wt = cpu_int4.int4_dequant_t(self.packed, self.scales_zeros, self.planes, self.lut)
            n = self.out_features
            return wt if wt.shape[1] == n else wt[:, :n]
        if self.lut is not None or self.half:  # the native kernels went away after packing
            rows = self.rows(torch.arange(self.out_features))  # fp32, planes summed
            return rows.t().to(torch.bfloat16)
        n_pad, k2 = self.packed.shape[0], self.packed.shape[1] * 2
        tile, half = self.layout.tile, self.layout.tile // 2
        # flipping each nibble's top bit turns code c into c - 8 under an arithmetic shift
        b = (self.packed ^ 0x88).view(torch.int8).view(n_pad // tile, k2, half)
        # W.T[k, tile * t + r] for the rows r of byte b[t, k, j] (`NibbleLayout`): low nibble
        # r = j, high r = j + tile / 2 (split), or low 2j, high 2j + 1
        wt = torch.empty(k2, n_pad // tile, tile, dtype=self.scales_zeros.dtype)
        nibbles = (wt.view(k2, -1, 2, half).unbind(2) if self.layout.split
                   else wt.view(k2, -1, half, 2).unbind(3))
        nibbles[0].copy_(((b << 4) >> 4).permute(1, 0, 2))
        nibbles[1].copy_((b >> 4).permute(1, 0, 2))
        gs = self.group_size
        groups = wt.view(k2 // gs, gs, n_pad)
        # contiguous copies of the (small) scales and zeros: strided ones make addcmul 3x slower
        pairs = cpu_int4.untile_scales(self.scales_zeros)
        scale = pairs[..., 0].unsqueeze(1).contiguous()  # [K / gs, 1, out_padded]
        zero = pairs[..., 1].unsqueeze(1).contiguous()
        torch.addcmul(zero, groups, scale, out=groups)  # (c - 8) * scale + zero
        w = wt.view(k2, n_pad)
        if self.planes == 2:
            w = w[:self.in_features] + w[self.in_features:]
        return w if n_pad == self.out_features else w[:, :self.out_features]

    def silu_gated(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x W_gate^T) * (x W_up^T) for a weight stacking gate and up (its first and second
        halves of rows): x [rows, in] -> [rows, out / 2]. A prompt's rows on AMX compute the
        activation tile by tile (`cpu_native.int4_gemm`), and more than GATED_BLOCK rows on the
        row kernel a block of rows at a time, so the [rows, out] product is never held whole."""
        inter, m = self.out_features // 2, x.shape[0]
        groups = row_groups(self._policy(), m)
        # outside a step only a batch's own rows decide (at least GATED_MIN_ROWS of them);
        # within one (`step_rows`) every row of a GEMM prompt takes it, whatever shares its step
        if inter % TILE or not any(
                path is MatmulPath.GEMM and (step_planned() or _count(rows, m) >= GATED_MIN_ROWS)
                for path, rows in groups):
            if m > GATED_BLOCK and self._native() and all(
                    path is MatmulPath.KERNEL for path, _ in groups):
                # the row kernel's rows do not depend on the call's: the same bits
                act = torch.empty(m, inter, dtype=x.dtype, device=x.device)
                for r0 in range(0, m, GATED_BLOCK):
                    act[r0:r0 + GATED_BLOCK] = silu_mul(self._kernel(x[r0:r0 + GATED_BLOCK]))
                return act
            return silu_mul(self.matmul(x))
        act = torch.empty(m, inter, dtype=x.dtype, device=x.device)
        for path, rows in groups:
            if path is MatmulPath.GEMM:
                act[rows] = cpu_int4.int4_gemm(x[rows], self.packed, self.scales_zeros,
                                               self.out_features, self.planes, self.lut,
                                               gated=True)
            else:
                act[rows] = silu_mul(self._kernel(x[rows]) if path is MatmulPath.KERNEL
                                     else self._rest(x[rows], path))
        return act

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W [len(ids), in], dequantized in fp32 (an embedding lookup); equal to
        the source format's `dequantize()` rows when built with `exact_rows` or half scales."""
        if self.half and self.codebook is None and self._native():  # Q8_0, Q4_0, Q5_0
            return cpu_int4.int4_rows_half(self.packed, self.scales_zeros, self.planes, ids)
        t, k2 = len(ids), self.packed.shape[1] * 2
        c = cpu_int4.packed_row_codes(self.packed, ids, self.layout)  # [T, K2]
        gs = self.group_size
        if self.exact is None and not self.half:
            sz = self.scales_zeros  # -> [T, planes * in / gs, 2]
            sz = (sz[ids // TILE, :, ids % TILE] if sz.dim() == 4
                  else sz[:, ids].permute(1, 0, 2)).float()
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

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in] bf16 -> [rows, out]
        return split_matmul(x, ROW_POLICY["any", "int8 per channel"], self._kernel,
                            lambda rows, _: rows @ self.dense_t(), self.out_features)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)

    def silu_gated(self, x: torch.Tensor) -> torch.Tensor:
        return silu_mul(self.matmul(x))

    fine_logits = False

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x).float()

    def refine_logits(self, logits: torch.Tensor, x: torch.Tensor, k: int) -> bool:
        return False

    @staticmethod
    def stack(parts: Sequence[object]) -> None:
        """Per-channel weights are not stacked (they stay one matmul each)."""
        return None

    def dense_t(self) -> torch.Tensor:
        return (self.qweight.to(self.scales.dtype) * self.scales.unsqueeze(1)).t()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight[ids].float() * self.exact_scales[ids].float().unsqueeze(1)


def _count(rows: slice | torch.Tensor, m: int) -> int:
    """How many of a batch's m rows `rows` selects."""
    return len(range(m)[rows]) if isinstance(rows, slice) else len(rows)

"""Runtime weight formats: grouped int4 and int8 matrices that kernels read directly.

Both formats hold a linear layer's weight `W` shaped [out, in] (PyTorch order, `y = x @ W.T`).
Columns are split into groups of `group_size` consecutive values along `in`; every group of a
row has one scale and, optionally, one offset. All tensors are contiguous row-major, on the same
device, with the same layout on CPU and GPU, so a Triton kernel finds element (n, k) at

    qweight_ptr + n * stride_q + k // 2      (int4, stride_q = in // 2 bytes)
    qweight_ptr + n * in + k                 (int8)
    scales_ptr  + n * n_groups + k // group_size   (offsets_ptr likewise; n_groups = in / group)

Int4Weight: two 4-bit codes per byte, column 2j in the low nibble, 2j+1 in the high nibble:

    byte j of row n:   bit 7      4 3      0
                          [ q[n,2j+1] | q[n,2j] ]

    (the row read as a little-endian stream of 4-bit codes: code k sits at bit 4*k)

    offsets given:   w[n, k] = scales[n, g] * q + offsets[n, g]        q in 0..15
    codebook given:  w[n, k] = codebook[q] * scales[n, g]              16-entry codebook
    neither:         w[n, k] = scales[n, g] * (q - 8)                  symmetric, bias 8
    with g = k // group_size

Int8Weight: one signed byte per value, `w = scales[n, g] * q (+ offsets[n, g])`, q in -128..127;
`group_size == in_features` means one scale per output channel (scales shaped [out, 1]).

Scales and offsets are fp16 or fp32 (both the same dtype): fp16 when the source's scales are fp16
already (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL: lossless and as small as GGUF), fp32 when GGUF
combines a super-block scale with a sub-block scale (K-quants): fp16 `d` (11-bit mantissa) times
a 6-bit integer needs 17 bits, which fp32 holds exactly. Every `dequantize` computes in fp32, in
the operation order of `gguf.quants`, so repacked weights reproduce GGUF's values bit for bit.
`dequantize` is the plain-PyTorch reference (`*_ref`) that the kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZES = (16, 32)
SCALE_DTYPES = (torch.float16, torch.float32)

IQ4_NL_CODEBOOK = (-127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0,
                   1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0)
# NOTE: bitsandbytes stores NF4 with the first value in the high nibble and blocks of 64;
# converting means swapping nibbles and repeating each absmax for two groups of 32.
NF4_CODEBOOK = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., 2m] in 0..15 -> uint8 [..., m]: column 2j low nibble, 2j+1 high."""
    if q.shape[-1] % 2:
        raise ValueError(f"cannot pack {q.shape[-1]} codes per row into bytes (odd count)")
    q = q.to(torch.uint8)
    return (q[..., 0::2] & 0x0F) | (q[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., m] -> uint8 codes [..., 2m], the inverse of `pack_nibbles`."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def _check_groups(name: str, scales: torch.Tensor, offsets: torch.Tensor | None,
                  out: int, in_: int, group_size: int, per_channel_ok: bool) -> None:
    ok = group_size in GROUP_SIZES or (per_channel_ok and group_size == in_)
    if not ok or in_ % group_size:
        allowed = "16, 32 or in_features" if per_channel_ok else "16 or 32"
        raise ValueError(f"{name}: group_size {group_size} must be {allowed} and divide "
                         f"in_features {in_}")
    expect = (out, in_ // group_size)
    if tuple(scales.shape) != expect:
        raise ValueError(f"{name}: scales shaped {tuple(scales.shape)}, expected {expect}")
    if scales.dtype not in SCALE_DTYPES:
        raise ValueError(f"{name}: scales must be fp16 or fp32, got {scales.dtype}")
    tensors = [scales]
    if offsets is not None:
        if offsets.shape != scales.shape or offsets.dtype != scales.dtype:
            raise ValueError(f"{name}: offsets must match scales' shape and dtype")
        tensors.append(offsets)
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"{name}: scales and offsets must be contiguous")


def _apply_groups(q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                  group_size: int) -> torch.Tensor:
    """q: fp32 [out, in]; returns scales * q (+ offsets) in fp32, one scale per group."""
    out, in_ = q.shape
    qg = q.view(out, in_ // group_size, group_size)  # [out, n_groups, group_size]
    w = scales.float().unsqueeze(-1) * qg
    if offsets is not None:
        # NOTE: a separate add (no fused multiply-add) keeps gguf's rounding exactly.
        w = w + offsets.float().unsqueeze(-1)
    return w.view(out, in_)


@dataclass(frozen=True, eq=False)
class Int4Weight:
    """4-bit grouped weight [out, in]; see the module docstring for the bit layout."""

    qweight: torch.Tensor  # uint8 [out, in // 2], two codes per byte
    scales: torch.Tensor  # fp16 | fp32 [out, in // group_size]
    offsets: torch.Tensor | None  # like scales, or None
    group_size: int
    codebook: torch.Tensor | None = None  # fp32 [16], or None

    def __post_init__(self) -> None:
        q = self.qweight
        if q.dtype != torch.uint8 or q.dim() != 2 or not q.is_contiguous():
            raise ValueError(f"Int4Weight: qweight must be contiguous uint8 [out, in // 2], got "
                             f"{q.dtype} {tuple(q.shape)}")
        _check_groups("Int4Weight", self.scales, self.offsets, self.out_features,
                      self.in_features, self.group_size, per_channel_ok=False)
        if self.codebook is not None:
            cb = self.codebook
            if cb.shape != (16,) or cb.dtype != torch.float32 or not cb.is_contiguous():
                raise ValueError("Int4Weight: codebook must be contiguous fp32 [16]")
            if self.offsets is not None:
                raise ValueError("Int4Weight: a codebook weight takes no offsets")

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1]) * 2

    @property
    def nbytes(self) -> int:
        ts = [self.qweight, self.scales, self.offsets, self.codebook]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def codes(self) -> torch.Tensor:
        """The 4-bit codes as uint8 [out, in]."""
        return unpack_nibbles(self.qweight)

    def dequantize(self) -> torch.Tensor:
        """fp32 [out, in]; the reference for the int4 kernels."""
        q = self.codes()
        if self.codebook is not None:
            values = self.codebook.to(q.device)[q.long()]  # [out, in]
            return _apply_groups(values, self.scales, None, self.group_size)
        if self.offsets is None:
            return _apply_groups(q.float() - 8.0, self.scales, None, self.group_size)
        return _apply_groups(q.float(), self.scales, self.offsets, self.group_size)

    def to(self, device: torch.device | str) -> Int4Weight:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return Int4Weight(self.qweight.to(device), self.scales.to(device), move(self.offsets),
                          self.group_size, move(self.codebook))


@dataclass(frozen=True, eq=False)
class Int8Weight:
    """8-bit weight [out, in], grouped (16/32) or per output channel (group_size == in)."""

    qweight: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # fp16 | fp32 [out, in // group_size]
    offsets: torch.Tensor | None  # like scales, or None
    group_size: int

    def __post_init__(self) -> None:
        q = self.qweight
        if q.dtype != torch.int8 or q.dim() != 2 or not q.is_contiguous():
            raise ValueError(f"Int8Weight: qweight must be contiguous int8 [out, in], got "
                             f"{q.dtype} {tuple(q.shape)}")
        _check_groups("Int8Weight", self.scales, self.offsets, self.out_features,
                      self.in_features, self.group_size, per_channel_ok=True)

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1])

    @property
    def per_channel(self) -> bool:
        return self.group_size == self.in_features

    @property
    def nbytes(self) -> int:
        ts = [self.qweight, self.scales, self.offsets]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def dequantize(self) -> torch.Tensor:
        """fp32 [out, in]; the reference for the int8 kernels."""
        return _apply_groups(self.qweight.float(), self.scales, self.offsets, self.group_size)

    def to(self, device: torch.device | str) -> Int8Weight:
        offsets = None if self.offsets is None else self.offsets.to(device)
        return Int8Weight(self.qweight.to(device), self.scales.to(device), offsets,
                          self.group_size)


def slice_rows(w: Int4Weight | Int8Weight, start: int, end: int) -> Int4Weight | Int8Weight:
    """Rows start..end of a weight, as a weight of the same format (views, no copies)."""
    offs = None if w.offsets is None else w.offsets[start:end]
    if isinstance(w, Int4Weight):
        return Int4Weight(w.qweight[start:end], w.scales[start:end], offs, w.group_size,
                          w.codebook)
    return Int8Weight(w.qweight[start:end], w.scales[start:end], offs, w.group_size)

"""Matmul straight from int4 / int8 weights: `y = x @ W.T` with W dequantized in registers.

`pack` repacks a runtime weight (`localllm.quant.formats`: Int4Weight / Int8Weight tensors)
once into `QMatrix`, a K-major layout in which a program's loads run along the output
dimension N (consecutive n are consecutive bytes: wide, coalesced loads for any number of
rows), in chunks of 32 columns of W (k). Kp is in_features rounded up to 32; the codes and
scales of the padding are 0, so it adds nothing.

    int4  qweight uint8 [Kp / 2, N]: chunk c of 32 columns is byte rows 16c .. 16c + 15,
          byte (16c + j, n), j < 16:   bit 7        4 3        0
                                         [ q[n, 32c+16+j] | q[n, 32c+j] ]
          (the low nibbles are the chunk's first 16 columns, the high ones its last 16)
    int8  qweight int8 [Kp, N]: element (k, n) = q[n, k]  (W transposed)
    scales, offsets [Kp / group_size, N] (one row per group of columns, fp16 or fp32 as the
          source had them, exact), or [1, N] for int8 per output channel
    codebook fp32 [16] or None

Values are those of the formats: `s * q + o` (offsets), `codebook[q] * s`, `s * (q - 8)`
(int4 without either) or `s * q` (int8 without offsets), with s, o the group's scale and offset.

`qmatmul` loops over chunks; each half chunk (16 columns, always inside one group: groups are
16 or 32 columns) is one [16, BLOCK_N] tile of codes dequantized in fp32 with one scale row.
Up to 16 rows of x (decode) it is a split-K GEMV: programs over (N tiles, K splits), each
summing a run of chunks (elementwise for one row, `tl.dot` on a 16-row tile otherwise) into an
fp32 workspace that a second kernel reduces in a fixed order; more rows run as a tiled GEMM
(`tl.dot` on [64 | 128, 128] tiles). Both accumulate in fp32: `tl.dot` takes x's bf16 / fp16
operands (weights rounded to that dtype) on a GPU, fp32 operands (IEEE, no TF32) for fp32 x
and under the interpreter.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from localllm.kernels.triton_common import INTERPRET
from localllm.kernels.triton_qmatmul_kernels import (
    dequantize_rows_kernel,
    qmatmul_kernel,
    splitk_reduce_kernel,
)

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
SCALE_DTYPES = (torch.float16, torch.float32)
CHUNK = 32  # columns of W per loop step (two halves of 16)
GEMV_MAX_M = 16  # rows of x up to which qmatmul splits K
MIN_SPLIT_CHUNKS = 4  # chunks each K split sums at least (by default)


@dataclass(frozen=True, eq=False)
class QMatrix:
    """A quantized weight W [out_features, in_features] in this module's layout (see above)."""

    qweight: torch.Tensor  # int4: uint8 [Kp // 2, N]; int8: int8 [Kp, N]
    scales: torch.Tensor  # fp16 | fp32 [Kp // group_size, N], or [1, N] per channel
    offsets: torch.Tensor | None  # like scales, or None
    codebook: torch.Tensor | None  # fp32 [16] (int4 only), or None
    bits: int  # 4 | 8
    group_size: int  # 16 | 32, or in_features (int8 per channel)
    in_features: int
    out_features: int

    @property
    def grouped(self) -> bool:
        """True when scales change every 16 / 32 columns (else one scale row per channel)."""
        return self.group_size in (16, 32)

    @property
    def nbytes(self) -> int:
        ts = [self.qweight, self.scales, self.offsets, self.codebook]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


def pack(qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
         codebook: torch.Tensor | None, bits: int, group_size: int) -> QMatrix:
    """The runtime format's tensors (Int4Weight: uint8 [N, K / 2]; Int8Weight: int8 [N, K];
    scales / offsets [N, K / group_size]) as a QMatrix on the same device."""
    if bits == 4 and qweight.dtype == torch.uint8 and qweight.dim() == 2:
        n, k = qweight.shape[0], qweight.shape[1] * 2
    elif bits == 8 and qweight.dtype == torch.int8 and qweight.dim() == 2:
        n, k = qweight.shape
    else:
        raise ValueError(f"pack: {bits}-bit qweight must be 2-D "
                         f"{'uint8' if bits == 4 else 'int8'}, got {qweight.dtype} "
                         f"{tuple(qweight.shape)} (bits must be 4 or 8)")
    if not (group_size in (16, 32) or (bits == 8 and group_size == k)) or k % group_size:
        raise ValueError(f"pack: group_size {group_size} must be 16 or 32 (or in_features for "
                         f"int8) and divide in_features {k}")
    if tuple(scales.shape) != (n, k // group_size) or scales.dtype not in SCALE_DTYPES:
        raise ValueError(f"pack: scales must be fp16 | fp32 {(n, k // group_size)}, got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    if offsets is not None and (offsets.shape != scales.shape or offsets.dtype != scales.dtype):
        raise ValueError("pack: offsets must match scales' shape and dtype")
    if codebook is not None and (bits != 4 or offsets is not None or codebook.shape != (16,)
                                 or codebook.dtype != torch.float32):
        raise ValueError("pack: a codebook is fp32 [16], for int4 weights without offsets")
    ts = [t for t in (scales, offsets, codebook) if t is not None]
    if any(t.device != qweight.device for t in ts):
        raise ValueError("pack: tensors on several devices")
    kp = triton.cdiv(k, CHUNK) * CHUNK
    grouped = group_size in (16, 32)
    if bits == 4:
        codes = torch.zeros(n, kp, dtype=torch.uint8, device=qweight.device)
        codes[:, :k] = torch.stack((qweight & 15, qweight >> 4), dim=-1).reshape(n, k)
        halves = codes.view(n, kp // CHUNK, 2, 16)
        packed = halves[:, :, 0] | (halves[:, :, 1] << 4)  # [N, Kp / 32, 16]
        q = packed.reshape(n, kp // 2).t().contiguous()  # [Kp / 2, N]
    else:
        codes8 = torch.zeros(n, kp, dtype=torch.int8, device=qweight.device)
        codes8[:, :k] = qweight
        q = codes8.t().contiguous()  # [Kp, N]

    def groups_t(t: torch.Tensor) -> torch.Tensor:
        rows = kp // group_size if grouped else 1
        out = torch.zeros(rows, n, dtype=t.dtype, device=t.device)
        out[:t.shape[1]] = t.t()
        return out  # [Kp / group_size | 1, N]

    return QMatrix(q, groups_t(scales), None if offsets is None else groups_t(offsets),
                   None if codebook is None else codebook.contiguous(), bits, group_size, k, n)


def stack(parts: list[QMatrix]) -> QMatrix | None:
    """The weights `parts` stacked along out_features (rows of W in order), or None when they
    differ in in_features, bits, group size, offsets, codebook or device. Scales of fp16 and
    fp32 parts are all made fp32 (exact)."""
    if not parts:
        return None
    a = parts[0]
    for p in parts[1:]:
        same = (p.bits, p.group_size, p.in_features, p.qweight.device) == \
            (a.bits, a.group_size, a.in_features, a.qweight.device)
        if not same or (p.offsets is None) != (a.offsets is None):
            return None
        if (p.codebook is None) != (a.codebook is None):
            return None
        if p.codebook is not None and a.codebook is not None and \
                not torch.equal(p.codebook, a.codebook):
            return None
    dtype = a.scales.dtype if all(p.scales.dtype == a.scales.dtype for p in parts) \
        else torch.float32

    def cat(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.to(dtype) if t.is_floating_point() else t for t in ts], dim=1)

    offsets = None if a.offsets is None else cat([p.offsets for p in parts
                                                  if p.offsets is not None])
    return QMatrix(cat([p.qweight for p in parts]), cat([p.scales for p in parts]), offsets,
                   a.codebook, a.bits, a.group_size, a.in_features,
                   sum(p.out_features for p in parts))


def _meta(w: QMatrix) -> dict[str, int | bool]:
    return dict(BITS=w.bits, GROUP=w.group_size if w.grouped else 0,
                HAS_OFFSETS=w.offsets is not None, HAS_CODEBOOK=w.codebook is not None)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _tiles(m: int) -> tuple[int, int, bool, int]:
    """(BLOCK_M, BLOCK_N, USE_DOT, num_warps) for m rows of x."""
    if m == 1:
        return 1, 128, False, 4
    if m <= GEMV_MAX_M:
        return 16, 64, True, 4
    if m <= 64:
        return 64, 128, True, 8  # 4 warps spill (255 registers on sm_90)
    return 128, 128, True, 8


def _check_2d(name: str, t: torch.Tensor, shape: tuple[int, int] | None,
              dtype: torch.dtype | None) -> None:
    if t.dim() != 2 or t.dtype not in FLOATS or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"qmatmul: {name} must be a 2-D float16/bfloat16/float32 tensor with "
                         f"unit column stride, got {t.dtype} {tuple(t.shape)} strides "
                         f"{t.stride()}")
    if (shape is not None and tuple(t.shape) != shape) or (dtype is not None and
                                                           t.dtype != dtype):
        raise ValueError(f"qmatmul: {name} is {t.dtype} {tuple(t.shape)}, expected {dtype} "
                         f"{shape}")


def qmatmul(x: torch.Tensor, w: QMatrix, bias: torch.Tensor | None = None, *,
            out: torch.Tensor | None = None, split_k: int | None = None) -> torch.Tensor:
    """x [M, K] (bf16 | fp16 | fp32, unit column stride, any row stride) -> x @ W.T (+ bias
    [N], any float dtype) [M, N] in x.dtype, fp32 accumulation, written to `out` ([M, N] of
    x.dtype, unit column stride) when given. `split_k` sets how many K splits sum partial
    products (default: enough programs for the GPU when M <= 16, else 1)."""
    _check_2d("x", x, None, None)
    m, k = x.shape
    n = w.out_features
    if k != w.in_features:
        raise ValueError(f"qmatmul: x has {k} columns, the weight {w.in_features}")
    if bias is not None and (bias.shape != (n,) or bias.dtype not in FLOATS
                             or (n > 1 and bias.stride(0) != 1)):
        raise ValueError(f"qmatmul: bias must be a contiguous float [{n}], got {bias.dtype} "
                         f"{tuple(bias.shape)}")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _check_2d("out", out, (m, n), x.dtype)
    devices = {t.device for t in (x, out, w.qweight, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"qmatmul: tensors on several devices: {sorted(map(str, devices))}")
    if m == 0 or n == 0:
        return out
    block_m, block_n, use_dot, warps = _tiles(m)
    grid_m, grid_n = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    n_chunks = w.qweight.shape[0] * (2 if w.bits == 4 else 1) // CHUNK
    if split_k is None:
        split_k = 1
        if m <= GEMV_MAX_M:
            want = triton.cdiv(2 * _sm_count(x.device), grid_m * grid_n)
            split_k = min(want, max(1, n_chunks // MIN_SPLIT_CHUNKS))
    per_split = triton.cdiv(n_chunks, max(1, min(split_k, n_chunks)))
    split = triton.cdiv(n_chunks, per_split)  # no empty split
    interp = INTERPRET
    o = w.offsets if w.offsets is not None else w.scales
    cb = w.codebook if w.codebook is not None else w.scales
    b = bias if bias is not None else out
    ws = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    stride_om, stride_os = (out.stride(0), 0) if split == 1 else (n, m * n)
    qmatmul_kernel[(grid_m, grid_n, split)](
        x, x.stride(0), w.qweight, w.scales, o, cb, b, ws, stride_om, stride_os, m, n, k,
        n_chunks, per_split, **_meta(w), HAS_BIAS=bias is not None, PARTIAL=split > 1,
        USE_DOT=use_dot, DOT_FP32=interp or x.dtype == torch.float32, EMULATE_BF16=interp,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=3)
    if split > 1:
        rb = min(1024, triton.next_power_of_2(n))
        splitk_reduce_kernel[(m, triton.cdiv(n, rb))](
            ws, b, out, out.stride(0), m, n, split, HAS_BIAS=bias is not None,
            EMULATE_BF16=interp, BLOCK_N=rb, num_warps=4)
    return out


def qmatmul_ref(x: torch.Tensor, w: QMatrix, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ dequantize_ref(w).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def dequantize_rows(w: QMatrix, ids: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `ids` (int64 | int32 [n], on w's device) of W in fp32 [n, K] (written to `out`,
    contiguous, when given), bit for bit the format's `dequantize()` rows (separate multiply
    and add, no FMA). An id outside 0..N-1 gives a row of NaN."""
    if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"dequantize_rows: ids must be int64 | int32 [n], got {ids.dtype} "
                         f"{tuple(ids.shape)}")
    n_ids, k = ids.shape[0], w.in_features
    if out is None:
        out = torch.empty(n_ids, k, dtype=torch.float32, device=ids.device)
    if out.shape != (n_ids, k) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"dequantize_rows: out must be contiguous fp32 {(n_ids, k)}")
    if len({ids.device, out.device, w.qweight.device}) != 1:
        raise ValueError("dequantize_rows: ids, out and the weight on several devices")
    if n_ids == 0:
        return out
    block_r = min(16, triton.next_power_of_2(n_ids))
    block_k = min(256, triton.next_power_of_2(k))
    o = w.offsets if w.offsets is not None else w.scales
    cb = w.codebook if w.codebook is not None else w.scales
    dequantize_rows_kernel[(triton.cdiv(n_ids, block_r), triton.cdiv(k, block_k))](
        ids, n_ids, w.qweight, w.scales, o, cb, out, w.out_features, k, **_meta(w),
        BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4, enable_fp_fusion=False)
    return out


def dequantize(w: QMatrix) -> torch.Tensor:
    """W [N, K] in fp32, exact (`dequantize_rows` of every row)."""
    ids = torch.arange(w.out_features, device=w.qweight.device)
    return dequantize_rows(w, ids)


def dequantize_ref(w: QMatrix) -> torch.Tensor:
    """W [N, K] in fp32 from the layout, in PyTorch (the formats' operation order)."""
    n, k, g = w.out_features, w.in_features, w.group_size
    if w.bits == 4:
        b = w.qweight.view(-1, 16, n)  # [Kp / 32, 16, N]
        codes = torch.stack((b & 15, b >> 4), dim=1).reshape(-1, n)  # [Kp, N]
    else:
        codes = w.qweight
    q = codes[:k].t()  # [N, K]
    if w.codebook is not None:
        values = w.codebook[q.long()]
    elif w.bits == 4 and w.offsets is None:
        values = q.float() - 8.0
    else:
        values = q.float()
    s = w.scales.t()[:, :k // g].float().unsqueeze(-1)  # [N, K / g, 1]
    y = s * values.reshape(n, k // g, g)
    if w.offsets is not None:
        y = y + w.offsets.t()[:, :k // g].float().unsqueeze(-1)
    return y.reshape(n, k)

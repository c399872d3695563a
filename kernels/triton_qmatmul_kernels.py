"""The `@triton.jit` kernels of `triton_qmatmul` (layout, host wrappers and references live
there): the matmul over 32-column chunks, its split-K reduction, and the row gather.

Codes are dequantized in registers as `w = s * q` then `w + o` (two roundings, in the order of
`localllm.quant.formats`), `w = codebook[q] * s`, or `w = s * (q - 8)`; the matmul accumulates
in fp32. `s`, `o` are one group's scale and offset, read as fp32 whatever their stored dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from localllm.kernels.triton_common import cast


@triton.jit
def _values(q, s, o, cb_ptr, BITS: tl.constexpr, HAS_OFFSETS: tl.constexpr,
            HAS_CODEBOOK: tl.constexpr):
    """fp32 weights from integer codes q and fp32 scales s / offsets o (broadcast to q)."""
    if HAS_CODEBOOK:
        w = tl.load(cb_ptr + q) * s
    else:
        qf = q.to(tl.float32)
        if BITS == 4:
            if not HAS_OFFSETS:
                qf = qf - 8.0
        w = s * qf
        if HAS_OFFSETS:
            w = w + o
    return w


@triton.jit
def _half(q, g, s_ptr, o_ptr, cb_ptr, offs_n, mask_n, N, BITS: tl.constexpr,
          HAS_OFFSETS: tl.constexpr, HAS_CODEBOOK: tl.constexpr):
    """fp32 [16, BLOCK_N]: the codes q [16, BLOCK_N] of one half chunk, all in group row g."""
    s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    o = s
    if HAS_OFFSETS:
        o = tl.load(o_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    return _values(q, s, o, cb_ptr, BITS, HAS_OFFSETS, HAS_CODEBOOK)


@triton.jit
def _accumulate(acc, x_ptr, stride_xm, offs_m, mask_m, k, K, w, USE_DOT: tl.constexpr,
                DOT_FP32: tl.constexpr):
    """USE_DOT: acc [BLOCK_M, BLOCK_N] += x[offs_m, k] [BLOCK_M, 16] @ w [16, BLOCK_N].
    Else (one row of x): acc [16, BLOCK_N] += x[row, k][:, None] * w, summed over k later."""
    if USE_DOT:
        x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + k[None, :],
                    mask=mask_m[:, None] & (k < K)[None, :], other=0.0)
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    else:
        xt = tl.load(x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm + k[:, None],
                     mask=mask_m[None, :] & (k < K)[:, None], other=0.0)  # [16, 1]
        acc += w * xt.to(tl.float32)
    return acc


@triton.jit
def qmatmul_kernel(x_ptr, stride_xm, q_ptr, s_ptr, o_ptr, cb_ptr, bias_ptr, out_ptr,
                   stride_om, stride_os, M, N, K, n_chunks, chunks_per_split,
                   BITS: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                   HAS_CODEBOOK: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                   USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, EMULATE_BF16: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[m, n] = sum_k x[m, k] w[n, k] over chunks pid_k * chunks_per_split ... of 32
    columns, for one [BLOCK_M, BLOCK_N] tile (USE_DOT False: BLOCK_M is 1). GROUP 0: one
    scale row (per channel). PARTIAL: stores the fp32 sums at out_ptr + pid_k * stride_os
    (no bias), for the reduction."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, 16)
    mask_m = offs_m < M
    mask_n = offs_n < N
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    c_lo = pid_k * chunks_per_split
    c_hi = tl.minimum(c_lo + chunks_per_split, n_chunks)
    for c in range(c_lo, c_hi):
        k0 = c * 32
        if BITS == 4:
            rows = (c * 16 + offs_j).to(tl.int64)[:, None] * N + offs_n[None, :]
            b = tl.load(q_ptr + rows, mask=mask_n[None, :], other=0).to(tl.int32)
            q0 = b & 15
            q1 = b >> 4
        else:
            rows = (k0 + offs_j).to(tl.int64)[:, None] * N + offs_n[None, :]
            q0 = tl.load(q_ptr + rows, mask=mask_n[None, :], other=0)
            q1 = tl.load(q_ptr + rows + 16 * N, mask=mask_n[None, :], other=0)
        if GROUP == 0:
            g0 = 0
            g1 = 0
        else:
            g0 = k0 // GROUP
            g1 = (k0 + 16) // GROUP
        w0 = _half(q0, g0, s_ptr, o_ptr, cb_ptr, offs_n, mask_n, N, BITS, HAS_OFFSETS,
                   HAS_CODEBOOK)
        acc = _accumulate(acc, x_ptr, stride_xm, offs_m, mask_m, k0 + offs_j, K, w0, USE_DOT,
                          DOT_FP32)
        w1 = _half(q1, g1, s_ptr, o_ptr, cb_ptr, offs_n, mask_n, N, BITS, HAS_OFFSETS,
                   HAS_CODEBOOK)
        acc = _accumulate(acc, x_ptr, stride_xm, offs_m, mask_m, k0 + 16 + offs_j, K, w1,
                          USE_DOT, DOT_FP32)
    if not USE_DOT:
        acc = tl.sum(acc, axis=0)[None, :]  # [1, BLOCK_N]
    mask = mask_m[:, None] & mask_n[None, :]
    out = out_ptr + pid_k.to(tl.int64) * stride_os
    ptrs = out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    if PARTIAL:
        tl.store(ptrs, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(ptrs, cast(acc, ptrs.dtype.element_ty, EMULATE_BF16), mask=mask)


@triton.jit
def splitk_reduce_kernel(ws_ptr, bias_ptr, out_ptr, stride_om, M, N, SPLIT,
                         HAS_BIAS: tl.constexpr, EMULATE_BF16: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """out[m, :] = sum over s in order of ws[s, m, :] (fp32 [SPLIT, M, N]) (+ bias)."""
    m = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(ws_ptr + (s * M + m) * N + offs_n, mask=mask_n, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    ptrs = out_ptr + m * stride_om + offs_n
    tl.store(ptrs, cast(acc, ptrs.dtype.element_ty, EMULATE_BF16), mask=mask_n)


@triton.jit
def dequantize_rows_kernel(ids_ptr, n_ids, q_ptr, s_ptr, o_ptr, cb_ptr, out_ptr, N, K,
                           BITS: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                           HAS_CODEBOOK: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_K: tl.constexpr):
    """out[i, k] = w[ids[i], k] in fp32 for a [BLOCK_R, BLOCK_K] tile; NaN rows for ids
    outside 0..N-1."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_r = offs_r < n_ids
    mask_k = k < K
    rows = tl.load(ids_ptr + offs_r, mask=mask_r, other=0).to(tl.int64)
    valid = mask_r & (rows >= 0) & (rows < N)
    mask = valid[:, None] & mask_k[None, :]
    if BITS == 4:
        byte_row = (k // 32) * 16 + k % 16
        b = tl.load(q_ptr + byte_row.to(tl.int64)[None, :] * N + rows[:, None], mask=mask,
                    other=0).to(tl.int32)
        q = (b >> (((k // 16) % 2) * 4)[None, :]) & 15
    else:
        q = tl.load(q_ptr + k.to(tl.int64)[None, :] * N + rows[:, None], mask=mask, other=0)
    if GROUP == 0:
        s_offs = rows[:, None] + 0 * k[None, :]
    else:
        s_offs = (k // GROUP).to(tl.int64)[None, :] * N + rows[:, None]
    s = tl.load(s_ptr + s_offs, mask=mask, other=0.0).to(tl.float32)
    o = s
    if HAS_OFFSETS:
        o = tl.load(o_ptr + s_offs, mask=mask, other=0.0).to(tl.float32)
    w = _values(q, s, o, cb_ptr, BITS, HAS_OFFSETS, HAS_CODEBOOK)
    w = tl.where(valid[:, None], w, float("nan"))
    out = out_ptr + offs_r.to(tl.int64)[:, None] * K + k[None, :]
    tl.store(out, w, mask=mask_r[:, None] & mask_k[None, :])

"""Paged decode attention in Triton: one query token per sequence, split-KV, GQA.

Stage 1 runs one program per (sequence, KV head, split): it handles every query head of that
KV head's group at once (the group is the M side of `tl.dot`, padded to 16 rows), walks its
chunk of the context in tiles of BLOCK_N positions gathered through the block table, and keeps
an online softmax in fp32. With one split it writes the normalized output directly; with more
it writes each split's normalized accumulator and log-sum-exp (base 2) to a workspace, and
stage 2 merges the splits of each (sequence, head).

Pools are [num_blocks, block_size, num_kv_heads, head_dim]; position p of a sequence lives at
pool[block_table[p // block_size], p % block_size]. Only block-table entries of positions
< context_len are ever read, so padding past a sequence's length may hold any id.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from localllm.kernels.triton_common import INTERPRET

_LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
_SPLIT_TARGET = 256  # positions a split covers at least, when the split count is chosen
_BUSY_PROGRAMS = 1024  # stage-1 programs that keep a large GPU busy
_MAX_SPLITS = 64


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def attend_tile(q, m_i, l_i, acc, allowed, pos, mask_n, bt_row, kvh, offs_d, mask_d,
                k_ptr, v_ptr, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                scale, softcap, SOFTCAP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                DOT_PREC: tl.constexpr):
    """One tile of cached positions `pos` ([BLOCK_N], read through the block table row
    `bt_row`) through the online softmax of the queries q [ROWS, BLOCK_D]: `allowed`
    (broadcastable to [ROWS, BLOCK_N]) masks the scores; returns the updated (m_i, l_i, acc)."""
    blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    slot = pos % BLOCK_SIZE
    k_off = blk * stride_kb + slot * stride_kt + kvh * stride_kh  # [BLOCK_N]
    v_off = blk * stride_vb + slot * stride_vt + kvh * stride_vh
    k_t = tl.load(k_ptr + k_off[None, :] + offs_d[:, None],
                  mask=mask_d[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
    s = tl.dot(q, k_t.to(q.dtype), input_precision=DOT_PREC) * scale  # [ROWS, BLOCK_N]
    if SOFTCAP:
        s = softcap * _tanh(s / softcap)
    s = tl.where(allowed, s * _LOG2E, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr, part_acc_ptr, part_lse_ptr,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_btb, stride_ob, stride_oh,
    num_heads, scale, softcap, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SOFTCAP: tl.constexpr, SINGLE: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    start = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    per_split = tl.cdiv(tl.cdiv(ctx - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, ctx)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_h
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM

    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb

    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + offs_n
        mask_n = pos < hi
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, mask_n[None, :], pos, mask_n, bt_row, kvh, offs_d, mask_d, k_ptr,
            v_ptr, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, scale,
            softcap, SOFTCAP, BLOCK_SIZE, DOT_PREC)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    mask_hd = mask_h[:, None] & mask_d[None, :]
    if SINGLE:
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_hd)
    else:
        row = (b * num_heads + heads) * num_splits + split  # [BLOCK_H]
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mask_hd)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    part_acc_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh, num_heads, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    row = (b * num_heads + h) * num_splits + offs_s  # [BLOCK_S]
    lse = tl.load(part_lse_ptr + row, mask=mask_s, other=float("-inf"))
    # NOTE: at least one split of every sequence is non-empty (context_len >= 1): m is finite.
    m = tl.max(lse, 0)
    w = tl.exp2(lse - m)  # [BLOCK_S], 0 for empty splits
    part = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                   mask=mask_s[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    o = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d,
             o.to(out_ptr.dtype.element_ty), mask=mask_d)


def decode_tiles(head_dim: int, group: int) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_H, BLOCK_N) of stage 1: the group padded to the 16 rows `tl.dot` needs;
    with 4 warps these compile for sm_90 without register spills up to head_dim 256 and
    GQA 16 (cuobjdump -res-usage, Triton 3.9)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return block_d, max(16, triton.next_power_of_2(group)), 64 if block_d <= 64 else 32


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int) -> int:
    """Splits per sequence: enough stage-1 programs to fill a large GPU, none shorter than
    about _SPLIT_TARGET positions, at most _MAX_SPLITS."""
    by_length = triton.cdiv(max(max_context, 1), _SPLIT_TARGET)
    by_busy = triton.cdiv(_BUSY_PROGRAMS, max(batch * num_kv_heads, 1))
    return max(1, min(by_length, by_busy, _MAX_SPLITS))


def check_paged_args(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, num_seqs: int,
                     softcap: float, window: int) -> None:
    """Raises ValueError unless the arguments fit the paged attention kernels of this file
    and of triton_extend_attention.py (num_seqs: rows of block_tables and context_lens)."""
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q must be [B, num_heads, head_dim] with unit stride on head_dim, "
                         f"got shape {tuple(q.shape)} strides {q.stride()}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q must be bf16, fp16 or fp32, got {q.dtype}")
    if k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool and v_pool must both be [num_blocks, block_size, "
                         f"num_kv_heads, head_dim], got {tuple(k_pool.shape)} and "
                         f"{tuple(v_pool.shape)}")
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("k_pool and v_pool need unit stride on head_dim")
    if not (k_pool.dtype.is_floating_point and v_pool.dtype.is_floating_point):
        raise ValueError(f"pools must be floating point, got {k_pool.dtype}, {v_pool.dtype}")
    _, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
    if k_pool.shape[3] != head_dim or not 1 <= head_dim <= 256:
        raise ValueError(f"head_dim {head_dim} must match the pools' {k_pool.shape[3]} and "
                         f"lie in 1..256")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} must be a power of two")
    if (block_tables.dim() != 2 or block_tables.shape[0] != num_seqs
            or block_tables.dtype not in (torch.int32, torch.int64)
            or block_tables.stride(-1) != 1):
        raise ValueError(f"block_tables must be int32/int64 [{num_seqs}, W] with unit stride, "
                         f"got {block_tables.dtype} {tuple(block_tables.shape)}")
    if (context_lens.dim() != 1 or context_lens.shape[0] != num_seqs
            or context_lens.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"context_lens must be int32/int64 [{num_seqs}], got "
                         f"{context_lens.dtype} {tuple(context_lens.shape)}")
    devices = {t.device for t in (q, k_pool, v_pool, block_tables, context_lens)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    if softcap < 0 or window < 0:
        raise ValueError(f"softcap ({softcap}) and window ({window}) must be >= 0")


def check_out(out: torch.Tensor, q: torch.Tensor) -> None:
    """Raises ValueError unless `out` can take the result for q."""
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} on {q.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if out.stride(-1) != 1:
        raise ValueError("out needs unit stride on head_dim")


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, softcap: float = 0.0, window: int = 0,
                           num_splits: int | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V: [B, num_heads, head_dim].

    q [B, num_heads, head_dim]; k_pool/v_pool [num_blocks, block_size, num_kv_heads, head_dim];
    block_tables [B, W]; context_lens [B] (>= 1; the query's own K/V already stored at
    context_len - 1). Scores are scale * q.k, soft-capped as softcap * tanh(s / softcap) when
    softcap > 0; window > 0 keeps positions j with context_len - 1 - j < window. num_splits
    (None: `choose_num_splits` from B, the KV heads and the block table's capacity, no device
    sync) chunks each context for parallel programs merged by log-sum-exp. Writes into `out`
    when given.
    """
    batch = q.shape[0] if q.dim() == 3 else 0
    check_paged_args(q, k_pool, v_pool, block_tables, context_lens, batch, softcap, window)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        check_out(out, q)
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    if num_splits is None:
        capacity = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(batch, num_kv_heads,
                                       min(capacity, window) if window else capacity)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    block_d, block_h, block_n = decode_tiles(head_dim, group)
    interpret = INTERPRET
    single = num_splits == 1
    if single:
        part_acc = part_lse = out  # unused
    else:
        part_acc = torch.empty(batch, num_heads, num_splits, head_dim, device=q.device,
                               dtype=torch.float32)
        part_lse = torch.empty(batch, num_heads, num_splits, device=q.device,
                               dtype=torch.float32)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_pool, v_pool, block_tables, context_lens, out, part_acc, part_lse,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        num_heads, float(scale), float(softcap), int(window),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, SOFTCAP=softcap > 0, SINGLE=single, DOT_FP32=interpret,
        DOT_PREC="ieee" if interpret or q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2,
    )
    if not single:
        _decode_merge_kernel[(batch, num_heads)](
            part_acc, part_lse, out, out.stride(0), out.stride(1), num_heads, num_splits,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=2,
        )
    return out


def paged_decode_attention_ref(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, softcap: float = 0.0,
                               window: int = 0) -> torch.Tensor:
    """Plain-PyTorch `paged_decode_attention` in fp32, one sequence at a time (tests only)."""
    batch, num_heads, _ = q.shape
    block_size, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
    out = torch.empty_like(q)
    for b in range(batch):
        ctx = int(context_lens[b])
        pos = torch.arange(ctx, device=q.device)
        if window > 0:
            pos = pos[pos > ctx - 1 - window]
        blocks = block_tables[b, pos // block_size].long()
        k = k_pool[blocks, pos % block_size].float()  # [n, num_kv_heads, head_dim]
        v = v_pool[blocks, pos % block_size].float()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale  # [num_heads, n]
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v).to(q.dtype)
    return out

"""Paged extend attention in Triton: a chunk of new positions per sequence over its paged K/V.

What prefill after a prefix hit, chunked prefill and mixed batches need: the chunk's K/V are
already in the pools, so one loop over the sequence's blocks covers both the cached prefix and
the chunk (causal inside it). One program per (query tile, KV head): a tile packs TQ
consecutive query tokens of one sequence times the GROUP query heads of the KV head into the
BLOCK_M rows of `tl.dot` (row r = token r // GROUP, head r % GROUP), so each K/V tile is read
once for the whole group; online softmax in fp32.

Tiles of sequence s take program ids base_s .. base_s + cdiv(qlen_s, TQ) - 1 with
base_s = query_start[s] // TQ + s; these ranges are disjoint and end below T // TQ + S, so the
grid is known on the host without reading query_start, and a program finds its sequence by
counting the bases <= its id.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from localllm.kernels.triton_common import INTERPRET
from localllm.kernels.triton_decode_attention import attend_tile, check_out, check_paged_args


@triton.jit
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qs_ptr, ctx_ptr, out_ptr,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_btb, stride_ot, stride_oh,
    num_seqs, tokens_per_tile, scale, softcap, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SEARCH: tl.constexpr, SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)

    count = 0
    for c0 in range(0, num_seqs, SEARCH):
        offs_s = c0 + tl.arange(0, SEARCH)
        valid = offs_s < num_seqs
        starts = tl.load(qs_ptr + offs_s, mask=valid, other=0).to(tl.int32)
        bases = starts // tokens_per_tile + offs_s
        count += tl.sum((valid & (bases <= pid)).to(tl.int32), 0)
    seq = count - 1
    if seq < 0:
        return
    q_start = tl.load(qs_ptr + seq).to(tl.int32)
    qlen = tl.load(qs_ptr + seq + 1).to(tl.int32) - q_start
    tile = pid - (q_start // tokens_per_tile + seq)
    first = tile * tokens_per_tile
    if first >= qlen:
        return
    ctx = tl.load(ctx_ptr + seq).to(tl.int32)
    last = tl.minimum(first + tokens_per_tile, qlen) - 1
    lo = tl.where(window > 0, tl.maximum(ctx - qlen + first - window + 1, 0), 0)
    hi = ctx - qlen + last + 1

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    tok = first + offs_m // GROUP  # [BLOCK_M] index in the chunk
    heads = kvh * GROUP + offs_m % GROUP
    mask_m = (offs_m < tokens_per_tile * GROUP) & (tok <= last)
    mask_d = offs_d < HEAD_DIM
    mask_md = mask_m[:, None] & mask_d[None, :]
    q_pos = tl.where(mask_m, ctx - qlen + tok, -1)  # [BLOCK_M]; padding rows see nothing
    rows = (q_start + tok).to(tl.int64)

    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :], mask=mask_md, other=0.0)  # [BLOCK_M, BLOCK_D]
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + seq * stride_btb

    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + offs_n
        mask_n = pos < hi
        allowed = mask_n[None, :] & (pos[None, :] <= q_pos[:, None])
        allowed = allowed & ((window <= 0) | (q_pos[:, None] - pos[None, :] < window))
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, allowed, pos, mask_n, bt_row, kvh, offs_d, mask_d, k_ptr, v_ptr,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, scale, softcap,
            SOFTCAP, BLOCK_SIZE, DOT_PREC)

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask_md)


def extend_tiles(head_dim: int, group: int) -> tuple[int, int, int, int]:
    """(BLOCK_D, BLOCK_M, BLOCK_N, num_warps): tiles that compile for sm_90 without register
    spills (cuobjdump -res-usage, Triton 3.9), not yet tuned for speed on a GPU."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m, block_n, num_warps = {16: (64, 64, 4), 32: (64, 64, 4), 64: (64, 64, 8),
                                   128: (64, 64, 8), 256: (32, 32, 8)}[block_d]
    return block_d, max(block_m, triton.next_power_of_2(group)), block_n, num_warps


def paged_extend_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           block_tables: torch.Tensor, query_start: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, softcap: float = 0.0,
                           window: int = 0,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's chunk of new positions over its paged K/V.

    q [T, num_heads, head_dim]: rows query_start[s] .. query_start[s+1] belong to sequence s
    (query_start [S+1], cu_seqlens style, query_start[0] == 0, query_start[S] <= T);
    context_lens [S] = cached + new tokens, the chunk's K/V already in the pools. Query i of
    sequence s sits at position context_lens[s] - qlen_s + i and attends positions j <= it,
    with window > 0 only those with position - j < window. Scores are scale * q.k, soft-capped
    as softcap * tanh(s / softcap) when softcap > 0. Returns [T, num_heads, head_dim] in
    q.dtype (written into `out` when given); rows outside every sequence are left unwritten.
    No device sync: the grid comes from T and S alone.
    """
    if (query_start.dim() != 1 or query_start.shape[0] < 1
            or query_start.dtype not in (torch.int32, torch.int64)
            or query_start.device != q.device):
        raise ValueError(f"query_start must be int32/int64 [S+1] on {q.device}, got "
                         f"{query_start.dtype} {tuple(query_start.shape)} on "
                         f"{query_start.device}")
    num_seqs = query_start.shape[0] - 1
    check_paged_args(q, k_pool, v_pool, block_tables, context_lens, num_seqs, softcap, window)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        check_out(out, q)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_d, block_m, block_n, num_warps = extend_tiles(head_dim, group)
    tokens_per_tile = block_m // group
    interpret = INTERPRET
    grid = (num_tokens // tokens_per_tile + num_seqs, num_kv_heads)
    _extend_kernel[grid](
        q, k_pool, v_pool, block_tables, query_start, context_lens, out,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        num_seqs, tokens_per_tile, float(scale), float(softcap), int(window),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_SIZE=block_size, SEARCH=128,
        SOFTCAP=softcap > 0, DOT_FP32=interpret,
        DOT_PREC="ieee" if interpret or q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=2,
    )
    return out


def paged_extend_attention_ref(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                               block_tables: torch.Tensor, query_start: torch.Tensor,
                               context_lens: torch.Tensor, scale: float, softcap: float = 0.0,
                               window: int = 0) -> torch.Tensor:
    """Plain-PyTorch `paged_extend_attention` in fp32, one sequence at a time (tests only)."""
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
    out = torch.empty_like(q)
    for s in range(context_lens.shape[0]):
        q0, q1, ctx = int(query_start[s]), int(query_start[s + 1]), int(context_lens[s])
        pos = torch.arange(ctx, device=q.device)
        blocks = block_tables[s, pos // block_size].long()
        k = k_pool[blocks, pos % block_size].float()  # [ctx, num_kv_heads, head_dim]
        v = v_pool[blocks, pos % block_size].float()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        sc = torch.einsum("qhd,nhd->hqn", q[q0:q1].float(), k) * scale  # [heads, qlen, ctx]
        if softcap > 0:
            sc = softcap * torch.tanh(sc / softcap)
        q_pos = torch.arange(ctx - (q1 - q0), ctx, device=q.device)[:, None]
        allowed = pos[None, :] <= q_pos
        if window > 0:
            allowed &= q_pos - pos[None, :] < window
        sc = sc.masked_fill(~allowed, float("-inf"))
        out[q0:q1] = torch.einsum("hqn,nhd->qhd", sc.softmax(-1), v).to(q.dtype)
    return out

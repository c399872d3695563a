"""The element-wise and attention kernels of `cpu_ops.c`, beside their references: RMSNorm
(with the residual add), SiLU-and-mul, RoPE, the K/V store, paged decode attention, top-k; and
`sample_rows` (`cpu_sample.c`), whose reference is the engine's own draw
(localllm/engine/draw.py after `top_k`). Call `cpu_native.available()` first."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from localllm.kernels import cpu_native


def _rows(t: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> bool:
    """A 2-D tensor of `dtype` whose rows are contiguous (any row stride)."""
    return t.dim() == 2 and t.dtype == dtype and t.stride(1) == 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 [T, D] -> RMSNorm(x) * weight; with `residual` ([T, D], contiguous rows), first
    `residual += x` in place (rounded to bf16) and normalizes the sum instead."""
    lib = cpu_native.library()
    assert lib is not None
    t, d = x.shape
    if not (_rows(x) and weight.is_contiguous() and weight.shape == (d,)
            and weight.dtype == torch.bfloat16
            and (residual is None or (_rows(residual) and residual.shape == x.shape))):
        raise ValueError("rms_norm: expects bf16 [T, D] rows and a bf16 [D] weight")
    out = torch.empty(t, d, dtype=torch.bfloat16)
    lib.rms_norm(x.data_ptr(), x.stride(0),
                 None if residual is None else residual.data_ptr(),
                 0 if residual is None else residual.stride(0),
                 weight.data_ptr(), t, d, eps, out.data_ptr(), d)
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    if residual is not None:
        residual.copy_(x + residual)
        x = residual
    return F.rms_norm(x, (x.shape[-1],), weight, eps=eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """bf16 [T, 2 I] (gate | up) -> silu(gate) * up, [T, I]."""
    lib = cpu_native.library()
    assert lib is not None
    t, n = gate_up.shape
    if not _rows(gate_up) or n % 2:
        raise ValueError("silu_mul: expects bf16 [T, 2 * I] rows")
    out = torch.empty(t, n // 2, dtype=torch.bfloat16)
    lib.silu_mul(gate_up.data_ptr(), gate_up.stride(0), t, n // 2, out.data_ptr(), n // 2)
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_(x: torch.Tensor, heads: int, head_dim: int, rope_dim: int, cos: torch.Tensor,
          sin: torch.Tensor, positions: torch.Tensor, neox: bool) -> torch.Tensor:
    """Rotates the first `heads` heads of each row of x (bf16 [T, >= heads * head_dim]) in
    place and returns x. cos, sin: fp32 [>= max position + 1, rope_dim / 2]; positions: [T]."""
    lib = cpu_native.library()
    assert lib is not None
    t = x.shape[0]
    if not (_rows(x) and x.shape[1] >= heads * head_dim and rope_dim % 2 == 0
            and rope_dim <= head_dim and cos.dtype == sin.dtype == torch.float32
            and cos.is_contiguous() and sin.is_contiguous()
            and cos.shape == sin.shape and cos.shape[1] == rope_dim // 2
            and positions.dtype == torch.int64 and positions.is_contiguous()
            and positions.shape == (t,)):
        raise ValueError("rope_: bad operands")
    if lib.rope(x.data_ptr(), t, x.stride(0), heads, head_dim, rope_dim, cos.data_ptr(),
                sin.data_ptr(), cos.shape[0], positions.data_ptr(), int(neox)):
        raise ValueError("rope_: a position is outside the cos/sin tables")
    return x


def rope_ref(x: torch.Tensor, heads: int, head_dim: int, rope_dim: int, cos: torch.Tensor,
             sin: torch.Tensor, positions: torch.Tensor, neox: bool) -> torch.Tensor:
    t = x.shape[0]
    h = x[:, :heads * head_dim].view(t, heads, head_dim)
    r = h[..., :rope_dim].float()
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [T, 1, rope_dim / 2]
    if neox:
        x1, x2 = r[..., :rope_dim // 2], r[..., rope_dim // 2:]
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    else:
        x1, x2 = r[..., 0::2], r[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    h[..., :rope_dim] = rotated.to(x.dtype)
    return x


def kv_store(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_pool: torch.Tensor,
             v_pool: torch.Tensor) -> None:
    """Writes rows k[t], v[t] (bf16 [T, num_kv_heads * head_dim]) to pool slot slots[t]; pools
    are bf16 [num_blocks, block_size, num_kv_heads, head_dim], contiguous."""
    lib = cpu_native.library()
    assert lib is not None
    t, row = k.shape
    n_slots = k_pool.numel() // max(row, 1)
    if not (_rows(k) and _rows(v) and v.shape == k.shape and k_pool.is_contiguous()
            and v_pool.is_contiguous() and k_pool.dtype == v_pool.dtype == torch.bfloat16
            and k_pool.shape == v_pool.shape and k_pool.shape[2] * k_pool.shape[3] == row
            and slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape == (t,)):
        raise ValueError("kv_store: bad operands")
    if lib.kv_store(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(), t,
                    row, k_pool.data_ptr(), v_pool.data_ptr(), n_slots):
        raise ValueError("kv_store: a slot is outside the pool")


def kv_store_ref(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_pool: torch.Tensor,
                 v_pool: torch.Tensor) -> None:
    k_pool.view(-1, k.shape[1]).index_copy_(0, slots, k)
    v_pool.view(-1, v.shape[1]).index_copy_(0, slots, v)


MAX_GROUP, MAX_HEAD_DIM = 16, 256


def decode_attention_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    return (head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUP)


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query token per sequence over its cached K/V: q bf16 [B, num_heads, head_dim] (rows
    may be strided); pools bf16 [num_blocks, block_size, num_kv_heads, head_dim]; block_tables
    int64 [B, width]; context_lens int64 [B] (>= 1) -> bf16 [B, num_heads, head_dim]."""
    lib = cpu_native.library()
    assert lib is not None
    b, num_heads, head_dim = q.shape
    _, bs, num_kv_heads, hd2 = k_pool.shape
    width = block_tables.shape[1] if block_tables.dim() == 2 else 0
    if not (q.dtype == torch.bfloat16 and q.stride(2) == 1 and q.stride(1) == head_dim
            and hd2 == head_dim and decode_attention_supported(num_heads, num_kv_heads, head_dim)
            and k_pool.is_contiguous() and v_pool.is_contiguous()
            and k_pool.shape == v_pool.shape and k_pool.dtype == v_pool.dtype == torch.bfloat16
            and block_tables.dtype == context_lens.dtype == torch.int64
            and block_tables.is_contiguous() and context_lens.is_contiguous()
            and block_tables.shape[0] == b and context_lens.shape == (b,)):
        raise ValueError("decode_attention: bad operands")
    out = torch.empty(b, num_heads, head_dim, dtype=torch.bfloat16)
    rc = lib.decode_attention(q.data_ptr(), q.stride(0), k_pool.data_ptr(), v_pool.data_ptr(),
                              k_pool.shape[0], block_tables.data_ptr(), width,
                              context_lens.data_ptr(), b, num_heads, num_kv_heads, head_dim, bs,
                              scale, out.data_ptr(), num_heads * head_dim, None)
    if rc == -2:
        raise MemoryError("decode_attention: out of memory")
    if rc:
        raise ValueError("decode_attention: a context length or block is out of range")
    return out


def decode_attention_ref(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor,
                         scale: float) -> torch.Tensor:
    b, num_heads, head_dim = q.shape
    _, bs, num_kv_heads, _ = k_pool.shape
    out = torch.empty(b, num_heads, head_dim, dtype=q.dtype)
    for i in range(b):
        ctx = int(context_lens[i])
        blocks = block_tables[i, :(ctx + bs - 1) // bs]
        # [ctx, num_kv_heads, head_dim]
        k = k_pool[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float()
        v = v_pool[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float()
        # [num_kv_heads, group, head_dim]
        qh = q[i].float().view(num_kv_heads, num_heads // num_kv_heads, head_dim)
        p = torch.softmax(torch.einsum("kgd,ckd->kgc", qh, k) * scale, dim=-1)
        out[i] = torch.einsum("kgc,ckd->kgd", p, v).reshape(num_heads, head_dim).to(q.dtype)
    return out


def top_k(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest of each row of x (fp32 [rows, n], k <= 64), largest first,
    ties to the lower index: int64 [rows, k]."""
    lib = cpu_native.library()
    assert lib is not None
    rows, n = x.shape
    if not (_rows(x, torch.float32) and 0 < k <= min(n, 64)):
        raise ValueError("top_k: expects fp32 [rows, n] rows and 0 < k <= min(n, 64)")
    idx = torch.empty(rows, k, dtype=torch.int64)
    lib.top_k(x.data_ptr(), x.stride(0), rows, n, k, idx.data_ptr())
    return idx


def top_k_ref(x: torch.Tensor, k: int) -> torch.Tensor:
    # a stable sort puts equal values in index order
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]


SAMPLE_MAX_K = 64  # cpu_kernels.h


class RowSampling(ctypes.Structure):
    """How one row draws its token (cpu_kernels.h): temperature 0 keeps its argmax; else among
    its top_k (1 .. SAMPLE_MAX_K) best logits, draw count + step of stream `key`."""
    _fields_ = [("temperature", ctypes.c_double), ("top_p", ctypes.c_double),
                ("min_p", ctypes.c_double), ("top_k", ctypes.c_int64),
                ("key", ctypes.c_uint64), ("count", ctypes.c_int64)]


def sampling_rows(rows: Sequence[RowSampling]) -> ctypes.Array[RowSampling]:
    """`rows` as the C array `sample_rows` and `decode_layers` take, after checking them."""
    for r in rows:
        if r.temperature > 0 and not (0 < r.top_k <= SAMPLE_MAX_K and r.count >= 0):
            raise ValueError(f"sample_rows: top_k must be 1 .. {SAMPLE_MAX_K}")
    return (RowSampling * len(rows))(*rows)


def sample_rows(logits: torch.Tensor, rows: Sequence[RowSampling], tokens: torch.Tensor,
                step: int = 0) -> None:
    """Each sampling row's token, drawn from its fp32 logits (`logits` [M, n]), into
    tokens (int64 [M]; a greedy row's entry is left as it is)."""
    lib = cpu_native.library()
    assert lib is not None
    m, n = logits.shape
    if not (_rows(logits, torch.float32) and len(rows) == m and tokens.dtype == torch.int64
            and tokens.shape == (m,) and tokens.is_contiguous()
            and all(r.top_k <= n for r in rows if r.temperature > 0)):
        raise ValueError("sample_rows: expects fp32 [M, n] logits, M rows and int64 [M] tokens")
    lib.sample_rows(logits.data_ptr(), logits.stride(0), m, n, sampling_rows(rows), step,
                    tokens.data_ptr())

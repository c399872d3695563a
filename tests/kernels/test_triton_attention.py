"""Paged decode and extend attention (Triton) against their PyTorch references.

Every pool slot that no sequence owns holds NaN (the tail of a sequence's last block, unused
blocks) and block-table padding points at NaN or inf blocks, so any read past a sequence's
length poisons the output; outputs are pre-filled with NaN so any unwritten element fails.
Without a GPU the kernels run under the Triton interpreter on CPU tensors (tests/conftest.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from localllm.kernels.triton_decode_attention import (  # noqa: E402
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from localllm.kernels.triton_extend_attention import (  # noqa: E402
    paged_extend_attention,
    paged_extend_attention_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def make_cache(ctx_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, gen: torch.Generator,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pools [num_blocks, block_size, num_kv_heads, head_dim] with each sequence's positions
    in shuffled blocks, everything else NaN; block tables [S, W] int32 padded with poison ids."""
    per_seq = [-(-n // block_size) for n in ctx_lens]
    num_used = sum(per_seq)
    num_blocks = num_used + 3  # two poison blocks and one never-referenced block
    ids = torch.randperm(num_blocks, generator=gen)
    poison = ids[num_used:num_used + 2]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_pool = torch.full(shape, float("nan"), dtype=dtype)
    v_pool = torch.full(shape, float("nan"), dtype=dtype)
    k_pool[poison[1]] = float("inf")
    v_pool[poison[1]] = float("-inf")
    width = max(per_seq) + 2
    tables = poison[torch.randint(0, 2, (len(ctx_lens), width), generator=gen)]
    used = 0
    for s, n in enumerate(ctx_lens):
        tables[s, :per_seq[s]] = ids[used:used + per_seq[s]]
        used += per_seq[s]
        pos = torch.arange(n)
        blocks, slots = tables[s, pos // block_size], pos % block_size
        k_pool[blocks, slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v_pool[blocks, slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    return k_pool.to(DEVICE), v_pool.to(DEVICE), tables.to(torch.int32).to(DEVICE)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    low = dtype != F32
    torch.testing.assert_close(out, ref, atol=2e-2 if low else 2e-4, rtol=2e-2 if low else 1e-4)


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


def cases(with_splits: bool) -> list[Any]:
    """GQA 1/3/8 x head_dim 8/64/128 x (plain, soft-cap, window, both), with block size,
    dtype and split count cycling; plus GQA 16 and head_dim 256."""
    sizes, dtypes, splits = (16, 8, 1, 32), (F32, BF16, F16), (1, 3, None, 2)
    rows: list[tuple[int, int, int, float, int, int | None, torch.dtype]] = []
    for group in (1, 3, 8):
        for head_dim in (8, 64, 128):
            for softcap, window in ((0.0, 0), (30.0, 0), (0.0, 12), (20.0, 7)):
                i = len(rows)
                rows.append((group, head_dim, sizes[i % 4], softcap, window,
                             splits[(i // 3) % 4], dtypes[i % 3]))
    rows += [(16, 64, 16, 0.0, 0, 2, BF16), (2, 256, 16, 30.0, 40, None, BF16)]
    params = []
    for group, head_dim, bs, softcap, window, n_splits, dtype in rows:
        name = f"g{group}-d{head_dim}-bs{bs}-cap{softcap:g}-win{window}-{dtype}"
        args: tuple[object, ...] = (group, head_dim, bs, softcap, window, dtype)
        if with_splits:
            name += f"-splits{n_splits}"
            args = args[:5] + (n_splits, dtype)
        params.append(pytest.param(*args, id=name.replace("torch.", "")))
    return params


@pytest.mark.parametrize("group,head_dim,block_size,softcap,window,num_splits,dtype",
                         cases(with_splits=True))
def test_decode_matches_ref(group: int, head_dim: int, block_size: int, softcap: float,
                            window: int, num_splits: int | None, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(group * 1000 + head_dim * 10 + block_size)
    ctx_lens = [1, 17, 50, 32]
    num_kv_heads = 1 if group == 16 else 2
    k_pool, v_pool, tables = make_cache(ctx_lens, block_size, num_kv_heads, head_dim, dtype,
                                        gen)
    q = randn(4, num_kv_heads * group, head_dim, dtype=dtype, gen=gen)
    ctx = torch.tensor(ctx_lens, device=DEVICE)
    scale = head_dim ** -0.5
    out = paged_decode_attention(q, k_pool, v_pool, tables, ctx, scale, softcap, window,
                                 num_splits=num_splits, out=nan_like(q))
    ref = paged_decode_attention_ref(q, k_pool, v_pool, tables, ctx, scale, softcap, window)
    assert out.dtype == dtype
    assert_matches(out, ref, dtype)


@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_decode_long_context_split_kv(num_splits: int | None) -> None:
    gen = torch.Generator().manual_seed(7)
    ctx_lens = [2000, 700]
    k_pool, v_pool, tables = make_cache(ctx_lens, 16, 1, 32, F32, gen)
    q = randn(2, 4, 32, dtype=F32, gen=gen)
    ctx = torch.tensor(ctx_lens, device=DEVICE, dtype=torch.int64)
    out = paged_decode_attention(q, k_pool, v_pool, tables.long(), ctx, 0.2, num_splits=num_splits,
                                 out=nan_like(q))
    ref = paged_decode_attention_ref(q, k_pool, v_pool, tables, ctx, 0.2)
    assert_matches(out, ref, F32)


def test_choose_num_splits() -> None:
    assert choose_num_splits(1, 1, 1) == 1
    assert choose_num_splits(1, 8, 256) == 1
    assert choose_num_splits(2, 1, 2016) == 8  # ~256 positions a split
    assert choose_num_splits(1, 8, 8192) == 32
    assert choose_num_splits(1, 1, 10**6) == 64  # capped
    assert choose_num_splits(256, 8, 8192) == 1  # the batch alone fills the GPU


def test_decode_mixed_dtypes_strided_q_and_out() -> None:
    """q a view into a fused qkv buffer, pools in another dtype, out a view whose padding
    columns must stay untouched."""
    gen = torch.Generator().manual_seed(3)
    ctx_lens = [5, 33]
    num_heads, num_kv_heads, head_dim = 6, 2, 24
    for q_dtype, pool_dtype in ((F32, BF16), (BF16, F32)):
        k_pool, v_pool, tables = make_cache(ctx_lens, 8, num_kv_heads, head_dim, pool_dtype,
                                            gen)
        qkv = randn(2, (num_heads + 2 * num_kv_heads) * head_dim, dtype=q_dtype, gen=gen)
        q = qkv[:, :num_heads * head_dim].view(2, num_heads, head_dim)
        buf = torch.full((2, num_heads, head_dim + 8), float("nan"), dtype=q_dtype,
                         device=DEVICE)
        ctx = torch.tensor(ctx_lens, device=DEVICE, dtype=torch.int32)
        out = paged_decode_attention(q, k_pool, v_pool, tables, ctx, 0.3, num_splits=2,
                                     out=buf[:, :, :head_dim])
        ref = paged_decode_attention_ref(q, k_pool, v_pool, tables, ctx, 0.3)
        assert_matches(out, ref, BF16)
        assert buf[:, :, head_dim:].isnan().all()


def test_decode_rejects_bad_arguments() -> None:
    gen = torch.Generator().manual_seed(0)
    k_pool, v_pool, tables = make_cache([4], 16, 2, 16, F32, gen)
    ctx = torch.tensor([4], device=DEVICE)
    q = randn(1, 4, 16, dtype=F32, gen=gen)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(randn(1, 4, 8, dtype=F32, gen=gen), k_pool, v_pool, tables,
                               ctx, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(randn(1, 3, 16, dtype=F32, gen=gen), k_pool, v_pool, tables,
                               ctx, 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(q, k_pool, v_pool, tables.float(), ctx, 1.0)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(q, k_pool[:, :12], v_pool[:, :12], tables, ctx, 1.0)
    with pytest.raises(ValueError, match="out"):
        paged_decode_attention(q, k_pool, v_pool, tables, ctx, 1.0, out=q.half())
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(q, k_pool, v_pool, tables, ctx, 1.0, num_splits=0)


# (cached tokens, new tokens) per sequence: a fresh prompt, a chunk after a cached prefix,
# a decode, and a one-token fresh prompt
EXTEND_SEQS = [(0, 37), (45, 20), (32, 1), (0, 1)]


def run_extend(seqs: list[tuple[int, int]], group: int, head_dim: int, block_size: int,
               softcap: float, window: int, dtype: torch.dtype, seed: int,
               num_kv_heads: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ctx_lens = [c + n for c, n in seqs]
    k_pool, v_pool, tables = make_cache(ctx_lens, block_size, num_kv_heads, head_dim, dtype,
                                        gen)
    starts = [0]
    for _, n in seqs:
        starts.append(starts[-1] + n)
    q = randn(starts[-1], num_kv_heads * group, head_dim, dtype=dtype, gen=gen)
    query_start = torch.tensor(starts, device=DEVICE, dtype=torch.int32)
    ctx = torch.tensor(ctx_lens, device=DEVICE)
    scale = head_dim ** -0.5
    out = paged_extend_attention(q, k_pool, v_pool, tables, query_start, ctx, scale, softcap,
                                 window, out=nan_like(q))
    ref = paged_extend_attention_ref(q, k_pool, v_pool, tables, query_start, ctx, scale,
                                     softcap, window)
    return out, ref


@pytest.mark.parametrize("group,head_dim,block_size,softcap,window,dtype",
                         cases(with_splits=False))
def test_extend_matches_ref(group: int, head_dim: int, block_size: int, softcap: float,
                            window: int, dtype: torch.dtype) -> None:
    out, ref = run_extend(EXTEND_SEQS, group, head_dim, block_size, softcap, window, dtype,
                          seed=group * 1000 + head_dim)
    assert out.dtype == dtype
    assert_matches(out, ref, dtype)


def test_extend_long_chunks_many_tiles() -> None:
    """Chunks longer than one query tile (64 tokens with GQA 1, 4 with GQA 16)."""
    out, ref = run_extend([(100, 130), (0, 3)], 1, 16, 16, 0.0, 0, F32, seed=5)
    assert_matches(out, ref, F32)
    out, ref = run_extend([(9, 11), (20, 1)], 16, 16, 16, 0.0, 5, F32, seed=6, num_kv_heads=1)
    assert_matches(out, ref, F32)


def test_extend_of_decodes_equals_decode() -> None:
    gen = torch.Generator().manual_seed(11)
    ctx_lens = [1, 30, 64]
    k_pool, v_pool, tables = make_cache(ctx_lens, 16, 2, 64, BF16, gen)
    q = randn(3, 6, 64, dtype=BF16, gen=gen)
    ctx = torch.tensor(ctx_lens, device=DEVICE)
    query_start = torch.arange(4, device=DEVICE)
    ext = paged_extend_attention(q, k_pool, v_pool, tables, query_start, ctx, 0.125, 10.0)
    dec = paged_decode_attention(q, k_pool, v_pool, tables, ctx, 0.125, 10.0, num_splits=2)
    torch.testing.assert_close(ext, dec, atol=1e-2, rtol=1e-2)


def test_extend_rejects_bad_arguments() -> None:
    gen = torch.Generator().manual_seed(0)
    k_pool, v_pool, tables = make_cache([4, 4], 16, 2, 16, F32, gen)
    q = randn(8, 4, 16, dtype=F32, gen=gen)
    ctx = torch.tensor([4, 4], device=DEVICE)
    with pytest.raises(ValueError, match="query_start"):
        paged_extend_attention(q, k_pool, v_pool, tables, torch.tensor([0, 4.0, 8]), ctx, 1.0)
    with pytest.raises(ValueError, match="context_lens"):
        paged_extend_attention(q, k_pool, v_pool, tables, torch.tensor([0, 4, 8]), ctx[:1],
                               1.0)

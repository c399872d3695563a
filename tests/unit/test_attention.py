"""Paged attention of the CPU and PyTorch backends against dense causal attention on
contiguous K/V, plain and with a soft-cap and a sliding window."""

from __future__ import annotations

import pytest
import torch

from localllm.backends.cpu import CpuBackend
from localllm.backends.pytorch.backend import TorchBackend
from localllm.layers.attention import AttentionMetadata, AttentionSpec, KVCache


def dense_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              softcap: float = 0.0, window: int = 0) -> torch.Tensor:
    # q: [T, H, D] (the last T positions); k, v: [C, KV, D] -> [T, H, D]
    t, h, _ = q.shape
    c, kv, _ = k.shape
    k = k.repeat_interleave(h // kv, dim=1)
    v = v.repeat_interleave(h // kv, dim=1)
    scores = torch.einsum("thd,chd->htc", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    distance = torch.arange(c - t, c)[:, None] - torch.arange(c)[None, :]
    allowed = (distance >= 0) & ((distance < window) if window else True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("htc,chd->thd", scores.softmax(-1), v)


@pytest.mark.parametrize("seqs", [
    [(9, 1), (3, 1), (14, 1), (5, 7), (0, 10)],  # batched decodes, a chunk, a fresh prompt
    [(12, 1), (4, 5)],  # a lone decode beside a chunk
    [(0, 1)],  # a one-token prompt
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("softcap, window", [(0.0, 0), (2.0, 0), (0.0, 5), (1.5, 3)])
def test_mixed_batch_matches_dense_reference(seqs: list[tuple[int, int]], dtype: torch.dtype,
                                             backend: str, cpu_path: str, softcap: float,
                                             window: int) -> None:
    torch.manual_seed(0)
    heads, kv_heads, dim, bs, num_blocks = 6, 2, 16, 4, 64
    cache = KVCache(torch.zeros(num_blocks, bs, kv_heads, dim, dtype=dtype),
                    torch.zeros(num_blocks, bs, kv_heads, dim, dtype=dtype))
    # seqs: (cached tokens before this step, new tokens this step) per sequence
    perm = torch.randperm(num_blocks).tolist()
    tables, full_k, full_v = [], [], []
    for cached, new in seqs:
        nb = -(-(cached + new) // bs)
        tables.append([perm.pop() for _ in range(nb)])
        full_k.append(torch.randn(cached + new, kv_heads, dim).to(dtype))
        full_v.append(torch.randn(cached + new, kv_heads, dim).to(dtype))
    # write the already-cached part straight into the pool
    for (cached, _), table, k, v in zip(seqs, tables, full_k, full_v):
        for p in range(cached):
            cache.k[table[p // bs], p % bs] = k[p]
            cache.v[table[p // bs], p % bs] = v[p]
    width = max(len(t) for t in tables)
    slots = [table[p // bs] * bs + p % bs for (cached, new), table in zip(seqs, tables)
             for p in range(cached, cached + new)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        query_lens=[n for _, n in seqs], context_lens=[c + n for c, n in seqs], block_size=bs,
    )
    q = torch.randn(sum(n for _, n in seqs), heads, dim).to(dtype)
    k_new = torch.cat([k[c:] for (c, _), k in zip(seqs, full_k)])
    v_new = torch.cat([v[c:] for (c, _), v in zip(seqs, full_v)])
    ops = CpuBackend() if backend == "cpu" else TorchBackend(torch.device("cpu"))
    if window:  # entries before every window are never read: poison them
        for (cached, _), table in zip(seqs, tables):
            for b in range(max(cached + 1 - window, 0) // bs):
                cache.k[table[b]] = float("nan")
                cache.v[table[b]] = float("nan")
    out = ops.attention(q, k_new, v_new, cache, meta, AttentionSpec(dim ** -0.5, softcap, window))
    start = 0
    for (_, new), k, v in zip(seqs, full_k, full_v):
        ref = dense_ref(q[start:start + new].float(), k.float(), v.float(), dim ** -0.5,
                        softcap, window)
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 inputs and output
        torch.testing.assert_close(out[start:start + new].float(), ref, rtol=tol, atol=tol)
        start += new


def test_a_prompt_row_gets_one_result_however_its_prompt_is_split(cpu_path: str) -> None:
    """bf16 on the CPU backend's kernels: a prompt's rows are bitwise the same whether the
    prompt runs in one step, in chunks of any size (across `PROMPT_BLOCK` boundaries), or as
    the tail after a cached prefix; rows past the prompt, computed again in a chunk (after a
    preemption), equal what the decode kernel gave them one at a time."""
    from localllm.kernels import cpu_native

    if not cpu_native.available():
        pytest.skip("the native kernels do not run here")
    torch.manual_seed(1)
    heads, kv_heads, dim, bs, n = 9, 3, 64, 16, 150
    blocks = torch.randperm(40)[:-(-n // bs)].tolist()  # scattered through the pool
    cache = KVCache(torch.zeros(40, bs, kv_heads, dim, dtype=torch.bfloat16),
                    torch.zeros(40, bs, kv_heads, dim, dtype=torch.bfloat16))
    q, k, v = (torch.randn(n, h, dim).bfloat16() for h in (heads, kv_heads, kv_heads))
    ops, spec = CpuBackend(), AttentionSpec(dim ** -0.5)

    def attend(start: int, end: int, prompt_len: int) -> torch.Tensor:
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(start, end)])
        meta = AttentionMetadata(slot_mapping=slots, block_tables=torch.tensor([blocks]),
                                 query_lens=[end - start], context_lens=[end], block_size=bs,
                                 prompt_lens=[prompt_len])
        return ops.attention(q[start:end], k[start:end], v[start:end], cache, meta, spec)

    whole = attend(0, n, n)
    torch.testing.assert_close(whole.float(), dense_ref(q.float(), k.float(), v.float(),
                                                        dim ** -0.5), rtol=2e-2, atol=2e-2)
    for chunk in (1, 7, 64, 100):
        parts = torch.cat([attend(s, min(s + chunk, n), n) for s in range(0, n, chunk)])
        assert torch.equal(parts, whole), chunk
    assert torch.equal(attend(144, n, n), whole[144:])  # after 9 cached blocks
    decoded = torch.cat([attend(p, p + 1, 100) for p in range(100, n)])  # one query a step
    again = attend(90, n, 100)  # 10 prompt rows, then 50 decoded once
    assert torch.equal(again[:10], whole[90:100])
    assert torch.equal(again[10:], decoded)

"""Native CPU kernels (kernels/cpu_*.c) against their plain-PyTorch references, and the fused
decode path of a model against its per-op path."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf_factory import VOCAB_SIZE, ModelSpec, write_model

from localllm.backends.cpu import CpuBackend, dispatch
from localllm.backends.cpu.packing import cpu_packable
from localllm.backends.cpu.weights import CpuPackedWeight
from localllm.backends.cpu.whole_step import build_stack
from localllm.engine.draw import draw_index, draw_u
from localllm.engine.model_runner import prompt_logits
from localllm.kernels import cpu_int4, cpu_native, cpu_ops
from localllm.kernels.cpu_layers import DecoderStack
from localllm.layers.linear import Linear, QuantLinear, row_source
from localllm.loader import load_gguf
from localllm.quant.formats import NF4_CODEBOOK, Int4Weight, pack_nibbles

pytestmark = pytest.mark.skipif(
    not cpu_native.available(), reason="native CPU kernels need x86-64 AVX2 + FMA + F16C (or "
    "AVX-512 BF16 + VBMI) and a C compiler; this machine runs the PyTorch path, which the "
    "other tests cover")


@pytest.fixture(autouse=True, params=cpu_native.isas_available() or ("none",))
def native_isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test here runs under each build of the kernels this CPU runs (AVX-512 BF16 and
    AVX2 on the bigger CPUs), against the same references."""
    if request.param == "none":  # the module is skipped
        yield "none"
        return
    assert cpu_native.set_isa(str(request.param)) == request.param
    yield str(request.param)
    cpu_native.set_isa(None)


def bf16_close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-6) -> None:
    # one bf16 rounding apart at most
    torch.testing.assert_close(a.float(), b.float(), rtol=8e-3, atol=atol)


def packed(out: int, inp: int, planes: int, seed: int = 0, group: int = 32,
           offsets: bool = True) -> CpuPackedWeight:
    """Without offsets the fp16 scales are kept alone (`half`), else as bf16 (scale, zero)."""
    import sys
    sys.path.insert(0, str(Path(__file__).parent))
    from test_linear import random_int4, random_int8

    make = random_int4 if planes == 1 else random_int8
    w = CpuPackedWeight.from_weight(make(out, inp, offsets=offsets, seed=seed, group=group),
                                    torch.bfloat16)
    assert w.half == (not offsets)
    return w


@pytest.fixture(params=["off", "int8", "bf16"])
def matmul_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """int4_mm's decoding rows through VNNI, then with batches on AMX-INT8 tiles, then every
    row on bf16 tiles (`cpu_native.amx_mode`; the tiles where the CPU has them)."""
    if not cpu_native.set_amx(request.param) and request.param != "off":
        pytest.skip(f"this build or CPU has no AMX tiles for {request.param}")
    yield str(request.param)
    cpu_native.set_amx(cpu_native.AMX_DEFAULT)


@pytest.mark.parametrize("offsets", [True, False])  # False: fp16 scales alone (Q4_0, Q8_0)
@pytest.mark.parametrize("group", [32, 16])  # 16: Q2_K, Q3_K, Q6_K
@pytest.mark.parametrize("planes", [1, 2])
# 96, 200: the last tile is padded; 64, 320: an odd number of tiles, whose middle one's two
# halves go to two threads
@pytest.mark.parametrize("out", [64, 96, 200, 320])
# 17, 40: chunks of 8 rows and what is left (17: a lone row on VNNI beside AMX-INT8 chunks)
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17, 40])
def test_int4_mm_matches_reference(group: int, planes: int, out: int, rows: int,
                                   matmul_path: str, offsets: bool) -> None:
    w = packed(out, 256, planes, group=group, offsets=offsets)
    assert w.group_size == group
    x = (torch.randn(rows, 256, generator=torch.Generator().manual_seed(1)) * 2).bfloat16()
    y = cpu_int4.int4_mm(x, w.packed, w.scales_zeros, out, planes)
    assert y.shape == (rows, out) and y.dtype == torch.bfloat16
    want = cpu_int4.int4_mm_ref(x, w.packed, w.scales_zeros, out, planes)
    # near-zero outputs: the fp32 group sums carry an absolute error of ~1e-6 of the scale
    bf16_close(y, want, atol=1e-5 * float(want.float().abs().max()))


@pytest.mark.parametrize("offsets", [True, False])  # False, two planes: Q8_0's one-pass path
@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("group", [32, 16])
# 96: an odd number of groups (AMX-INT8 takes them in pairs; with two planes a pair spans
# both), 576: 18 groups
@pytest.mark.parametrize("cols", [96, 128, 576])
def test_int4_mm_row_results_do_not_depend_on_the_batch(matmul_path: str, group: int,
                                                        planes: int, offsets: bool,
                                                        cols: int) -> None:
    # int8: one row takes VNNI, two and the 20-row batch's chunks of 8 and 4 AMX-INT8 tiles;
    # bf16: one and two rows put several groups in the rows of the C tiles, the 20-row batch
    # one group to a C tile; all must give the same bits
    w = packed(320, cols, planes, group=group, offsets=offsets)  # 5 tiles: one unpaired at 1 row
    x = torch.randn(20, cols, generator=torch.Generator().manual_seed(2)).bfloat16()
    batched = cpu_int4.int4_mm(x, w.packed, w.scales_zeros, 320, planes)
    bf16_close(batched, cpu_int4.int4_mm_ref(x, w.packed, w.scales_zeros, 320, planes),
               atol=1e-5 * float(batched.float().abs().max()))
    for i in range(20):
        pair = cpu_int4.int4_mm(x[[i, 19 - i if i != 19 - i else 0]], w.packed, w.scales_zeros,
                                320, planes)
        assert torch.equal(pair[0], batched[i])
        alone = cpu_int4.int4_mm(x[i:i + 1], w.packed, w.scales_zeros, 320, planes)[0]
        assert torch.equal(alone, batched[i])


@pytest.mark.parametrize("offsets", [True, False])
@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("group", [32, 16])
def test_int4_mm_gives_the_same_bits_in_both_builds(native_isa: str, group: int, planes: int,
                                                    offsets: bool) -> None:
    # without a codebook both builds round x to the same integers and sum them exactly: the
    # AVX-512 build gives the AVX2 build's bits, one row or a batch (11 rows: a chunk of 8 and
    # one of 3), on VNNI and, where the CPU has them, with its batches on AMX-INT8 tiles; so
    # does the AVX2 build with AVX-VNNI, where the CPU has it
    builds = cpu_native.isas_available()
    if not {"avx512", "avx2"} <= set(builds):
        pytest.skip("needs a CPU that runs both builds")
    w = packed(200, 576, planes, group=group, offsets=offsets)
    x = torch.randn(11, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    x[3, 40:72] = 0  # a group of zeros
    x[5, :32] *= 1e-30  # values far below the others (subnormal-sized groups)
    x[9, 100] = float("inf")  # a group with an inf and one with a NaN: their rows all NaN
    x[10, 300] = float("nan")
    ys = {}
    try:
        for name, amx in (("avx512", False), ("avx512", True), ("avx2", False),
                          ("avx2_vnni", False)):
            if name not in builds:
                continue
            cpu_native.set_isa(name)
            if cpu_native.set_amx(amx) != amx:
                continue
            ys[name, amx] = (cpu_int4.int4_mm(x, w.packed, w.scales_zeros, 200, planes),
                             cpu_int4.int4_mm(x[7:8], w.packed, w.scales_zeros, 200, planes))
    finally:
        cpu_native.set_isa("avx512")
        cpu_native.set_amx(cpu_native.AMX_DEFAULT)
        cpu_native.set_isa(native_isa)
    want = ys["avx2", False]
    assert torch.isnan(want[0][9:]).all() and not torch.isnan(want[0][:9]).any()
    for batch, alone in ys.values():
        assert torch.equal(batch.nan_to_num(7.0), want[0].nan_to_num(7.0))
        assert torch.equal(alone, want[1])
    assert torch.equal(want[1][0], want[0][7])
    bf16_close(want[0][:9], cpu_int4.int4_mm_ref(x[:9], w.packed, w.scales_zeros, 200, planes),
               atol=1e-5 * float(want[0][:9].float().abs().max()))


def test_int4_mm_a_prompts_rows_equal_the_rows_alone() -> None:
    """60 rows of 4096 columns: the AVX2 build takes them in slabs of 24 (their rounded rows
    within 256 KiB); every row matches the reference and its result alone."""
    w = packed(128, 4096, 1)
    x = torch.randn(60, 4096, generator=torch.Generator().manual_seed(6)).bfloat16()
    y = cpu_int4.int4_mm(x, w.packed, w.scales_zeros, 128, 1)
    want = cpu_int4.int4_mm_ref(x, w.packed, w.scales_zeros, 128, 1)
    bf16_close(y, want, atol=1e-5 * float(want.float().abs().max()))
    for i in (0, 23, 24, 47, 48, 59):
        assert torch.equal(cpu_int4.int4_mm(x[i:i + 1], w.packed, w.scales_zeros, 128, 1)[0],
                           y[i])


@pytest.mark.parametrize("group", [32, 16])
def test_int4_mm_rows_of_any_range_and_non_finite_rows(group: int) -> None:
    """Rows far from 1 in size, a group whose values span 2^20, a zero row and rows holding an
    inf or a NaN: the finite rows match the reference (the AVX2 build rounds each group of x to
    16-bit integers on a power-of-two scale), a zero row gives zeros, a non-finite row gives no
    finite output, and no row changes another's bits."""
    w = packed(128, 256, 1, group=group)
    g = torch.Generator().manual_seed(5)
    base = torch.randn(8, 256, generator=g)
    wide = base[0].clone()
    wide[::group] = 3e4  # each group: one large value, the rest about 2^-15 of it and less
    wide[1::group] = 1e-3
    rows = [base[1] * 1e-30, base[2] * 1e30, wide, torch.zeros(256), base[3], base[4], base[5]]
    rows[4][17] = float("inf")
    rows[5][200] = float("nan")
    x = torch.stack(rows).bfloat16()
    y = cpu_int4.int4_mm(x, w.packed, w.scales_zeros, 128, 1)
    want = cpu_int4.int4_mm_ref(x, w.packed, w.scales_zeros, 128, 1)
    for i in (0, 1, 2, 6):
        bf16_close(y[i], want[i], atol=1e-5 * float(want[i].float().abs().max()))
    assert torch.equal(y[3], torch.zeros(128, dtype=torch.bfloat16))
    assert not torch.isfinite(y[4]).any() and not torch.isfinite(y[5]).any()
    for i in range(7):
        alone = cpu_int4.int4_mm(x[i:i + 1], w.packed, w.scales_zeros, 128, 1)[0]
        torch.testing.assert_close(alone, y[i], rtol=0.0, atol=0.0, equal_nan=True)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_kernels_give_the_same_bits_however_the_threads_share_the_tiles(rows: int) -> None:
    # each thread takes its own share and then steals from the others' (cpu_team.h's
    # share_next): which thread computes which tiles changes from call to call (a worker wakes
    # later than the caller, the cores run at different speeds), the results may not
    w = packed(2048, 256, 1)  # 32 tiles: chunks of several tiles to claim and to steal
    head = packed(2048, 256, 2, offsets=False)  # the Q8_0 head's layout (int8_logits)
    x = (torch.randn(rows, 256, generator=torch.Generator().manual_seed(3)) * 2).bfloat16()
    first = cpu_int4.int4_mm(x, w.packed, w.scales_zeros, 2048, 1)
    bf16_close(first, cpu_int4.int4_mm_ref(x, w.packed, w.scales_zeros, 2048, 1),
               atol=1e-5 * float(first.float().abs().max()))
    logits = cpu_int4.int8_logits(x, head.packed, head.scales_zeros, 2048)
    ref = cpu_int4.int8_logits_ref(x, head.packed, head.scales_zeros, 2048)
    torch.testing.assert_close(logits, ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()))
    for _ in range(30):
        assert torch.equal(cpu_int4.int4_mm(x, w.packed, w.scales_zeros, 2048, 1), first)
        assert torch.equal(cpu_int4.int8_logits(x, head.packed, head.scales_zeros, 2048),
                           logits)


def test_int4_mm_refuses_mismatched_operands() -> None:
    w = packed(64, 128, 1)
    with pytest.raises(ValueError, match="int4_mm: bad operands"):
        cpu_int4.int4_mm(torch.zeros(1, 96, dtype=torch.bfloat16), w.packed, w.scales_zeros, 64, 1)
    with pytest.raises(ValueError, match="int4_mm: bad operands"):
        cpu_int4.int4_mm(torch.zeros(1, 128), w.packed, w.scales_zeros, 64, 1)  # fp32 input


@pytest.mark.parametrize("rows", [1, 5, 40])  # 40: the parallel branch
@pytest.mark.parametrize("dim", [576, 100])  # 100: a partial vector at the end of a row
def test_rms_norm_with_and_without_residual(rows: int, dim: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, dim, generator=g) * 4).bfloat16()
    w = torch.randn(dim, generator=g).bfloat16()
    bf16_close(cpu_ops.rms_norm(x, w, 1e-5), cpu_ops.rms_norm_ref(x, w, 1e-5))
    r0 = torch.randn(rows, dim, generator=g).bfloat16()
    ra, rb = r0.clone(), r0.clone()
    bf16_close(cpu_ops.rms_norm(x, w, 1e-5, ra), cpu_ops.rms_norm_ref(x, w, 1e-5, rb))
    assert torch.equal(ra, rb)  # the residual stream: one bf16 add, exactly


@pytest.mark.parametrize("rows", [1, 40])
def test_silu_mul(rows: int) -> None:
    gu = (torch.randn(rows, 2 * 1000, generator=torch.Generator().manual_seed(3)) * 4).bfloat16()
    out = cpu_ops.silu_mul(gu)
    assert out.shape == (rows, 1000)
    bf16_close(out, cpu_ops.silu_mul_ref(gu))


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("rot_dim", [64, 40])  # 40: partial rotary (and a partial vector)
def test_rope_in_place(neox: bool, rot_dim: int) -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 12 * 64 + 64, generator=g).bfloat16()  # 12 rotated heads, then others
    pos = torch.tensor([0, 7, 99])
    ang = torch.arange(100).float()[:, None] * torch.rand(rot_dim // 2, generator=g)
    cos, sin = ang.cos(), ang.sin()
    got = cpu_ops.rope_(x.clone(), 12, 64, rot_dim, cos, sin, pos, neox)
    want = cpu_ops.rope_ref(x.clone(), 12, 64, rot_dim, cos, sin, pos, neox)
    bf16_close(got, want)
    assert torch.equal(got[:, 12 * 64:], x[:, 12 * 64:])
    with pytest.raises(ValueError, match="outside the cos/sin tables"):
        cpu_ops.rope_(x.clone(), 12, 64, rot_dim, cos, sin, torch.tensor([0, 1, 100]), neox)


def test_kv_store_and_bad_slots() -> None:
    pools = [torch.zeros(4, 16, 2, 32, dtype=torch.bfloat16) for _ in range(4)]
    k, v = torch.randn(2, 3, 64).bfloat16().unbind(0)
    slots = torch.tensor([5, 63, 17])
    cpu_ops.kv_store(k, v, slots, pools[0], pools[1])
    cpu_ops.kv_store_ref(k, v, slots, pools[2], pools[3])
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    with pytest.raises(ValueError, match="outside the pool"):
        cpu_ops.kv_store(k, v, torch.tensor([5, 64, 0]), pools[0], pools[1])
    assert torch.equal(pools[0], pools[2])  # nothing written


@pytest.mark.parametrize("ctxs", [[1], [300], [16, 17, 1, 129]])
@pytest.mark.parametrize("n_heads, n_kv", [(9, 3), (4, 4)])
def test_decode_attention(ctxs: list[int], n_heads: int, n_kv: int) -> None:
    g = torch.Generator().manual_seed(5)
    kp = torch.randn(40, 16, n_kv, 64, generator=g).bfloat16()
    vp = torch.randn(40, 16, n_kv, 64, generator=g).bfloat16()
    tables = torch.stack([torch.randperm(40, generator=g)[:20] for _ in ctxs])
    ctx = torch.tensor(ctxs)
    q = (torch.randn(len(ctxs), n_heads, 64, generator=g) * 2).bfloat16()
    got = cpu_ops.decode_attention(q, kp, vp, tables, ctx, 0.125)
    bf16_close(got, cpu_ops.decode_attention_ref(q, kp, vp, tables, ctx, 0.125))


@pytest.mark.parametrize("ctxs, head_dim, n_heads, n_kv, block", [
    ([700, 1, 1300], 64, 9, 3, 16),   # 2 and 3 chunks merged, beside a one-chunk row
    ([5000], 128, 8, 1, 32),          # eight chunks, group of 8
    ([77, 600], 80, 4, 2, 128),       # head_dim not a multiple of 32; blocks beyond a chunk
    ([33], 256, 2, 2, 16),
    ([40, 200], 96, 10, 2, 16),       # V in blocks of 4 and 2 vectors; 5 query heads: 4 + 1
    ([130], 48, 6, 2, 16),            # 3 vectors of V, a half-masked second query vector
    ([300, 40], 128, 40, 8, 16),      # more query heads than a whole-row task takes
])
def test_decode_attention_long_contexts_and_head_sizes(ctxs: list[int], head_dim: int,
                                                       n_heads: int, n_kv: int,
                                                       block: int) -> None:
    g = torch.Generator().manual_seed(6)
    width = max(ctxs) // block + 1
    n_blocks = width * len(ctxs) + 3
    kp = torch.randn(n_blocks, block, n_kv, head_dim, generator=g).bfloat16()
    vp = torch.randn(n_blocks, block, n_kv, head_dim, generator=g).bfloat16()
    tables = torch.randperm(n_blocks, generator=g)[:width * len(ctxs)].view(len(ctxs), width)
    ctx = torch.tensor(ctxs)
    q = (torch.randn(len(ctxs), n_heads, head_dim, generator=g) * 2).bfloat16()
    scale = head_dim ** -0.5
    got = cpu_ops.decode_attention(q, kp, vp, tables, ctx, scale)
    bf16_close(got, cpu_ops.decode_attention_ref(q, kp, vp, tables, ctx, scale), atol=1e-5)
    for i in range(len(ctxs)):  # a sequence's result does not depend on its batch
        alone = cpu_ops.decode_attention(q[i:i + 1], kp, vp, tables[i:i + 1], ctx[i:i + 1],
                                         scale)
        assert torch.equal(alone[0], got[i])


@pytest.mark.parametrize("n_heads, n_kv", [(9, 3), (8, 2), (16, 1), (12, 4)])
def test_decode_attention_split_heads_equal_whole_groups(n_heads: int, n_kv: int) -> None:
    # per-KV-head tasks (the AVX-512 build): one short sequence gives the threads fewer tasks
    # than two each, so its KV heads' query heads are split between tasks; in a batch of 8
    # each task takes a whole group. Whole-row tasks (the AVX2 build): a sequence of 32
    # positions and more is cut into chunks. Either way the same result bit for bit
    g = torch.Generator().manual_seed(7)
    kp = torch.randn(80, 16, n_kv, 64, generator=g).bfloat16()
    vp = torch.randn(80, 16, n_kv, 64, generator=g).bfloat16()
    tables = torch.randperm(80, generator=g)[:80].view(8, 10)
    ctx = torch.tensor([72, 40, 100, 9, 150, 33, 64, 120])
    q = (torch.randn(8, n_heads, 64, generator=g) * 2).bfloat16()
    got = cpu_ops.decode_attention(q, kp, vp, tables, ctx, 0.125)
    bf16_close(got, cpu_ops.decode_attention_ref(q, kp, vp, tables, ctx, 0.125), atol=1e-5)
    for i in range(8):
        alone = cpu_ops.decode_attention(q[i:i + 1], kp, vp, tables[i:i + 1], ctx[i:i + 1],
                                         0.125)
        assert torch.equal(alone[0], got[i])


def test_decode_attention_gives_the_same_bits_however_the_threads_share_the_tasks() -> None:
    # each thread runs a share of consecutive tasks (chunks, or a chunk's KV heads in turn) and
    # then steals from the others' (cpu_team.h's share_next): which thread runs which task
    # changes from call to call, the result may not
    g = torch.Generator().manual_seed(8)
    ctx = torch.tensor([700, 1, 1300, 40, 200, 513, 64, 900])
    kp = torch.randn(8 * 82 + 3, 16, 3, 64, generator=g).bfloat16()
    vp = torch.randn(8 * 82 + 3, 16, 3, 64, generator=g).bfloat16()
    tables = torch.randperm(8 * 82 + 3, generator=g)[:8 * 82].view(8, 82)
    q = (torch.randn(8, 9, 64, generator=g) * 2).bfloat16()
    first = cpu_ops.decode_attention(q, kp, vp, tables, ctx, 0.125)
    bf16_close(first, cpu_ops.decode_attention_ref(q, kp, vp, tables, ctx, 0.125), atol=1e-5)
    for _ in range(30):
        assert torch.equal(cpu_ops.decode_attention(q, kp, vp, tables, ctx, 0.125), first)


def test_decode_attention_refuses_out_of_range_tables() -> None:
    kp = torch.zeros(4, 16, 1, 64, dtype=torch.bfloat16)
    q = torch.zeros(1, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out of range"):  # block 4 of a 4-block pool
        cpu_ops.decode_attention(q, kp, kp, torch.tensor([[0, 4]]), torch.tensor([20]), 1.0)
    with pytest.raises(ValueError, match="out of range"):  # longer than its table
        cpu_ops.decode_attention(q, kp, kp, torch.tensor([[0, 1]]), torch.tensor([33]), 1.0)


@pytest.mark.parametrize("k", [1, 16, 40])
def test_top_k(k: int) -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 49152, generator=g)
    assert torch.equal(cpu_ops.top_k(x, k), cpu_ops.top_k_ref(x, k))
    ties = torch.randint(0, 4, (2, 1000), generator=g).float()  # ties go to the lower index
    assert torch.equal(cpu_ops.top_k(ties, k), cpu_ops.top_k_ref(ties, k))


def test_sample_rows_draw_as_the_engine_draws() -> None:
    # the native draw (top_k, then draw_index with draw count + step) against the engine's
    # Python one, token for token, greedy rows left alone; params as chat uses them and wider
    g = torch.Generator().manual_seed(16)
    params = [(0.8, 0.95, 0.05, 40), (1.5, 1.0, 0.0, 64), (0.3, 0.5, 0.2, 3), (2.0, 0.99, 0.0, 1)]
    for t in range(300):
        x = torch.randn(5, 700, generator=g) * (1 + t % 4)
        x[:, 600:] = float("-inf") if t % 5 == 0 else x[:, 600:]
        rows = [cpu_ops.RowSampling(*params[(t + b) % 4][:3], params[(t + b) % 4][3], 11 * t + b,
                                    t) for b in range(4)] + [cpu_ops.RowSampling()]
        tokens = torch.full((5,), -7, dtype=torch.int64)
        cpu_ops.sample_rows(x, rows, tokens, step=3)
        for b, r in enumerate(rows[:4]):
            idx = cpu_ops.top_k_ref(x[b:b + 1], r.top_k)[0]
            u = draw_u(r.key, r.count + 3)
            assert int(tokens[b]) == int(idx[draw_index(x[b, idx].tolist(), r.temperature,
                                                         r.top_p, r.min_p, u)])
        assert int(tokens[4]) == -7
    with pytest.raises(ValueError, match="top_k"):
        cpu_ops.sample_rows(x, [cpu_ops.RowSampling(1.0, 1.0, 0.0, 65, 0, 0)] * 5, tokens)


SPEC = ModelSpec(hidden=128, ffn=128, heads=4, kv_heads=2, layers=2, qtype=QT.Q4_0,
                 qtypes={"token_embd.weight": QT.Q8_0})


@pytest.fixture(scope="module")
def small_model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("native") / "m.gguf", SPEC).path


@pytest.fixture(scope="module")
def small_model(small_model_file: Path) -> torch.nn.Module:
    return load_gguf(small_model_file, torch.bfloat16).model


def test_fused_decode_equals_the_per_op_path(small_model: torch.nn.Module,
                                             small_model_file: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    m = small_model
    assert build_stack(m.decoder_layout()) is not None
    ids = [3 + (7 * i) % 50 for i in range(40)]
    backend = m.backend
    built = backend.whole_step(m.decoder_layout(), m)  # the CPU's stack ignores `forward`
    assert built is not None
    calls = []

    def counting_step(layout: object, forward: object) -> object:
        def step(*args: object) -> object:
            out = built(*args)  # type: ignore[arg-type]
            calls.append(out is not None)
            return out
        return step

    monkeypatch.setattr(backend, "whole_step", counting_step)
    fused = prompt_logits(m, ids, chunk=1)  # decode steps: one native call each
    assert len(calls) == len(ids) and all(calls)  # every step took the native stack
    monkeypatch.setattr(backend, "whole_step", lambda layout, forward: None)  # per-op path
    per_op = prompt_logits(m, ids, chunk=1)
    assert torch.equal(fused, per_op)
    prompt = prompt_logits(m, ids)  # one prompt: per-op, dense matmuls for many rows
    # both bf16 paths against the fp32 model (each about 0.05-0.06 off at worst; they round
    # differently, so their own difference can reach the sum)
    exact = prompt_logits(load_gguf(small_model_file, torch.float32).model, ids)
    torch.testing.assert_close(fused, exact, rtol=0.0, atol=0.08)
    torch.testing.assert_close(prompt, exact, rtol=0.0, atol=0.08)


def stack_step(seed: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor,
                                   tuple[torch.Tensor, ...]]:
    """A 3-sequence decode step for the small models' stacks: 2 layers' K/V pools (8 blocks
    of 16), inputs x [3, 128], and (positions, slots, block tables, context lengths)."""
    g = torch.Generator().manual_seed(seed)
    pools = [(torch.randn(8, 16, 2, 32, generator=g).bfloat16(),
              torch.randn(8, 16, 2, 32, generator=g).bfloat16()) for _ in range(2)]
    x = torch.randn(3, 128, generator=g).bfloat16()
    pos = torch.tensor([4, 20, 0])
    return pools, x, (pos, torch.tensor([4, 16 + 20 % 16, 2 * 16]),
                      torch.tensor([[0, 5], [6, 1], [2, 7]]), pos + 1)


def test_decoder_stack_matches_its_reference(small_model: torch.nn.Module) -> None:
    m = small_model
    stack = build_stack(m.decoder_layout())
    assert stack is not None
    pools, x, (pos, slots, tables, ctx) = stack_step(7)
    ref_pools = [(k.clone(), v.clone()) for k, v in pools]
    cos, sin = m.rope.tables(64, torch.device("cpu"))
    want = stack.run_ref(x.clone(), pos, slots, tables, ctx, ref_pools, cos, sin)
    got = stack.run(x.clone(), pos, slots, tables, ctx, pools, cos, sin)
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)
    for (k, v), (rk, rv) in zip(pools, ref_pools):  # the step's K/V, stored at its slots
        torch.testing.assert_close(k.float(), rk.float(), rtol=0.05, atol=0.05)
        torch.testing.assert_close(v.float(), rv.float(), rtol=0.05, atol=0.05)
    with pytest.raises(ValueError, match="out of range"):
        stack.run(x.clone(), pos, slots, tables, ctx + 40, pools, cos, sin)
    # a position beyond the cos/sin tables: an error, for a row of a batch or alone (where one
    # thread rotates q and another k and stores: then nothing is stored)
    far = torch.tensor([4, 20, cos.shape[0]])
    with pytest.raises(ValueError, match="out of range"):
        stack.run(x.clone(), far, slots, tables, ctx, pools, cos, sin)
    before = [(k.clone(), v.clone()) for k, v in pools]
    with pytest.raises(ValueError, match="out of range"):
        stack.run(x[2:].clone(), far[2:], slots[2:], tables[2:], ctx[2:], pools, cos, sin)
    assert all(torch.equal(k, bk) and torch.equal(v, bv)
               for (k, v), (bk, bv) in zip(pools, before))


def test_decoder_stack_with_a_sequence_split_into_chunks(small_model: torch.nn.Module) -> None:
    # a context past ATTN_UNIT (512) positions is attended in chunks merged in order: inside
    # the step's team, the plan one thread makes and the merge; beside it, a short sequence
    m = small_model
    stack = build_stack(m.decoder_layout())
    assert stack is not None
    g = torch.Generator().manual_seed(3)
    pools = [(torch.randn(48, 16, 2, 32, generator=g).bfloat16(),
              torch.randn(48, 16, 2, 32, generator=g).bfloat16()) for _ in range(2)]
    ref_pools = [(k.clone(), v.clone()) for k, v in pools]
    x = torch.randn(2, 128, generator=g).bfloat16()
    pos = torch.tensor([700, 3])
    tables = torch.tensor([list(range(44)), [44] + [0] * 43])
    slots = torch.tensor([43 * 16 + 700 % 16, 44 * 16 + 3])
    cos, sin = m.rope.tables(704, torch.device("cpu"))
    want = stack.run_ref(x.clone(), pos, slots, tables, pos + 1, ref_pools, cos, sin)
    got = stack.run(x.clone(), pos, slots, tables, pos + 1, pools, cos, sin)
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)
    alone = stack.run(x[:1].clone(), pos[:1], slots[:1], tables[:1], pos[:1] + 1,
                      [(k.clone(), v.clone()) for k, v in ref_pools], cos, sin)
    assert torch.equal(alone, got[:1])  # the long sequence alone: the same bits


# the default model's kind of head: tied to a Q8_0 embedding, logits from int8_logits
HEAD_SPEC = ModelSpec(hidden=128, ffn=128, heads=4, kv_heads=2, layers=2, qtype=QT.Q4_0,
                      qtypes={"token_embd.weight": QT.Q8_0}, tied=True)


@pytest.fixture(scope="module")
def head_model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("native_head") / "m.gguf", HEAD_SPEC).path


def test_decoder_stack_runs_a_q8_0_head_as_the_model_does(small_model: torch.nn.Module,
                                                          head_model_file: Path) -> None:
    stack = build_stack(small_model.decoder_layout())
    assert stack is not None and stack.head is None  # a Q4_0 head: the per-op path's
    m = load_gguf(head_model_file, torch.bfloat16).model
    stack = build_stack(m.decoder_layout())
    assert stack is not None and stack.head is not None
    pools, x, args = stack_step(8)
    clean = [(k.clone(), v.clone()) for k, v in pools]
    cos, sin = m.rope.tables(64, torch.device("cpu"))
    logits, best, best_logit = stack.run_logits(x.clone(), *args, pools, cos, sin)
    again = [(k.clone(), v.clone()) for k, v in clean]
    want = m.compute_logits(stack.run(x.clone(), *args, again, cos, sin))  # the per-op head
    assert torch.equal(logits, want)
    assert best == cpu_ops.top_k_ref(want, 1)[:, 0].tolist()
    assert best_logit == [want[i, b].item() for i, b in enumerate(best)]
    ref, ref_best, _ = stack.run_logits_ref(x.clone(), *args, clean, cos, sin)
    torch.testing.assert_close(logits, ref, rtol=0.0, atol=0.1)
    # the embedding looked up in the same call: its rows as QuantLinear.embed gives them
    assert stack.embed is not None
    ids = torch.tensor([5, 0, VOCAB_SIZE - 1])
    x = m.embed_tokens.embed(ids)
    for head in (False, True):
        fresh = [[(k.clone(), v.clone()) for k, v in clean] for _ in range(2)]
        got = stack.run_tokens(ids, *args, fresh[0], cos, sin, head)
        want = (stack.run_logits if head else stack.run)(x.clone(), *args, fresh[1], cos, sin)
        if head:
            assert isinstance(got, tuple) and torch.equal(got[0], want[0])
            assert got[1:] == want[1:]
        else:
            assert torch.equal(got, want)
        assert all(torch.equal(a, b) for p, q in zip(*fresh) for a, b in zip(p, q))
    with pytest.raises(IndexError, match="token id"):
        stack.run_tokens(torch.tensor([1, VOCAB_SIZE, 2]), *args, clean, cos, sin, True)


def steps_one_at_a_time(head_model_file: Path, steps: int,
                        rows: list[cpu_ops.RowSampling] | None = None
                        ) -> tuple[DecoderStack, list[list[int]], Any]:
    """The head model's stack, the tokens of one `run_steps` call of `steps` steps from three
    rows (`rows`: how each draws) after checking them, and the K/V pools, against `steps` calls
    of `run_tokens` (each row's best then its `sample_rows` draw the next input); also the
    call's operands (pos, slots, tables, ctx, clean pools, cos, sin)."""
    m = load_gguf(head_model_file, torch.bfloat16).model
    stack = build_stack(m.decoder_layout())
    assert stack is not None and stack.head is not None and stack.embed is not None
    pools, _, (pos, slots, tables, ctx) = stack_step(9)
    clean = [(k.clone(), v.clone()) for k, v in pools]
    cos, sin = m.rope.tables(64, torch.device("cpu"))
    ids = torch.tensor([5, 0, VOCAB_SIZE - 1])
    best, best_logit = stack.run_steps(ids, pos, slots, tables, ctx, pools, cos, sin, steps,
                                       rows)
    alone = [(k.clone(), v.clone()) for k, v in clean]
    p, c = pos.clone(), ctx.clone()
    for j in range(steps):
        s = torch.tensor([int(tables[i, int(p[i]) // 16]) * 16 + int(p[i]) % 16
                          for i in range(3)])
        got = stack.run_tokens(ids, p, s, tables, c, alone, cos, sin, True)
        assert isinstance(got, tuple)
        tokens = torch.tensor(got[1])
        if rows is not None:
            cpu_ops.sample_rows(got[0], rows, tokens, step=j)
        assert best[j] == tokens.tolist() and best_logit[j] == got[2]
        ids, p, c = tokens, p + 1, c + 1
    assert all(torch.equal(a, b) for x, y in zip(pools, alone) for a, b in zip(x, y))
    return stack, best, (pos, slots, tables, ctx, clean, cos, sin)


def test_greedy_steps_in_one_call_are_the_steps_one_at_a_time(head_model_file: Path) -> None:
    stack, _, (pos, slots, tables, ctx, clean, cos, sin) = steps_one_at_a_time(head_model_file,
                                                                                3)
    # one step is the plain call; a step past a row's block table is an error
    assert stack.run_steps(torch.tensor([5, 0, 1]), pos, slots, tables, ctx,
                           [(k.clone(), v.clone()) for k, v in clean], cos, sin, 1)[0][0] == \
        stack.run_tokens(torch.tensor([5, 0, 1]), pos, slots, tables, ctx,
                         [(k.clone(), v.clone()) for k, v in clean], cos, sin, True)[1]
    end = torch.tensor([4, 31, 0])  # row 1's table ends at position 31
    with pytest.raises(ValueError, match="out of range"):
        stack.run_steps(torch.tensor([5, 0, 1]), end, torch.tensor([4, 16 + 15, 32]), tables,
                        end + 1, [(k.clone(), v.clone()) for k, v in clean], cos, sin, 2)
    bad = tables.clone()
    bad[0, 1] = 8  # row 0's next block is not in the pools (8 blocks)
    edge = torch.tensor([15, 4, 0])
    with pytest.raises(ValueError, match="out of range"):
        stack.run_steps(torch.tensor([5, 0, 1]), edge, torch.tensor([15, 16 + 4, 32]), bad,
                        edge + 1, [(k.clone(), v.clone()) for k, v in clean], cos, sin, 2)


def test_sampled_steps_in_one_call_are_the_steps_one_at_a_time(head_model_file: Path) -> None:
    # rows that sample draw inside the call what `sample_rows` after each one-step call draws
    rows = [cpu_ops.RowSampling(1.5, 1.0, 0.0, 50, 3, 10), cpu_ops.RowSampling(),
            cpu_ops.RowSampling(0.9, 0.9, 0.02, 8, 2**64 - 5, 0)]
    stack, best, (pos, slots, tables, ctx, clean, cos, sin) = steps_one_at_a_time(
        head_model_file, 4, rows)
    # the greedy row is the greedy call's; a sampled row drew other tokens than its best
    _, greedy, _ = steps_one_at_a_time(head_model_file, 4)
    assert [b[1] for b in best] == [b[1] for b in greedy]
    assert [b[0] for b in best] != [b[0] for b in greedy]
    with pytest.raises(ValueError, match="top_k"):
        stack.run_steps(torch.tensor([5, 0, 1]), pos, slots, tables, ctx, clean, cos, sin, 2,
                        [cpu_ops.RowSampling(1.0, 1.0, 0.0, VOCAB_SIZE + 1, 0, 0)] * 3)


def test_engine_samples_the_heads_pick_as_the_per_op_head(head_model_file: Path) -> None:
    from localllm import LLM, SamplingParams, SchedulerConfig
    from localllm.layers.backend import StepLogits

    llm = LLM(head_model_file, scheduler=SchedulerConfig(decode_steps=1))  # a call a step
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[1, 5, 9, 13], [1, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    runner = llm.engine.runner
    llm.generate([prompts[0]], SamplingParams(max_tokens=2))  # builds the whole step
    step = runner._whole_step
    assert step is not None
    kinds: list[str] = []

    def watched(*args: object, head: bool | None = None) -> object:
        out = step(*(args[:4] + ((head,) if head is not None else args[4:])))  # type: ignore
        kinds.append(type(out).__name__)
        return out

    runner._whole_step = watched  # type: ignore[assignment]
    fused = [c.token_ids for c in llm.generate(prompts, params)]
    assert kinds.count(StepLogits.__name__) >= params.max_tokens - 1
    runner._whole_step = lambda *a: watched(*a[:4], head=False)  # type: ignore
    kinds.clear()
    per_op = [c.token_ids for c in llm.generate(prompts, params)]
    assert StepLogits.__name__ not in kinds and "Tensor" in kinds
    assert fused == per_op


@pytest.mark.parametrize("group", [32, 16])
@pytest.mark.parametrize("planes", [1, 2])
def test_tiled_scales_give_what_pytorchs_pairs_give(matmul_path: str, planes: int,
                                                    group: int) -> None:
    # packing with the native kernels keeps (scale, zero) pairs tile by tile; the kernels read
    # PyTorch's pairs form too, and must give the same bits from either
    w = packed(200, 256, planes, group=group)  # 4 tiles, the last padded
    k2 = planes * 256
    assert cpu_int4.scales_layout(w.scales_zeros, k2, planes, 256) == (group, cpu_int4.TILED)
    pairs = cpu_int4.untile_scales(w.scales_zeros)
    assert pairs.shape == (k2 // group, 256, 2)
    assert cpu_int4.scales_layout(pairs, k2, planes, 256) == (group, cpu_int4.PAIRS)
    assert torch.equal(cpu_int4.tile_scales(pairs), w.scales_zeros)
    # pair (group g, row n) sits at [n // 64, g, n % 64] of the tiled form
    assert torch.equal(w.scales_zeros[2, 3, 5], pairs[3, 2 * 64 + 5])
    for rows in (1, 2, 3, 8, 17):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        y = cpu_int4.int4_mm(x, w.packed, w.scales_zeros, 200, planes)
        assert torch.equal(y, cpu_int4.int4_mm(x, w.packed, pairs, 200, planes))
        want = cpu_int4.int4_mm_ref(x, w.packed, pairs, 200, planes)
        assert torch.equal(want, cpu_int4.int4_mm_ref(x, w.packed, w.scales_zeros, 200, planes))
        bf16_close(y, want, atol=1e-5 * float(want.float().abs().max()))
    assert torch.equal(cpu_int4.int4_dequant_t(w.packed, w.scales_zeros, planes),
                       cpu_int4.int4_dequant_t(w.packed, pairs, planes))
    if cpu_native.gemm_available():
        x = torch.randn(33, 256, generator=torch.Generator().manual_seed(5)).bfloat16()
        assert torch.equal(cpu_int4.int4_gemm(x, w.packed, w.scales_zeros, 200, planes),
                           cpu_int4.int4_gemm(x, w.packed, pairs, 200, planes))
    # rows of the weight, and its matmul on PyTorch's kernel should the native ones go away
    ids = torch.tensor([0, 63, 64, 130, 199])
    dense = cpu_int4._dequant_fp32(w.packed, pairs, planes)[ids]
    assert torch.equal(w.rows(ids), dense if planes == 1 else dense[:, :256] + dense[:, 256:])
    if group == 32:
        x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6)).bfloat16()
        native = w.matmul(x)
        available = cpu_native.available
        try:
            cpu_native.available = lambda: False  # type: ignore[assignment]
            fallback = w.matmul(x)
        finally:
            cpu_native.available = available  # type: ignore[assignment]
        bf16_close(fallback, native, atol=1e-2 * float(native.float().abs().max()))


@pytest.mark.parametrize("offsets", [True, False])
@pytest.mark.parametrize("group", [32, 16])
@pytest.mark.parametrize("planes", [1, 2])
def test_int4_dequant_t(planes: int, group: int, offsets: bool) -> None:
    w = packed(96, 128, planes, group=group, offsets=offsets)  # one padded tile
    wt = cpu_int4.int4_dequant_t(w.packed, w.scales_zeros, planes)
    assert wt.shape == (128, 128)
    bf16_close(wt, cpu_int4.int4_dequant_t_ref(w.packed, w.scales_zeros, planes))
    assert not wt[:, 96:].any()  # padding rows are zero weights


@pytest.mark.parametrize("group", [32, 16])
@pytest.mark.parametrize("planes", [1, 2])
def test_int4_rows_half_equal_the_source_rows(planes: int, group: int) -> None:
    import sys
    sys.path.insert(0, str(Path(__file__).parent))
    from test_linear import random_int4, random_int8

    src = (random_int4 if planes == 1 else random_int8)(160, 128, offsets=False, seed=3,
                                                        group=group)
    w = CpuPackedWeight.from_weight(src, torch.bfloat16)
    assert w.half  # fp16 scales kept as the file stores them
    ids = torch.tensor([0, 31, 32, 63, 64, 100, 159, 5, 5] * 4)  # both nibbles, 3 tiles, 36 rows
    got = cpu_int4.int4_rows_half(w.packed, w.scales_zeros, planes, ids)
    assert torch.equal(got, cpu_int4.int4_rows_half_ref(w.packed, w.scales_zeros, planes, ids))
    assert torch.equal(got, src.dequantize()[ids])  # exact: the file's own values
    with pytest.raises(IndexError, match="out of range"):
        cpu_int4.int4_rows_half(w.packed, w.scales_zeros, planes, torch.tensor([192]))


@pytest.fixture
def needs_gemm(native_isa: str) -> None:
    """Skips the test where `int4_gemm` does not run under this build: a CPU without AMX
    (amx_tile, amx_bf16), or the AVX2 build, which has no tiles (prompts then take dequantize +
    matmul, which the cpu_path tests cover)."""
    if not cpu_native.gemm_available():
        pytest.skip(f"int4_gemm needs AMX tiles and the AVX-512 build (this is {native_isa})")


def weight_of_kind(kind: str, out: int) -> tuple[CpuPackedWeight, int]:
    """A packed [out, 128] weight and its planes: int4 (with offsets), int4-half (fp16 scales
    alone), int8-half, int8-g16 (groups of 16) or codebook (IQ4_NL)."""
    if kind == "codebook":
        return CpuPackedWeight.from_weight(iq4_weight(out, 128), torch.bfloat16), 1
    planes = 2 if kind.startswith("int8") else 1
    return packed(out, 128, planes, group=16 if kind.endswith("g16") else 32,
                  offsets=not kind.endswith("half")), planes


@pytest.mark.usefixtures("needs_gemm")
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("weight", ["int4", "int4-half", "int8-half", "int8-g16", "codebook"])
@pytest.mark.parametrize("rows", [1, 16, 33, 200])  # 33, 200: a partial block of 16 rows
def test_int4_gemm_matches_reference(weight: str, rows: int, gated: bool) -> None:
    w, planes = weight_of_kind(weight, 256)
    x = (torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)) * 2).bfloat16()
    got = cpu_int4.int4_gemm(x, w.packed, w.scales_zeros, 256, planes, w.lut, gated=gated)
    want = cpu_int4.int4_gemm_ref(x, w.packed, w.scales_zeros, 256, planes, w.lut, gated=gated)
    assert got.shape == (rows, 128 if gated else 256)
    # gated: a product one bf16 step off (fp32 sums in another order) moves the activation up
    # to two steps
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2 if gated else 8e-3,
                               atol=1e-5 * float(want.float().abs().max()))


@pytest.mark.usefixtures("needs_gemm")
@pytest.mark.parametrize("weight", ["int4", "int8-half", "int8-g16", "codebook"])
@pytest.mark.parametrize("rows", [5, 17, 32])
def test_prompt_rows_on_tiles_match_reference(weight: str, rows: int) -> None:
    # int4_mm(tiles=True): AMX on the packed codes whatever LOCALLLM_AMX says (groups of 32
    # without a codebook; the others take the AVX-512 path)
    w, planes = weight_of_kind(weight, 192)
    x = (torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)) * 2).bfloat16()
    got = cpu_int4.int4_mm(x, w.packed, w.scales_zeros, 192, planes, w.lut, tiles=True)
    want = cpu_int4.int4_mm_ref(x, w.packed, w.scales_zeros, 192, planes, w.lut)
    bf16_close(got, want, atol=1e-5 * float(want.float().abs().max()))
    # the decode setting is left alone
    assert cpu_native.amx_mode() in (cpu_native.AMX_DEFAULT, "off")


@pytest.mark.usefixtures("needs_gemm")
def test_int4_gemm_rows_do_not_depend_on_the_batch() -> None:
    w = packed(200, 128, 1)  # a padded last tile: 200 of 256 rows written
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    batched = cpu_int4.int4_gemm(x, w.packed, w.scales_zeros, 200, 1)
    assert batched.shape == (40, 200)
    for i in (0, 17, 39):
        assert torch.equal(cpu_int4.int4_gemm(x[i:i + 1], w.packed, w.scales_zeros, 200, 1)[0],
                           batched[i])
    with pytest.raises(ValueError, match="bad operands"):  # 200 rows are no gate/up pair
        cpu_int4.int4_gemm(x, w.packed, w.scales_zeros, 200, 1, gated=True)


def test_a_failed_build_falls_back_with_a_one_line_warning(
        native_isa: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # a compiler that fails: no library, PyTorch ops serve, and the log says why in one line
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\n"
                    "echo 'error: no such instruction' >&2; exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("LOCALLLM_NATIVE_DIR", str(tmp_path / "build"))
    with caplog.at_level("WARNING", logger="localllm"):
        assert cpu_native._library_of.__wrapped__(native_isa) is None
    assert "did not compile (error: no such instruction)" in caplog.text
    assert not list((tmp_path / "build").glob("*.so"))  # nothing half-written is left


IQ4_VALUES = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                           113], dtype=torch.float32)  # IQ4_NL's codebook: integers


def iq4_weight(out: int, inp: int, group: int = 32) -> Int4Weight:
    g = torch.Generator().manual_seed(8)
    codes = torch.randint(0, 16, (out, inp), generator=g, dtype=torch.uint8)
    scales = (torch.rand(out, inp // group, generator=g) * 1e-3 + 1e-4).half()
    return Int4Weight(pack_nibbles(codes), scales, None, group, IQ4_VALUES)


@pytest.mark.parametrize("group", [32, 16])
@pytest.mark.parametrize("rows", [1, 2, 5, 11])  # 11: blocks of 4 rows and a chunk of 8 + 3
def test_int4_mm_with_a_codebook(group: int, rows: int) -> None:
    w = CpuPackedWeight.from_weight(iq4_weight(96, 128, group), torch.bfloat16)
    assert w.lut is not None and w.group_size == group
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(9)).bfloat16()
    y = cpu_int4.int4_mm(x, w.packed, w.scales_zeros, 96, 1, w.lut)
    want = cpu_int4.int4_mm_ref(x, w.packed, w.scales_zeros, 96, 1, w.lut)
    bf16_close(y, want, atol=1e-5 * float(want.float().abs().max()))
    for i in range(rows):  # each row's bits whatever shares its call
        assert torch.equal(cpu_int4.int4_mm(x[i:i + 1], w.packed, w.scales_zeros, 96, 1,
                                            w.lut)[0], y[i])
    wt = cpu_int4.int4_dequant_t(w.packed, w.scales_zeros, 1, w.lut)
    bf16_close(wt, cpu_int4.int4_dequant_t_ref(w.packed, w.scales_zeros, 1, w.lut))


def test_codebook_weight_in_a_linear_layer_and_as_embedding_rows() -> None:
    src = iq4_weight(128, 128)
    lin = Linear(128, 128, False, torch.bfloat16, CpuBackend(), exact_rows=True).pack(
        row_source(src))
    assert isinstance(lin, QuantLinear)
    ref = src.dequantize()
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(10)).bfloat16()
    want = x.float() @ ref.t()
    assert float((lin(x).float() - want).abs().max()) <= 2e-2 * float(want.abs().max())
    ids = torch.tensor([0, 5, 127])
    assert torch.equal(lin.rows_fp32(ids), ref[ids])  # exact: the file's own values


@pytest.mark.parametrize("rows", [1, 5, 40])  # 40: a prompt's dense path
def test_nf4_weight_stays_packed_with_its_fp32_values(rows: int) -> None:
    g = torch.Generator().manual_seed(11)
    codes = torch.randint(0, 16, (96, 128), generator=g, dtype=torch.uint8)
    absmax = torch.rand(96, 4, generator=g) + 0.05  # fp32 scales, as bitsandbytes keeps them
    src = Int4Weight(pack_nibbles(codes), absmax, None, 32, torch.tensor(NF4_CODEBOOK))
    assert cpu_packable(src, torch.bfloat16)
    lin = Linear(128, 96, False, torch.bfloat16, CpuBackend(), exact_rows=True).pack(
        row_source(src))
    assert lin is not None and isinstance(lin.qweight, CpuPackedWeight)
    assert lin.qweight.lut is not None
    assert lin.qweight.lut[16:].any()  # NF4 is not exact in bf16: two terms
    ref = src.dequantize()
    x = torch.randn(rows, 128, generator=g).bfloat16()
    want = x.float() @ ref.t()
    got = lin(x).float()
    w = lin.qweight
    if rows <= dispatch.NATIVE_KERNEL_MAX_ROWS:  # the kernel: the codebook's two terms
        exact = cpu_int4.int4_mm_ref(x, w.packed, w.scales_zeros, 96, 1, w.lut)  # same bf16 scales
        bf16_close(got, exact.float(), atol=1e-5 * float(want.abs().max()))
    # bf16 scales (and for a prompt, bf16 weights): within bf16 rounding of the fp32 product
    assert float((got - want).abs().max()) <= 2e-2 * float(want.abs().max())
    ids = torch.tensor([0, 5, 95])
    assert torch.equal(lin.rows_fp32(ids), ref[ids])  # exact: the source's own values
    lut = cpu_int4.codebook_lut(torch.tensor(NF4_CODEBOOK))
    assert float((cpu_int4.lut_values(lut) - torch.tensor(NF4_CODEBOOK)).abs().max()) < 1e-5


def test_nf4_with_fp16_scales_rounds_like_the_fp32_product() -> None:
    # exact scales (kept alone, fp16) and both codebook terms: the kernel's outputs are the
    # fp32 product rounded to bf16 (fp32 sums aside); the codebook's bf16 rounding alone
    # (one term) misses about a quarter of them
    g = torch.Generator().manual_seed(12)
    codes = torch.randint(0, 16, (96, 512), generator=g, dtype=torch.uint8)
    scales = (torch.rand(96, 16, generator=g) + 0.05).half()
    src = Int4Weight(pack_nibbles(codes), scales, None, 32, torch.tensor(NF4_CODEBOOK))
    w = CpuPackedWeight.from_weight(src, torch.bfloat16)
    assert w.half and w.lut is not None
    x = torch.randn(3, 512, generator=g).bfloat16()
    want = (x.float() @ src.dequantize().t()).bfloat16()
    one_term = torch.cat((w.lut[:16], torch.zeros(16, dtype=torch.bfloat16)))
    two = cpu_int4.int4_mm(x, w.packed, w.scales_zeros, 96, 1, w.lut)
    one = cpu_int4.int4_mm(x, w.packed, w.scales_zeros, 96, 1, one_term)
    assert int((two != want).sum()) <= 3 < 30 <= int((one != want).sum())




def test_each_build_has_its_own_library_file_and_the_switch_forces_one(native_isa: str) -> None:
    import subprocess
    import sys

    libs = {p.name.split("-")[0] for p in cpu_native._cache_dir().glob("localllm_cpu_*.so")}
    assert f"localllm_cpu_{native_isa}" in libs
    code = ("from localllm.kernels import cpu_native as c; "
            "print(c.isa(), c.available(), c.gemm_available(), c.unavailable_reason())")
    for want, expect in ((native_isa, f"{native_isa} True"), ("avx3", "None False False")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, env={**os.environ, "LOCALLLM_NATIVE_ISA": want}).stdout
        assert out.startswith(expect), out
    assert "LOCALLLM_NATIVE_ISA=avx3 is none of avx512, avx2_vnni, avx2" in out
    with pytest.raises(ValueError, match="unknown native build 'avx3'"):
        cpu_native.set_isa("avx3")


def test_the_build_is_picked_by_the_cpus_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    # Alder Lake's flags (AVX2, FMA, F16C and AVX-VNNI, no AVX-512) pick avx2_vnni, Zen 3's
    # (no AVX-VNNI) avx2, Sapphire Rapids' avx512; a forced build the CPU lacks runs nothing
    monkeypatch.setattr(cpu_native, "_active", None)
    monkeypatch.setattr(cpu_native, "_forced", None)
    alder = frozenset({"avx2", "fma", "f16c", "avx_vnni"})
    zen3 = alder - {"avx_vnni"}
    spr = alder | set(cpu_native.ISA_FLAGS["avx512"])
    for flags, want in ((alder, "avx2_vnni"), (zen3, "avx2"), (spr, "avx512")):
        monkeypatch.setattr(cpu_native, "_cpu_flags", lambda f=flags: f)
        assert cpu_native.isa() == want
    monkeypatch.setattr(cpu_native, "_cpu_flags", lambda: zen3)
    monkeypatch.setattr(cpu_native, "_forced", "avx2_vnni")
    assert cpu_native.isa() is None
    assert cpu_native.unavailable_reason() == "the CPU lacks avx_vnni for the avx2_vnni build"


def test_the_amx_switch_names_a_mode_and_warns_of_anything_else(native_isa: str) -> None:
    import subprocess
    import sys

    code = "from localllm.kernels import cpu_native as c; print(c.amx_mode())"
    for setting, mode in (("bf16", "bf16"), ("off", "off"), ("bogus", "int8")):
        cpu_native.set_amx(mode)  # what this process's build and CPU make of the mode
        want = cpu_native.amx_mode()
        cpu_native.set_amx(cpu_native.AMX_DEFAULT)
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, env={**os.environ, "LOCALLLM_NATIVE_ISA": native_isa,
                                              "LOCALLLM_AMX": setting})
        assert run.stdout.strip() == want
        assert (f"LOCALLLM_AMX={setting} is none of" in run.stderr) == (setting == "bogus")
    assert native_isa == "avx512" or want == "off"  # the AVX2 build has no tiles


@pytest.mark.parametrize("name", cpu_native.ISAS)
def test_a_builds_hash_covers_every_header_its_sources_include(name: str) -> None:
    # the library's file name hashes SOURCES and HEADERS: a header missing from HEADERS would
    # leave a stale library in use after that header changed
    import re

    listed = {p.name for p in cpu_native.HEADERS[name]}
    todo = list(cpu_native.SOURCES[name])
    seen: set[str] = set()
    while todo:
        path = todo.pop()
        for inc in re.findall(r'#include "([^"]+)"', path.read_text()):
            assert inc in listed, f"{path.name} includes {inc}, not in HEADERS[{name!r}]"
            if inc not in seen:
                seen.add(inc)
                todo.append(path.with_name(inc))
    assert seen == listed

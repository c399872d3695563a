"""The Triton small ops (kernels/triton_ops.py, kernels/triton_kv_store.py) against their
PyTorch references, on fresh random inputs, with NaN-poisoned outputs (under the interpreter
on CPU tensors where there is no CUDA GPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from localllm.kernels import triton_kv_store as kvs  # noqa: E402
from localllm.kernels import triton_ops as ops  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# one rounding of the result in the dtype (plus fp32 reduction-order noise)
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (2e-3, 1e-5)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEV)


def _nan(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not got.isnan().any()
    rtol, atol = TOL[got.dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,d", [(1, 64), (5, 172), (3, 576)])
def test_rms_norm(dtype: torch.dtype, t: int, d: int) -> None:
    g = _gen(t * 1000 + d)
    wide = _randn(g, t, d + 9, dtype=dtype) * 3
    x = wide[:, 4:4 + d]  # strided rows
    w = _randn(g, d, dtype=dtype)
    out = _nan(t, d, dtype=dtype)
    assert ops.rms_norm(x, w, 1e-5, out=out) is out
    _close(out, ops.rms_norm_ref(x, w, 1e-5))
    _close(ops.rms_norm(x, w, 1e-6), ops.rms_norm_ref(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,d", [(1, 64), (6, 172)])
def test_add_rms_norm(dtype: torch.dtype, t: int, d: int) -> None:
    g = _gen(t * 1000 + d + 1)
    x = _randn(g, t, d, dtype=dtype)
    res_wide = _randn(g, t, d + 3, dtype=dtype)
    residual = res_wide[:, :d]  # strided rows
    w = _randn(g, d, dtype=dtype)
    want_res = residual.clone()
    want_out, _ = ops.add_rms_norm_ref(x, want_res, w, 1e-5)
    tail = res_wide[:, d:].clone()
    out = _nan(t, d, dtype=dtype)
    got_out, got_res = ops.add_rms_norm(x, residual, w, 1e-5, out=out)
    assert got_out is out and got_res is residual
    # the add is one fp32 sum rounded once: bit-identical to the reference
    torch.testing.assert_close(residual, want_res, rtol=0, atol=0)
    assert torch.equal(res_wide[:, d:], tail)
    _close(out, want_out)
    # it normalizes the rounded sum, as rms_norm of the new residual does
    assert torch.equal(out, ops.rms_norm(residual, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,i", [(1, 86), (4, 300), (2, 1100)])
def test_silu_mul(dtype: torch.dtype, t: int, i: int) -> None:
    g = _gen(t * 10000 + i)
    wide = _randn(g, t, 2 * i + 5, dtype=dtype) * 4
    gate_up = wide[:, 5:]  # strided rows
    out = _nan(t, i, dtype=dtype)
    assert ops.silu_mul(gate_up, out=out) is out
    _close(out, ops.silu_mul_ref(gate_up))
    _close(ops.silu_mul(gate_up), ops.silu_mul_ref(gate_up))


def _tables(num_pos: int, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 10000.0 ** (-torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    ang = torch.arange(num_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return ang.cos().to(DEV), ang.sin().to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [False, True])
# tile 64 splits the 24 heads of the last case into 6 programs of 4 heads per row
@pytest.mark.parametrize("t,nh,nkv,hd,rd,tile", [(1, 4, 2, 64, 64, 4096), (5, 3, 1, 48, 32, 4096),
                                                 (3, 16, 8, 32, 20, 64)])
def test_rope_fused_qkv(dtype: torch.dtype, neox: bool, t: int, nh: int, nkv: int, hd: int,
                        rd: int, tile: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "ROPE_TILE", tile)
    g = _gen(t * 100 + nh * 10 + hd + rd + neox)
    heads = nh + nkv
    qkv = _randn(g, t, (nh + 2 * nkv) * hd + 7, dtype=dtype)  # q | k | v | padding
    x = qkv[:, :(nh + 2 * nkv) * hd]  # strided rows
    cos, sin = _tables(50, rd)
    positions = torch.randint(0, 50, (t,), generator=g).to(DEV)
    want = qkv.clone()
    ops.rope_ref(want[:, :(nh + 2 * nkv) * hd], heads, hd, rd, cos, sin, positions, neox)
    before = qkv.clone()
    assert ops.rope_(x, heads, hd, rd, cos, sin, positions, neox) is x
    # v heads, dims >= rope_dim of each head and the padding stay bit-identical
    cols = torch.arange(qkv.shape[1], device=DEV)
    rotated = (cols < heads * hd) & (cols % hd < rd)
    assert torch.equal(qkv[:, ~rotated], before[:, ~rotated])
    _close(qkv[:, rotated], want[:, rotated])
    assert not torch.equal(qkv[:, rotated], before[:, rotated])


def test_rope_checks() -> None:
    g = _gen(3)
    x = _randn(g, 2, 64)
    cos, sin = _tables(8, 16)
    if DEV == "cpu":
        with pytest.raises(ValueError, match="outside"):
            ops.rope_(x, 2, 32, 16, cos, sin, torch.tensor([0, 8]), False)
    with pytest.raises(ValueError, match="fit"):
        ops.rope_(x, 3, 32, 16, cos, sin, torch.tensor([0, 1], device=DEV), False)
    with pytest.raises(ValueError, match="fit"):
        ops.rope_(x, 2, 32, 15, cos, sin, torch.tensor([0, 1], device=DEV), False)
    with pytest.raises(ValueError, match="cos"):
        ops.rope_(x, 2, 32, 16, cos.double(), sin, torch.tensor([0, 1], device=DEV), False)


def test_norm_and_silu_checks() -> None:
    x = torch.zeros(3, 10, device=DEV)
    w = torch.ones(10, device=DEV)
    with pytest.raises(ValueError, match="out"):
        ops.rms_norm(x, w, 1e-5, out=torch.empty(3, 10, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(x, torch.ones(9, device=DEV), 1e-5)
    with pytest.raises(ValueError, match="unit"):
        ops.rms_norm(x.t(), torch.ones(3, device=DEV), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        ops.add_rms_norm(x, x.bfloat16(), w, 1e-5)
    with pytest.raises(ValueError, match="odd"):
        ops.silu_mul(torch.zeros(2, 7, device=DEV))


@pytest.mark.parametrize("src,pool", [(torch.bfloat16, torch.bfloat16),
                                      (torch.float32, torch.float32),
                                      (torch.float16, torch.float16),
                                      (torch.bfloat16, torch.float32),
                                      (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
# tile 32 puts each of the 3 heads of the last case in its own program
@pytest.mark.parametrize("nh,nkv,hd,tile", [(4, 2, 64, 4096), (3, 1, 24, 4096), (6, 3, 24, 32)])
def test_kv_store(src: torch.dtype, pool: torch.dtype, slot_dtype: torch.dtype, nh: int,
                  nkv: int, hd: int, tile: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvs, "TILE", tile)
    g = _gen(nh * 100 + hd + (slot_dtype == torch.int32))
    num_blocks, bs = 6, 4
    slots = torch.tensor([13, -1, 2, 22, -1, 7, 0], dtype=slot_dtype)  # holes, padding
    t = slots.numel()
    qkv = _randn(g, t, (nh + 2 * nkv) * hd + 5, dtype=src)  # q | k | v | padding
    k = qkv[:, nh * hd:(nh + nkv) * hd].unflatten(1, (nkv, hd))
    v = qkv[:, (nh + nkv) * hd:(nh + 2 * nkv) * hd].unflatten(1, (nkv, hd))
    k_pool, v_pool = _nan(num_blocks, bs, nkv, hd, dtype=pool), _nan(num_blocks, bs, nkv, hd,
                                                                      dtype=pool)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    ops.kv_store_ref(k, v, slots.to(DEV), want_k, want_v)
    ops.kv_store(k, v, slots.to(DEV), k_pool, v_pool)
    written = torch.zeros(num_blocks * bs, dtype=torch.bool)
    written[slots[slots >= 0].long()] = True
    for got, want in ((k_pool, want_k), (v_pool, want_v)):
        flat = got.view(num_blocks * bs, -1).cpu()
        assert not flat[written].isnan().any()
        assert flat[~written].isnan().all()
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_kv_store_checks() -> None:
    k = torch.zeros(2, 2, 8, device=DEV)
    pool = torch.zeros(3, 4, 2, 8, device=DEV)
    if DEV == "cpu":
        with pytest.raises(ValueError, match="outside"):
            ops.kv_store(k, k, torch.tensor([0, 12], device=DEV), pool, pool.clone())
        with pytest.raises(ValueError, match="outside"):
            ops.kv_store(k, k, torch.tensor([0, -2], device=DEV), pool, pool.clone())
    with pytest.raises(ValueError, match="k_pool"):
        ops.kv_store(k, k, torch.tensor([0, 1], device=DEV), pool[:, :, :1], pool[:, :, :1])
    with pytest.raises(ValueError, match="slot_mapping"):
        ops.kv_store(k, k, torch.tensor([0.0, 1.0], device=DEV), pool, pool.clone())
    with pytest.raises(ValueError, match="unit stride"):
        ops.kv_store(k.transpose(1, 2), k.transpose(1, 2), torch.tensor([0, 1], device=DEV),
                     pool, pool.clone())


def test_kv_store_specials() -> None:
    """inf, NaN, overflow and subnormals through the fp32 -> bf16 conversion, as torch does."""
    vals = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.4e38, -1e-39, 1e-45,
                         1.00390625, 1.01171875, -0.0, 2.0 ** -130])
    k = vals.repeat(2).view(2, 1, 10).to(DEV)
    pool = _nan(2, 2, 1, 10, dtype=torch.bfloat16)
    v_pool = pool.clone()
    ops.kv_store(k, k, torch.tensor([3, 0], device=DEV), pool, v_pool)
    want = vals.to(torch.bfloat16).to(DEV)
    for p in (pool, v_pool):
        for slot in (0, 3):
            got = p.view(4, 10)[slot]
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got.view(torch.int16)[~want.isnan()],
                               want.view(torch.int16)[~want.isnan()])


# compiles the GPU path (EMULATE_BF16 off) of every kernel; run in a fresh process because
# triton.jit under TRITON_INTERPRET=1 gives interpreted functions, which cannot be compiled
_COMPILE_SM90 = """
import sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as e:
    sys.exit(f"SKIP no Triton ahead-of-time compiler: {e}")
from localllm.kernels import triton_kv_store as kvs, triton_ops as ops
i32, bf16 = "i32", "*bf16"
kernels = [
    (ops._rms_norm_kernel, dict(x_ptr=bf16, x_stride=i32, r_ptr=bf16, r_stride=i32, w_ptr=bf16,
                                out_ptr=bf16, out_stride=i32, D=i32, eps="fp32"),
     dict(ADD=True, BLOCK_D=1024)),
    (ops._silu_mul_kernel, dict(gu_ptr=bf16, gu_stride=i32, out_ptr=bf16, out_stride=i32, I=i32),
     dict(BLOCK=1024)),
    (ops._rope_kernel, dict(x_ptr=bf16, x_stride=i32, cos_ptr="*fp32", sin_ptr="*fp32",
                            pos_ptr="*i64", num_pos=i32, heads=i32, head_dim=i32, half=i32),
     dict(NEOX=True, BLOCK_H=16, BLOCK_R=64)),
    (kvs._kv_store_kernel, dict(k_ptr="*fp32", k_stride_t=i32, k_stride_h=i32, v_ptr="*fp32",
                                v_stride_t=i32, v_stride_h=i32, slot_ptr="*i32", kp_ptr=bf16,
                                vp_ptr=bf16, n_slots=i32, KVH=i32, D=i32),
     dict(BLOCK_H=8, BLOCK_D=128)),
]
for fn, sig, const in kernels:
    const = {**const, "EMULATE_BF16": False}
    src = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(const, "constexpr")},
                    constexprs=const)
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    except RuntimeError as e:
        sys.exit(f"SKIP cannot compile for sm_90 here: {e}")
    assert "cvt.rn.bf16.f32" in compiled.asm["ptx"], fn
print("OK")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the tests above compile on this GPU")
def test_kernels_compile_for_sm90() -> None:
    """Without a GPU, the kernels still compile for Hopper (sm_90) with Triton's own ptxas."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True,
                       text=True, timeout=300)
    if r.returncode and r.stderr.startswith("SKIP"):
        pytest.skip(r.stderr.strip())
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stderr[-3000:]

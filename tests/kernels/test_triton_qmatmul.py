"""The int4 / int8 Triton matmul (kernels/triton_qmatmul.py) against its PyTorch reference and
the runtime formats' `dequantize()`, for every weight kind, on fresh random weights, with
NaN-poisoned outputs (under the interpreter on CPU tensors where there is no CUDA GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

pytest.importorskip("triton")

from localllm.kernels import triton_qmatmul as tq  # noqa: E402
from localllm.quant.formats import (  # noqa: E402
    IQ4_NL_CODEBOOK,
    NF4_CODEBOOK,
    Int4Weight,
    Int8Weight,
    pack_nibbles,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
Weight = Int4Weight | Int8Weight


def _int4(out: int, inp: int, group: int, g: torch.Generator, offsets: bool,
          codebook: tuple[float, ...] | None, sdtype: torch.dtype) -> Int4Weight:
    codes = torch.randint(0, 16, (out, inp), generator=g, dtype=torch.uint8)
    scales = (torch.rand(out, inp // group, generator=g) * 0.02 + 0.001).to(sdtype)
    offs = (torch.randn(out, inp // group, generator=g) * 0.05).to(sdtype) if offsets else None
    cb = None if codebook is None else torch.tensor(codebook, dtype=torch.float32)
    return Int4Weight(pack_nibbles(codes), scales, offs, group, cb)


def _int8(out: int, inp: int, group: int, g: torch.Generator, offsets: bool,
          sdtype: torch.dtype) -> Int8Weight:
    q = torch.randint(-128, 128, (out, inp), generator=g, dtype=torch.int8)
    scales = (torch.rand(out, inp // group, generator=g) * 0.002 + 1e-4).to(sdtype)
    offs = (torch.randn(out, inp // group, generator=g) * 0.05).to(sdtype) if offsets else None
    return Int8Weight(q, scales, offs, group)


F16, F32 = torch.float16, torch.float32
# kind -> (out, in, group, generator) -> weight; "per channel" ignores the group size
KINDS: dict[str, Callable[[int, int, int, torch.Generator], Weight]] = {
    "int4 offsets (q4_1)": lambda o, i, gs, g: _int4(o, i, gs, g, True, None, F16),
    "int4 offsets fp32 (q4_k)": lambda o, i, gs, g: _int4(o, i, gs, g, True, None, F32),
    "int4 q-8 (q4_0)": lambda o, i, gs, g: _int4(o, i, gs, g, False, None, F16),
    "int4 nf4": lambda o, i, gs, g: _int4(o, i, gs, g, False, NF4_CODEBOOK, F32),
    "int4 iq4_nl": lambda o, i, gs, g: _int4(o, i, gs, g, False, IQ4_NL_CODEBOOK, F16),
    "int8 (q8_0)": lambda o, i, gs, g: _int8(o, i, gs, g, False, F16),
    "int8 offsets fp32": lambda o, i, gs, g: _int8(o, i, gs, g, True, F32),
    "int8 per channel": lambda o, i, gs, g: _int8(o, i, i, g, False, F32),
}
# (kind, group size, out, in): in a multiple of the group, not always of the 32-column chunk
SHAPES = [(kind, gs, 200 if gs == 16 else 96, 80 if gs == 16 else 96)
          for kind in KINDS for gs in (16, 32) if kind != "int8 per channel" or gs == 32]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weight(kind: str, out: int, inp: int, gs: int, seed: int) -> tuple[Weight, tq.QMatrix]:
    w = KINDS[kind](out, inp, gs, _gen(seed)).to(DEV)
    codebook = w.codebook if isinstance(w, Int4Weight) else None
    bits = 4 if isinstance(w, Int4Weight) else 8
    return w, tq.pack(w.qweight, w.scales, w.offsets, codebook, bits, w.group_size)


def _x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    wide = torch.randn(m, k + 24, generator=_gen(seed)).to(device=DEV, dtype=dtype)
    return wide[:, 8:8 + k]  # strided rows


def _nan(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not got.isnan().any()
    rel = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[got.dtype]
    err = float((got.float() - want.float()).abs().max())
    assert err <= rel * float(want.float().abs().max()), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16, 17, 40])  # GEMV (one row, dot tile), GEMM
@pytest.mark.parametrize("kind,gs,n,k", SHAPES)
def test_qmatmul_matches_reference(kind: str, gs: int, n: int, k: int, m: int,
                                   dtype: torch.dtype) -> None:
    w, qm = _weight(kind, n, k, gs, seed=m + gs)
    x = _x(m, k, dtype, seed=m)
    with_bias = (m in (1, 16, 40)) == (dtype == torch.float32)  # each m with and without
    bias = torch.randn(n, generator=_gen(7)).to(DEV, dtype) if with_bias else None
    out = _nan(m, n, dtype=dtype)
    assert tq.qmatmul(x, qm, bias, out=out) is out
    _close(out, tq.qmatmul_ref(x, qm, bias))
    want = x.float() @ w.dequantize().t() + (0 if bias is None else bias.float())
    _close(out, want.to(dtype))


@pytest.mark.parametrize("split", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("kind", ["int4 offsets (q4_1)", "int4 nf4", "int8 per channel"])
def test_split_k_sums_every_chunk(kind: str, m: int, split: int) -> None:
    _, qm = _weight(kind, 72, 160, 32, seed=split)  # 5 chunks of 32 columns
    x = _x(m, 160, torch.float32, seed=split + 10)
    bias = torch.randn(72, generator=_gen(8)).to(DEV)
    out = _nan(m, 72, dtype=torch.float32)
    tq.qmatmul(x, qm, bias, out=out, split_k=split)
    _close(out, tq.qmatmul_ref(x, qm, bias))
    _close(tq.qmatmul(x, qm, split_k=split), tq.qmatmul_ref(x, qm))


@pytest.mark.parametrize("kind", ["int4 offsets (q4_1)", "int8 offsets fp32"])
def test_gemm_several_row_tiles(kind: str) -> None:
    _, qm = _weight(kind, 136, 64, 16, seed=3)
    x = _x(150, 64, torch.bfloat16, seed=4)
    _close(tq.qmatmul(x, qm), tq.qmatmul_ref(x, qm))


@pytest.mark.parametrize("m", [1, 4, 20])
def test_fp16_activations(m: int) -> None:
    _, qm = _weight("int4 iq4_nl", 96, 64, 32, seed=m)
    x = _x(m, 64, torch.float16, seed=m)
    bias = torch.randn(96, generator=_gen(9)).to(DEV, torch.float16)
    _close(tq.qmatmul(x, qm, bias), tq.qmatmul_ref(x, qm, bias))


@pytest.mark.parametrize("kind,gs,n,k", SHAPES)
def test_dequantize_is_the_formats_dequantize_exactly(kind: str, gs: int, n: int,
                                                      k: int) -> None:
    w, qm = _weight(kind, n, k, gs, seed=gs)
    dense = w.dequantize()
    assert torch.equal(tq.dequantize(qm), dense)
    assert torch.equal(tq.dequantize_ref(qm), dense)
    ids = torch.tensor([5, 0, n - 1, 5, 17, 3, 3, 40, 2, 1, 0, 9, 11, 60, 13, 8, 7, 5, 19],
                       device=DEV)
    out = _nan(len(ids), k, dtype=torch.float32)
    assert tq.dequantize_rows(qm, ids, out=out) is out
    assert torch.equal(out, dense[ids])
    one = torch.tensor([n - 2], dtype=torch.int32, device=DEV)
    assert torch.equal(tq.dequantize_rows(qm, one), dense[one.long()])


def test_rows_outside_the_weight_are_nan() -> None:
    w, qm = _weight("int8 (q8_0)", 40, 64, 32, seed=1)
    rows = tq.dequantize_rows(qm, torch.tensor([3, 40, -1], device=DEV))
    assert torch.equal(rows[0], w.dequantize()[3]) and rows[1:].isnan().all()


@pytest.mark.parametrize("kind", ["int4 offsets (q4_1)", "int4 nf4", "int8 per channel"])
@pytest.mark.parametrize("m", [1, 17])
def test_stack_equals_the_parts(kind: str, m: int) -> None:
    parts = [_weight(kind, n, 96, 32, seed=n) for n in (64, 40, 24)]
    stacked = tq.stack([p[1] for p in parts])
    assert stacked is not None and stacked.out_features == 128
    dense = torch.cat([p[0].dequantize() for p in parts])
    assert torch.equal(tq.dequantize(stacked), dense)
    x = _x(m, 96, torch.float32, seed=m)
    y = tq.qmatmul(x, stacked)
    _close(y, torch.cat([tq.qmatmul(x, p[1]) for p in parts], dim=1))
    _close(y, x @ dense.t())


def test_stack_mixed_scale_dtypes_and_refusals() -> None:
    a = _weight("int4 offsets (q4_1)", 32, 64, 32, seed=1)
    b = _weight("int4 offsets fp32 (q4_k)", 16, 64, 32, seed=2)
    mixed = tq.stack([a[1], b[1]])
    assert mixed is not None and mixed.scales.dtype == torch.float32
    assert torch.equal(tq.dequantize(mixed), torch.cat([a[0].dequantize(), b[0].dequantize()]))
    others = [_weight("int4 q-8 (q4_0)", 32, 64, 32, 3), _weight("int4 offsets (q4_1)", 32, 64,
                                                                 16, 4),
              _weight("int4 offsets (q4_1)", 32, 96, 32, 5), _weight("int8 (q8_0)", 32, 64, 32, 6)]
    for other in others:
        assert tq.stack([a[1], other[1]]) is None
    nf4, iq4 = _weight("int4 nf4", 32, 64, 32, 7), _weight("int4 iq4_nl", 32, 64, 32, 8)
    assert tq.stack([nf4[1], iq4[1]]) is None
    assert tq.stack([]) is None


def test_nbytes_counts_the_packed_tensors() -> None:
    w, qm = _weight("int4 offsets (q4_1)", 64, 128, 32, seed=1)
    assert qm.nbytes == w.nbytes  # 128 columns: no chunk padding


def test_bad_arguments_raise() -> None:
    w, qm = _weight("int4 offsets (q4_1)", 32, 64, 32, seed=1)
    x = _x(2, 64, torch.float32, seed=1)
    with pytest.raises(ValueError, match="columns"):
        tq.qmatmul(x[:, :32], qm)
    with pytest.raises(ValueError, match="unit column stride"):
        tq.qmatmul(torch.randn(64, 2, device=DEV).t(), qm)
    with pytest.raises(ValueError, match="float16"):
        tq.qmatmul(x.to(torch.int32), qm)
    with pytest.raises(ValueError, match="bias"):
        tq.qmatmul(x, qm, torch.zeros(31, device=DEV))
    with pytest.raises(ValueError, match="expected"):
        tq.qmatmul(x, qm, out=torch.empty(2, 32, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="group_size"):
        tq.pack(w.qweight, w.scales, w.offsets, None, 4, 64)
    with pytest.raises(ValueError, match="scales"):
        tq.pack(w.qweight, w.scales[:, :1], None, None, 4, 32)
    with pytest.raises(ValueError, match="ids"):
        tq.dequantize_rows(qm, torch.tensor([0.0], device=DEV))


@pytest.mark.parametrize("m,split", [(1, 1), (1, 2), (17, 1)])
def test_bf16_outputs_round_to_nearest_even(m: int, split: int) -> None:
    # integer x and weights: every fp32 sum is exact, so only the final rounding is seen
    g = _gen(m)
    q = torch.randint(-128, 128, (64, 96), generator=g, dtype=torch.int8)
    w = Int8Weight(q, torch.ones(64, 1), None, 96).to(DEV)
    qm = tq.pack(w.qweight, w.scales, None, None, 8, 96)
    x = torch.randint(-8, 9, (m, 96), generator=g).to(DEV, torch.bfloat16)
    exact = x.float() @ w.dequantize().t()
    assert torch.equal(tq.qmatmul(x, qm, split_k=split), exact.to(torch.bfloat16))


# Compiles (PTX, then a cubin with the ptxas bundled in triton) every qmatmul tile config, the
# split-K reduction and the row gather for an sm_90 GPU, without the interpreter and without
# needing a GPU: what the interpreter accepts but the compiler would not fails here.
COMPILE_SM90 = r"""
import itertools
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from localllm.kernels import triton_qmatmul as tq, triton_qmatmul_kernels as K

def build(fn, types, consts, **opts):
    sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
    div = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
           if a.endswith("_ptr") or a in ("N", "K", "stride_xm", "stride_om")}
    key = {(fn.arg_names.index(a),): v for a, v in consts.items()}
    c = triton.compile(ASTSource(fn, sig, key, div), target=GPUTarget("cuda", 90, 32),
                       options=opts)
    assert c.asm["cubin"]

for m, bits, x in itertools.product((1, 8, 40, 200), (4, 8), ("bf16", "fp32")):
    bm, bn, dot, warps = tq._tiles(m)
    types = dict(x_ptr="*" + x, q_ptr="*u8" if bits == 4 else "*i8", s_ptr="*fp16",
                 o_ptr="*fp16", cb_ptr="*fp32", bias_ptr="*" + x, out_ptr="*" + x)
    build(K.qmatmul_kernel, types, dict(
        BITS=bits, GROUP=32 if m != 8 else 0, HAS_OFFSETS=bits == 8, HAS_CODEBOOK=bits == 4,
        HAS_BIAS=True, PARTIAL=m == 1, USE_DOT=dot, DOT_FP32=x == "fp32", EMULATE_BF16=False,
        BLOCK_M=bm, BLOCK_N=bn), num_warps=warps, num_stages=3)
build(K.splitk_reduce_kernel, dict(ws_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16"),
      dict(HAS_BIAS=True, EMULATE_BF16=False, BLOCK_N=1024), num_warps=4)
for bits in (4, 8):
    build(K.dequantize_rows_kernel, dict(ids_ptr="*i64", q_ptr="*u8" if bits == 4 else "*i8",
          s_ptr="*fp32", o_ptr="*fp32", cb_ptr="*fp32", out_ptr="*fp32"),
          dict(BITS=bits, GROUP=16, HAS_OFFSETS=True, HAS_CODEBOOK=False, BLOCK_R=16,
               BLOCK_K=256), num_warps=4, enable_fp_fusion=False)
print("ok")
"""


def test_kernels_compile_for_sm90() -> None:
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences triton 3.9's notice (the 3.6 default)
    r = subprocess.run([sys.executable, "-c", COMPILE_SM90], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-4000:]

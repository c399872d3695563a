"""The LM head's native paths: `int8_logits`, a Q8_0 head's fp32 logits from 16-bit x
(kernels/cpu_int8_logits.c), against its float64 reference and the exact fp32 product;
`int4_refine_half`, the best logits recomputed from the exact rows in one call; and the head's
choice of path."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from localllm.backends.cpu.weights import CpuPackedWeight
from localllm.kernels import cpu_int4, cpu_native

sys.path.insert(0, str(Path(__file__).parent))
from test_linear import random_int4, random_int8  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="native CPU kernels need "
                                "x86-64 AVX2 + FMA + F16C (or AVX-512) and a C compiler")


@pytest.fixture(params=cpu_native.isas_available() or ("none",))
def each_isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each build of the kernels this CPU runs (AVX-512 and AVX2 on the bigger CPUs)."""
    if request.param == "none":
        pytest.skip("no native build runs here")
    assert cpu_native.set_isa(str(request.param)) == request.param
    yield str(request.param)
    cpu_native.set_isa(None)


def q8_head(out: int, inp: int, seed: int = 0) -> tuple[CpuPackedWeight, torch.Tensor]:
    """A Q8_0-like weight (fp16 scales, no offsets) packed, and its fp32 values [out, inp]."""
    src = random_int8(out, inp, offsets=False, seed=seed)
    return CpuPackedWeight.from_weight(src, torch.bfloat16), src.dequantize().float()


def hidden(rows: int, inp: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(seed)) * 2
    x[:, :32] *= 40.0  # one group far larger than the rest
    x[0, 32:64] = 0.0  # a group of zeros (scale 0)
    return x.bfloat16()


@pytest.mark.parametrize("out", [64, 96, 200])  # 96, 200: the last tile is padded
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17])  # 1: two tiles at a time; 17: 8 + 8 + 1
@pytest.mark.parametrize("inp", [64, 576])
def test_int8_logits_match_reference_and_the_exact_product(each_isa: str, out: int, rows: int,
                                                          inp: int) -> None:
    w, dense = q8_head(out, inp, seed=out + inp)
    x = hidden(rows, inp, seed=rows)
    got = cpu_int4.int8_logits(x, w.packed, w.scales_zeros, out)
    assert got.dtype == torch.float32 and got.shape == (rows, out)
    ref = cpu_int4.int8_logits_ref(x, w.packed, w.scales_zeros, out)
    # the same integer sums; the kernel's fp32 sum over groups rounds
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()))
    # 16-bit x: within 2^-15 of each group's largest |x|, so of sum |w| * max |x| per group
    exact = x.float() @ dense.t()
    bound = (dense.abs().view(out, -1, 32).sum(-1)
             @ x.float().abs().view(rows, -1, 32).amax(-1).t()).t() * 2.0**-15
    assert ((got - exact).abs() <= bound + 1e-6).all()
    # far closer than a bf16 rounding of the logits (what int4_mm returns)
    assert (got - exact).abs().max() < (exact.bfloat16().float() - exact).abs().max()


def test_a_row_gets_the_same_logits_alone_and_in_any_batch(each_isa: str) -> None:
    w, _ = q8_head(200, 576, seed=1)
    x = hidden(19, 576, seed=2)
    whole = cpu_int4.int8_logits(x, w.packed, w.scales_zeros, 200)
    alone = torch.cat([cpu_int4.int8_logits(x[i:i + 1], w.packed, w.scales_zeros, 200)
                       for i in range(19)])
    threes = torch.cat([cpu_int4.int8_logits(x[i:i + 3], w.packed, w.scales_zeros, 200)
                        for i in range(0, 19, 3)])
    # 19 = 8 + 8 + 3: rows from decoded words (4-8 at a time) beside pairs and single rows
    fives = torch.cat([cpu_int4.int8_logits(x[i:i + 5], w.packed, w.scales_zeros, 200)
                       for i in range(0, 19, 5)])
    assert torch.equal(whole, alone) and torch.equal(whole, threes) and torch.equal(whole, fives)


def test_the_q8_head_takes_int8_logits_and_other_weights_their_matmul(each_isa: str) -> None:
    w, _ = q8_head(128, 64)
    x = hidden(3, 64)
    assert torch.equal(w.logits(x), cpu_int4.int8_logits(x, w.packed, w.scales_zeros, 128))
    assert w.fine_logits  # so compute_logits refines fewer of them
    q4 = CpuPackedWeight.from_weight(random_int4(128, 64, offsets=False), torch.bfloat16)
    assert torch.equal(q4.logits(x), q4.matmul(x).float())  # one plane: int4_mm
    assert not q4.fine_logits
    with pytest.raises(ValueError, match="fp16 scales"):
        offsets = CpuPackedWeight.from_weight(random_int8(128, 64, offsets=True),
                                              torch.bfloat16)
        cpu_int4.int8_logits(x, offsets.packed, offsets.scales_zeros, 128)


def test_both_builds_give_the_same_logits() -> None:
    if not all(cpu_native.isa_supported(n) for n in ("avx512", "avx2")):
        pytest.skip("needs a CPU that runs both builds (AVX-512 BF16/VBMI/VNNI)")
    w, _ = q8_head(200, 576, seed=4)
    x = hidden(11, 576, seed=5)
    got = {}
    try:
        for isa in [n for n in cpu_native.ISAS if cpu_native.isa_supported(n)]:
            assert cpu_native.set_isa(isa) == isa
            got[isa] = cpu_int4.int8_logits(x, w.packed, w.scales_zeros, 200)
    finally:
        cpu_native.set_isa(None)
    for isa, logits in got.items():
        assert torch.equal(logits, got["avx2"]), isa


@pytest.mark.parametrize("planes", [1, 2])  # Q4_0-like, Q8_0-like
@pytest.mark.parametrize("rows, k", [(1, 16), (3, 1), (9, 16), (2, 64)])  # 9 x 16: threads
def test_int4_refine_half_matches_reference(each_isa: str, planes: int, rows: int,
                                            k: int) -> None:
    src = (random_int4 if planes == 1 else random_int8)(200, 96, offsets=False, seed=planes)
    w = CpuPackedWeight.from_weight(src, torch.bfloat16)
    x = hidden(rows, 96, seed=k)
    logits = torch.randn(rows, 200, generator=torch.Generator().manual_seed(rows))
    logits[:, 50:60] = logits.max()  # ties: the lower ids win
    want, got = logits.clone(), logits.clone()
    cpu_int4.int4_refine_half_ref(want, x, w.packed, w.scales_zeros, planes, k)
    cpu_int4.int4_refine_half(got, x, w.packed, w.scales_zeros, planes, k)
    chosen = want != logits  # the reference's candidates (a random logit is never exact)
    assert int(chosen.sum()) == rows * k
    assert torch.equal(got[~chosen], logits[~chosen])  # the same candidates, the rest untouched
    # fp32 sums in another fixed order: within a few roundings of sum |w x|
    dense = src.dequantize().float()
    scale = float((x.float().abs() @ dense.abs().t()).max())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * scale)
    exact = (x.double() @ dense.double().t()).float()
    torch.testing.assert_close(got[chosen], exact[chosen], rtol=0, atol=1e-6 * scale)
    with pytest.raises(ValueError, match="bad operands"):
        cpu_int4.int4_refine_half(got, x, w.packed, w.scales_zeros, planes, 65)


def test_a_head_refines_in_one_call_only_without_bias_and_with_fp16_scales(
        each_isa: str) -> None:
    from localllm.backends.cpu import CpuBackend
    from localllm.layers.linear import LinearBase, QuantLinear

    backend = CpuBackend()
    w, _ = q8_head(128, 64)
    x = hidden(4, 64)
    head = QuantLinear(w, None, torch.bfloat16, backend)
    logits = head.logits(x)
    native, python = logits.clone(), logits.clone()
    head.refine_logits(native, x, backend.top_k, 16)
    LinearBase.refine_logits(head, python, x, backend.top_k, 16)  # rows_fp32 + bmm
    torch.testing.assert_close(native, python, rtol=1e-6, atol=1e-6)
    assert int((native != logits).sum()) == 4 * 16
    pairs = CpuPackedWeight.from_weight(random_int8(128, 64, offsets=True), torch.bfloat16)
    assert not pairs.refine_logits(logits.clone(), x, 16)  # bf16 (scale, zero) pairs

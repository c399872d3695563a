"""Linear layers holding int4 weights: both CPU paths against the dequantized reference."""

from __future__ import annotations

import pytest
import torch

from localllm.layers.linear import INT4_KERNEL_MAX_ROWS, Linear, quantized_cpu_supported
from localllm.quant.formats import Int4Weight, pack_nibbles


def random_int4(out: int, inp: int, offsets: bool, seed: int = 0) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, inp), generator=g, dtype=torch.uint8)
    scales = (torch.rand(out, inp // 32, generator=g) * 0.02 + 0.001).half()
    offs = (torch.randn(out, inp // 32, generator=g) * 0.05).half() if offsets else None
    return Int4Weight(pack_nibbles(codes), scales, offs, 32)


@pytest.mark.parametrize("offsets", [True, False])  # Q4_1-like, Q4_0-like
@pytest.mark.parametrize("rows", [1, 3, INT4_KERNEL_MAX_ROWS, INT4_KERNEL_MAX_ROWS + 1, 200])
def test_int4_linear_matches_reference(offsets: bool, rows: int) -> None:
    w = random_int4(96, 128, offsets)
    lin = Linear(128, 96, bias=True, dtype=torch.bfloat16)
    lin.bias.data.normal_()  # type: ignore[union-attr]
    lin.set_quantized(w)
    assert lin.quantized and lin.weight is None
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    ref = x.float() @ w.dequantize().t() + lin.bias.float()  # type: ignore[union-attr]
    y = lin(x).float()
    # bf16 activations, scales and zero points: relative error of a few 1e-3
    assert (y - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_dense_weight_of_quantized_linear_is_the_dequantized_weight() -> None:
    w = random_int4(64, 64, offsets=True)
    lin = Linear(64, 64, bias=False, dtype=torch.bfloat16)
    lin.set_quantized(w)
    torch.testing.assert_close(lin.dense_weight().float(), w.dequantize(), rtol=1e-2, atol=1e-3)


def test_unsupported_formats_are_refused() -> None:
    w = random_int4(64, 64, offsets=True)
    assert not quantized_cpu_supported(w, torch.float32)  # fp32 stays dense and exact
    lin = Linear(64, 64, bias=False, dtype=torch.float32)
    with pytest.raises(ValueError, match="no quantized CPU path"):
        lin.set_quantized(w)
    g16 = Int4Weight(w.qweight, w.scales.repeat_interleave(2, 1), None, 16)
    assert not quantized_cpu_supported(g16, torch.bfloat16)

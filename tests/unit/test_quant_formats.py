"""Runtime weight formats and GGUF repacking, checked against `gguf.quants.dequantize`."""

from __future__ import annotations

import warnings

import gguf
import gguf.quants as gq
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings
from hypothesis import strategies as st

from localllm.quant.formats import (
    NF4_CODEBOOK,
    Int4Weight,
    Int8Weight,
    pack_nibbles,
    unpack_nibbles,
)
from localllm.quant.repack import _REPACKERS, DENSE_TYPES, INT4_TYPES, INT8_TYPES, repack

INT4 = [T.Q4_0, T.Q4_1, T.Q2_K, T.Q3_K, T.Q4_K, T.IQ4_NL, T.IQ4_XS]
INT8 = [T.Q8_0, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K]
DENSE = [T.F32, T.F16, T.BF16]
# NOTE: these keep GGUF's fp16 scales as they are; K-quants multiply two scales (in fp32).
UNCOMBINED = {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL, T.F32, T.F16, T.BF16}
# byte offsets of the fp16 scale fields inside one block, for blocks made of random bytes
F16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
              T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2),
              T.Q6_K: (208,), T.IQ4_NL: (0,), T.IQ4_XS: (0,)}
ROWS, COLS = 12, 768


def _random_raw(qtype: T, rng: np.random.Generator) -> np.ndarray:
    """Random bytes for every block, with finite fp16 scales of varied magnitude and sign."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    nb = COLS // block
    raw = rng.integers(0, 256, (ROWS, nb, type_size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        mag = 10.0 ** rng.uniform(-6, 1, (ROWS, nb))
        val = (rng.choice([-1.0, 1.0], (ROWS, nb)) * mag).astype(np.float16)
        raw[:, :, off:off + 2] = val[..., None].view(np.uint8)
    return raw.reshape(ROWS, nb * type_size)


def _source(qtype: T, kind: str, rng: np.random.Generator) -> np.ndarray:
    if kind == "random":
        return _random_raw(qtype, rng)
    data = (rng.standard_normal((ROWS, COLS)) * rng.uniform(0.01, 2, (ROWS, 1))).astype(np.float32)
    return gq.quantize(data, qtype)


def _gguf_can_quantize(qtype: T) -> bool:
    try:
        gq.quantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][0]), dtype=np.float32), qtype)
    except NotImplementedError:
        return False
    return True


# every type from random valid blocks; those gguf can write also from quantized real data
CASES = [(t, "random") for t in INT4 + INT8] + [
    (t, "quantize") for t in INT4 + INT8 if _gguf_can_quantize(t)]


def _check(qtype: T, raw: np.ndarray, shape: tuple[int, ...]) -> float:
    """Repack, compare with gguf, return max |diff| / max |value|."""
    w = repack(raw, qtype, shape)
    assert w is not None
    got = w.float() if isinstance(w, torch.Tensor) else w.dequantize()
    ref = torch.from_numpy(np.array(gq.dequantize(raw, qtype), dtype=np.float32))
    ref = ref.reshape(got.shape)
    assert got.dtype == torch.float32 and tuple(got.shape) == tuple(ref.shape)
    rel = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    assert rel <= 1e-3, f"{qtype.name}: relative error {rel:.3g}"
    if qtype in UNCOMBINED:
        assert torch.equal(got, ref), f"{qtype.name}: not bit-exact"
    return rel


@pytest.mark.parametrize("qtype,kind", CASES, ids=lambda v: getattr(v, "name", v))
def test_blocked_types_match_gguf(qtype: T, kind: str) -> None:
    rng = np.random.default_rng(int(qtype) * 7 + len(kind))
    raw = _source(qtype, kind, rng)
    w = repack(raw, qtype, (ROWS, COLS))
    expected = Int4Weight if qtype in INT4 else Int8Weight
    assert isinstance(w, expected)
    assert (w.out_features, w.in_features) == (ROWS, COLS)
    assert w.group_size in (16, 32)
    rel = _check(qtype, raw, (ROWS, COLS))
    print(f"{qtype.name} ({kind}): max relative error {rel:.3g}")


@pytest.mark.parametrize("qtype", DENSE, ids=lambda t: t.name)
def test_dense_types_keep_their_dtype(qtype: T) -> None:
    data = np.random.default_rng(1).standard_normal((ROWS, COLS)).astype(np.float32)
    raw = gq.quantize(data, qtype)
    w = repack(raw, qtype, (ROWS, COLS))
    assert isinstance(w, torch.Tensor)
    assert w.dtype == {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[qtype]
    _check(qtype, raw, (ROWS, COLS))


def test_type_tables_agree_with_gguf() -> None:
    for qtype in _REPACKERS:
        assert gguf.GGML_QUANT_SIZES[T(qtype)] == (qtype.block_size, qtype.type_size)
    assert set(_REPACKERS) == INT4_TYPES | INT8_TYPES
    assert set(INT4) == {T(t) for t in INT4_TYPES}
    assert set(INT8) == {T(t) for t in INT8_TYPES}
    assert set(DENSE) == {T(t) for t in DENSE_TYPES}


@pytest.mark.parametrize("qtype", [T.IQ2_XXS, T.IQ3_S, T.IQ1_M, T.TQ1_0, T.TQ2_0, T.MXFP4],
                         ids=lambda t: t.name)
def test_unsupported_types_return_none(qtype: T) -> None:
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros((2, 512 // block * type_size), dtype=np.uint8)
    assert repack(raw, qtype, (2, 512)) is None
    assert repack(np.zeros(4, dtype=np.int32), 26, (4,)) is None  # I32
    assert repack(raw, 9999, (2, 512)) is None


def test_wrong_byte_count_raises() -> None:
    raw = np.zeros((2, 40), dtype=np.uint8)
    with pytest.raises(ValueError, match="bytes for shape"):
        repack(raw, T.Q4_1, (2, 96))
    with pytest.raises(ValueError, match="block size"):
        repack(raw, T.Q4_1, (2, 40))


def test_leading_dims_are_flattened_into_rows() -> None:
    data = np.random.default_rng(2).standard_normal((3, 4, 64)).astype(np.float32)
    raw = gq.quantize(data, T.Q8_0)
    w = repack(raw, T.Q8_0, (3, 4, 64))
    assert isinstance(w, Int8Weight) and (w.out_features, w.in_features) == (12, 64)
    assert torch.equal(w.dequantize(), torch.from_numpy(gq.dequantize(raw, T.Q8_0)).view(12, 64))


def test_nibble_order() -> None:
    q = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    packed = pack_nibbles(q)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]  # column 2j low nibble, 2j+1 high nibble
    assert torch.equal(unpack_nibbles(packed), q)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 15), min_size=2, max_size=64))
def test_pack_unpack_roundtrip(values: list[int]) -> None:
    values = values[: len(values) // 2 * 2]
    q = torch.tensor(values, dtype=torch.uint8).view(1, -1)
    assert torch.equal(unpack_nibbles(pack_nibbles(q)), q)


def test_q4_0_block_lands_in_our_nibble_order() -> None:
    # GGUF Q4_0: byte j holds value j (low) and value 16 + j (high); we pack 2j, 2j+1 together.
    codes = np.arange(32, dtype=np.uint8) % 16
    qs = codes[:16] | (codes[16:] << 4)
    block = np.concatenate([np.array([1.0], dtype=np.float16).view(np.uint8), qs])[None, :]
    w = repack(block, T.Q4_0, (1, 32))
    assert isinstance(w, Int4Weight)
    assert torch.equal(w.codes()[0], torch.from_numpy(codes))
    assert w.qweight[0, 0].item() == (codes[1] << 4) | codes[0]
    assert torch.equal(w.dequantize()[0], torch.from_numpy(codes.astype(np.float32) - 8))


@pytest.mark.parametrize("qtype", INT4 + INT8 + DENSE, ids=lambda t: t.name)
def test_result_never_aliases_the_input(qtype: T) -> None:
    # one block of one row: every slice of it is contiguous, the case where a view could slip out
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    data = np.random.default_rng(5).standard_normal((1, 256)).astype(np.float32)[:, :block]
    if qtype in F16_FIELDS:
        raw = np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    else:
        raw = np.ascontiguousarray(gq.quantize(data, qtype))
    raw.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w = repack(raw, qtype, (1, block))
    assert w is not None
    tensors = [w] if isinstance(w, torch.Tensor) else [w.qweight, w.scales, w.offsets]
    for t in tensors:
        if t is not None:
            assert not np.shares_memory(t.reshape(-1).view(torch.uint8).numpy(), raw)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.IQ4_NL], ids=lambda t: t.name)
def test_fp16_scale_types_are_as_small_as_gguf(qtype: T) -> None:
    raw = _random_raw(qtype, np.random.default_rng(3))
    w = repack(raw, qtype, (ROWS, COLS))
    assert w is not None and not isinstance(w, torch.Tensor)
    codebook = 64 if qtype == T.IQ4_NL else 0
    assert w.nbytes - codebook == raw.nbytes


def test_codebook_and_per_channel_formats() -> None:
    rng = np.random.default_rng(4)
    q = torch.from_numpy(rng.integers(0, 16, (3, 64), dtype=np.uint8))
    scales = torch.rand(3, 4) + 0.5
    cb = torch.tensor(NF4_CODEBOOK, dtype=torch.float32)
    w4 = Int4Weight(pack_nibbles(q), scales, None, 16, cb)
    assert torch.equal(w4.dequantize(), cb[q.long()] * scales.repeat_interleave(16, dim=1))
    q8 = torch.from_numpy(rng.integers(-128, 128, (5, 48), dtype=np.int8))
    s8 = torch.rand(5, 1, dtype=torch.float32)
    w8 = Int8Weight(q8, s8.half(), None, 48)
    assert w8.per_channel
    assert torch.equal(w8.dequantize(), q8.float() * s8.half().float())
    assert w8.to("cpu").nbytes == 5 * 48 + 5 * 2


def test_formats_reject_bad_layouts() -> None:
    q = torch.zeros(2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="group_size"):
        Int4Weight(q, torch.ones(2, 1), None, 64)
    with pytest.raises(ValueError, match="scales shaped"):
        Int4Weight(q, torch.ones(2, 2), None, 32)
    with pytest.raises(ValueError, match="uint8"):
        Int4Weight(q.to(torch.int8), torch.ones(2, 1), None, 32)
    with pytest.raises(ValueError, match="offsets"):
        Int8Weight(torch.zeros(2, 32, dtype=torch.int8), torch.ones(2, 1), torch.ones(2, 2), 32)
    with pytest.raises(ValueError, match="fp16 or fp32"):
        Int8Weight(torch.zeros(2, 32, dtype=torch.int8), torch.ones(2, 1).double(), None, 32)

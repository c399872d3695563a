"""Loading synthetic GGUF files (written by `tests/gguf_factory.py`): every GGML type against
`gguf.quants.dequantize`, config from metadata with llama.cpp's defaults, tied embeddings, Qwen2
biases and Qwen3 Q/K norms, and one-line `ModelLoadError`s for missing, foreign, truncated,
corrupt and inconsistent files, also through the CLI."""

from __future__ import annotations

import signal
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_factory import (
    BOS_ID,
    QT,
    VOCAB_SIZE,
    ModelSpec,
    WrittenModel,
    block_size,
    can_dequantize,
    can_quantize,
    data_offset,
    patch,
    truncate,
    value_offset,
    write_model,
)

from localllm.apps.cli import main as cli_main
from localllm.engine.model_runner import prompt_logits
from localllm.errors import ModelLoadError
from localllm.gguf.reader import GGUFFile, TensorInfo
from localllm.gguf.tensors import module_name, qtype_name
from localllm.gguf.types import GGML_TYPE_SIZES, GGMLType
from localllm.layers.linear import QuantLinear
from localllm.loader import LoadedModel, load_gguf
from localllm.quant.dequant import dequantize

PROMPT = [BOS_ID, 5, 40, 261, VOCAB_SIZE - 1, 2, 100]

# Types gguf 0.19 can quantize: these are tested with real quantized data; every other type
# that gguf can dequantize is tested with synthetic blocks (see gguf_factory.encode).
QUANTIZABLE = (QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0,
               QT.TQ1_0, QT.TQ2_0, QT.MXFP4)
DECODABLE = tuple(t for t in QT if can_dequantize(t))
UNDECODABLE = tuple(t for t in QT if not can_dequantize(t))


def load(path: Path | str) -> LoadedModel:
    return load_gguf(path, torch.float32)


def spec_for(fit: QT, **kw: object) -> ModelSpec:
    """A model whose row lengths fit the block size of type `fit` (hidden 32 .. 256)."""
    hidden = max(32, block_size(fit))
    ffn = 2 * hidden if hidden < 256 else hidden
    return ModelSpec(hidden=hidden, ffn=ffn, **kw)  # type: ignore[arg-type]


def assert_one_line_error(exc: BaseException, path: Path | str, *fragments: str) -> None:
    msg = str(exc)
    assert isinstance(exc, ModelLoadError), f"{type(exc).__name__}: {msg}"
    assert "\n" not in msg and "\r" not in msg, msg
    assert str(path) in msg, msg
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"


def expect_load_error(path: Path | str, *fragments: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        load(path)
    assert_one_line_error(info.value, path, *fragments)


def assert_weights_match(loaded: LoadedModel, written: WrittenModel) -> None:
    """Every stored tensor sits, exactly as gguf dequantizes it, in its model parameter."""
    params = loaded.model.named_weights()
    for name in written.tensors:
        target = module_name(name)
        assert target is not None and target in params, name
        got = params[target].detach().numpy()
        want = written.values(name)
        assert got.dtype == np.float32
        assert np.array_equal(got, want), f"{name} -> {target} differs"


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> WrittenModel:
    return write_model(tmp_path_factory.mktemp("good") / "tiny.gguf")


def copy_of(good: WrittenModel, tmp_path: Path, name: str = "model.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(good.path.read_bytes())
    return p


# -- 1. every GGML type -------------------------------------------------------------------


def test_known_quantizable_types() -> None:
    for qt in QUANTIZABLE:
        assert can_quantize(qt), qt.name
    assert {QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K} <= set(DECODABLE)


def test_block_layouts_are_the_formats() -> None:
    # our own table (so that loading common types never imports the gguf package): the same
    # ids, names and sizes as gguf's, and every type gguf knows
    assert set(GGML_TYPE_SIZES) == set(GGMLType)
    for qtype, layout in GGML_TYPE_SIZES.items():
        assert layout == gguf.GGML_QUANT_SIZES[QT(qtype)], QT(qtype).name
        assert (qtype.block_size, qtype.type_size) == layout
        assert qtype.name == QT(qtype).name
    assert {int(t) for t in QT} == {int(t) for t in GGMLType}


def test_loading_common_types_does_not_import_gguf(tmp_path: Path) -> None:
    # the gguf package costs about 2 MB and 40 ms at import; a fresh process shows whether
    # loading a K-quant / Q8_0 model (bf16 and fp32 compute) pulls it in
    spec = ModelSpec(hidden=256, ffn=256, heads=4, kv_heads=2, qtype=QT.Q4_K,
                     qtypes={"token_embd.weight": QT.Q8_0, "blk.0.ffn_down.weight": QT.Q6_K})
    path = write_model(tmp_path / "common.gguf", spec).path
    code = ("import sys, torch\n"
            "from localllm.loader import load_gguf\n"
            f"load_gguf({str(path)!r}, torch.bfloat16)\n"
            f"load_gguf({str(path)!r}, torch.float32)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'gguf'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", out


def test_type_names() -> None:
    assert qtype_name(GGMLType.Q4_K) == qtype_name(12) == "Q4_K"
    assert qtype_name(99) == "unknown type 99"


@pytest.mark.parametrize("qtype", DECODABLE, ids=lambda t: t.name)
def test_every_decodable_type_loads_exactly(qtype: QT, tmp_path: Path) -> None:
    written = write_model(tmp_path / f"{qtype.name}.gguf", spec_for(qtype, qtype=qtype))
    loaded = load(written.path)
    assert written.tensors["blk.0.ffn_down.weight"].qtype == qtype
    down = loaded.model.layers[0].mlp.down_proj.weight
    assert torch.equal(down, torch.from_numpy(written.values("blk.0.ffn_down.weight")))
    assert_weights_match(loaded, written)
    logits = prompt_logits(loaded.model, PROMPT)
    assert logits.shape == (len(PROMPT), VOCAB_SIZE)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("qtype", UNDECODABLE, ids=lambda t: t.name)
def test_undecodable_type_is_a_load_error(qtype: QT, tmp_path: Path) -> None:
    spec = spec_for(qtype, qtypes={"blk.0.ffn_down.weight": qtype})
    written = write_model(tmp_path / f"{qtype.name}.gguf", spec)
    expect_load_error(written.path, "'blk.0.ffn_down.weight'", qtype.name)


def test_k_quant_tensor_through_dequantize(tmp_path: Path) -> None:
    written = write_model(tmp_path / "k.gguf", ModelSpec(hidden=256, ffn=256, layers=1,
                                                          qtype=QT.Q4_K))
    gf = GGUFFile(written.path)
    info = gf.tensors["blk.0.attn_q.weight"]
    assert info.qtype == QT.Q4_K and info.shape == (256, 256)
    got = dequantize(info, str(gf.path))
    assert got.dtype == torch.float32 and tuple(got.shape) == (256, 256)
    assert np.array_equal(got.numpy(), written.values("blk.0.attn_q.weight"))


def test_dequantize_unknown_type_number_names_tensor() -> None:
    info = TensorInfo("blk.3.attn_k.weight", 999, (4, 32), np.zeros((4, 32), np.uint8))
    with pytest.raises(ModelLoadError) as e:
        dequantize(info, "/models/x.gguf")
    assert_one_line_error(e.value, "/models/x.gguf", "'blk.3.attn_k.weight'", "999")


# -- 2. config from metadata ------------------------------------------------------------


def test_config_from_metadata(good: WrittenModel) -> None:
    loaded = load(good.path)
    cfg = loaded.config
    s = good.spec
    assert (cfg.arch, cfg.hidden_size, cfg.intermediate_size) == ("llama", s.hidden, s.ffn)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (s.layers, s.heads, s.kv_heads)
    assert cfg.head_dim == s.head_dim and cfg.rope_dim == s.head_dim
    assert cfg.vocab_size == VOCAB_SIZE == loaded.tokenizer.vocab_size
    assert cfg.rope_theta == 500000.0
    assert cfg.rms_norm_eps == pytest.approx(1e-6, rel=1e-6)
    assert cfg.context_length == 256
    assert cfg.rope_neox is False
    assert not cfg.tie_word_embeddings and not cfg.attn_bias and not cfg.qk_norm
    assert cfg.name == "tiny-test-model"
    assert loaded.model.rope.neox is False
    assert loaded.path == good.path
    assert_weights_match(loaded, good)
    assert torch.isfinite(prompt_logits(loaded.model, PROMPT)).all()


def test_llama_cpp_defaults_for_missing_keys(tmp_path: Path) -> None:
    a = "llama"
    spec = ModelSpec(kv_heads=4, drop_keys=(
        f"{a}.attention.head_count_kv", f"{a}.rope.freq_base", f"{a}.rope.dimension_count",
        f"{a}.context_length", f"{a}.attention.layer_norm_rms_epsilon", f"{a}.vocab_size",
    ))
    written = write_model(tmp_path / "defaults.gguf", spec)
    cfg = load(written.path).config
    assert cfg.num_kv_heads == cfg.num_heads == 4  # head_count_kv -> head_count
    assert cfg.rope_theta == 10000.0
    assert cfg.head_dim == 32 // 4
    assert cfg.rope_dim == cfg.head_dim  # rope.dimension_count -> head_dim
    assert cfg.context_length == 2048
    assert cfg.rms_norm_eps == 1e-5
    assert cfg.vocab_size == VOCAB_SIZE  # from tokenizer.ggml.tokens


def test_tied_embeddings(tmp_path: Path) -> None:
    written = write_model(tmp_path / "tied.gguf", ModelSpec(tied=True))
    assert "output.weight" not in written.tensors
    loaded = load(written.path)
    m = loaded.model
    assert loaded.config.tie_word_embeddings
    assert m.lm_head.weight.data_ptr() == m.embed_tokens.weight.data_ptr()
    assert np.array_equal(m.lm_head.weight.numpy(), written.values("token_embd.weight"))
    hidden = torch.randn(3, written.spec.hidden)
    assert torch.allclose(m.compute_logits(hidden), hidden @ m.embed_tokens.weight.T)
    assert torch.isfinite(prompt_logits(m, PROMPT)).all()


@pytest.mark.parametrize("tied", [True, False])
def test_bf16_logits_of_the_best_tokens_are_exact(tmp_path: Path, tied: bool) -> None:
    # quantized head (Q8_0 embedding kept packed), bf16 compute: the top logits are recomputed
    # in fp32 from the file's exact values, not left at bf16's coarse steps
    spec = ModelSpec(tied=tied, qtype=QT.Q8_0)
    written = write_model(tmp_path / "q8.gguf", spec)
    m = load_gguf(written.path, torch.bfloat16).model
    assert isinstance(m.lm_head, QuantLinear)
    head = written.values("token_embd.weight" if tied else "output.weight")
    hidden = (torch.randn(4, spec.hidden) * 3).bfloat16()
    logits = m.compute_logits(hidden)
    exact = hidden.float() @ torch.from_numpy(head).T
    top = exact.topk(4, dim=-1).indices
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-4)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q8_0, QT.Q6_K, QT.Q3_K, QT.IQ4_NL, QT.IQ4_XS])
def test_bf16_packed_decode_is_close_to_fp32(tmp_path: Path, qtype: QT, cpu_path: str) -> None:
    # the fast path (packed weights, bf16; on machines with the native kernels, one call per
    # decode step, and K-quants with groups of 16 stay packed too) against fp32 math on the
    # same weights, for a prompt and for decode steps
    size = 256 if block_size(qtype) == 256 else 128
    spec = ModelSpec(hidden=size, ffn=size, heads=4, kv_heads=2, qtype=qtype)
    written = write_model(tmp_path / "m.gguf", spec)
    ref = prompt_logits(load_gguf(written.path, torch.float32).model, PROMPT * 4)
    model = load_gguf(written.path, torch.bfloat16).model
    native_only = qtype in (QT.Q6_K, QT.Q3_K, QT.IQ4_NL, QT.IQ4_XS)  # groups of 16, codebooks
    assert isinstance(model.layers[0].self_attn.qkv_proj, QuantLinear) == (
        not native_only or cpu_path.startswith("native"))
    scale = float(ref.abs().max())
    for chunk in (0, 1):
        got = prompt_logits(model, PROMPT * 4, chunk=chunk)
        assert float((got - ref).abs().max()) <= 0.03 * scale


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # q/k/v biases; per-head Q/K norms
def test_bf16_packed_decode_of_other_architectures(tmp_path: Path, arch: str,
                                                   cpu_path: str) -> None:
    # these take the per-op path (the one-call step has no biases or Q/K norms), with the
    # native norms, RoPE and attention where available
    spec = ModelSpec(arch=arch, hidden=128, ffn=128, heads=4, kv_heads=2, qtype=QT.Q8_0)
    written = write_model(tmp_path / "m.gguf", spec)
    ref = prompt_logits(load_gguf(written.path, torch.float32).model, PROMPT * 4)
    model = load_gguf(written.path, torch.bfloat16).model
    scale = float(ref.abs().max())
    for chunk in (0, 1):
        got = prompt_logits(model, PROMPT * 4, chunk=chunk)
        assert float((got - ref).abs().max()) <= 0.03 * scale


def test_bf16_packed_decode_with_wide_heads_and_gqa(tmp_path: Path, cpu_path: str) -> None:
    # head_dim 128 and 4 query heads per KV head (Llama-7B-like heads) through the one-call
    # decode step where the native kernels run
    spec = ModelSpec(hidden=512, ffn=256, heads=4, kv_heads=1, qtype=QT.Q4_0)
    written = write_model(tmp_path / "m.gguf", spec)
    ref = prompt_logits(load_gguf(written.path, torch.float32).model, PROMPT * 4)
    model = load_gguf(written.path, torch.bfloat16).model
    got = prompt_logits(model, PROMPT * 4, chunk=1)
    assert float((got - ref).abs().max()) <= 0.03 * float(ref.abs().max())


def test_untied_output_is_its_own_tensor(good: WrittenModel) -> None:
    m = load(good.path).model
    assert m.lm_head.weight.data_ptr() != m.embed_tokens.weight.data_ptr()
    assert np.array_equal(m.lm_head.weight.numpy(), good.values("output.weight"))


def test_qwen2_biases(tmp_path: Path) -> None:
    written = write_model(tmp_path / "qwen2.gguf", ModelSpec(arch="qwen2"))
    loaded = load(written.path)
    cfg = loaded.config
    assert cfg.arch == "qwen2" and cfg.attn_bias and not cfg.qk_norm and cfg.rope_neox
    assert loaded.model.rope.neox is True
    for i in range(written.spec.layers):
        attn = loaded.model.layers[i].self_attn
        weights = loaded.model.named_weights()
        for short, proj in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
            want = written.values(f"blk.{i}.attn_{short}.bias")
            assert np.array_equal(weights[f"layers.{i}.self_attn.{proj}.bias"].numpy(), want)
            assert np.any(want != 0)
        assert attn.o_proj.bias is None
    assert_weights_match(loaded, written)
    assert torch.isfinite(prompt_logits(loaded.model, PROMPT)).all()


def test_qwen3_qk_norm(tmp_path: Path) -> None:
    written = write_model(tmp_path / "qwen3.gguf", ModelSpec(arch="qwen3"))
    loaded = load(written.path)
    cfg = loaded.config
    assert cfg.arch == "qwen3" and cfg.qk_norm and not cfg.attn_bias and cfg.rope_neox
    for i in range(written.spec.layers):
        attn = loaded.model.layers[i].self_attn
        assert attn.q_norm is not None and attn.k_norm is not None
        assert attn.qkv_proj is not None and attn.qkv_proj.bias is None
        assert np.array_equal(attn.q_norm.weight.numpy(),
                              written.values(f"blk.{i}.attn_q_norm.weight"))
        assert np.array_equal(attn.k_norm.weight.numpy(),
                              written.values(f"blk.{i}.attn_k_norm.weight"))
    assert_weights_match(loaded, written)
    assert torch.isfinite(prompt_logits(loaded.model, PROMPT)).all()


def test_mistral_loads_as_llama(tmp_path: Path) -> None:
    written = write_model(tmp_path / "mistral.gguf", ModelSpec(arch="mistral"))
    loaded = load(written.path)
    assert loaded.config.arch == "mistral" and loaded.config.rope_neox is False
    assert_weights_match(loaded, written)


def test_qwen3_without_qk_norm_is_missing_tensors(tmp_path: Path) -> None:
    drop = [f"blk.{i}.attn_{x}_norm.weight" for i in range(2) for x in "qk"]
    written = write_model(tmp_path / "q3.gguf", ModelSpec(arch="qwen3", drop_tensors=drop))
    expect_load_error(written.path, "missing tensors", "q_norm")


# -- 3. bad input -----------------------------------------------------------------------


def test_nonexistent_path(tmp_path: Path) -> None:
    expect_load_error(tmp_path / "nope" / "model.gguf")


def test_directory(tmp_path: Path) -> None:
    expect_load_error(tmp_path, "directory")


@pytest.mark.parametrize(
    "content",
    [b"", b"hello, this is a text file\n", b"PK\x03\x04\x14\x00\x00\x00\x08\x00" + bytes(64),
     b"GGML" + bytes(100), b"\x00" * 3],
    ids=["empty", "text", "zip", "ggml-magic", "3-bytes"],
)
def test_not_gguf(content: bytes, tmp_path: Path) -> None:
    p = tmp_path / "model.gguf"
    p.write_bytes(content)
    expect_load_error(p)


def _cut_points(good: WrittenModel) -> dict[str, int]:
    size = good.path.stat().st_size
    data = data_offset(good.path)
    tokens = value_offset(good.path, "tokenizer.ggml.tokens")
    return {
        "magic-only": 4,
        "in-version": 6,
        "in-counts": 15,
        "after-counts": 24,
        "in-first-key": 30,
        "in-arch-value": value_offset(good.path, "general.architecture") + 9,
        "in-token-array": tokens + 2000,
        "in-scores": value_offset(good.path, "tokenizer.ggml.scores") + 40,
        "in-tensor-info": data - 60,
        "at-data-start": data,
        "in-first-tensor": data + 1000,
        "in-middle-tensor": data + (size - data) // 2,
        "in-last-tensor": size - 40,
        "last-byte-missing": size - 1,
    }


@pytest.mark.parametrize("where", [
    "magic-only", "in-version", "in-counts", "after-counts", "in-first-key", "in-arch-value",
    "in-token-array", "in-scores", "in-tensor-info", "at-data-start", "in-first-tensor",
    "in-middle-tensor", "in-last-tensor", "last-byte-missing",
])
def test_truncated(where: str, good: WrittenModel, tmp_path: Path) -> None:
    # output_norm / output are last; the F32 output tensor ends exactly at the end of the file
    assert good.path.stat().st_size % 32 == 0
    p = copy_of(good, tmp_path)
    truncate(p, _cut_points(good)[where])
    expect_load_error(p)


class _Hang(BaseException):
    """Raised by the alarm below; a BaseException so `except Exception` cannot swallow it."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def on_alarm(signum: int, frame: object) -> None:
        raise _Hang(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _corrupt_key_length(p: Path) -> None:
    patch(p, 24, struct.pack("<Q", 2**63))  # the first key's length


def _corrupt_string_length(p: Path) -> None:
    patch(p, value_offset(p, "general.architecture"), struct.pack("<Q", 2**62))


def _corrupt_string_array_count(p: Path) -> None:
    patch(p, value_offset(p, "tokenizer.ggml.tokens") + 4, struct.pack("<Q", 2**40))


def _corrupt_value_type(p: Path) -> None:
    patch(p, value_offset(p, "general.architecture") - 4, struct.pack("<I", 99))


def _corrupt_kv_count(p: Path) -> None:
    patch(p, 16, struct.pack("<Q", 2**40))


def _corrupt_tensor_count(p: Path) -> None:
    patch(p, 8, struct.pack("<Q", 2**40))


def _corrupt_version(p: Path) -> None:
    patch(p, 4, struct.pack("<I", 7))


def _tensor_info_offset(p: Path, name: str) -> int:
    """Offset of the GGML type field of a tensor's info record."""
    t = next(t for t in gguf.GGUFReader(p).tensors if t.name == name)
    return int(t.field.offset) + 8 + len(name.encode()) + 4 + 8 * len(t.shape)


def _corrupt_tensor_type(p: Path) -> None:
    patch(p, _tensor_info_offset(p, "blk.0.attn_q.weight"), struct.pack("<I", 250))


def _corrupt_tensor_offset(p: Path) -> None:
    patch(p, _tensor_info_offset(p, "blk.1.ffn_up.weight") + 4, struct.pack("<Q", 2**40))


def _corrupt_tensor_dims(p: Path) -> None:
    patch(p, _tensor_info_offset(p, "token_embd.weight") - 8, struct.pack("<Q", 2**31))


CORRUPTIONS: dict[str, Callable[[Path], None]] = {
    "key-length": _corrupt_key_length,
    "string-length": _corrupt_string_length,
    "string-array-count": _corrupt_string_array_count,
    "value-type": _corrupt_value_type,
    "kv-count": _corrupt_kv_count,
    "tensor-count": _corrupt_tensor_count,
    "version": _corrupt_version,
    "tensor-type": _corrupt_tensor_type,
    "tensor-offset": _corrupt_tensor_offset,
    "tensor-dims": _corrupt_tensor_dims,
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt(kind: str, good: WrittenModel, tmp_path: Path) -> None:
    p = copy_of(good, tmp_path)
    CORRUPTIONS[kind](p)
    with time_limit(10):
        expect_load_error(p)


@pytest.mark.parametrize("version", [1, 4])
def test_other_gguf_version_is_not_called_corrupt(version: int, good: WrittenModel,
                                                  tmp_path: Path) -> None:
    # an intact file of another format version: no "corrupt or truncated, download it again"
    p = copy_of(good, tmp_path)
    patch(p, 4, struct.pack("<I", version))
    with pytest.raises(ModelLoadError) as info:
        load(p)
    assert_one_line_error(info.value, p, f"GGUF version {version} is not supported (localllm "
                          "reads versions 2 and 3")
    assert "corrupt" not in str(info.value) and "download" not in str(info.value)


def test_corrupt_scalar_array_count_fails_fast(good: WrittenModel, tmp_path: Path) -> None:
    # gguf.GGUFReader walked such a count item by item past the end of the file (hours for
    # 2**40); GGUFFile must bound counts by the file size.
    p = copy_of(good, tmp_path)
    patch(p, value_offset(p, "tokenizer.ggml.scores") + 4, struct.pack("<Q", 2**40))
    with time_limit(2):
        expect_load_error(p)


@pytest.mark.parametrize("arch", ["gpt2", "mamba"])
def test_unsupported_architecture(arch: str, tmp_path: Path) -> None:
    written = write_model(tmp_path / f"{arch}.gguf", ModelSpec(keys={"general.architecture": arch}))
    # names itself and lists every supported one, in one line
    expect_load_error(written.path, f"unsupported architecture {arch!r} (supported: gemma2, "
                      "gemma3, llama, mistral, phi3, qwen2, qwen3)")


def test_missing_architecture(tmp_path: Path) -> None:
    written = write_model(tmp_path / "noarch.gguf", ModelSpec(drop_keys=["general.architecture"]))
    expect_load_error(written.path, "general.architecture")


@pytest.mark.parametrize("key", ["block_count", "embedding_length", "feed_forward_length",
                                 "attention.head_count"])
def test_missing_required_key(key: str, tmp_path: Path) -> None:
    written = write_model(tmp_path / "m.gguf", ModelSpec(drop_keys=[f"llama.{key}"]))
    expect_load_error(written.path, f"llama.{key}")


def test_missing_tokenizer(tmp_path: Path) -> None:
    written = write_model(tmp_path / "m.gguf", ModelSpec(drop_keys=["tokenizer.ggml.tokens"]))
    expect_load_error(written.path, "tokenizer.ggml.tokens")


@pytest.mark.parametrize("tensor,param", [
    ("blk.1.ffn_up.weight", "layers.1.mlp.up_proj.weight"),
    ("token_embd.weight", "embed_tokens.weight"),
    ("output_norm.weight", "norm.weight"),
    ("blk.0.attn_k.weight", "layers.0.self_attn.k_proj.weight"),
])
def test_missing_tensor(tensor: str, param: str, tmp_path: Path) -> None:
    written = write_model(tmp_path / "m.gguf", ModelSpec(drop_tensors=[tensor]))
    expect_load_error(written.path, "missing", param)


def test_many_missing_tensors_stay_one_line(tmp_path: Path) -> None:
    drop = [f"blk.1.{n}.weight" for n in ("attn_q", "attn_k", "attn_v", "ffn_up", "ffn_down")]
    written = write_model(tmp_path / "m.gguf", ModelSpec(drop_tensors=drop))
    expect_load_error(written.path, "missing", "and 2 more")


@pytest.mark.parametrize("tensor,shape", [
    ("blk.0.attn_q.weight", (32, 64)),
    ("blk.1.ffn_down.weight", (64, 32)),  # transposed
    ("blk.0.attn_norm.weight", (16,)),
    ("token_embd.weight", (VOCAB_SIZE + 5, 32)),
])
def test_wrong_tensor_shape(tensor: str, shape: tuple[int, ...], tmp_path: Path) -> None:
    written = write_model(tmp_path / "m.gguf", ModelSpec(shapes={tensor: shape}))
    expect_load_error(written.path, repr(tensor), "shape")


def test_wrong_quantized_tensor_shape(tmp_path: Path) -> None:
    spec = ModelSpec(qtype=QT.Q8_0, shapes={"blk.0.ffn_gate.weight": (64, 64)})
    written = write_model(tmp_path / "m.gguf", spec)
    expect_load_error(written.path, "'blk.0.ffn_gate.weight'", "shape")


def test_embedding_smaller_than_tokenizer(tmp_path: Path) -> None:
    spec = ModelSpec(keys={"llama.vocab_size": 200}, tied=True,
                     shapes={"token_embd.weight": (200, 32)})
    written = write_model(tmp_path / "m.gguf", spec)
    expect_load_error(written.path, "tokenizer")


# -- bad metadata values -----------------------------------------------------------------


def test_alignment_of_wrong_type(tmp_path: Path) -> None:
    written = write_model(tmp_path / "m.gguf", ModelSpec(keys={"general.alignment": [32]}))
    expect_load_error(written.path, "general.alignment")


def test_zero_heads(tmp_path: Path) -> None:
    written = write_model(tmp_path / "m.gguf",
                          ModelSpec(keys={"llama.attention.head_count": 0}))
    expect_load_error(written.path, "head")


@pytest.mark.parametrize("key,value", [
    ("llama.block_count", "two"),
    ("llama.attention.layer_norm_rms_epsilon", "tiny"),
])
def test_metadata_value_of_wrong_type(key: str, value: str, tmp_path: Path) -> None:
    written = write_model(tmp_path / "m.gguf", ModelSpec(keys={key: value}))
    expect_load_error(written.path, key)


def test_huge_config_size_is_a_load_error(tmp_path: Path) -> None:
    spec = ModelSpec(keys={"llama.feed_forward_length": (2**40, gguf.GGUFValueType.UINT64)})
    written = write_model(tmp_path / "m.gguf", spec)
    expect_load_error(written.path, "ffn_gate", "metadata implies")


def test_token_type_of_wrong_type(tmp_path: Path) -> None:
    spec = ModelSpec(keys={"tokenizer.ggml.token_type": ["normal"] * VOCAB_SIZE})
    written = write_model(tmp_path / "m.gguf", spec)
    expect_load_error(written.path, "tokenizer.ggml.token_type")


def test_tokenizer_error_names_path_once(tmp_path: Path) -> None:
    written = write_model(tmp_path / "m.gguf", ModelSpec(keys={"tokenizer.ggml.model": "bert"}))
    with pytest.raises(ModelLoadError) as e:
        load(written.path)
    assert_one_line_error(e.value, written.path, "tokenizer.ggml.model")
    assert str(e.value).count(str(written.path)) == 1, str(e.value)


def test_scores_of_wrong_type(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = ModelSpec(keys={"tokenizer.ggml.scores": ["high"] * VOCAB_SIZE})
    written = write_model(tmp_path / "m.gguf", spec)
    code = cli_main(["tokenize", "--model", str(written.path), "hi hello"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("localllm: error: ") and "scores" in err, err


# -- CLI --------------------------------------------------------------------------------


def _bad_files(good: WrittenModel, tmp_path: Path) -> dict[str, Path]:
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    text = tmp_path / "notes.txt"
    text.write_text("not a model\n")
    cut = copy_of(good, tmp_path, "cut.gguf")
    truncate(cut, data_offset(good.path) // 2)
    corrupt = copy_of(good, tmp_path, "corrupt.gguf")
    _corrupt_string_length(corrupt)
    return {"missing": tmp_path / "missing.gguf", "directory": tmp_path, "empty": empty,
            "text": text, "truncated": cut, "corrupt": corrupt}


@pytest.mark.parametrize("kind", ["missing", "directory", "empty", "text", "truncated",
                                  "corrupt"])
def test_cli_bad_model_is_one_line(kind: str, good: WrittenModel, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    bad = _bad_files(good, tmp_path)[kind]
    code = cli_main(["tokenize", "--model", str(bad), "hi"])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1, err
    assert lines[0].startswith("localllm: error: "), err
    assert str(bad) in lines[0]
    assert "Traceback" not in err


def test_cli_tokenize_good_model(good: WrittenModel, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main(["tokenize", "--model", str(good.path), "hi hello"])
    out, err = capsys.readouterr()
    assert code == 0, err
    ids = [int(x) for x in out.split()]
    assert ids[0] == BOS_ID and len(ids) > 1
    assert all(0 <= i < VOCAB_SIZE for i in ids)


def test_types_without_a_packed_format_load_dense_with_one_warning(
        tmp_path: Path, cpu_path: str, caplog: pytest.LogCaptureFixture) -> None:
    # IQ2_XS (a lattice codebook) has no packed CPU format: its weights are dequantized to
    # bf16, and the load says so once for the type, with what it costs
    spec = ModelSpec(hidden=256, ffn=256, heads=4, kv_heads=2, qtype=QT.IQ2_XS)
    written = write_model(tmp_path / "m.gguf", spec)
    with caplog.at_level("WARNING", logger="localllm"):
        model = load_gguf(written.path, torch.bfloat16).model
    lines = [r.getMessage() for r in caplog.records if "IQ2_XS" in r.getMessage()]
    assert len(lines) == 1
    assert "have no packed format on the cpu backend: dequantized to bfloat16" in lines[0]
    # what the file holds (the type's block bytes) against 2 bytes a weight in bf16
    iq2 = [t for t in written.tensors.values() if t.qtype == QT.IQ2_XS]
    block, block_bytes = gguf.GGML_QUANT_SIZES[QT.IQ2_XS]
    stored = sum(int(np.prod(t.shape)) // block * block_bytes for t in iq2)
    dense = sum(int(np.prod(t.shape)) * 2 for t in iq2)
    assert f"{len(iq2)} tensor(s) of type IQ2_XS" in lines[0]
    assert (f"{dense / 2**20:.1f} MiB instead of {stored / 2**20:.1f} MiB "
            f"({dense / stored:.1f}x)") in lines[0]
    assert not isinstance(model.layers[0].self_attn.qkv_proj, QuantLinear)
    caplog.clear()
    with caplog.at_level("WARNING", logger="localllm"):
        load_gguf(written.path, torch.float32)  # fp32 dequantizes everything by request
    assert not [r for r in caplog.records if "no packed CPU format" in r.getMessage()]

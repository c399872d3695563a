"""Synthetic GGUF model files for tests: a tiny Llama-family model written with `gguf.GGUFWriter`.

`write_model(path, ModelSpec(...))` writes metadata as llama.cpp's converters do (uint32 counts,
float32 epsilon and RoPE base, an SPM-style `tokenizer.ggml.*` vocabulary with `<0xNN>` byte
tokens) plus every tensor a `llama` / `qwen2` / `qwen3` model needs, and returns what it stored
so a test can compare the loaded weights with `gguf.quants.dequantize` of the very same bytes.

Weights of a type that `gguf.quants.quantize` can produce are real quantizations of random
values. For the types it cannot produce (K-quants, IQ*, ...) the blocks are random bytes below
0x30, so that every fp16 / fp32 / E8M0 / E4M3 scale field decodes to a finite value (fp16:
`|d| < 0.125`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import gguf.quants
import numpy as np
from gguf.constants import GGML_QUANT_SIZES

QT = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType

SPACE = "\u2581"
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
# Word pieces after the 3 specials and the 256 byte tokens, best (highest score) first.
WORD_PIECES = (
    SPACE, *"etaoinshrdlucmwfgypbvk",
    f"{SPACE}t", f"{SPACE}a", "th", "he", "in", "er", "an", "ll", "hi", "lo",
    f"{SPACE}the", f"{SPACE}h", f"{SPACE}hi", f"{SPACE}w", "or", "el", "ello",
    f"{SPACE}hello", f"{SPACE}world", "rl", "wor",
)
BOS_ID, EOS_ID, UNK_ID = 1, 2, 0

# Element types that are plain numpy dtypes in a GGUF file (no blocks).
_PLAIN_NP: dict[QT, type[np.generic]] = {
    QT.F32: np.float32, QT.F16: np.float16, QT.F64: np.float64,
    QT.I8: np.int8, QT.I16: np.int16, QT.I32: np.int32, QT.I64: np.int64,
}


def vocab() -> tuple[list[str], list[float], list[int]]:
    """tokens, scores, token types (gguf.TokenType values) of the test vocabulary."""
    tokens = list(SPECIAL_TOKENS)
    types = [int(gguf.TokenType.UNKNOWN), int(gguf.TokenType.CONTROL),
             int(gguf.TokenType.CONTROL)]
    scores = [0.0, 0.0, 0.0]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(int(gguf.TokenType.BYTE))
        scores.append(0.0)
    for i, piece in enumerate(WORD_PIECES):
        tokens.append(piece)
        types.append(int(gguf.TokenType.NORMAL))
        scores.append(-float(i))
    return tokens, scores, types


VOCAB_SIZE = len(vocab()[0])


def block_size(qtype: QT) -> int:
    return GGML_QUANT_SIZES[qtype][0]


def can_quantize(qtype: QT) -> bool:
    """Whether `gguf.quants.quantize` can write this type."""
    try:
        gguf.quants.quantize(np.zeros((1, block_size(qtype)), np.float32), qtype)
    except NotImplementedError:
        return False
    return True


def can_dequantize(qtype: QT) -> bool:
    """Whether `gguf.quants.dequantize` can read this type."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    if qtype in _PLAIN_NP:
        data: np.ndarray = np.zeros((1, bs), _PLAIN_NP[qtype])
    else:
        data = np.zeros((1, ts), np.uint8)
    try:
        gguf.quants.dequantize(data, qtype)
    except NotImplementedError:
        return False
    return True


def encode(values: np.ndarray, qtype: QT, rng: np.random.Generator) -> np.ndarray:
    """The array to hand to `GGUFWriter.add_tensor` for `values` ([rows, cols], fp32) stored as
    `qtype`: a real quantization where gguf can make one, else synthetic blocks (see above)."""
    if qtype in _PLAIN_NP:
        dt = _PLAIN_NP[qtype]
        if np.issubdtype(dt, np.integer):
            return (values * 100).round().clip(-100, 100).astype(dt)
        return values.astype(dt)
    if can_quantize(qtype):
        return gguf.quants.quantize(values.astype(np.float32), qtype)
    bs, ts = GGML_QUANT_SIZES[qtype]
    rows, cols = values.shape
    if cols % bs:
        raise ValueError(f"{qtype.name}: row length {cols} is not a multiple of {bs}")
    return rng.integers(0, 0x30, size=(rows, cols // bs * ts), dtype=np.uint8)


def dequantized(stored: np.ndarray, qtype: QT, shape: tuple[int, ...]) -> np.ndarray:
    """fp32 values of a stored array, by `gguf.quants.dequantize`, in PyTorch order `shape`."""
    return np.asarray(gguf.quants.dequantize(stored, qtype), np.float32).reshape(shape)


@dataclass
class ModelSpec:
    """What to write. Shapes below are PyTorch order ([out, in]); GGUF stores them reversed."""

    arch: str = "llama"  # tensor layout and key prefix: llama | mistral | qwen2 | qwen3
    hidden: int = 32
    ffn: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    qtype: QT = QT.F32  # type of every 2D weight (token_embd, output and the projections)
    qtypes: Mapping[str, QT] = field(default_factory=dict)  # per-tensor overrides by GGUF name
    tied: bool = False  # omit output.weight (the lm_head shares token_embd)
    drop_keys: Iterable[str] = ()  # metadata keys left out (full names, e.g. "llama.block_count")
    # extra / replaced metadata keys: a value (int -> UINT32, float -> FLOAT32, str, bool, list)
    # or a (value, GGUFValueType) pair
    keys: Mapping[str, Any] = field(default_factory=dict)
    drop_tensors: Iterable[str] = ()  # GGUF tensor names left out
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # shape overrides
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass
class StoredTensor:
    data: np.ndarray  # exactly what was given to the writer
    qtype: QT
    shape: tuple[int, ...]  # PyTorch order

    def values(self) -> np.ndarray:
        return dequantized(self.data, self.qtype, self.shape)


@dataclass
class WrittenModel:
    path: Path
    spec: ModelSpec
    metadata: dict[str, Any]
    tensors: dict[str, StoredTensor]

    def values(self, name: str) -> np.ndarray:
        """fp32 values of a GGUF tensor by `gguf.quants.dequantize`, PyTorch order."""
        return self.tensors[name].values()


def _metadata(spec: ModelSpec) -> dict[str, tuple[Any, VT]]:
    a = spec.arch
    tokens, scores, types = vocab()
    meta: dict[str, tuple[Any, VT]] = {
        "general.architecture": (a, VT.STRING),
        "general.name": ("tiny-test-model", VT.STRING),
        f"{a}.vocab_size": (len(tokens), VT.UINT32),
        f"{a}.context_length": (256, VT.UINT32),
        f"{a}.embedding_length": (spec.hidden, VT.UINT32),
        f"{a}.block_count": (spec.layers, VT.UINT32),
        f"{a}.feed_forward_length": (spec.ffn, VT.UINT32),
        f"{a}.attention.head_count": (spec.heads, VT.UINT32),
        f"{a}.attention.head_count_kv": (spec.kv_heads, VT.UINT32),
        f"{a}.rope.freq_base": (500000.0, VT.FLOAT32),
        f"{a}.rope.dimension_count": (spec.head_dim, VT.UINT32),
        f"{a}.attention.layer_norm_rms_epsilon": (1e-6, VT.FLOAT32),
        "general.file_type": (int(spec.qtype), VT.UINT32),
        "tokenizer.ggml.model": ("llama", VT.STRING),
        "tokenizer.ggml.tokens": (tokens, VT.ARRAY),
        "tokenizer.ggml.scores": (scores, VT.ARRAY),
        "tokenizer.ggml.token_type": (types, VT.ARRAY),
        "tokenizer.ggml.bos_token_id": (BOS_ID, VT.UINT32),
        "tokenizer.ggml.eos_token_id": (EOS_ID, VT.UINT32),
        "tokenizer.ggml.unknown_token_id": (UNK_ID, VT.UINT32),
        "tokenizer.ggml.add_bos_token": (True, VT.BOOL),
        "tokenizer.ggml.add_eos_token": (False, VT.BOOL),
    }
    for key in spec.drop_keys:
        meta.pop(key, None)
    for key, value in spec.keys.items():
        if isinstance(value, tuple):  # (value, GGUFValueType) with an explicit type
            meta[key] = (value[0], value[1])
        else:
            meta[key] = (value, _value_type(value))
    return meta


def _value_type(value: Any) -> VT:
    if isinstance(value, str):
        return VT.STRING
    if isinstance(value, bool):
        return VT.BOOL
    if isinstance(value, int):
        return VT.UINT32
    if isinstance(value, float):
        return VT.FLOAT32
    if isinstance(value, list):
        return VT.ARRAY
    raise TypeError(f"no GGUF value type for {value!r}")


def tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model, GGUF name -> PyTorch-order shape, in file order."""
    h, f, hd = spec.hidden, spec.ffn, spec.head_dim
    q, kv = spec.heads * hd, spec.kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (VOCAB_SIZE, h)}
    for i in range(spec.layers):
        b = f"blk.{i}"
        shapes[f"{b}.attn_norm.weight"] = (h,)
        shapes[f"{b}.attn_q.weight"] = (q, h)
        shapes[f"{b}.attn_k.weight"] = (kv, h)
        shapes[f"{b}.attn_v.weight"] = (kv, h)
        if spec.arch == "qwen2":
            shapes[f"{b}.attn_q.bias"] = (q,)
            shapes[f"{b}.attn_k.bias"] = (kv,)
            shapes[f"{b}.attn_v.bias"] = (kv,)
        if spec.arch == "qwen3":
            shapes[f"{b}.attn_q_norm.weight"] = (hd,)
            shapes[f"{b}.attn_k_norm.weight"] = (hd,)
        shapes[f"{b}.attn_output.weight"] = (h, q)
        shapes[f"{b}.ffn_norm.weight"] = (h,)
        shapes[f"{b}.ffn_gate.weight"] = (f, h)
        shapes[f"{b}.ffn_up.weight"] = (f, h)
        shapes[f"{b}.ffn_down.weight"] = (h, f)
    shapes["output_norm.weight"] = (h,)
    if not spec.tied:
        shapes["output.weight"] = (VOCAB_SIZE, h)
    return shapes


def write_model(path: str | os.PathLike[str], spec: ModelSpec | None = None) -> WrittenModel:
    """Write a GGUF file for `spec` (default: tiny F32 llama) and return what it holds."""
    spec = spec or ModelSpec()
    path = Path(path)
    rng = np.random.default_rng(spec.seed)
    meta = _metadata(spec)
    writer = gguf.GGUFWriter(path, spec.arch)
    writer.kv_data[0].clear()  # drop the automatic general.architecture: `meta` decides
    for key, (value, vtype) in meta.items():
        if vtype == VT.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, vtype)

    stored: dict[str, StoredTensor] = {}
    drop = set(spec.drop_tensors)
    for name, shape in tensor_shapes(spec).items():
        shape = tuple(spec.shapes.get(name, shape))
        if name in drop:
            continue
        if len(shape) == 1:  # norms (around 1) and biases (around 0) stay F32
            base = 0.0 if name.endswith(".bias") else 1.0
            values = (base + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            qtype = spec.qtypes.get(name, QT.F32)
        else:
            values = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
            qtype = spec.qtypes.get(name, spec.qtype)
        data = encode(values.reshape(-1, shape[-1]), qtype, rng)
        if len(shape) == 1:
            data = data.reshape(-1)
        raw = None if qtype in _PLAIN_NP else qtype
        writer.add_tensor(name, data, raw_dtype=raw)
        stored[name] = StoredTensor(data, qtype, shape)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return WrittenModel(path, spec, {k: v for k, (v, _) in meta.items()}, stored)


def field_offset(path: str | os.PathLike[str], key: str) -> int:
    """Byte offset of a metadata key-value pair (its key-length field) in a GGUF file."""
    reader = gguf.GGUFReader(path)
    return int(reader.fields[key].offset)


def value_offset(path: str | os.PathLike[str], key: str) -> int:
    """Byte offset of a key's value: the length field of a string, the item-type field of an
    array (its uint64 count follows 4 bytes later), or the scalar itself."""
    return field_offset(path, key) + 8 + len(key.encode()) + 4


def data_offset(path: str | os.PathLike[str]) -> int:
    """Byte offset where tensor data begins."""
    return int(gguf.GGUFReader(path).data_offset)


def patch(path: str | os.PathLike[str], offset: int, data: bytes) -> None:
    """Overwrite bytes of a file in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def truncate(path: str | os.PathLike[str], size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)

"""Weight bytes of a model file as stored, and as each backend would hold them once loaded,
worked out from the tensor headers and the backends' packing rules without loading the model.

A GGUF matrix's runtime format (`Int4Weight` / `Int8Weight`: group size, offsets, scale dtype,
codebook) is learnt by repacking its first 64 rows, as the loader does; the byte counts then
follow the layouts:

- torch: every tensor dense in the compute dtype.
- cpu (bf16 compute): a linear weight that `cpu_packable` accepts is held in the int4 kernel's
  tiles (`backends/cpu/packing.py`): rows padded to 64, `planes * in / 2` code bytes a row
  (int8 is two 4-bit planes), bf16 (scale, zero) pairs per plane and group, or the source's
  fp16 scales alone (`half_scales`); the embedding keeps its source scales and offsets too
  (`exact_rows`); a codebook adds 64 + 64 bytes. Everything else is dense.
- triton (bf16 / fp16 compute): every repackable matrix as a `QMatrix`
  (`kernels/triton_qmatmul.py`): in_features rounded up to 32, one code byte (int8) or half a
  byte (int4) a value, scales (and offsets) per group in their source dtype, made fp32 where
  fused parts (q/k/v, gate/up) mix fp16 and fp32 scales.

A Hugging Face folder is read from its safetensors headers; its weights load dense (figures for
`--quantize` are not worked out here). Tensors the model does not use (RoPE frequency factors)
are left out.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import torch

from localllm.backends.cpu.packing import TILE, cpu_packable, half_scales
from localllm.gguf.reader import GGUFFile
from localllm.gguf.tensors import module_name, qtype_name
from localllm.model_stats import module_of
from localllm.quant.formats import Int4Weight, Int8Weight
from localllm.quant.repack import DENSE_TYPES, repack

BACKEND_NAMES = ("cpu", "torch", "triton")
FIRST_ROWS = 64  # rows repacked to learn a matrix's runtime format
TRITON_CHUNK = 32  # `triton_qmatmul.CHUNK`: in_features is padded to a multiple
CODEBOOK_BYTES = 16 * 4
_FUSED = re.compile(r"^layers\.(\d+)\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.weight$")


class TensorEntry(NamedTuple):
    param: str  # the model parameter it fills (`layers.0.mlp.up_proj.weight`)
    module: str  # its `model_stats.ParamCounts` field
    qtype: str  # GGML type name, or the safetensors dtype ("BF16")
    shape: tuple[int, ...]  # [out, in] for a matrix
    stored: int  # bytes in the file
    runtime: Int4Weight | Int8Weight | None  # runtime format of its first rows; None: dense

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def linear(self) -> bool:
        """The weight of a linear layer (the embedding table is one): the loader asks the
        backend to pack it."""
        return self.module != "norms" and self.param.endswith(".weight") and len(self.shape) == 2


def gguf_entries(gf: GGUFFile) -> list[TensorEntry]:
    out = []
    for info in gf:
        name = module_name(info.name)
        module = None if name is None else module_of(name)
        if name is None or module is None:
            continue
        runtime = None
        if len(info.shape) == 2 and info.qtype not in DENSE_TYPES and info.data.ndim == 2:
            rows = min(FIRST_ROWS, info.shape[0])
            first = repack(info.data[:rows], info.qtype, (rows, info.shape[1]))
            runtime = first if isinstance(first, (Int4Weight, Int8Weight)) else None
        out.append(TensorEntry(name, module, qtype_name(info.qtype), info.shape,
                               int(info.data.nbytes), runtime))
    return out


_ST_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1}


def hf_entries(folder: Path, tied: bool) -> list[TensorEntry]:
    """`tied`: the config ties the LM head to the embedding (a stored `lm_head.weight` is then
    not loaded)."""
    from localllm.hf.loader import local_name
    from localllm.hf.weights import SafetensorsFolder

    out = []
    with SafetensorsFolder(folder) as st:
        for hf_name in st.names():
            name = local_name(hf_name)
            module = None if name is None else module_of(name)
            if name is None or module is None or (tied and module == "head"):
                continue
            dtype, shape = st.dtype(hf_name), st.shape(hf_name)
            size = _ST_SIZES.get(dtype, 4)
            out.append(TensorEntry(name, module, dtype, shape, math.prod(shape) * size, None))
    return out


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _scale_bytes(w: Int4Weight | Int8Weight) -> int:
    return w.scales.element_size() * (2 if w.offsets is not None else 1)


def cpu_nbytes(e: TensorEntry, dtype: torch.dtype) -> int:
    """Bytes the CPU backend holds for `e` on this machine (its native kernels decide which
    formats pack)."""
    w = e.runtime
    dense = e.numel * _itemsize(dtype)
    if not e.linear or w is None or not cpu_packable(w, dtype):
        return dense
    out, in_ = e.shape
    planes = 1 if isinstance(w, Int4Weight) else 2
    groups = in_ // w.group_size
    n_pad = out + (-out % TILE)
    codes = n_pad * planes * in_ // 2
    half = half_scales(w)
    scales = groups * n_pad * 2 if half else planes * groups * n_pad * 2 * _itemsize(dtype)
    exact = out * groups * _scale_bytes(w) if e.module == "embeddings" and not half else 0
    codebook = 2 * CODEBOOK_BYTES if isinstance(w, Int4Weight) and w.codebook is not None else 0
    return codes + scales + exact + codebook


def triton_nbytes(e: TensorEntry, dtype: torch.dtype, scale_size: int = 0) -> int:
    """Bytes the Triton backend holds for `e`; `scale_size` overrides the scales' item size
    (a fused layer's fp32 scales)."""
    w = e.runtime
    if not e.linear or w is None or dtype not in (torch.bfloat16, torch.float16):
        return e.numel * _itemsize(dtype)
    out, in_ = e.shape
    kp = -(-in_ // TRITON_CHUNK) * TRITON_CHUNK
    grouped = w.group_size in (16, 32)
    codes = kp * out // (2 if isinstance(w, Int4Weight) else 1)
    per_scale = _scale_bytes(w) if not scale_size else scale_size * (
        2 if w.offsets is not None else 1)
    scales = (kp // w.group_size if grouped else 1) * out * per_scale
    codebook = CODEBOOK_BYTES if isinstance(w, Int4Weight) and w.codebook is not None else 0
    return codes + scales + codebook


def _triton_fused_scale_size(entries: Iterable[TensorEntry]) -> dict[str, int]:
    """Parameters whose scales become fp32 when the Triton backend stacks q/k/v or gate/up
    (`triton_qmatmul.stack`: parts of one format whose scale dtypes differ)."""
    groups: dict[tuple[str, str], list[TensorEntry]] = {}
    for e in entries:
        m = _FUSED.match(e.param)
        if m is not None and e.runtime is not None:
            kind = "qkv" if "self_attn" in m.group(2) else "gate_up"
            groups.setdefault((m.group(1), kind), []).append(e)
    out: dict[str, int] = {}
    for parts in groups.values():
        ws = [p.runtime for p in parts if p.runtime is not None]
        if len(ws) != (3 if "self_attn" in parts[0].param else 2):
            continue
        formats = {(isinstance(w, Int4Weight), w.group_size, w.offsets is None,
                    isinstance(w, Int4Weight) and w.codebook is not None) for w in ws}
        if len(formats) == 1 and len({w.scales.dtype for w in ws}) > 1:
            out.update({p.param: 4 for p in parts})
    return out


class WeightBytes(NamedTuple):
    stored: dict[str, tuple[int, int, int]]  # qtype -> (tensors, parameters, bytes)
    loaded: dict[str, dict[str, int]]  # backend -> module -> bytes

    def loaded_total(self, backend: str) -> int:
        return sum(self.loaded[backend].values())

    @property
    def stored_total(self) -> int:
        return sum(b for _, _, b in self.stored.values())


def weight_bytes(entries: list[TensorEntry], dtype: torch.dtype) -> WeightBytes:
    stored: dict[str, tuple[int, int, int]] = {}
    for e in entries:
        n, p, b = stored.get(e.qtype, (0, 0, 0))
        stored[e.qtype] = (n + 1, p + e.numel, b + e.stored)
    fused = _triton_fused_scale_size(entries)
    loaded: dict[str, dict[str, int]] = {b: {} for b in BACKEND_NAMES}
    for e in entries:
        sizes = {"cpu": cpu_nbytes(e, dtype), "torch": e.numel * _itemsize(dtype),
                 "triton": triton_nbytes(e, dtype, fused.get(e.param, 0))}
        for backend, size in sizes.items():
            loaded[backend][e.module] = loaded[backend].get(e.module, 0) + size
    return WeightBytes(stored, loaded)


def model_entries(path: Path, tied: bool) -> list[TensorEntry]:
    """The weight tensors of a GGUF file or a Hugging Face folder (`tied`: see `hf_entries`)."""
    return hf_entries(path, tied) if path.is_dir() else gguf_entries(GGUFFile(path))

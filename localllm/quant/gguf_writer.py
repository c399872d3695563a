"""Requantize a GGUF file to Q4_0, Q4_1 or Q8_0 (what `localllm quantize` runs).

Tensor choice follows llama.cpp's llama-quantize: 2D matrices whose rows are a multiple of the
block size (32) get the target type; 1D tensors (norms, biases) and matrices with other row
lengths stay F32; `token_embd.weight` and `output.weight` stay at Q8_0 when the target is a
4-bit type. A tensor already in the type it would get is copied byte for byte.

Metadata is carried over with its original GGUF value types (`GGUFFile.metadata_types`):
llama.cpp checks them, e.g. `token_type` must be an INT32 array and `*_token_id` UINT32.

The file is written under a temporary name in the target directory and renamed at the end, so
a failed or interrupted run never leaves a half-written output.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import gguf
import gguf.quants
import numpy as np
import torch

from localllm.errors import LocalLLMError
from localllm.gguf.reader import GGUFFile, TensorInfo
from localllm.gguf.types import GGMLType
from localllm.quant.dequant import dequantize

VT = gguf.GGUFValueType
# target name -> (ggml type, LLAMA_FTYPE_MOSTLY_* value)
TARGETS: dict[str, tuple[GGMLType, int]] = {
    "q4_0": (GGMLType.Q4_0, 2),
    "q4_1": (GGMLType.Q4_1, 3),
    "q8_0": (GGMLType.Q8_0, 7),
}
QUANTIZATION_VERSION = 2
HIGH_PRECISION = ("token_embd.weight", "output.weight")  # Q8_0 under a 4-bit target
# keys the writer sets itself
_SKIP_KEYS = ("general.architecture", "general.alignment")
_SKIP_PREFIXES = ("GGUF.", "split.")

ProgressFn = Callable[[int, int, str, str], None]  # (done, total, tensor name, type written)


class QuantizeError(LocalLLMError):
    """The quantization cannot run (bad type name, unusable output path) or failed to write."""


class QuantizeResult(NamedTuple):
    out: Path
    in_bytes: int
    out_bytes: int
    seconds: float
    types: dict[str, str]  # tensor name -> type written
    kept_f32: list[str]  # matrices left F32: their row length is not a multiple of 32


def parse_target(name: str) -> tuple[GGMLType, int]:
    key = name.strip().lower()
    if key not in TARGETS:
        raise QuantizeError(f"unknown quantization type {name!r} (choose from "
                            f"{', '.join(TARGETS)})")
    return TARGETS[key]


def metadata_types(path: Path) -> dict[str, tuple[int, int | None]]:
    """Each metadata key's GGUF value type (and array item type) as stored in the file."""
    return GGUFFile(path).metadata_types


def target_type(info: TensorInfo, target: GGMLType) -> GGMLType:
    """The type llama-quantize's rules give this tensor under `target`."""
    if len(info.shape) != 2 or info.shape[-1] % 32:
        return GGMLType.F32
    if info.name in HIGH_PRECISION and target in (GGMLType.Q4_0, GGMLType.Q4_1):
        return GGMLType.Q8_0
    return target


def _convert(info: TensorInfo, qt: GGMLType, source: str) -> np.ndarray:
    if info.qtype == qt:
        return np.ascontiguousarray(info.data)  # same type: the exact bytes
    w = dequantize(info, source).numpy()
    if qt == GGMLType.F32:
        return np.ascontiguousarray(w, dtype=np.float32)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType(qt))


def _byte_size(info: TensorInfo, qt: GGMLType) -> int:
    n = int(np.prod(info.shape)) if info.shape else 1
    return n // qt.block_size * qt.type_size


def copy_metadata(writer: gguf.GGUFWriter, gf: GGUFFile,
                  types: dict[str, tuple[int, int | None]] | None = None,
                  overrides: dict[str, tuple[int, VT]] | None = None) -> None:
    """Every key of `gf` in its own type and order, except those the writer sets; `overrides`
    (key -> value, type) replace keys in place or come last."""
    types = gf.metadata_types if types is None else types
    rest = dict(overrides or {})
    for key, value in gf.metadata.items():
        if key in rest:
            value, vtype = rest.pop(key)
            writer.add_key_value(key, value, vtype)
            continue
        if key in _SKIP_KEYS or key.startswith(_SKIP_PREFIXES):
            continue
        vt, sub = types[key]
        if vt == VT.ARRAY and not value:
            continue  # the writer cannot write empty arrays; llama.cpp treats them as absent
        writer.add_key_value(key, value, VT(vt), VT(sub) if sub is not None else None)
    for key, (value, vtype) in rest.items():
        writer.add_key_value(key, value, vtype)


def quantize_gguf(src: str | os.PathLike[str], out: str | os.PathLike[str], type_name: str,
                  progress: ProgressFn | None = None) -> QuantizeResult:
    """Write `src` requantized to `type_name` (q4_0, q4_1, q8_0) at `out`."""
    t0 = time.perf_counter()
    target, ftype = parse_target(type_name)
    out = Path(out)
    if not out.parent.is_dir():
        raise QuantizeError(f"{out}: output directory {out.parent} does not exist")
    if out.is_dir():
        raise QuantizeError(f"{out}: is a directory; give the output file name")
    gf = GGUFFile(src)  # ModelLoadError (one line) when unreadable
    if out.exists() and out.resolve() == gf.path.resolve():
        raise QuantizeError(f"{out}: is the source file; write to another name")
    types = gf.metadata_types

    tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"
    writer = gguf.GGUFWriter(tmp, gf.architecture)
    # torch dequantizes, numpy quantizes, in turn: torch's OpenMP workers spinning between its
    # small parallel regions starve the numpy thread (7 s instead of 1.7 s for 135M on 2 cores)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        copy_metadata(writer, gf, types, {
            "general.file_type": (ftype, VT.UINT32),
            "general.quantization_version": (QUANTIZATION_VERSION, VT.UINT32)})
        plan = [(info, target_type(info, target)) for info in gf]
        for info, qt in plan:  # PyTorch-order shapes: the writer reverses them
            writer.add_tensor_info(info.name, list(info.shape), np.dtype(np.float32),
                                   _byte_size(info, qt),
                                   raw_dtype=gguf.GGMLQuantizationType(qt))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, (info, qt) in enumerate(plan):
            writer.write_tensor_data(_convert(info, qt, str(gf.path)))
            if progress is not None:
                progress(i + 1, len(plan), info.name, qt.name)
        writer.close()
        os.replace(tmp, out)
    except OSError as e:
        raise QuantizeError(f"{out}: cannot write ({e.strerror or e})") from None
    finally:
        torch.set_num_threads(threads)
        writer.close()
        tmp.unlink(missing_ok=True)
    kept = [info.name for info, qt in plan
            if qt == GGMLType.F32 and len(info.shape) == 2 and info.shape[-1] % 32]
    return QuantizeResult(out, gf.file_size, out.stat().st_size, time.perf_counter() - t0,
                          {info.name: qt.name for info, qt in plan}, kept)


"""Memory-mapped GGUF reading with one-line errors.

The header (metadata and tensor infos) is parsed here directly: the `gguf` package's reader
builds a numpy view per string and takes seconds on a 49k-token vocabulary, while this parser
takes tens of milliseconds. Tensor data stays in one read-only memory map; each tensor is a
numpy view into it (raw bytes per row for quantized types, as `gguf.quants` expects).

File layout (little endian, version 2 and 3):
    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x (string key | u32 type | value)
    n_tensors x (string name | u32 n_dims | u64 dims[n_dims] | u32 ggml_type | u64 offset)
    padding to `general.alignment` (default 32) | tensor data
"""

from __future__ import annotations

import mmap
import os
import struct
from array import array
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from localllm.errors import ModelLoadError
from localllm.gguf.types import GGMLType
from localllm.text.string_table import StringTable

GGUF_MAGIC = b"GGUF"
_SCALARS: dict[int, tuple[str, Any]] = {  # value type -> (struct format, numpy dtype)
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
    4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
    10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9
# ggml types viewed as numpy numbers rather than as rows of block bytes
_PLAIN = {GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.I8: np.int8,
          GGMLType.I16: np.int16, GGMLType.I32: np.int32, GGMLType.I64: np.int64,
          GGMLType.F64: np.float64}


class TensorInfo(NamedTuple):
    name: str
    qtype: GGMLType
    shape: tuple[int, ...]  # PyTorch order: [rows, cols] for a matrix (GGUF stores it reversed)
    data: np.ndarray  # memory-mapped: plain dtype, or uint8 [rows, bytes_per_row] when blocked


class _Corrupt(Exception):
    pass


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise _Corrupt("unexpected end of file in the header")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise _Corrupt(f"string of {n} bytes runs past the end of the file")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int) -> StringTable:
        """An array of `count` strings, kept as their bytes (a vocabulary as a list of `str`
        costs several times its size; see `StringTable`)."""
        buf, pos, size = self.buf, self.pos, len(self.buf)
        unpack = struct.Struct("<Q").unpack_from
        starts, ends = array("q"), array("q")
        for _ in range(count):
            if pos + 8 > size:
                raise _Corrupt("unexpected end of file in the header")
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > size:
                raise _Corrupt(f"string of {n} bytes runs past the end of the file")
            starts.append(pos - self.pos)
            pos += n
            ends.append(pos - self.pos)
        blob = buf[self.pos:pos]  # the strings with their length prefixes between them
        self.pos = pos
        return StringTable(blob, np.frombuffer(starts, dtype=np.int64),
                           np.frombuffer(ends, dtype=np.int64))

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype][0])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.take("<I"), self.take("<Q")
            if itype in _SCALARS:
                dtype = np.dtype(_SCALARS[itype][1]).newbyteorder("<")
                nbytes = count * dtype.itemsize
                if self.pos + nbytes > len(self.buf):
                    raise _Corrupt(f"array of {count} values runs past the end of the file")
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += nbytes
                return arr.tolist()
            if count > len(self.buf) - self.pos:
                raise _Corrupt(f"array of {count} values cannot fit in the file")
            if itype == _STRING:
                return self.strings(count)
            return [self.value(itype) for _ in range(count)]
        raise _Corrupt(f"unknown metadata value type {vtype}")


class GGUFFile:
    """A GGUF file opened read-only through a memory map.

    `metadata` holds every key-value pair as plain Python values (str, int, float, bool,
    lists of those), except that arrays of strings (vocabularies, merges) are `StringTable`s.
    Tensor data stays in the memory map until a caller copies it.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise ModelLoadError(f"{self.path}: no such file")
        if self.path.is_dir():
            raise ModelLoadError(f"{self.path}: is a directory, not a GGUF file")
        try:
            with open(self.path, "rb") as f:
                magic = f.read(4)
                if magic != GGUF_MAGIC:
                    raise ModelLoadError(f"{self.path}: not a GGUF file (starts with {magic!r}, "
                                         "expected b'GGUF')")
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise ModelLoadError(f"{self.path}: cannot be read ({e.strerror})") from None
        try:
            self._parse()
        except (_Corrupt, struct.error, ValueError, TypeError, OverflowError,
                MemoryError) as e:
            raise ModelLoadError(f"{self.path}: corrupt or truncated GGUF file ({e}); "
                                 "download or copy it again") from None

    def _parse(self) -> None:
        cur = _Cursor(self._map)
        cur.pos = 4
        version = cur.take("<I")
        if version not in (2, 3):  # a whole file of another format version: not corrupt
            raise ModelLoadError(f"{self.path}: GGUF version {version} is not supported "
                                 "(localllm reads versions 2 and 3, which llama.cpp's converter "
                                 "writes); convert the model again")
        n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
        if n_tensors > len(self._map) or n_kv > len(self._map):
            raise _Corrupt(f"header claims {n_tensors} tensors and {n_kv} keys")
        self.version = version
        self.metadata: dict[str, Any] = {}
        # each key's value type and, for arrays, item type, as stored (for rewriting the file)
        self.metadata_types: dict[str, tuple[int, int | None]] = {}
        for _ in range(n_kv):
            key = cur.string()
            vtype = cur.take("<I")
            sub = None
            if vtype == _ARRAY and cur.pos + 4 <= len(self._map):
                (sub,) = struct.unpack_from("<I", self._map, cur.pos)
            self.metadata[key] = cur.value(vtype)
            self.metadata_types[key] = (vtype, sub)
        raw: list[tuple[str, tuple[int, ...], GGMLType, int]] = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.take("<I")
            if n_dims > 8:
                raise _Corrupt(f"tensor {name!r} claims {n_dims} dimensions")
            dims = tuple(cur.take("<Q") for _ in range(n_dims))
            type_id = cur.take("<I")
            try:
                qtype = GGMLType(type_id)
            except ValueError:
                raise _Corrupt(f"unknown tensor type {type_id}") from None
            raw.append((name, dims, qtype, cur.take("<Q")))
        align = self.metadata.get("general.alignment", 32)
        if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or (
                align & (align - 1)):
            raise _Corrupt(f"general.alignment {align} is not a power of two")
        data_start = -(-cur.pos // align) * align
        size = len(self._map)
        self._tensors: dict[str, TensorInfo] = {}
        self._spans: dict[str, tuple[int, int]] = {}  # name -> (first byte, end) in the file
        for name, dims, qtype, offset in raw:
            shape = tuple(reversed(dims))  # GGUF lists the fastest-varying dimension first
            n = int(np.prod(shape)) if shape else 1
            if qtype in _PLAIN:
                dtype = np.dtype(_PLAIN[qtype]).newbyteorder("<")
                nbytes, view_shape = n * dtype.itemsize, shape
            else:
                block, type_size = qtype.block_size, qtype.type_size
                if dims and dims[0] % block:
                    raise _Corrupt(f"tensor {name!r} has rows of {dims[0]} values, not a "
                                   f"multiple of its block size {block}")
                dtype = np.dtype(np.uint8)
                row_bytes = dims[0] // block * type_size if dims else type_size
                nbytes = n // block * type_size
                view_shape = (*shape[:-1], row_bytes) if shape else (row_bytes,)
            start = data_start + offset
            if start + nbytes > size:
                raise _Corrupt(f"tensor {name!r} ends at byte {start + nbytes}, past the end of "
                               f"the file ({size} bytes)")
            arr = np.frombuffer(self._map, dtype=dtype, count=nbytes // dtype.itemsize,
                                offset=start).reshape(view_shape)
            self._tensors[name] = TensorInfo(name, qtype, shape, arr)
            self._spans[name] = (start, start + nbytes)

    def release(self, info: TensorInfo, rows: tuple[int, int] | None = None) -> None:
        """Drop from this process's resident memory the file pages of a tensor that has been
        copied out, and of everything before it in the file (they stay in the page cache;
        touching them again maps them back). Loading calls it after each tensor, so the
        mapped file never counts whole. `rows` (start, end): up to the end of those rows.

        A page fault maps the whole cached folio around it, and with large folios (ext4 on
        Linux 6.16+) that reaches well into the neighbouring tensors: dropping only the
        tensor's own range left 21 MB of the default model's 94 MB file resident. Dropping
        a page still to be read (tensors out of file order) costs a minor fault."""
        start, end = self._spans[info.name]
        if rows is not None:
            end = start + rows[1] * ((end - start) // max(info.shape[0], 1))
        end = min(len(self._map), end // mmap.PAGESIZE * mmap.PAGESIZE)
        if hasattr(self._map, "madvise") and end > 0:
            self._map.madvise(mmap.MADV_DONTNEED, 0, end)

    @property
    def tensors(self) -> Mapping[str, TensorInfo]:
        return self._tensors

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self._tensors.values())

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(f"{self.path}: GGUF metadata has no general.architecture")
        return arch

    @property
    def file_size(self) -> int:
        return len(self._map)

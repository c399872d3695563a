"""One entry of the on-disk prefix store: the K/V of one full block, every layer, in one file.

Header (little-endian, `HEADER`), then the block's token ids, then the K/V bytes:

    offset  bytes  field
    0       4      magic b"LLKV"
    4       2      LAYOUT_VERSION
    6       2      header size
    8       16     model id (`StoreIdentity.model_id`): a file of another model is refused
    24      16     block hash (`prefix_cache.block_hash`), also the file's name
    40      4      number of token ids (the block size)
    44      8      payload bytes
    52      4      crc32 of bytes 0..52, the token ids and the payload
    56      4 * n  token ids, int32
    ...            payload: [num_layers, 2 (K, V), block_size, num_kv_heads, head_dim] in the
                   pool's dtype, bytes as the pool holds them

The checksum is a CRC32: it is there for torn, truncated or bit-flipped files (a crash, a power
loss before the page cache reached the disk, a bad sector), not against someone forging entries
in the user's own cache directory, and it runs at about 7 GB/s where sha256 manages 2 (it is on
the path of every hit). The model id and the token ids are compared as they are.

An entry is written to a private temporary name in the model's `tmp/` folder and renamed into
place (`os.replace`, atomic on one file system), so a reader sees a whole entry or none, whatever
happens to the writer.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import struct
import zlib
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np

from localllm.engine.prefix_cache import BlockKey

LAYOUT_VERSION = 1  # NOTE: bump when the header, the payload layout or the KV pool's bytes change
MAGIC = b"LLKV"
HEADER = struct.Struct("<4sHH16s16sIQI")
SUFFIX = ".kv"
_tmp_names = itertools.count()


class StoreIdentity(NamedTuple):
    """What makes K/V bytes reusable: entries live under a folder named by `model_id`."""

    fingerprint: str  # the model's weights (`LoadedModel.fingerprint`: file size and contents)
    backend: str  # `Backend.name`: backends compute K/V with different kernels and roundings
    kv_dtype: str  # the pool's dtype, e.g. "bfloat16"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    model_name: str = ""  # the file's name, shown by `localllm cache stats`; not in the id
    layout: int = LAYOUT_VERSION

    @property
    def model_id(self) -> str:
        fields = self._asdict()
        del fields["model_name"]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]

    @property
    def payload_bytes(self) -> int:
        itemsize = np.dtype(_NUMPY_SIZES[self.kv_dtype]).itemsize
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    @property
    def entry_bytes(self) -> int:
        return HEADER.size + 4 * self.block_size + self.payload_bytes

    def to_json(self) -> str:
        return json.dumps(self._asdict(), sort_keys=True)


# element sizes by dtype name (bf16 has no numpy dtype of its own)
_NUMPY_SIZES = {"float32": "f4", "float16": "f2", "bfloat16": "u2", "float64": "f8"}


class EntryError(Exception):
    """An entry that cannot be used; the message says why (one short phrase)."""


def entry_path(model_dir: Path, block_hash: bytes) -> Path:
    name = block_hash.hex()
    return model_dir / name[:2] / f"{name}{SUFFIX}"


def _header(model_id: bytes, key: BlockKey, payload_len: int) -> tuple[bytes, bytes]:
    tokens = np.asarray(key.token_ids, dtype="<i4").tobytes()
    head = HEADER.pack(MAGIC, LAYOUT_VERSION, HEADER.size, model_id, key.hash,
                       len(key.token_ids), payload_len, 0)
    return head, tokens


def write_entry(path: Path, tmp_dir: Path, model_id: bytes, key: BlockKey,
                payload: np.ndarray) -> int:
    """Write one entry atomically (temporary file, flush, rename); its size in bytes.

    `payload` is the block's K/V as uint8. No fsync: a killed process loses nothing the kernel
    already has, and after a power loss a torn file fails its checksum and is recomputed.
    """
    head, tokens = _header(model_id, key, payload.nbytes)
    body = payload.data  # a memoryview of the array
    crc = zlib.crc32(body, zlib.crc32(tokens, zlib.crc32(head[:HEADER.size - 4])))
    head = head[:HEADER.size - 4] + struct.pack("<I", crc)
    tmp = tmp_dir / f"{os.getpid()}-{next(_tmp_names)}.tmp"
    try:
        try:
            f = open(tmp, "wb")
        except FileNotFoundError:  # the folder went (`localllm cache clear`): make it again
            tmp_dir.mkdir(parents=True, exist_ok=True)
            f = open(tmp, "wb")
        with f:
            f.write(head)
            f.write(tokens)
            f.write(body)
        try:
            os.replace(tmp, path)
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return HEADER.size + len(tokens) + payload.nbytes


class EntryHeader(NamedTuple):
    model_id: bytes
    block_hash: bytes
    num_tokens: int
    payload_bytes: int
    crc: int
    raw: bytes


def read_header(f: BinaryIO) -> EntryHeader:
    raw = f.read(HEADER.size)
    if len(raw) < HEADER.size:
        raise EntryError("truncated header")
    magic, version, size, model_id, block_hash, n, payload, crc = HEADER.unpack(raw)
    if magic != MAGIC:
        raise EntryError("not an entry")
    if version != LAYOUT_VERSION or size != HEADER.size:
        raise EntryError(f"layout version {version}")
    return EntryHeader(model_id, block_hash, n, payload, crc, raw)


def _read_into(f: BinaryIO, buf: memoryview) -> int:
    done = 0
    while done < len(buf):
        n = f.readinto(buf[done:])  # type: ignore[attr-defined]
        if not n:
            break
        done += n
    return done


def read_entry(path: Path, model_id: bytes, key: BlockKey, out: np.ndarray) -> None:
    """Read and verify one entry, its payload into `out` (uint8, exactly the payload's size).

    Raises EntryError when the file is of another model or block, truncated, too long, or its
    checksum fails; OSError when it cannot be read (FileNotFoundError: gone).
    """
    with open(path, "rb", buffering=0) as f:
        head = read_header(f)
        if head.model_id != model_id:
            raise EntryError("entry of another model")
        if head.block_hash != key.hash:
            raise EntryError("entry of another block")
        n = len(key.token_ids)
        if head.num_tokens != n or head.payload_bytes != out.nbytes:
            raise EntryError("entry of another shape")
        tokens = f.read(4 * n)
        if len(tokens) < 4 * n or _read_into(f, out.data) != out.nbytes:
            raise EntryError("truncated")
        if f.read(1):
            raise EntryError("trailing bytes")
    crc = zlib.crc32(out.data, zlib.crc32(tokens, zlib.crc32(head.raw[:HEADER.size - 4])))
    if crc != head.crc:
        raise EntryError("checksum mismatch")
    if tuple(np.frombuffer(tokens, dtype="<i4").tolist()) != tuple(key.token_ids):
        raise EntryError("other token ids")  # a hash collision: not this prefix


def scan_entries(root: Path) -> list[tuple[str, bytes, int, float]]:
    """(model id, block hash, bytes, mtime) of every entry file under `root` whose header is
    whole and agrees with its place; other files in the entry folders are deleted."""
    found: list[tuple[str, bytes, int, float]] = []
    for model_dir in sorted(p for p in root.iterdir() if _is_hex(p.name, 32) and p.is_dir()):
        for sub in sorted(p for p in model_dir.iterdir() if _is_hex(p.name, 2) and p.is_dir()):
            for path in sub.iterdir():
                try:
                    with open(path, "rb") as f:
                        head = read_header(f)
                        size = os.fstat(f.fileno()).st_size
                        mtime = os.fstat(f.fileno()).st_mtime
                    ok = (head.model_id.hex() == model_dir.name
                          and path.name == f"{head.block_hash.hex()}{SUFFIX}"
                          and size == HEADER.size + 4 * head.num_tokens + head.payload_bytes)
                except (OSError, EntryError):
                    ok = False
                if ok:
                    found.append((model_dir.name, head.block_hash, size, mtime))
                else:
                    with contextlib.suppress(OSError):
                        path.unlink(missing_ok=True)
    return found


def _is_hex(name: str, n: int) -> bool:
    return len(name) == n and all(c in "0123456789abcdef" for c in name)

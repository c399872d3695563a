"""PrefixStore: tier 2 of the prefix cache, full KV blocks kept on disk across restarts.

The block manager asks it for the keys after tier 1's hits (`match`), loads the hits into fresh
pool blocks (`load`) and hands it every block that becomes full (`insert_blocks`). Layout of its
directory (the platformdirs user cache directory unless configured; `store_dir`):

    ROOT/index-1.sqlite3          the index shared by every process (`prefix_index`)
    ROOT/MODEL_ID/HH/HASH.kv      one entry per block (`prefix_entry`); MODEL_ID names the model
                                  file's contents, backend, KV dtype, block size and layout
    ROOT/MODEL_ID/tmp/            entries being written (PID-N.tmp)

Writes run on a background thread: `insert_blocks` copies the blocks' K/V out of the pool (the
pool block may be reused at the next step) and queues them, so no step waits on the disk and a
request may finish before its blocks are written. The writer then evicts least recently used
entries of the whole directory until it fits the size budget. Reads of a hit run one chunk
ahead on a reader thread: chunk i+1 is read and verified while chunk i is copied into the pool.

Failures never stop the engine: an entry that is missing, truncated, corrupt or of another model
is skipped (the first with a warning), deleted and recomputed; a failed write (full or read-only
disk) turns writing off with one warning; a directory that cannot be opened at all means no
store (`open_store` returns None, with a warning).

Handles (`PrefixHits.block_ids`) are row ids of the index. Locks are this process's pins: its
own evictions skip them. Another process may still evict a matched entry; `load` then gets fewer
blocks than matched and the rest is computed.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Protocol

import torch

from localllm.config import CacheConfig
from localllm.engine.prefix_cache import BlockKey, PrefixCache, PrefixHits, SizeInfo
from localllm.engine.prefix_entry import EntryError, StoreIdentity, entry_path, read_entry
from localllm.engine.prefix_index import StoreIndex, open_index
from localllm.engine.prefix_writer import StoreWriter

log = logging.getLogger("localllm")
ENV_DIR = "LOCALLLM_PREFIX_CACHE_DIR"
ENV_SWITCH = "LOCALLLM_PREFIX_CACHE"  # "0": off unless the config turns it on
READ_CHUNK = 8  # blocks read ahead of the copy into the pool
MATCH_BATCH = 64  # keys looked up per index query
_live: weakref.WeakSet[PrefixStore] = weakref.WeakSet()


class KVBlockIO(Protocol):
    """Copies whole blocks' K/V (every layer) out of and into the KV pool (the model runner)."""

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A CPU copy: [n, num_layers, 2, block_size, num_kv_heads, head_dim]."""
        ...

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Fill the blocks from `data` shaped as `read_blocks` gives it."""
        ...


def default_dir() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("localllm")) / "prefix"


def store_dir(cache: CacheConfig) -> Path | None:
    """The store's directory for `cache`, or None when the store is off."""
    on = cache.prefix_cache
    if on is None:
        on = os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "off", "false", "no")
    if not on:
        return None
    return Path(cache.prefix_cache_dir or os.environ.get(ENV_DIR) or default_dir()).expanduser()


class PrefixStore(PrefixCache):
    def __init__(self, root: Path, identity: StoreIdentity, io: KVBlockIO,
                 max_bytes: int, max_pending_bytes: int = 64 << 20) -> None:
        self.root = root
        self.identity = identity
        self.model = identity.model_id
        self.dir = root / self.model
        self.io = io
        self.kv_dtype: torch.dtype = getattr(torch, identity.kv_dtype)
        self._warned: set[str] = set()
        self._pins: dict[int, int] = {}  # row id -> locks held by this process
        self._pins_lock = threading.Lock()
        windex: StoreIndex | None = None
        write_error: Exception | None = None
        try:
            root.mkdir(parents=True, exist_ok=True)
            windex = open_index(root)
            windex.register(self.model, identity.to_json())
            (self.dir / "tmp").mkdir(parents=True, exist_ok=True)
        except (OSError, sqlite3.Error) as e:
            if windex is not None:
                windex.close()
            windex, write_error = None, e
        # the engine thread's own connection (the writer thread has `windex`); when even
        # reading fails, this raises and `open_store` says so
        self.index = open_index(root, readonly=windex is None)
        if write_error is not None:
            self.warn_once("write", "prefix cache: cannot write to %s (%s); stored prefixes are "
                           "used, new ones are not saved", root, write_error)
        self.writer = StoreWriter(self, windex, max_bytes, max_pending_bytes)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="localllm-prefix-read")
        self._bufs: list[torch.Tensor] = []  # two chunks of entries' payloads, made on first use
        self._closed = False
        _live.add(self)

    @property
    def writable(self) -> bool:
        return self.writer.writable

    def warn_once(self, kind: str, msg: str, *args: object) -> None:
        """A warning the first time for `kind`, debug lines after that."""
        level = logging.DEBUG if kind in self._warned else logging.WARNING
        self._warned.add(kind)
        log.log(level, msg, *args)

    # ---------------------------------------------------------------- the PrefixCache contract
    def match(self, keys: Iterable[BlockKey]) -> PrefixHits:
        """Hits for the longest run of `keys` that the index holds for this model.

        Looks keys up `MATCH_BATCH` at a time, so it reads up to that many keys past the first
        miss. Token ids are compared when an entry is loaded (they are in its file).
        """
        ids: list[int] = []
        hashes: list[bytes] = []
        it = iter(keys)
        while not self._closed:
            batch = [k for _, k in zip(range(MATCH_BATCH), it)]
            if not batch:
                break
            found = self.index.find(self.model, [k.hash for k in batch])
            for key in batch:
                row = found.get(key.hash)
                if row is None:
                    return PrefixHits(tuple(ids), tuple(hashes))
                ids.append(row)
                hashes.append(key.hash)
        return PrefixHits(tuple(ids), tuple(hashes))

    def lock(self, block_ids: Sequence[int]) -> None:
        with self._pins_lock:
            for row in block_ids:
                self._pins[row] = self._pins.get(row, 0) + 1

    def unlock(self, block_ids: Sequence[int]) -> None:
        with self._pins_lock:
            for row in block_ids:
                if self._pins.get(row, 0) <= 0:
                    raise ValueError(f"entry {row} is not locked")
                self._pins[row] -= 1
                if not self._pins[row]:
                    del self._pins[row]

    def pinned(self) -> set[int]:
        with self._pins_lock:
            return set(self._pins)

    def insert(self, block_id: int, key: BlockKey) -> bool:
        """Queue pool block `block_id` to be written under `key` (it holds no lock)."""
        return self.insert_blocks([block_id], [key]) == 1

    def insert_blocks(self, block_ids: Sequence[int], keys: Sequence[BlockKey]) -> int:
        """Copy the blocks' K/V out of the pool now and queue them for the writer thread;
        how many were queued (none while writing is off or the queue is full)."""
        if not block_ids or not self.writer.reserve(len(block_ids)):
            return 0
        data = self.io.read_blocks(block_ids)  # [n, layers, 2, block_size, kv_heads, head_dim]
        self.writer.put_blocks(keys, data)
        return len(block_ids)

    def evict(self, n: int) -> list[int]:
        """Delete up to `n` entries of the directory, least recently used first; their ids."""
        return self.writer.evict(count=n)

    def __contains__(self, block_id: object) -> bool:
        return isinstance(block_id, int) and not self._closed and self.index.has_row(block_id)

    @property
    def size_info(self) -> SizeInfo:
        total = 0 if self._closed else self.index.count(self.model)
        locked = len(self.pinned())
        return SizeInfo(max(0, total - locked), locked)

    def check_integrity(self) -> None:
        """Every row of this model has its whole file; totals agree with the rows."""
        for h, size in self.index.rows(self.model):
            path = entry_path(self.dir, h)
            assert path.is_file(), f"entry {h.hex()} has a row but no file"
            assert path.stat().st_size == size, f"entry {h.hex()}: size differs from its row"
        n, size = self.index.totals()
        rows = self.index.con.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM entries")
        assert (n, size) == tuple(rows.fetchone()), "the index's totals disagree with its rows"

    # ---------------------------------------------------------------- loading hits
    def load(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> int:
        """Read entries `keys` into pool blocks `block_ids`, in order, stopping at the first
        that cannot be used; how many were loaded. Reading runs a chunk ahead of the copy."""
        n = 0
        if self._closed or not keys:
            return 0
        if not self._bufs:
            self._bufs = [torch.empty(READ_CHUNK, self.identity.payload_bytes,
                                      dtype=torch.uint8) for _ in range(2)]
        try:
            n = self._load(keys, block_ids)
        except Exception:
            log.exception("prefix cache: loading stored blocks failed; they are recomputed")
            n = 0
        if n:
            self.writer.put_touch([k.hash for k in keys[:n]])
        return n

    def _load(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> int:
        cfg = self.identity
        shape = (cfg.num_layers, 2, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
        pending: Future[int] | None = self._reader.submit(
            self._read_chunk, keys[:READ_CHUNK], self._bufs[0])
        n = 0
        try:
            for c, start in enumerate(range(0, len(keys), READ_CHUNK)):
                assert pending is not None
                loaded = pending.result()  # leading entries of the chunk, read and verified
                pending = None
                chunk = keys[start:start + READ_CHUNK]
                nxt = start + READ_CHUNK
                if loaded == len(chunk) and nxt < len(keys):
                    pending = self._reader.submit(self._read_chunk, keys[nxt:nxt + READ_CHUNK],
                                                  self._bufs[(c + 1) % 2])
                if loaded:
                    data = self._bufs[c % 2][:loaded].view(self.kv_dtype).view(-1, *shape)
                    self.io.write_blocks(block_ids[start:start + loaded], data)
                n += loaded
                if loaded < len(chunk):
                    break
        finally:
            if pending is not None:  # a copy failed: the buffer must be free before reuse
                wait([pending])
        return n

    def _read_chunk(self, keys: Sequence[BlockKey], buf: torch.Tensor) -> int:
        """On the reader thread: entries into rows of `buf` until one fails."""
        mid = bytes.fromhex(self.model)
        for i, key in enumerate(keys):
            path = entry_path(self.dir, key.hash)
            try:
                read_entry(path, mid, key, buf[i].numpy())
            except FileNotFoundError:  # evicted by another process, or never written whole
                log.debug("prefix cache: entry %s is gone", key.hash.hex())
                self.writer.put_forget([key.hash])
                return i
            except (OSError, EntryError) as e:
                self.warn_once("entry", "prefix cache: skipped an unusable entry in %s (%s); it "
                               "is deleted and recomputed", self.dir, e)
                with contextlib.suppress(OSError):
                    path.unlink()
                self.writer.put_forget([key.hash])
                return i
        return len(keys)

    def record_lookup(self, asked_tokens: int, hit_tokens: int) -> None:
        """Count tokens of an admitted prompt asked of the store, and those it served."""
        self.writer.put_count(asked_tokens, hit_tokens)

    def touch(self, hashes: Sequence[bytes]) -> None:
        """Mark entries used now (tier 1 served them), so the budget keeps them longest."""
        if hashes:
            self.writer.put_touch(list(hashes))

    # ---------------------------------------------------------------- lifetime
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued is on disk and in the index; False on timeout."""
        return self.writer.flush(timeout)

    def close(self, timeout: float | None = 60.0) -> None:
        """Finish queued writes (up to `timeout` seconds), then stop both threads."""
        if self._closed:
            return
        if self.writer.close(timeout):
            self._closed = True
            self._reader.shutdown(wait=True)
            self.index.close()
            _live.discard(self)


def open_store(cache: CacheConfig, identity: StoreIdentity, io: KVBlockIO) -> PrefixStore | None:
    """The store `cache` asks for, or None (off, or its directory unusable: one warning)."""
    root = store_dir(cache)
    if root is None:
        return None
    try:
        return PrefixStore(root, identity, io, cache.prefix_cache_bytes)
    except (OSError, sqlite3.Error) as e:
        log.warning("prefix cache: cannot use %s (%s); running without it", root, e)
        return None


@atexit.register
def _close_all() -> None:
    """Queued blocks are written before the process exits (a short `generate` needs this)."""
    t0 = time.monotonic()
    for store in list(_live):
        store.close(timeout=max(1.0, 60.0 - (time.monotonic() - t0)))


"""The prefix store's background thread: writes queued blocks, updates the index, keeps the
size budget.

The engine thread only appends to a queue (`put_*`); this thread takes up to `BATCH` items at a
time, writes the new entries' files, records them, the uses and the lookups in one index
transaction, then evicts least recently used entries of the whole directory (every model's)
until the budget holds. Blocks queued while `max_pending_bytes` are already waiting are not
saved: a step never waits for the disk. The first failed write (full or read-only disk) turns
writing off for good, with one warning; queued writes are dropped and the engine goes on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from localllm.engine.prefix_cache import BlockKey
from localllm.engine.prefix_entry import StoreIdentity, entry_path, write_entry
from localllm.engine.prefix_index import LRUEntry, StoreIndex

log = logging.getLogger("localllm")
BATCH = 64
STALE_TMP_SECONDS = 3600.0


class _Write(NamedTuple):
    key: BlockKey
    data: torch.Tensor  # [num_layers, 2, block_size, num_kv_heads, head_dim] on the CPU


class _Touch(NamedTuple):
    hashes: list[bytes]


class _Forget(NamedTuple):
    hashes: list[bytes]


class _Count(NamedTuple):
    asked: int
    hits: int


_Item = _Write | _Touch | _Forget | _Count


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def clean_tmp(tmp_dir: Path) -> None:
    """Delete temporary files of writers that are gone (killed mid-write)."""
    now = time.time()
    for path in tmp_dir.iterdir():
        pid = path.name.split("-", 1)[0]
        try:
            stale = (not pid.isdigit() or not _pid_alive(int(pid))
                     or now - path.stat().st_mtime > STALE_TMP_SECONDS)
            if stale and pid != str(os.getpid()):
                path.unlink()
        except OSError:
            continue


class StoreParts(Protocol):
    """What the writer reads of its `PrefixStore`."""

    root: Path
    dir: Path  # the model's folder
    model: str  # the model id
    identity: StoreIdentity

    def pinned(self) -> set[int]: ...

    def warn_once(self, kind: str, msg: str, *args: object) -> None: ...


class StoreWriter:
    def __init__(self, store: StoreParts, index: StoreIndex | None, max_bytes: int,
                 max_pending_bytes: int) -> None:
        self.store = store
        self.index = index  # None: the store is read-only and this thread never runs
        self.max_bytes = max_bytes
        self.max_pending_bytes = max_pending_bytes
        self.writable = index is not None
        self._entry_bytes = store.identity.entry_bytes
        self._cond = threading.Condition()
        # NOTE: the four fields below are guarded by _cond
        self._queue: deque[_Item] = deque()
        self._busy = 0  # items taken by the thread and not done yet
        self._pending_bytes = 0  # of queued and busy writes
        self._closing = False
        self._index_lock = threading.Lock()  # `index` is used by this thread and by evict()
        self._thread: threading.Thread | None = None
        if index is not None:
            with contextlib.suppress(OSError):
                clean_tmp(store.dir / "tmp")
            self._thread = threading.Thread(target=self._run, name="localllm-prefix-write",
                                            daemon=True)
            self._thread.start()

    # ---------------------------------------------------------------- the engine side
    def reserve(self, n: int) -> bool:
        """Room for `n` more blocks in the queue (taken now), or False."""
        with self._cond:
            if not self.writable or self._closing:
                return False
            size = n * self._entry_bytes
            if self._pending_bytes + size > self.max_pending_bytes:
                log.debug("prefix cache: write queue full, %d blocks not saved", n)
                return False
            self._pending_bytes += size
            return True

    def put_blocks(self, keys: Sequence[BlockKey], data: torch.Tensor) -> None:
        self._put(*(_Write(k, d) for k, d in zip(keys, data)))

    def put_touch(self, hashes: list[bytes]) -> None:
        self._put(_Touch(hashes))

    def put_forget(self, hashes: list[bytes]) -> None:
        self._put(_Forget(hashes))

    def put_count(self, asked: int, hits: int) -> None:
        self._put(_Count(asked, hits))

    def _put(self, *items: _Item) -> None:
        with self._cond:
            if self._thread is None or self._closing:
                return
            self._queue.extend(items)
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float | None) -> bool:
        """Write what is queued and stop; False when that took longer than `timeout`."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("prefix cache: %d queued items not written after %.0f s",
                            len(self._queue), timeout or 0)
                return False
        if self.index is not None:
            self.index.close()
        return True

    # ---------------------------------------------------------------- the thread
    def _run(self) -> None:
        # NOTE: a lower priority for this thread alone (Linux: per-thread nice values), so that
        # it takes the CPU only when the model's threads leave it idle: next to a busy thread,
        # OpenMP's workers wait on each other and a prompt step takes several times longer
        with contextlib.suppress(AttributeError, OSError):
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + 10))
        self._guarded(self.evict)  # the budget may be smaller than last time
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                batch = [self._queue.popleft() for _ in range(min(BATCH, len(self._queue)))]
                self._busy = len(batch)
            self._guarded(self._apply, batch)
            with self._cond:
                self._busy = 0
                self._pending_bytes -= self._entry_bytes * sum(isinstance(b, _Write)
                                                               for b in batch)
                self._cond.notify_all()

    def _guarded(self, fn: Callable[..., object], *args: object) -> None:
        try:
            fn(*args)
        except (OSError, sqlite3.Error) as e:
            self._disable(e)
        except Exception:
            log.exception("prefix cache: the writer failed; new prefixes are not saved")
            self._disable(None)

    def _disable(self, error: BaseException | None) -> None:
        if error is not None:
            self.store.warn_once("write", "prefix cache: cannot write to %s (%s); new prefixes "
                                 "are not saved, the engine goes on", self.store.root, error)
        with self._cond:
            self.writable = False
            dropped = [b for b in self._queue if isinstance(b, _Write)]
            self._queue = deque(b for b in self._queue if not isinstance(b, _Write))
            self._pending_bytes -= self._entry_bytes * len(dropped)

    def _apply(self, batch: list[_Item]) -> None:
        store, index = self.store, self.index
        assert index is not None
        writes = [b for b in batch if isinstance(b, _Write)]
        touch = [h for b in batch if isinstance(b, _Touch) for h in b.hashes]
        forget = [h for b in batch if isinstance(b, _Forget) for h in b.hashes]
        asked = sum(b.asked for b in batch if isinstance(b, _Count))
        hits = sum(b.hits for b in batch if isinstance(b, _Count))
        rows: list[tuple[bytes, int]] = []
        error: OSError | None = None
        with self._index_lock:
            # a forgotten entry (a bad file, deleted) is written again if it is queued
            seen = set(index.find(store.model, [w.key.hash for w in writes])) if writes else set()
            seen -= set(forget)
            mid = bytes.fromhex(store.model)
            for w in writes if self.writable else []:
                h = w.key.hash
                if h in seen:  # stored already (by another process, or earlier in this batch)
                    touch.append(h)
                    continue
                seen.add(h)
                try:
                    size = write_entry(entry_path(store.dir, h), store.dir / "tmp", mid, w.key,
                                       w.data.reshape(-1).view(torch.uint8).numpy())
                except OSError as e:
                    error = e
                    break
                rows.append((h, size))
            now = time.time()
            with index.transaction():
                index.remove(store.model, forget)
                index.add(store.model, rows, now)
                index.touch(store.model, touch, now)
                if asked:
                    index.count_lookups(store.model, asked, hits)
        if error is not None:
            raise error
        if rows:
            self.evict()

    def evict(self, count: int | None = None) -> list[int]:
        """Delete entries least recently used first, skipping this process's pins: `count` of
        them, or (None) as many as it takes to bring the directory within the budget."""
        index = self.index
        if index is None:
            return []
        pinned = self.store.pinned()
        victims: list[LRUEntry] = []
        with self._index_lock, index.transaction():
            over = index.totals()[1] - self.max_bytes
            offset = 0
            while (over > 0) if count is None else (len(victims) < count):
                page = index.oldest(256, offset)
                if not page:
                    break
                offset += len(page)
                for e in page:
                    if e.model == self.store.model and e.row_id in pinned:
                        continue
                    victims.append(e)
                    over -= e.bytes
                    if (over <= 0) if count is None else (len(victims) == count):
                        break
            index.remove_ids([v.row_id for v in victims])
        for v in victims:
            with contextlib.suppress(OSError):
                entry_path(self.store.root / v.model, v.hash).unlink()
        if victims:
            log.debug("prefix cache: evicted %d entries", len(victims))
        return [v.row_id for v in victims]

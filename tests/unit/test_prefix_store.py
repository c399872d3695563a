"""The on-disk prefix store without a model: entries survive a new store instance, identity
changes never reuse them, bad entries are skipped and deleted, the budget holds, writes never
block the caller, reads run ahead, and a full or read-only disk turns writing off once."""

from __future__ import annotations

import errno
import logging
import sqlite3
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from store_helpers import IDENTITY, PoolIO, chain, load_and_check, store_blocks

from localllm.config import CacheConfig
from localllm.engine import prefix_store, prefix_writer
from localllm.engine.prefix_cache import BlockKey
from localllm.engine.prefix_entry import HEADER, StoreIdentity, entry_path, write_entry
from localllm.engine.prefix_index import INDEX_NAME, StoreIndex
from localllm.engine.prefix_store import READ_CHUNK, PrefixStore, open_store, store_dir

ENTRY = IDENTITY.entry_bytes


def make(root: Path, io: PoolIO | None = None, max_bytes: int = 1 << 30,
         identity: StoreIdentity = IDENTITY) -> tuple[PrefixStore, PoolIO]:
    io = io or PoolIO()
    return PrefixStore(root, identity, io, max_bytes), io


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_entries_survive_a_new_store_and_load_exactly(tmp_path: Path) -> None:
    store, io = make(tmp_path)
    keys = chain(1, 6)
    store_blocks(store, io, keys)
    store.close()
    again, io2 = make(tmp_path)
    other = chain(2, 1)
    assert again.match(keys[:3] + other + keys[3:]).num_blocks == 3  # stops at the first miss
    assert load_and_check(again, io2, keys, first_block=20) == (6, 0)
    assert again.size_info.total == 6
    again.check_integrity()
    files = sorted(p.name for p in (tmp_path / IDENTITY.model_id).rglob("*.kv"))
    assert files == sorted(f"{k.hash.hex()}.kv" for k in keys)
    assert all(p.stat().st_size == ENTRY for p in (tmp_path / IDENTITY.model_id).rglob("*.kv"))
    again.close()


@pytest.mark.parametrize("change", [{"fingerprint": "other-weights"}, {"backend": "triton"},
                                    {"kv_dtype": "bfloat16"}, {"layout": 99},
                                    {"num_kv_heads": 1}])
def test_another_identity_never_reuses_entries(tmp_path: Path, change: dict[str, object]) -> None:
    store, io = make(tmp_path)
    keys = chain(1, 4)
    store_blocks(store, io, keys)
    store.close()
    other = IDENTITY._replace(**change)
    assert other.model_id != IDENTITY.model_id
    assert IDENTITY._replace(model_name="renamed.gguf").model_id == IDENTITY.model_id
    dtype = torch.bfloat16 if change.get("kv_dtype") == "bfloat16" else torch.float32
    theirs, _ = make(tmp_path, PoolIO(dtype=dtype), identity=other)
    assert theirs.match(keys).num_blocks == 0
    theirs.close()


def _damage(path: Path, how: str, foreign: Path) -> None:
    raw = bytearray(path.read_bytes())
    if how == "corrupt":
        raw[-7] ^= 0x40
    elif how == "truncated":
        raw = raw[:len(raw) // 2]
    elif how == "wrong checksum":
        raw[HEADER.size - 4:HEADER.size] = struct.pack("<I", 12345)
    elif how == "foreign":
        raw = bytearray(foreign.read_bytes())  # another model's entry in this place
    elif how == "other token ids":  # a whole entry, but of another block with this hash
        key = BlockKey(bytes.fromhex(path.stem), (7,) * IDENTITY.block_size)
        write_entry(path, path.parent, bytes.fromhex(IDENTITY.model_id), key,
                    np.zeros(IDENTITY.payload_bytes, dtype=np.uint8))
        return
    elif how == "trailing bytes":
        raw += b"\0" * 8
    elif how == "empty":
        raw = bytearray()
    elif how == "half-written":  # the row is there, the file never made it
        path.unlink()
        (path.parents[1] / "tmp" / "999999-0.tmp").write_bytes(raw[:100])
        return
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["corrupt", "truncated", "wrong checksum", "foreign",
                                 "other token ids", "trailing bytes", "empty", "half-written"])
def test_bad_entries_are_skipped_deleted_and_recomputed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str) -> None:
    keys = chain(1, 6)
    store, io = make(tmp_path)
    store_blocks(store, io, keys)
    store.close()
    foreign_store, fio = make(tmp_path, identity=IDENTITY._replace(fingerprint="other"))
    store_blocks(foreign_store, fio, keys)  # the same blocks, the same bytes, another model
    foreign_store.close()
    model_dir = tmp_path / IDENTITY.model_id
    for bad in (keys[2], keys[4]):
        foreign = entry_path(tmp_path / foreign_store.model, bad.hash)
        _damage(entry_path(model_dir, bad.hash), how, foreign)

    store, io = make(tmp_path)
    assert not list((model_dir / "tmp").iterdir())  # a dead writer's leftovers are removed
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="localllm"):
        assert store.match(keys).num_blocks == 6  # the index knows nothing is wrong yet
        assert load_and_check(store, io, keys, first_block=10) == (2, 0)
        store.flush()
        assert not entry_path(model_dir, keys[2].hash).exists()
        assert store.match(keys).num_blocks == 2  # the row went with the file
        assert load_and_check(store, io, keys[3:], first_block=10) == (1, 0)  # past the first
    warned = warnings_of(caplog)
    assert len(warned) == (0 if how == "half-written" else 1), warned
    store_blocks(store, io, keys)  # recomputed blocks are stored again
    store.flush()
    assert load_and_check(store, io, keys, first_block=10) == (6, 0)
    store.check_integrity()
    store.close()


def test_budget_evicts_least_recently_used_across_models(tmp_path: Path) -> None:
    other = IDENTITY._replace(fingerprint="other")
    theirs, tio = make(tmp_path, max_bytes=5 * ENTRY, identity=other)
    store_blocks(theirs, tio, chain(9, 2))
    theirs.close()
    store, io = make(tmp_path, max_bytes=5 * ENTRY)
    old = chain(1, 3)
    store_blocks(store, io, old)
    store.flush()
    assert load_and_check(store, io, old[:1], first_block=50) == (1, 0)  # used again: kept
    store.flush()
    time.sleep(0.01)
    new = chain(2, 4)
    store_blocks(store, io, new, first_block=10)
    store.flush()
    entries, size = store.index.totals()
    assert size <= 5 * ENTRY and entries == 5
    assert store.match(old[:1]).num_blocks == 1
    assert store.match(old[1:2]).num_blocks == 0 and store.match(old[2:]).num_blocks == 0
    assert store.match(new).num_blocks == 4
    assert len(list(tmp_path.rglob("*.kv"))) == 5  # the other model's entries went first
    store.check_integrity()
    # evict(n), the contract's call, skips what this process has locked
    hits = store.match(new)
    store.lock(hits.block_ids[:1])
    assert hits.block_ids[0] not in store.evict(10)
    assert store.size_info.total == 1 and store.size_info.locked == 1
    store.unlock(hits.block_ids[:1])
    store.close()


def test_writes_never_block_the_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real = prefix_writer.write_entry

    def slow_disk(*args: object) -> int:
        gate.wait(10)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(prefix_writer, "write_entry", slow_disk)
    store, io = make(tmp_path)
    keys = chain(1, 8)
    t0 = time.perf_counter()
    store_blocks(store, io, keys)
    assert time.perf_counter() - t0 < 1.0
    io.pool.zero_()  # the pool blocks are reused: the queued copies must not change
    assert not store.flush(timeout=0.2)
    gate.set()
    assert store.flush(timeout=10)
    assert load_and_check(store, io, keys, first_block=20) == (8, 0)
    store.close()


def test_reads_run_a_chunk_ahead_of_the_copy(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    keys = chain(1, 3 * READ_CHUNK)
    store, io = make(tmp_path)
    store_blocks(store, io, keys)
    store.flush()
    second_chunk_read = threading.Event()
    real = prefix_store.read_entry

    def read_entry(path: Path, *args: object) -> None:
        if path.name.startswith(keys[READ_CHUNK].hash.hex()):
            second_chunk_read.set()
        real(path, *args)  # type: ignore[arg-type]

    copies: list[bool] = []
    write = io.write_blocks

    def write_blocks(ids: list[int], data: torch.Tensor) -> None:
        if not copies:  # the first chunk's copy: the next chunk is being read meanwhile
            copies.append(second_chunk_read.wait(5))
        write(ids, data)

    monkeypatch.setattr(prefix_store, "read_entry", read_entry)
    monkeypatch.setattr(io, "write_blocks", write_blocks)
    assert load_and_check(store, io, keys, first_block=100) == (len(keys), 0)
    assert copies == [True]
    store.close()


def test_full_disk_turns_writing_off_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    store, io = make(tmp_path)
    early = chain(1, 3)
    store_blocks(store, io, early)
    store.flush()
    real = prefix_writer.write_entry
    calls = []

    def full(*args: object) -> int:
        calls.append(1)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(prefix_writer, "write_entry", full)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="localllm"):
        for seed in range(2, 6):
            store_blocks(store, io, chain(seed, 4), first_block=20)
            store.flush()
    assert len(warnings_of(caplog)) == 1 and "No space left" in warnings_of(caplog)[0]
    assert not store.writable
    reads = io.reads
    assert store.insert_blocks([0], early[:1]) == 0 and io.reads == reads  # no copy either
    assert load_and_check(store, io, early, first_block=40) == (3, 0)  # reading goes on
    assert store.match(chain(2, 4)).num_blocks == 2  # what was written before is whole
    store.check_integrity()
    store.close()


def test_read_only_index_means_reading_without_writing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    store, io = make(tmp_path)
    keys = chain(1, 4)
    store_blocks(store, io, keys)
    store.close()

    def read_only(self: StoreIndex, model: str, identity: str) -> None:
        raise sqlite3.OperationalError("attempt to write a readonly database")

    monkeypatch.setattr(StoreIndex, "register", read_only)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="localllm"):
        ro, io = make(tmp_path)
        assert load_and_check(ro, io, keys, first_block=10) == (4, 0)
        assert ro.insert_blocks([0, 1], chain(2, 2)) == 0
        ro.close()
    assert len(warnings_of(caplog)) == 1 and "readonly" in warnings_of(caplog)[0]


def test_a_broken_or_missing_index_is_rebuilt_from_the_entries(tmp_path: Path) -> None:
    store, io = make(tmp_path)
    keys = chain(1, 5)
    store_blocks(store, io, keys)
    store.close()
    (tmp_path / INDEX_NAME).write_bytes(b"this is not a database" * 100)
    again, io = make(tmp_path)
    assert load_and_check(again, io, keys, first_block=10) == (5, 0)
    again.check_integrity()
    again.close()
    (tmp_path / INDEX_NAME).unlink()
    third, io = make(tmp_path)
    assert third.index.totals() == (5, 5 * ENTRY)
    third.close()


def test_switches_and_an_unusable_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(prefix_store.ENV_SWITCH, raising=False)
    monkeypatch.setenv(prefix_store.ENV_DIR, str(tmp_path / "env"))
    assert store_dir(CacheConfig()) == tmp_path / "env"
    assert store_dir(CacheConfig(prefix_cache_dir=str(tmp_path / "cfg"))) == tmp_path / "cfg"
    assert store_dir(CacheConfig(prefix_cache=False)) is None
    monkeypatch.setenv(prefix_store.ENV_SWITCH, "0")
    assert store_dir(CacheConfig()) is None
    assert store_dir(CacheConfig(prefix_cache=True)) == tmp_path / "env"
    monkeypatch.delenv(prefix_store.ENV_DIR)
    assert store_dir(CacheConfig(prefix_cache=True)) == prefix_store.default_dir()
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="localllm"):
        assert open_store(CacheConfig(prefix_cache=True, prefix_cache_dir=str(blocker)),
                          IDENTITY, PoolIO()) is None
    assert len(warnings_of(caplog)) == 1 and "running without it" in warnings_of(caplog)[0]

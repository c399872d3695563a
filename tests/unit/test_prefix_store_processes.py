"""The prefix store shared by processes and on real file systems: two writers and readers of
one directory at once, a writer killed with SIGKILL, and a full and a read-only tmpfs (where
this machine lets the tests mount one)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from store_helpers import IDENTITY, PoolIO, chain, load_and_check, store_blocks

from localllm.engine.prefix_entry import read_entry
from localllm.engine.prefix_index import StoreIndex
from localllm.engine.prefix_store import PrefixStore

HELPER = Path(__file__).resolve().parents[1] / "store_helpers.py"
BLOCKS = 60


def worker(root: Path, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, str(HELPER), str(root), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_two_processes_write_and_read_one_directory_at_once(tmp_path: Path) -> None:
    # both write chain 3 too: the same entries from two writers at the same moments
    a = worker(tmp_path, "--write", "1", "--write", "3", "--read", "2", "--blocks", str(BLOCKS))
    b = worker(tmp_path, "--write", "2", "--write", "3", "--read", "1", "--blocks", str(BLOCKS))
    results = []
    for p in (a, b):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    assert results == [{"written": 2 * BLOCKS, "loaded": BLOCKS, "wrong": 0}] * 2
    store = PrefixStore(tmp_path, IDENTITY, PoolIO(), max_bytes=1 << 30)
    for seed in (1, 2, 3):  # nothing lost, nothing torn
        assert load_and_check(store, store.io, chain(seed, BLOCKS), 0) == (BLOCKS, 0)
    assert store.index.totals() == (3 * BLOCKS, 3 * BLOCKS * IDENTITY.entry_bytes)
    store.check_integrity()
    assert len(list(tmp_path.rglob("*.kv"))) == 3 * BLOCKS
    store.close()


def test_sigkill_while_writing_leaves_a_usable_store(tmp_path: Path) -> None:
    tmp = tmp_path / IDENTITY.model_id / "tmp"
    p = worker(tmp_path, "--write", "1", "--blocks", "20", "--slow", "--forever")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _stored(tmp_path, 30):
            time.sleep(0.05)
        (tmp_path / "slow").touch()  # from now on each payload waits 0.5 s: a wide window
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (tmp.is_dir() and any(tmp.iterdir())):
            time.sleep(0.001)
        p.send_signal(signal.SIGKILL)  # in the middle of writing an entry
    finally:
        p.kill()
        p.wait()
    assert any(tmp.iterdir())
    keys = {k.hash.hex(): k for seed in range(1, 200) for k in chain(seed, 20)}
    payload = np.empty(IDENTITY.payload_bytes, dtype=np.uint8)
    for path in (tmp_path / IDENTITY.model_id).rglob("*.kv"):  # with or without a row
        read_entry(path, bytes.fromhex(IDENTITY.model_id), keys[path.stem], payload)
    store = PrefixStore(tmp_path, IDENTITY, PoolIO(num_blocks=64), max_bytes=1 << 30)
    assert not any(tmp.iterdir())  # the dead writer's temporary file is gone
    store.check_integrity()  # every row has its whole file
    entries = store.index.totals()[0]
    assert entries >= 30
    served = 0
    for seed in range(1, entries // 20 + 2):
        n, wrong = load_and_check(store, store.io, chain(seed, 20), 0)
        assert wrong == 0
        served += n
    assert served == entries  # every indexed entry verifies and loads
    fresh = chain(999, 8)
    store_blocks(store, store.io, fresh, first_block=30)
    store.flush()
    assert load_and_check(store, store.io, fresh, 40) == (8, 0)
    store.close()


def _stored(root: Path, n: int) -> bool:
    try:
        index = StoreIndex(root, "ro")
    except Exception:  # not created yet
        return False
    try:
        return index.totals()[0] >= n
    finally:
        index.close()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 192 KiB tmpfs (skips where mounting is not allowed)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_full_disk_turns_writing_off_with_one_warning(
        tmpfs: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = PrefixStore(tmpfs, IDENTITY, PoolIO(), max_bytes=1 << 30)
    with caplog.at_level(logging.WARNING, logger="localllm"):
        for seed in range(1, 40):  # about 1 MiB of entries for 192 KiB
            store_blocks(store, store.io, chain(seed, 8))
            store.flush()
    assert not store.writable
    assert len(_warnings(caplog)) == 1, _warnings(caplog)
    assert "No space left" in _warnings(caplog)[0] or "full" in _warnings(caplog)[0]
    stored = store.index.totals()[0]
    assert stored > 0
    assert load_and_check(store, store.io, chain(1, 8), 100)[1] == 0
    store.check_integrity()
    store.close()


def test_a_read_only_disk_serves_what_it_holds(
        tmpfs: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = PrefixStore(tmpfs, IDENTITY, PoolIO(), max_bytes=1 << 30)
    keys = chain(1, 8)
    store_blocks(store, store.io, keys)
    store.close()
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    with caplog.at_level(logging.WARNING, logger="localllm"):
        ro = PrefixStore(tmpfs, IDENTITY, PoolIO(), max_bytes=1 << 30)
        assert load_and_check(ro, ro.io, keys, 20) == (8, 0)
        assert ro.insert_blocks([0], chain(2, 1)) == 0
        ro.close()
    assert len(_warnings(caplog)) == 1 and "cannot write" in _warnings(caplog)[0]

"""The prefix store's index: one sqlite3 database at the root of the store's directory.

Why sqlite: several processes (a `chat` and a `serve`) share one directory, and each needs the
total size (for the budget), the least recently used entries (to evict) and whether a hash is
stored (to match), without listing the directory per request. sqlite gives exactly that with
transactions across processes (its own file locks, WAL journal: readers never wait for a
writer) and survives a process killed mid-write; a hand-made ledger would have to re-implement
both. It is in the standard library.

Tables: `entries` (one row per entry file: model id, block hash, bytes, last use), `totals`
(entries and bytes of the whole directory, kept by triggers in the same transactions as the
rows, so usage is one row read) and `models` (each model's identity and its lookup counters for
`localllm cache stats`). Row ids of `entries` are never reused (AUTOINCREMENT): the store hands
them out as its handles.

Order of writes: an entry's file is renamed into place before its row is added, and its row is
deleted before its file, so a row can lack its file only for a moment or after a crash; readers
treat that as a miss and drop the row. A file without a row (a crash between rename and insert)
is found again when its block is next written. The index itself can always be rebuilt from the
entry files' headers; that happens when it is missing or unreadable.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import shutil
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from localllm.engine.prefix_entry import scan_entries

log = logging.getLogger("localllm")
SCHEMA_VERSION = 1
INDEX_NAME = f"index-{SCHEMA_VERSION}.sqlite3"

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS entries (
        id INTEGER PRIMARY KEY AUTOINCREMENT, model TEXT NOT NULL, hash BLOB NOT NULL,
        bytes INTEGER NOT NULL, last_used REAL NOT NULL, UNIQUE (model, hash))""",
    "CREATE INDEX IF NOT EXISTS entries_lru ON entries (last_used)",
    """CREATE TABLE IF NOT EXISTS totals (
        id INTEGER PRIMARY KEY CHECK (id = 0), entries INTEGER NOT NULL, bytes INTEGER NOT NULL)""",
    "INSERT OR IGNORE INTO totals VALUES (0, 0, 0)",
    """CREATE TRIGGER IF NOT EXISTS entries_added AFTER INSERT ON entries BEGIN
        UPDATE totals SET entries = entries + 1, bytes = bytes + NEW.bytes WHERE id = 0; END""",
    """CREATE TRIGGER IF NOT EXISTS entries_removed AFTER DELETE ON entries BEGIN
        UPDATE totals SET entries = entries - 1, bytes = bytes - OLD.bytes WHERE id = 0; END""",
    """CREATE TABLE IF NOT EXISTS models (
        model TEXT PRIMARY KEY, identity TEXT NOT NULL, lookups INTEGER NOT NULL DEFAULT 0,
        hits INTEGER NOT NULL DEFAULT 0)""",
)
_MAX_VARS = 500  # host parameters per statement


class ModelUsage(NamedTuple):
    model: str  # model id (folder name)
    identity: str  # StoreIdentity as JSON; "" when only the entries are known
    entries: int
    bytes: int
    lookups: int  # prompt tokens asked of the store
    hits: int  # of those, tokens loaded from it
    last_used: float  # 0 when no entry


class LRUEntry(NamedTuple):
    row_id: int
    model: str
    hash: bytes
    bytes: int


def _chunks(items: Sequence[bytes], n: int = _MAX_VARS) -> Iterable[Sequence[bytes]]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


class StoreIndex:
    """One connection to the index. The store opens one per thread that uses it."""

    def __init__(self, root: Path, mode: str = "rwc") -> None:
        """`mode`: rwc (read, write, create), ro (read only), immutable (read only, in a
        folder where not even sqlite's lock files can be made)."""
        path = root / INDEX_NAME
        self.readonly = mode != "rwc"
        query = {"rwc": "", "ro": "?mode=ro", "immutable": "?immutable=1"}[mode]
        self.con = sqlite3.connect(f"file:{path}{query}", uri=True, timeout=30.0,
                                   isolation_level=None, check_same_thread=False)
        if not self.readonly:
            # NOTE: processes opening a new index at the same moment take turns: switching a
            # fresh file to WAL can fail with SQLITE_BUSY without waiting, and a second opener
            # must not read the file before the first has created the tables
            with _exclusive(root / (INDEX_NAME + ".lock")):
                self.con.execute("PRAGMA journal_mode=WAL")
                self.con.execute("PRAGMA synchronous=NORMAL")
                self._create(root)
        self.con.execute("SELECT entries FROM totals").fetchone()  # a broken file fails here

    def _create(self, root: Path) -> None:
        with self.transaction():
            if self.con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION:
                return
            for stmt in _SCHEMA:
                self.con.execute(stmt)
            now = time.time()
            rows = [(m, h, n, min(t, now)) for m, h, n, t in scan_entries(root)]
            self.con.executemany("INSERT OR IGNORE INTO entries (model, hash, bytes, last_used) "
                                 "VALUES (?, ?, ?, ?)", rows)
            if rows:
                log.info("prefix cache: index of %s rebuilt from %d entries", root, len(rows))
            self.con.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def transaction(self) -> _Transaction:
        return _Transaction(self.con)

    def close(self) -> None:
        self.con.close()

    # ---------------------------------------------------------------- reads
    def find(self, model: str, hashes: Sequence[bytes]) -> dict[bytes, int]:
        """Row ids of the given hashes that are stored for `model`."""
        found: dict[bytes, int] = {}
        for part in _chunks(hashes):
            marks = ",".join("?" * len(part))
            for h, row in self.con.execute(
                    f"SELECT hash, id FROM entries WHERE model = ? AND hash IN ({marks})",
                    (model, *part)):
                found[bytes(h)] = int(row)
        return found

    def has_row(self, row_id: int) -> bool:
        row = self.con.execute("SELECT 1 FROM entries WHERE id = ?", (row_id,)).fetchone()
        return row is not None

    def count(self, model: str) -> int:
        return int(self.con.execute("SELECT COUNT(*) FROM entries WHERE model = ?",
                                    (model,)).fetchone()[0])

    def totals(self) -> tuple[int, int]:
        """Entries and bytes of the whole directory."""
        n, size = self.con.execute("SELECT entries, bytes FROM totals").fetchone()
        return int(n), int(size)

    def rows(self, model: str) -> list[tuple[bytes, int]]:
        return [(bytes(h), int(n)) for h, n in self.con.execute(
            "SELECT hash, bytes FROM entries WHERE model = ?", (model,))]

    def oldest(self, limit: int, offset: int = 0) -> list[LRUEntry]:
        return [LRUEntry(int(i), m, bytes(h), int(n)) for i, m, h, n in self.con.execute(
            "SELECT id, model, hash, bytes FROM entries ORDER BY last_used, id LIMIT ? OFFSET ?",
            (limit, offset))]

    def usage(self) -> list[ModelUsage]:
        counts = {m: (int(n), int(b), float(t)) for m, n, b, t in self.con.execute(
            "SELECT model, COUNT(*), SUM(bytes), MAX(last_used) FROM entries GROUP BY model")}
        out = []
        for m, ident, lookups, hits in self.con.execute(
                "SELECT model, identity, lookups, hits FROM models"):
            n, b, t = counts.pop(m, (0, 0, 0.0))
            out.append(ModelUsage(m, ident, n, b, int(lookups), int(hits), t))
        out += [ModelUsage(m, "", n, b, 0, 0, t) for m, (n, b, t) in counts.items()]
        return sorted(out, key=lambda u: -u.last_used)

    # ---------------------------------------------------------------- writes
    def register(self, model: str, identity: str) -> None:
        with self.transaction():
            self.con.execute("INSERT INTO models (model, identity) VALUES (?, ?) "
                             "ON CONFLICT (model) DO UPDATE SET identity = excluded.identity",
                             (model, identity))

    def add(self, model: str, rows: Sequence[tuple[bytes, int]], now: float) -> None:
        """Entries just renamed into place; a row already there is only marked used now."""
        self.con.executemany(
            "INSERT INTO entries (model, hash, bytes, last_used) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (model, hash) DO UPDATE SET last_used = excluded.last_used",
            [(model, h, n, now) for h, n in rows])

    def touch(self, model: str, hashes: Sequence[bytes], now: float) -> None:
        for part in _chunks(hashes):
            marks = ",".join("?" * len(part))
            self.con.execute(f"UPDATE entries SET last_used = ? WHERE model = ? AND hash IN "
                             f"({marks})", (now, model, *part))

    def remove(self, model: str, hashes: Sequence[bytes]) -> None:
        for part in _chunks(hashes):
            marks = ",".join("?" * len(part))
            self.con.execute(f"DELETE FROM entries WHERE model = ? AND hash IN ({marks})",
                             (model, *part))

    def remove_ids(self, row_ids: Sequence[int]) -> None:
        self.con.executemany("DELETE FROM entries WHERE id = ?", [(i,) for i in row_ids])

    def remove_models(self, models: Sequence[str]) -> None:
        for m in models:
            self.con.execute("DELETE FROM entries WHERE model = ?", (m,))
            self.con.execute("DELETE FROM models WHERE model = ?", (m,))

    def count_lookups(self, model: str, lookups: int, hits: int) -> None:
        self.con.execute("UPDATE models SET lookups = lookups + ?, hits = hits + ? "
                         "WHERE model = ?", (lookups, hits, model))


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on an exception): takes the write lock up front, so
    two processes never deadlock upgrading a read to a write."""

    def __init__(self, con: sqlite3.Connection) -> None:
        self.con = con

    def __enter__(self) -> sqlite3.Connection:
        self.con.execute("BEGIN IMMEDIATE")
        return self.con

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.con.execute("COMMIT")
        else:
            self.con.execute("ROLLBACK")


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """An exclusive advisory lock on `lock_path` (created if absent) for the block."""
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def open_index(root: Path, readonly: bool = False) -> StoreIndex:
    """The index at `root`; read-only where asked (falling back to sqlite's immutable mode in
    a folder it cannot write), else rebuilt when its file is not a database (one warning)."""
    if readonly:
        try:
            return StoreIndex(root, "ro")
        except sqlite3.OperationalError:
            return StoreIndex(root, "immutable")
    try:
        return StoreIndex(root)
    except sqlite3.DatabaseError as e:
        if isinstance(e, sqlite3.OperationalError):
            raise
        log.warning("prefix cache: the index %s is unreadable (%s); rebuilding it",
                    root / INDEX_NAME, e)
    for suffix in ("", "-wal", "-shm"):
        (root / (INDEX_NAME + suffix)).unlink(missing_ok=True)
    return StoreIndex(root)


def clear_models(root: Path, models: Sequence[str]) -> None:
    """Forget the models' entries and delete their folders (other processes that still use
    one make it again on their next write)."""
    index = open_index(root)
    try:
        with index.transaction():
            index.remove_models(models)
    finally:
        index.close()
    for m in models:
        shutil.rmtree(root / m, ignore_errors=True)

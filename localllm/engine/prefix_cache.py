"""The prefix-cache contract and its in-memory tier.

A full KV block is named by `block_hash`: blake2b over its parent's hash, its token ids and the
model fingerprint, so one hash stands for the whole prefix up to and including that block. A
`PrefixCache` maps such hashes to handles of blocks whose K/V it keeps. `LRUPrefixCache` is the
first tier: an index over blocks of the KV pool, whose unlocked entries are the blocks no request
holds, evicted least recently unlocked first.

Mutation rules (who calls what):

- Only the `BlockManager` calls `lock`, `unlock`, `insert` and `evict`. It stays the one owner of
  block tables and reference counts; a cache changes only its own index and lock counts.
- A request that uses a hit locks it (`lock`) and unlocks it when it lets go of the block
  (`unlock`); a block it fills and `insert`s counts as locked once by it. While any lock is held
  the entry is never evicted.
- `match`, `size_info`, `check_integrity` and `in` change nothing and may be called any time on
  the thread that steps the engine.

The second tier, `PrefixStore` (blocks kept on disk, `prefix_store.py`), sits behind the same
contract: `match` gives hits in chain order and stops at the first miss, so the block manager
asks the store for the keys after the hits of the first tier.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np


def block_hash(parent: bytes, token_ids: Sequence[int], fingerprint: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(fingerprint)
    return h.digest()


class BlockKey(NamedTuple):
    """Identity of one full block: its chained hash and its own token ids."""

    hash: bytes
    token_ids: tuple[int, ...]


class PrefixHits(NamedTuple):
    """Hits of a `match`, in chain order: entry i holds the K/V of the i-th key asked."""

    block_ids: tuple[int, ...]  # the cache's handle of each hit (a KV-pool block id in tier 1)
    hashes: tuple[bytes, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


NO_HITS = PrefixHits((), ())


class SizeInfo(NamedTuple):
    evictable: int  # cached entries without a lock: `evict` may take them
    locked: int  # cached entries some request holds

    @property
    def total(self) -> int:
        return self.evictable + self.locked


class PrefixCache(ABC):
    """A cache of full KV blocks keyed by chained block hash (see the module docstring)."""

    @abstractmethod
    def match(self, keys: Iterable[BlockKey]) -> PrefixHits:
        """Hits for the longest run of `keys`, from the first, that the cache holds.

        A key hits when its hash is cached with the same token ids. `keys` is read in order and
        no further than the first miss, so it may be a lazy generator. Changes nothing: a hit
        is safe to use only once it is locked, and before any other mutating call.
        """

    @abstractmethod
    def lock(self, block_ids: Sequence[int]) -> None:
        """Add one lock to each cached entry; a locked entry leaves the evictable set."""

    @abstractmethod
    def unlock(self, block_ids: Sequence[int]) -> None:
        """Remove one lock from each cached entry, in the order given.

        An entry whose last lock goes becomes evictable, behind every other evictable entry,
        so the block manager passes a request's blocks tail first: those are evicted first.
        """

    @abstractmethod
    def insert(self, block_id: int, key: BlockKey) -> bool:
        """Register a block that just became full, held by the one request that filled it.

        The entry starts with one lock, the caller's. Returns False and changes nothing when
        the block is already cached or another block holds the same hash.
        """

    @abstractmethod
    def evict(self, n: int) -> list[int]:
        """Forget up to `n` unlocked entries, least recently unlocked first; their ids.

        Evicted blocks hold no cached K/V anymore: the allocator may hand them out as plain
        free blocks. Locked entries are never evicted; fewer than `n` come back when fewer are
        evictable.
        """

    @abstractmethod
    def __contains__(self, block_id: object) -> bool:
        """Whether `block_id` is a cached entry (locked or not)."""

    @property
    @abstractmethod
    def size_info(self) -> SizeInfo: ...

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError when the cache's own state is inconsistent."""


class LRUPrefixCache(PrefixCache):
    """Tier 1: an index over KV-pool blocks with lock counts and an LRU of unlocked entries."""

    def __init__(self) -> None:
        self._by_hash: dict[bytes, int] = {}
        self._keys: dict[int, BlockKey] = {}  # block id -> its key
        self._locks: dict[int, int] = {}  # block id -> number of locks held
        self._lru: OrderedDict[int, None] = OrderedDict()  # unlocked, least recent first

    def match(self, keys: Iterable[BlockKey]) -> PrefixHits:
        ids: list[int] = []
        hashes: list[bytes] = []
        for key in keys:
            bid = self._by_hash.get(key.hash)
            if bid is None or self._keys[bid].token_ids != key.token_ids:
                break
            ids.append(bid)
            hashes.append(key.hash)
        return PrefixHits(tuple(ids), tuple(hashes))

    def lock(self, block_ids: Sequence[int]) -> None:
        for bid in block_ids:
            if self._locks[bid] == 0:
                del self._lru[bid]
            self._locks[bid] += 1

    def unlock(self, block_ids: Sequence[int]) -> None:
        for bid in block_ids:
            if self._locks[bid] <= 0:
                raise ValueError(f"block {bid} is not locked")
            self._locks[bid] -= 1
            if self._locks[bid] == 0:
                self._lru[bid] = None

    def insert(self, block_id: int, key: BlockKey) -> bool:
        if block_id in self._keys or key.hash in self._by_hash:
            return False
        self._by_hash[key.hash] = block_id
        self._keys[block_id] = key
        self._locks[block_id] = 1
        return True

    def evict(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n and self._lru:
            bid, _ = self._lru.popitem(last=False)
            del self._by_hash[self._keys.pop(bid).hash]
            del self._locks[bid]
            out.append(bid)
        return out

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._keys

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(len(self._lru), len(self._keys) - len(self._lru))

    def check_integrity(self) -> None:
        assert len(self._by_hash) == len(self._keys), (
            f"{len(self._by_hash)} hashes for {len(self._keys)} cached blocks")
        for bid, key in self._keys.items():
            assert self._by_hash.get(key.hash) == bid, f"hash of block {bid} maps elsewhere"
        assert self._locks.keys() == self._keys.keys(), "lock counts and entries disagree"
        assert self._lru.keys() <= self._keys.keys(), "the evictable queue holds unknown blocks"
        for bid, locks in self._locks.items():
            assert locks >= 0, f"block {bid} has {locks} locks"
            assert (locks == 0) == (bid in self._lru), (
                f"block {bid}: {locks} locks but {'in' if bid in self._lru else 'not in'} "
                "the evictable queue")

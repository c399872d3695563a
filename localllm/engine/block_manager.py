"""Block tables of requests over a `BlockAllocator` and a `PrefixCache`.

The scheduler talks only to this facade. On admission a prompt's full blocks are looked up in the
prefix cache (`match_prefix`), the hits are shared and locked, and fresh blocks come from the
front of the allocator's free queue. Blocks that become full are hashed and inserted into the
cache; a finished or preempted request releases its blocks tail first, those the cache does
not index to the front of the queue (reused before never-used blocks: their pages are
resident).

NOTE: only this class changes `Request.block_table`, `Request.block_hashes`, reference counts
and prefix-cache entries.

NOTE: an unlocked cached block stays in the allocator's free queue, and both keep the order in
which blocks were released, so the cache's least recently unlocked entry is the first cached
block in the queue. Taking a block from the front evicts that entry first: the least recently
freed cached block is reused first, as vLLM and nano-vllm do.

Sliding windows: when every layer of the model has one (`kv_window` > 0, e.g. Mistral), a
running request's blocks that lie wholly before the window of its next position are released
after each step (`release_behind_window`): no later query of any layer reads them (the
attention backends never read block-table entries before a query's window). Their ids stay in
`block_table[:num_released_blocks]`, stale, so positions keep their index; the blocks go back
to the free queue and, being hashed, stay in the prefix cache until reused. A later prompt with
that prefix matches them only while every block of its chain is still cached (`match` stops at
the first miss), and the blocks it gets hold exactly the K/V a cold run computes for those
positions: the K/V of position p depends only on tokens 0..p, whatever was freed since. Models
with a global layer (Gemma 2/3) keep every block.

A second tier, the on-disk `PrefixStore`, is asked for the keys after the first tier's hits
(`match` stops at the first miss). On admission its hits are loaded into fresh blocks, which
then join the first tier as blocks the request filled; a block that fails to load is computed
instead, with every block after it. Every block that becomes full is handed to the store too,
whose writer thread saves it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

from localllm.engine.block_allocator import BlockAllocator
from localllm.engine.prefix_cache import (
    BlockKey,
    LRUPrefixCache,
    PrefixCache,
    SizeInfo,
    block_hash,
)
from localllm.engine.prefix_store import PrefixStore
from localllm.engine.request import Request

log = logging.getLogger("localllm")


class PrefixMatch(NamedTuple):
    """A prompt's cached prefix: the first tier's hits, then the store's hits after them."""

    block_ids: tuple[int, ...]  # tier 1: pool blocks, shared as they are
    hashes: tuple[bytes, ...]
    stored: tuple[BlockKey, ...] = ()  # tier 2: the next blocks, loaded into fresh blocks
    stored_ids: tuple[int, ...] = ()  # the store's handles of those
    asked: int = 0  # blocks asked of the store

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids) + len(self.stored)


NO_MATCH = PrefixMatch((), ())


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, fingerprint: str,
                 cache: PrefixCache | None = None, store: PrefixStore | None = None,
                 kv_window: int = 0) -> None:
        self.allocator = BlockAllocator(num_blocks)
        self.cache = cache if cache is not None else LRUPrefixCache()
        self.store = store
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.fingerprint = fingerprint.encode()
        self.kv_window = kv_window  # > 0: every layer attends to at most this many positions
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request owns, cached ones included."""
        return self.allocator.num_free

    @property
    def free_ids(self) -> OrderedDict[int, None]:
        """The allocator's free queue, front first (read-only for callers)."""
        return self.allocator.free_ids

    @property
    def usage(self) -> float:
        return 1.0 - self.allocator.num_free / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _prompt_keys(self, token_ids: Sequence[int]) -> Iterator[BlockKey]:
        # At least one token is left uncovered so the model still computes the last position.
        bs = self.block_size
        parent = b""
        for i in range((len(token_ids) - 1) // bs):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            parent = block_hash(parent, chunk, self.fingerprint)
            yield BlockKey(parent, chunk)

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Cached blocks covering the longest prefix of full blocks, short of the last token:
        the first tier's, then the store's after them.

        Changes nothing; `allocate` locks the hits it is given and loads the stored ones.
        """
        if self.store is None:
            hits = self.cache.match(self._prompt_keys(token_ids))
            return PrefixMatch(hits.block_ids, hits.hashes)
        keys = list(self._prompt_keys(token_ids))
        hits = self.cache.match(keys)
        rest = keys[hits.num_blocks:]
        if not rest:
            return PrefixMatch(hits.block_ids, hits.hashes)
        stored = self.store.match(rest)
        return PrefixMatch(hits.block_ids, hits.hashes, tuple(rest[:stored.num_blocks]),
                           stored.block_ids, len(rest))

    def record_prefix_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Count an admitted request's lookup once, however often it was retried."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit

    def _num_new_blocks(self, req: Request, num_new_tokens: int, hits: PrefixMatch) -> int:
        """Fresh blocks to take: for the new tokens and for the store's hits."""
        total = req.num_computed_tokens + hits.num_blocks * self.block_size + num_new_tokens
        return self.blocks_needed(total) - len(req.block_table) - len(hits.block_ids)

    def can_allocate(self, req: Request, num_new_tokens: int,
                     hits: PrefixMatch = NO_MATCH) -> bool:
        need = self._num_new_blocks(req, num_new_tokens, hits)
        reclaim = sum(1 for b in hits.block_ids if self.allocator.ref_counts[b] == 0)
        return need + reclaim <= self.allocator.num_free

    def can_grow(self, reqs: Sequence[Request], num_new_tokens: int) -> bool:
        """Whether every request of `reqs` can have blocks for its next `num_new_tokens` tokens
        at once."""
        # a request holding more blocks than it needs (taken ahead for steps that did not run)
        # lends none of them to the others
        need = sum(max(0, self._num_new_blocks(r, num_new_tokens, NO_MATCH)) for r in reqs)
        return need <= self.allocator.num_free

    def allocate(self, req: Request, num_new_tokens: int, hits: PrefixMatch = NO_MATCH) -> bool:
        """Give `req` its prefix hits (on admission) and enough new blocks for its next tokens.

        Hits from the store are loaded here; `req.block_hashes` then ends with those that
        loaded, and the caller computes the rest of the prompt from there.
        """
        if not self.can_allocate(req, num_new_tokens, hits):
            return False
        need = self._num_new_blocks(req, num_new_tokens, hits)
        for bid in hits.block_ids:
            self.allocator.acquire(bid)
        self.cache.lock(hits.block_ids)
        req.block_table.extend(hits.block_ids)
        req.block_hashes.extend(hits.hashes)
        fresh = [self._take_block() for _ in range(need)]
        req.block_table.extend(fresh)
        if self.store is not None:
            self._load_stored(req, hits, fresh)
        return True

    def _load_stored(self, req: Request, hits: PrefixMatch, fresh: list[int]) -> None:
        assert self.store is not None
        loaded = 0
        if hits.stored:
            self.store.lock(hits.stored_ids)
            try:
                loaded = self.store.load(hits.stored, fresh[:len(hits.stored)])
            finally:
                self.store.unlock(hits.stored_ids)
            for key, bid in zip(hits.stored[:loaded], fresh):
                self.cache.insert(bid, key)  # locked once, by `req`, as a block it filled
                req.block_hashes.append(key.hash)
        if hits.asked:
            bs = self.block_size
            self.store.record_lookup(hits.asked * bs, loaded * bs)
            log.info("prefix cache: %d tokens from disk, %d from memory", loaded * bs,
                     len(hits.block_ids) * bs)
        self.store.touch(hits.hashes)

    def _take_block(self) -> int:
        bid = self.allocator.take()
        if bid in self.cache:  # the cache's least recently unlocked entry (module NOTE)
            evicted = self.cache.evict(1)
            assert evicted == [bid], f"the prefix cache evicted {evicted}, not block {bid}"
        return bid

    def free(self, req: Request) -> None:
        """Release a request's blocks; tail blocks become the first to be evicted. Blocks the
        cache does not index go to the front of the free queue: their pages are resident, so
        the next request reuses them instead of faulting in fresh memory (about 2% of a decode
        step at 1 and 8 sequences, and the process grows only to the blocks in use at once)."""
        cached: list[int] = []
        for bid in reversed(req.block_table[req.num_released_blocks:]):
            indexed = bid in self.cache
            self.allocator.release(bid, front=not indexed)
            if indexed:
                cached.append(bid)
        self.cache.unlock(cached)
        req.block_table = []
        req.block_hashes = []
        req.num_released_blocks = 0

    def release_behind_window(self, req: Request) -> None:
        """Release the hashed blocks wholly before the window of `req`'s next position (see
        the module docstring); nothing without `kv_window`."""
        if not self.kv_window:
            return
        # the next query is at num_computed_tokens; it sees positions > that - kv_window
        first_seen = req.num_computed_tokens - self.kv_window + 1
        dead = min(max(first_seen, 0) // self.block_size, len(req.block_hashes))
        released = req.block_table[req.num_released_blocks:dead]
        if not released:
            return
        for bid in released:
            self.allocator.release(bid)
        self.cache.unlock([bid for bid in released if bid in self.cache])
        req.num_released_blocks = dead

    def cache_full_blocks(self, req: Request) -> list[bytes]:
        """Hash the blocks that became full, insert them in the cache and hand them to the
        store (which copies them out now and writes them later); the new hashes."""
        bs = self.block_size
        new: list[bytes] = []
        keys: list[BlockKey] = []
        for i in range(len(req.block_hashes), req.num_computed_tokens // bs):
            parent = req.block_hashes[-1] if req.block_hashes else b""
            chunk = tuple(req.token_ids(i * bs, (i + 1) * bs))
            h = block_hash(parent, chunk, self.fingerprint)
            req.block_hashes.append(h)
            keys.append(BlockKey(h, chunk))
            self.cache.insert(req.block_table[i], keys[-1])
            new.append(h)
        if self.store is not None and keys:
            start = len(req.block_hashes) - len(keys)
            self.store.insert_blocks(req.block_table[start:len(req.block_hashes)], keys)
        return new

    def check_invariants(self, live: Iterable[Request]) -> None:
        """Raise AssertionError if reference counts, the free queue or the cache disagree."""
        owners: dict[int, int] = {}
        for req in live:
            table = req.block_table[req.num_released_blocks:]
            assert len(set(table)) == len(table), f"{req} repeats a block"
            for bid in table:
                owners[bid] = owners.get(bid, 0) + 1
        self.allocator.check_integrity(owners)
        self.cache.check_integrity()
        cached = [bid for bid in range(self.num_blocks) if bid in self.cache]
        unowned = sum(1 for bid in cached if self.allocator.ref_counts[bid] == 0)
        expect = SizeInfo(evictable=unowned, locked=len(cached) - unowned)
        assert self.cache.size_info == expect, (
            f"prefix cache {self.cache.size_info}, but its blocks' owners give {expect}")

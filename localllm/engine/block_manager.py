"""Block tables of requests over a `BlockAllocator` and a `PrefixCache`.

The scheduler talks only to this facade. On admission a prompt's full blocks are looked up in the
prefix cache (`match_prefix`), the hits are shared and locked, and fresh blocks come from the
front of the allocator's free queue. Blocks that become full are hashed and inserted into the
cache; a finished or preempted request releases its blocks tail first.

NOTE: only this class changes `Request.block_table`, `Request.block_hashes`, reference counts
and prefix-cache entries.

NOTE: an unlocked cached block stays in the allocator's free queue, and both keep the order in
which blocks were released, so the cache's least recently unlocked entry is the first cached
block in the queue. Taking a block from the front evicts that entry first: the least recently
freed cached block is reused first, as vLLM and nano-vllm do.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from localllm.engine.block_allocator import BlockAllocator
from localllm.engine.prefix_cache import (
    NO_HITS,
    BlockKey,
    LRUPrefixCache,
    PrefixCache,
    PrefixHits,
    SizeInfo,
    block_hash,
)
from localllm.engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, fingerprint: str,
                 cache: PrefixCache | None = None) -> None:
        self.allocator = BlockAllocator(num_blocks)
        self.cache = cache if cache is not None else LRUPrefixCache()
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.fingerprint = fingerprint.encode()
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

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixHits:
        """Cached blocks covering the longest prefix of full blocks, short of the last token.

        Changes nothing; `allocate` locks the hits it is given.
        """
        return self.cache.match(self._prompt_keys(token_ids))

    def record_prefix_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Count an admitted request's lookup once, however often it was retried."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit

    def _num_new_blocks(self, req: Request, num_new_tokens: int, num_hits: int) -> int:
        total = req.num_computed_tokens + num_hits * self.block_size + num_new_tokens
        return self.blocks_needed(total) - len(req.block_table) - num_hits

    def can_allocate(self, req: Request, num_new_tokens: int, hits: PrefixHits = NO_HITS) -> bool:
        need = self._num_new_blocks(req, num_new_tokens, hits.num_blocks)
        reclaim = sum(1 for b in hits.block_ids if self.allocator.ref_counts[b] == 0)
        return need + reclaim <= self.allocator.num_free

    def allocate(self, req: Request, num_new_tokens: int, hits: PrefixHits = NO_HITS) -> bool:
        """Give `req` its prefix hits (on admission) and enough new blocks for its next tokens."""
        if not self.can_allocate(req, num_new_tokens, hits):
            return False
        need = self._num_new_blocks(req, num_new_tokens, hits.num_blocks)
        for bid in hits.block_ids:
            self.allocator.acquire(bid)
        self.cache.lock(hits.block_ids)
        req.block_table.extend(hits.block_ids)
        req.block_hashes.extend(hits.hashes)
        for _ in range(need):
            req.block_table.append(self._take_block())
        return True

    def _take_block(self) -> int:
        bid = self.allocator.take()
        if bid in self.cache:  # the cache's least recently unlocked entry (module NOTE)
            evicted = self.cache.evict(1)
            assert evicted == [bid], f"the prefix cache evicted {evicted}, not block {bid}"
        return bid

    def free(self, req: Request) -> None:
        """Release a request's blocks; tail blocks become the first to be evicted."""
        cached: list[int] = []
        for bid in reversed(req.block_table):
            self.allocator.release(bid)
            if bid in self.cache:
                cached.append(bid)
        self.cache.unlock(cached)
        req.block_table = []
        req.block_hashes = []

    def cache_full_blocks(self, req: Request) -> list[bytes]:
        """Hash the blocks that became full and insert them in the cache; the new hashes."""
        bs = self.block_size
        tokens = req.all_token_ids
        new: list[bytes] = []
        for i in range(len(req.block_hashes), req.num_computed_tokens // bs):
            parent = req.block_hashes[-1] if req.block_hashes else b""
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = block_hash(parent, chunk, self.fingerprint)
            req.block_hashes.append(h)
            self.cache.insert(req.block_table[i], BlockKey(h, chunk))
            new.append(h)
        return new

    def check_invariants(self, live: Iterable[Request]) -> None:
        """Raise AssertionError if reference counts, the free queue or the cache disagree."""
        owners: dict[int, int] = {}
        for req in live:
            assert len(set(req.block_table)) == len(req.block_table), f"{req} repeats a block"
            for bid in req.block_table:
                owners[bid] = owners.get(bid, 0) + 1
        self.allocator.check_integrity(owners)
        self.cache.check_integrity()
        cached = [bid for bid in range(self.num_blocks) if bid in self.cache]
        unowned = sum(1 for bid in cached if self.allocator.ref_counts[bid] == 0)
        expect = SizeInfo(evictable=unowned, locked=len(cached) - unowned)
        assert self.cache.size_info == expect, (
            f"prefix cache {self.cache.size_info}, but its blocks' owners give {expect}")

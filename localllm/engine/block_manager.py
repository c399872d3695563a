"""Paged KV block allocation with hash-chained prefix caching.

A full block's identity is blake2b(parent hash, its token ids, model fingerprint). Blocks whose
reference count drops to zero go to the back of the free queue but keep their hash, so a later
request with the same prefix can take them back; allocation takes from the front of the queue,
which evicts the least recently freed cached block (LRU).

NOTE: only this class changes `Request.block_table`, `Request.block_hashes` and reference
counts.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from localllm.engine.request import Request


def block_hash(parent: bytes, token_ids: Sequence[int], fingerprint: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(fingerprint)
    return h.digest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, fingerprint: str) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.fingerprint = fingerprint.encode()
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_ids) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """Cached blocks (and their hashes) covering the longest prefix of full blocks.

        At least one token is left uncovered so the model still computes the last position.
        """
        bs = self.block_size
        ids: list[int] = []
        hashes: list[bytes] = []
        parent = b""
        for i in range((len(token_ids) - 1) // bs):
            chunk = token_ids[i * bs:(i + 1) * bs]
            h = block_hash(parent, chunk, self.fingerprint)
            bid = self.hash_to_block.get(h)
            if bid is None or self.blocks[bid].token_ids != tuple(chunk):
                break
            ids.append(bid)
            hashes.append(h)
            parent = h
        return ids, hashes

    def record_prefix_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Count an admitted request's lookup once, however often it was retried."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit

    def can_allocate(self, req: Request, num_new_tokens: int,
                     cached: Sequence[int] = ()) -> bool:
        total = req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - len(req.block_table) - len(cached)
        reclaim = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        return need + reclaim <= self.num_free_blocks

    def allocate(self, req: Request, num_new_tokens: int, cached: Sequence[int] = (),
                 cached_hashes: Sequence[bytes] = ()) -> bool:
        """Give `req` cached blocks (on admission) and enough new blocks for its next tokens."""
        if not self.can_allocate(req, num_new_tokens, cached):
            return False
        for bid in cached:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free_ids[bid]
            block.ref_count += 1
            req.block_table.append(bid)
        req.block_hashes.extend(cached_hashes)
        total = req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        while len(req.block_table) < self.blocks_needed(total):
            req.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        bid, _ = self.free_ids.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None and self.hash_to_block.get(block.hash) == bid:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return bid

    def free(self, req: Request) -> None:
        """Release a request's blocks; tail blocks become the first to be evicted."""
        for bid in reversed(req.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_ids[bid] = None
        req.block_table = []
        req.block_hashes = []

    def cache_full_blocks(self, req: Request) -> list[bytes]:
        """Register the hashes of blocks that became full; returns the new hashes."""
        bs = self.block_size
        tokens = req.all_token_ids
        new: list[bytes] = []
        for i in range(len(req.block_hashes), req.num_computed_tokens // bs):
            parent = req.block_hashes[-1] if req.block_hashes else b""
            chunk = tokens[i * bs:(i + 1) * bs]
            h = block_hash(parent, chunk, self.fingerprint)
            req.block_hashes.append(h)
            block = self.blocks[req.block_table[i]]
            if block.hash is None and h not in self.hash_to_block:
                block.hash, block.token_ids = h, tuple(chunk)
                self.hash_to_block[h] = block.block_id
            new.append(h)
        return new

    def check_invariants(self, live: Iterable[Request]) -> None:
        """Raise AssertionError if reference counts, the free queue or the hash map disagree."""
        owners: dict[int, int] = {}
        for req in live:
            assert len(set(req.block_table)) == len(req.block_table), f"{req} repeats a block"
            for bid in req.block_table:
                owners[bid] = owners.get(bid, 0) + 1
        for block in self.blocks:
            assert block.ref_count == owners.get(block.block_id, 0), (
                f"block {block.block_id}: ref_count {block.ref_count}, "
                f"owned {owners.get(block.block_id, 0)} times")
            assert (block.ref_count == 0) == (block.block_id in self.free_ids), (
                f"block {block.block_id}: ref_count {block.ref_count} but "
                f"{'in' if block.block_id in self.free_ids else 'not in'} the free queue")
        for h, bid in self.hash_to_block.items():
            assert self.blocks[bid].hash == h, f"hash map points to block {bid} with other hash"

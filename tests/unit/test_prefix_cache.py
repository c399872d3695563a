"""The prefix-cache contract (match, lock/unlock, insert, evict, size_info, check_integrity) on
the in-memory LRU tier, the block allocator, and how the block manager composes them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localllm.config import SamplingParams
from localllm.engine.block_allocator import BlockAllocator
from localllm.engine.block_manager import BlockManager
from localllm.engine.prefix_cache import (
    NO_HITS,
    BlockKey,
    LRUPrefixCache,
    PrefixHits,
    SizeInfo,
    block_hash,
)
from localllm.engine.request import Request

FP = b"test-model"


def chain(blocks: list[tuple[int, ...]]) -> list[BlockKey]:
    keys, parent = [], b""
    for tokens in blocks:
        parent = block_hash(parent, tokens, FP)
        keys.append(BlockKey(parent, tokens))
    return keys


def cache_with(keys: list[BlockKey], first_id: int = 0) -> LRUPrefixCache:
    cache = LRUPrefixCache()
    for i, key in enumerate(keys):
        assert cache.insert(first_id + i, key)
    return cache


def test_block_hash_is_pinned() -> None:
    # NOTE: entries on disk are named by these bytes; a change invalidates every stored prefix.
    h = block_hash(b"", [1, 2, 3, 4], FP)
    assert h.hex() == "89a7dac3b3e346675453c16fa4f5da3e"
    assert block_hash(h, (5, 6, 7, 8), FP).hex() == "7232aa5dae26f190cfb3fb0b8714d27e"
    assert block_hash(b"", [1, 2, 3, 4], b"other-model") != h


def test_match_gives_hits_in_order_and_stops_at_first_miss() -> None:
    keys = chain([(1, 2), (3, 4), (5, 6)])
    cache = cache_with(keys[:2], first_id=7)
    assert cache.match([]) == NO_HITS
    assert cache.match(keys) == PrefixHits((7, 8), (keys[0].hash, keys[1].hash))
    assert cache.match(keys[1:]).num_blocks == 1  # a hit needs only its own hash
    read: list[BlockKey] = []

    def lazy() -> Iterator[BlockKey]:
        for key in [keys[0], keys[2], keys[1]]:
            read.append(key)
            yield key

    assert cache.match(lazy()).block_ids == (7,)
    assert read == [keys[0], keys[2]]  # nothing read past the miss
    # same hash, other tokens (a collision): a miss
    assert cache.match([BlockKey(keys[0].hash, (9, 9))]) == NO_HITS


def test_match_changes_nothing() -> None:
    keys = chain([(1,), (2,)])
    cache = cache_with(keys)
    cache.unlock([1, 0])
    before = cache.size_info
    cache.match(keys)
    assert cache.size_info == before
    assert cache.evict(2) == [1, 0]


def test_insert_starts_locked_once_and_refuses_duplicates() -> None:
    k1, k2 = chain([(1, 2), (3, 4)])
    cache = LRUPrefixCache()
    assert cache.insert(0, k1)
    assert cache.size_info == SizeInfo(evictable=0, locked=1)
    assert not cache.insert(1, k1)  # hash already held by block 0
    assert not cache.insert(0, k2)  # block 0 already cached
    assert 0 in cache and 1 not in cache
    cache.unlock([0])
    assert cache.size_info == SizeInfo(evictable=1, locked=0)
    with pytest.raises(ValueError):
        cache.unlock([0])
    cache.check_integrity()


def test_locked_entries_are_never_evicted() -> None:
    keys = chain([(1,), (2,), (3,)])
    cache = cache_with(keys)
    cache.unlock([0, 1, 2])
    cache.lock([1])
    cache.lock([1])  # two requests share block 1
    assert cache.size_info == SizeInfo(evictable=2, locked=1)
    assert cache.evict(10) == [0, 2]
    assert cache.evict(1) == []
    cache.unlock([1])
    assert cache.evict(1) == []  # one lock is still held
    cache.unlock([1])
    assert cache.evict(0) == []
    assert cache.evict(1) == [1]
    assert cache.size_info == SizeInfo(0, 0) and cache.match(keys) == NO_HITS
    cache.check_integrity()


def test_evict_is_least_recently_unlocked_first() -> None:
    keys = chain([(1,), (2,), (3,), (4,)])
    cache = cache_with(keys)
    cache.unlock([2, 0])
    cache.unlock([3, 1])
    cache.lock([0])
    cache.unlock([0])  # back of the queue again
    assert cache.evict(4) == [2, 3, 1, 0]


def test_check_integrity_catches_corrupted_state() -> None:
    def fresh() -> LRUPrefixCache:
        cache = cache_with(chain([(1,), (2,)]))
        cache.unlock([1])
        cache.check_integrity()
        return cache

    cache = fresh()
    cache._by_hash[b"x" * 16] = 0  # a second hash for block 0
    with pytest.raises(AssertionError):
        cache.check_integrity()
    cache = fresh()
    cache._lru[0] = None  # block 0 is locked but queued for eviction
    with pytest.raises(AssertionError):
        cache.check_integrity()
    cache = fresh()
    cache._locks[1] = 1  # block 1 is queued but locked
    with pytest.raises(AssertionError):
        cache.check_integrity()
    cache = fresh()
    del cache._locks[0]
    with pytest.raises(AssertionError):
        cache.check_integrity()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "lock", "unlock", "evict"]),
                          st.integers(0, 7), st.integers(0, 3)), max_size=60))
def test_random_operations_match_a_reference_model(ops: list[tuple[str, int, int]]) -> None:
    keys = chain([(i,) for i in range(8)])
    cache = LRUPrefixCache()
    locks: dict[int, int] = {}  # the reference: block -> locks; order of unlocked entries
    order: list[int] = []
    for op, bid, n in ops:
        if op == "insert":
            ok = bid not in locks
            assert cache.insert(bid, keys[bid]) is ok
            if ok:
                locks[bid] = 1
        elif op == "lock" and bid in locks:
            cache.lock([bid])
            if locks[bid] == 0:
                order.remove(bid)
            locks[bid] += 1
        elif op == "unlock" and locks.get(bid, 0) > 0:
            cache.unlock([bid])
            locks[bid] -= 1
            if locks[bid] == 0:
                order.append(bid)
        elif op == "evict":
            out = cache.evict(n)
            assert out == order[:n]
            assert all(locks[b] == 0 for b in out)
            for b in out:
                del locks[b]
            del order[:n]
        cache.check_integrity()
        assert cache.size_info == SizeInfo(len(order), len(locks) - len(order))
        assert all((b in cache) == (b in locks) for b in range(8))


def test_allocator_hands_out_in_release_order() -> None:
    alloc = BlockAllocator(4)
    assert [alloc.take(), alloc.take(), alloc.take()] == [0, 1, 2]
    alloc.acquire(1)
    assert not alloc.release(1) and alloc.release(1)
    assert alloc.release(0)
    alloc.acquire(3)  # an unowned block leaves the free queue when shared
    assert list(alloc.free_ids) == [1, 0]
    with pytest.raises(ValueError):
        alloc.release(0)
    alloc.check_integrity({2: 1, 3: 1})
    with pytest.raises(AssertionError):
        alloc.check_integrity({2: 1})


def test_a_block_released_to_the_front_is_handed_out_next() -> None:
    alloc = BlockAllocator(4)
    a, b = alloc.take(), alloc.take()
    assert (a, b) == (0, 1) and list(alloc.free_ids) == [2, 3]
    alloc.release(a)  # to the back: the order of release
    alloc.release(b, front=True)  # to the front: resident, nothing cached in it
    assert list(alloc.free_ids) == [1, 2, 3, 0]
    assert alloc.take() == 1


def test_block_manager_evicts_least_recently_freed_tail_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=2, fingerprint="test-model")
    a = Request([1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=1, temperature=0))
    assert bm.allocate(a, 7) and a.block_table == [0, 1, 2, 3]
    a.num_computed_tokens = 7
    assert len(bm.cache_full_blocks(a)) == 3
    assert bm.cache.size_info == SizeInfo(evictable=0, locked=3)
    bm.free(a)  # blocks 0, 1, 2 stay cached, 3 does not; all released tail first
    bm.check_invariants([])
    # 3, uncached and resident, is handed out first, then the never-used blocks, then the
    # cached ones, least recently freed first
    assert list(bm.free_ids) == [3, 4, 5, 2, 1, 0]
    assert bm.match_prefix([1, 2, 3, 4, 5, 6, 9]).block_ids == (0, 1, 2)
    b = Request([7] * 8, SamplingParams(max_tokens=1, temperature=0))
    assert bm.allocate(b, 8) and b.block_table == [3, 4, 5, 2]  # 2: the cached tail block
    assert bm.match_prefix([1, 2, 3, 4, 5, 6, 9]).block_ids == (0, 1)
    c = Request([1, 2, 3], SamplingParams(max_tokens=1, temperature=0))
    hits = bm.match_prefix(c.all_token_ids)
    assert hits.block_ids == (0,)
    assert bm.allocate(c, 1, hits) and c.block_table == [0, 1]  # 0 locked, so 1 is evicted
    bm.check_invariants([b, c])
    assert bm.cache.size_info == SizeInfo(evictable=0, locked=1)
    assert bm.num_free_blocks == 0
    assert not bm.can_allocate(Request([5] * 3, SamplingParams()), 3)


def test_check_invariants_catches_a_lock_leak_and_a_lost_block() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, fingerprint="test-model")
    a = Request([1, 2, 3], SamplingParams(max_tokens=1, temperature=0))
    assert bm.allocate(a, 3)
    a.num_computed_tokens = 3
    bm.cache_full_blocks(a)
    bm.cache.lock([0])  # a lock nobody will release
    bm.free(a)
    with pytest.raises(AssertionError):
        bm.check_invariants([])
    bm2 = BlockManager(num_blocks=4, block_size=2, fingerprint="test-model")
    assert bm2.allocate(a, 3)
    with pytest.raises(AssertionError):
        bm2.check_invariants([])  # a's blocks are owned by no live request

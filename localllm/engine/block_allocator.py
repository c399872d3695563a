"""Reference counts of the KV pool's blocks and the queue of blocks no request owns.

The queue is in the order blocks are handed out: blocks released to the front (by the block
manager: those the prefix cache does not index, whose pages are already resident), then
never-used blocks, by id, then blocks in the order their last owner let go of them. It knows
nothing of hashes: a block the prefix cache still indexes stays in the queue, and the block
manager evicts it from the cache when it reaches the front.

NOTE: only the `BlockManager` calls `take`, `acquire` and `release`.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def take(self) -> int:
        """The front block of the free queue, now owned once."""
        bid, _ = self.free_ids.popitem(last=False)
        self.ref_counts[bid] = 1
        return bid

    def acquire(self, block_id: int) -> None:
        """One more owner for a block (one that had none leaves the free queue)."""
        if self.ref_counts[block_id] == 0:
            del self.free_ids[block_id]
        self.ref_counts[block_id] += 1

    def release(self, block_id: int, front: bool = False) -> bool:
        """One owner less; a block left without owners joins the back of the free queue (the
        front with `front`: the next one handed out)."""
        if self.ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} has no owner to release")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_ids[block_id] = None
            if front:
                self.free_ids.move_to_end(block_id, last=False)
            return True
        return False

    def check_integrity(self, owners: dict[int, int]) -> None:
        """Raise AssertionError unless each block's count equals `owners` (block id -> number
        of block tables holding it) and exactly the unowned blocks are in the free queue."""
        for bid, count in enumerate(self.ref_counts):
            assert count == owners.get(bid, 0), (
                f"block {bid}: ref_count {count}, owned {owners.get(bid, 0)} times")
            assert (count == 0) == (bid in self.free_ids), (
                f"block {bid}: ref_count {count} but "
                f"{'in' if bid in self.free_ids else 'not in'} the free queue")

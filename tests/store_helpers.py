"""A prefix store without a model, for tests: a KV pool tensor in place of the model runner,
block contents that follow from their hash (so any process can check what it was served),
and a worker process (`python tests/store_helpers.py ...`) that writes and reads a directory
while other processes do the same.

    python tests/store_helpers.py DIR --write A [--write S] --read B --blocks 40 [--slow]
                                  [--forever]

writes the chains of blocks seeded A (and S...), waits until chain B is stored (by another
process), loads and checks it, and prints one JSON line: {"written": ..., "loaded": ...,
"wrong": ...}. --forever writes chains A, A+1, ... until killed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from localllm.engine.prefix_cache import BlockKey, block_hash
from localllm.engine.prefix_entry import StoreIdentity
from localllm.engine.prefix_store import PrefixStore

IDENTITY = StoreIdentity(fingerprint="test-weights", backend="cpu", kv_dtype="float32",
                         block_size=4, num_layers=2, num_kv_heads=2, head_dim=8,
                         model_name="test.gguf")
BLOCK_SHAPE = (IDENTITY.num_layers, 2, IDENTITY.block_size, IDENTITY.num_kv_heads,
               IDENTITY.head_dim)


class PoolIO:
    """A KV pool [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]."""

    def __init__(self, num_blocks: int = 256, dtype: torch.dtype = torch.float32) -> None:
        self.pool = torch.zeros(num_blocks, *BLOCK_SHAPE, dtype=dtype)
        self.reads = 0  # read_blocks calls

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        self.reads += 1
        return self.pool[list(block_ids)].clone()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        self.pool[list(block_ids)] = data


def chain(seed: int, n: int, block_size: int = IDENTITY.block_size) -> list[BlockKey]:
    keys, parent = [], b""
    for i in range(n):
        tokens = tuple((seed * 1000 + i * block_size + j) % 30000 for j in range(block_size))
        parent = block_hash(parent, tokens, b"test-weights")
        keys.append(BlockKey(parent, tokens))
    return keys


def content(key: BlockKey, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The K/V every test stores under `key`: random values seeded by its hash."""
    g = torch.Generator().manual_seed(int.from_bytes(key.hash[:8], "little") >> 1)
    return torch.randn(BLOCK_SHAPE, generator=g).to(dtype)


def store_blocks(store: PrefixStore, io: PoolIO, keys: list[BlockKey], first_block: int = 0
                 ) -> None:
    """Fill pool blocks first_block.. with the keys' contents and hand them to the store."""
    ids = list(range(first_block, first_block + len(keys)))
    for bid, key in zip(ids, keys):
        io.pool[bid] = content(key, io.pool.dtype)
    store.insert_blocks(ids, keys)


def load_and_check(store: PrefixStore, io: PoolIO, keys: list[BlockKey], first_block: int
                   ) -> tuple[int, int]:
    """Match and load `keys` into blocks first_block..; (blocks loaded, blocks wrong)."""
    hits = store.match(keys)
    ids = list(range(first_block, first_block + hits.num_blocks))
    io.pool[ids] = float("nan")
    store.lock(hits.block_ids)
    try:
        n = store.load(keys[:hits.num_blocks], ids)
    finally:
        store.unlock(hits.block_ids)
    wrong = sum(not torch.equal(io.pool[ids[i]], content(keys[i], io.pool.dtype))
                for i in range(n))
    return n, wrong


def _slow_writes(root: Path) -> None:
    """Each entry's payload is written 20 ms after its header (0.5 s once a file named `slow`
    is in `root`), so that a kill lands in the middle of a file."""
    from localllm.engine import prefix_entry

    class SlowFile:
        def __init__(self, f: Any) -> None:
            self.f = f
            self.writes = 0

        def write(self, data: Any) -> int:
            self.writes += 1
            if self.writes == 3:  # header, token ids, then the payload
                time.sleep(0.5 if (root / "slow").exists() else 0.02)
            return int(self.f.write(data))

        def __enter__(self) -> SlowFile:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

    def slow_open(path: Any, mode: str = "r", *args: Any, **kw: Any) -> Any:
        f = open(path, mode, *args, **kw)
        return SlowFile(f) if "w" in mode else f

    prefix_entry.open = slow_open  # type: ignore[attr-defined]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--write", type=int, action="append", required=True)
    ap.add_argument("--read", type=int, default=None)
    ap.add_argument("--blocks", type=int, default=40)
    ap.add_argument("--slow", action="store_true")
    ap.add_argument("--forever", action="store_true", help="keep writing until killed")
    args = ap.parse_args()
    if args.slow:
        _slow_writes(Path(args.dir))
    io = PoolIO(num_blocks=2 * args.blocks + 8)
    store = PrefixStore(Path(args.dir), IDENTITY, io, max_bytes=1 << 30)
    seeds = list(args.write)
    written = 0
    while seeds:
        mine = chain(seeds.pop(0), args.blocks)
        for i in range(0, len(mine), 4):  # a few blocks at a time, as engine steps hand them
            store_blocks(store, io, mine[i:i + 4], first_block=i)
            store.flush()
            written += len(mine[i:i + 4])
        if args.forever:
            seeds.append(args.write[0] + written // args.blocks)
    loaded = wrong = 0
    if args.read is not None:
        theirs = chain(args.read, args.blocks)
        deadline = time.monotonic() + 60
        while store.match(theirs).num_blocks < len(theirs) and time.monotonic() < deadline:
            n, w = load_and_check(store, io, theirs, first_block=args.blocks)
            wrong += w  # partial loads while the other process is still writing
            time.sleep(0.01)
        loaded, w = load_and_check(store, io, theirs, first_block=args.blocks)
        wrong += w
    store.close()
    print(json.dumps({"written": written, "loaded": loaded, "wrong": wrong}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

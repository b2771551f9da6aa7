"""The pool of KV-cache blocks: reference counts, a free list in LRU order, and the prefix cache."""

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Hash of this full block's tokens chained with its prefix's; None while the block is not cached.
    block_hash: Optional[bytes] = None


class BlockPool:
    """Free blocks sit in an ordered dict: allocation takes the oldest, release appends.

    A freed block keeps its cached contents (and stays findable by hash) until it is handed out
    again, so the least recently used cached block is the first evicted.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free: "OrderedDict[int, None]" = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block key (engine/block_hash.py) -> block id
        # With a KV connector that keeps evicted blocks (the host tier): (block id, key) of each cached
        # block handed out again, until the scheduler passes them on; None: not recorded.
        self.evicted: Optional[list[tuple[int, bytes]]] = None

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free):
            raise RuntimeError(f"asked for {count} KV blocks, {len(self.free)} free")
        ids = []
        for _ in range(count):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict its cached contents
                if self.cached.get(block.block_hash) == block_id:
                    del self.cached[block.block_hash]
                    if self.evicted is not None:
                        self.evicted.append((block_id, block.block_hash))
                block.block_hash = None
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference to cached blocks (a prefix-cache hit)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free[block_id]
            block.ref_cnt += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop a reference; pass a request's blocks tail first, so its prefix is evicted last."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block_id} released more often than taken"
            if block.ref_cnt == 0:
                self.free[block_id] = None

    def lookup(self, block_hash: bytes) -> Optional[int]:
        return self.cached.get(block_hash)

    def cache(self, block_id: int, block_hash: bytes) -> None:
        if not self.enable_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        if block_hash in self.cached:  # identical contents computed twice: keep the first
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block_id

    def take_evicted(self) -> list[tuple[int, bytes]]:
        evicted, self.evicted = self.evicted, []
        return evicted

    def reset_cache(self) -> None:
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()

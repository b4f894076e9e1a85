"""The block pool's hash → block map (`kvstore.pool.BlockPool`), and its null object for a pool
with prefix caching off."""
from __future__ import annotations

from kvstore.free_queue import BlockId
from kvstore.keys import BlockHash


class HashIndex:
    """hash → id of the block that caches it (read `map`, write through `add`)."""

    def __init__(self) -> None:
        self.map: dict[BlockHash, BlockId] = {}

    def add(self, block_hash: BlockHash, block_id: BlockId) -> bool:
        """Map `block_hash` to `block_id` unless it already maps somewhere; True if added."""
        if block_hash in self.map:
            return False
        self.map[block_hash] = block_id
        return True


class NullHashIndex(HashIndex):
    """Prefix caching off: nothing is ever added, so nothing is ever found or evicted."""

    def add(self, block_hash: BlockHash, block_id: BlockId) -> bool:
        return False

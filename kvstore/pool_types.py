"""What `kvstore.pool.BlockPool` reports: its counters and one block's metadata."""
from __future__ import annotations

from typing import NamedTuple

from kvstore.free_queue import BlockId
from kvstore.keys import BlockHash


class PoolStats(NamedTuple):
    """Counters since the pool was built. `queries`: `find_longest_prefix` calls; `hits`:
    calls that found at least one block; `*_blocks`: hashes asked for / blocks found;
    `evictions`: cached hashes dropped by `allocate` (not by `reset_prefix_cache`)."""

    queries: int
    hits: int
    query_blocks: int
    hit_blocks: int
    evictions: int


class BlockInfo(NamedTuple):
    """A snapshot of one block's metadata (for tests and integrity checks of callers)."""

    block_id: BlockId
    ref_cnt: int
    block_hash: BlockHash | None

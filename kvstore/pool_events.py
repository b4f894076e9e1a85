"""The events a `BlockPool` (kvstore/pool.py) records as its prefix cache changes, in order:
what a worker publishes to the router's block index (kvstore/events.py `from_pool_events`) and
what the disk tier and the hand-over follow. Torch-free."""
from __future__ import annotations

from dataclasses import dataclass

from kvstore.free_queue import BlockId
from kvstore.keys import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """`block_id` now caches the block keyed `block_hash`, whose parent is `parent_hash`."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    block_id: BlockId


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """`block_id` no longer caches `block_hash` (evicted by an allocation)."""

    block_hash: BlockHash
    block_id: BlockId


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every cached hash was dropped (`reset_prefix_cache`)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

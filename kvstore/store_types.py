"""What `kvstore.store.KVStore` returns and raises: a lookup's `Match`, a copy's `HeldBlocks`,
a `StoreUsage` snapshot, and `NoHostTier`."""
from __future__ import annotations

from typing import NamedTuple

import torch

from kvstore.errors import KVStoreError
from kvstore.pool import BlockId


class Match(NamedTuple):
    """Where the leading blocks of a hash chain are: `device` are the pool's blocks caching
    the first `len(device)` hashes (not referenced by the lookup: `take` them before the
    next allocation, which may evict them), then `num_host` more are in the host tier, then
    `num_disk` more on disk (not usable by `take` until `read_ahead` brought them to the host)."""

    device: tuple[BlockId, ...]
    num_host: int
    num_disk: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.device) + self.num_host


class HeldBlocks(NamedTuple):
    """A copy of the leading run of asked blocks held here: `[L, 2, n, bs, H, D | bytes]`."""

    num_blocks: int
    blocks: torch.Tensor | None


class StoreUsage(NamedTuple):
    """A snapshot of the store. `prefix_*_blocks`: hashes asked / device blocks found by
    admissions (`take`); `num_onloaded_blocks`: blocks admissions copied from the host tier."""

    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    host_num_blocks: int
    num_host_blocks: int
    prefix_queries: int
    prefix_query_blocks: int
    prefix_hit_blocks: int
    num_onloaded_blocks: int
    num_protected_blocks: int = 0    # free, caching a reused prefix: evicted last
    num_reused_blocks: int = 0       # cached and reused by a later request (in use or free)
    num_disk_staged_blocks: int = 0  # blocks read back from the disk tier into the host tier


class NoHostTier(KVStoreError):
    """Blocks were staged into a store that has no host tier."""

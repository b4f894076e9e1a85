"""The block allocator: block ids, ref counts, a segmented LRU free queue and the hash→block map.

The design of vLLM v1 (0.10) `BlockPool`, without tensors (this module imports no torch):

- Every block is either in use (`ref_cnt > 0`, owned by the requests that allocated or
  touched it) or in the free queue (`ref_cnt == 0`). A free block may still hold a cached
  hash: its KV content stays valid and reusable until `allocate` hands the block out again.
- The free queue is an intrusive doubly linked list: O(1) `popleft` (allocate takes the
  least recently freed block), `append` (free) and removal from the middle (`touch` of a
  cached free block that a new request reuses).
- Freed blocks are appended in the order the caller gives them. A finished sequence's
  blocks should be given tail first (`free_sequence` does that), so a prefix's tail
  blocks are evicted before its head blocks, which more requests share.
- Reuse-aware eviction (segmented LRU, as in SGLang's radix cache, which evicts a shared
  prefix only after the requests' own tails hanging off it): a cached block that a later
  request reused (`touch`) is *protected*. Freed, it joins the protected queue, which
  `allocate` takes from only when the probation queue (free blocks never reused: empty
  ones, finished requests' own tails) is empty. So under pressure a pool keeps the prefixes
  its requests share and evicts the one-off questions first, where a plain LRU (vLLM's)
  evicts an idle shared prefix as soon as it is older than the last few requests' tails.
  The protected queue holds at most `protected_frac` of the pool; past that its least
  recently freed block moves back to the probation queue's tail. `protected_frac=0` is
  vLLM's plain LRU.
- Protection fades: a protected block not reused while the pool allocated a window of blocks
  (`protect_turnovers` x its size to start with) is *stale*: `allocate` weighs it against cached
  probation blocks by age alone, so yesterday's shared prefixes give way to today's (a workload
  that shifts). The window is learned from the blocks the pool evicted and then had to cache
  again (`kvstore/fade.py`, ARC's ghost lists; `fade_steps` None: fixed). None: never fades.
- Per-owner caps (`kvstore.quota`): `cache_full_blocks` records the owner (tenant) of each
  newly cached block; while an owner holds more cached blocks than its cap (`set_owner_cap`,
  else `max_cached_frac` of the pool), `allocate` takes empty free blocks, then that owner's
  free cached blocks, before anything else. With no owner over its cap the order above holds.
- With `enable_prefix_caching=False` the hash map is a null object that stores nothing:
  `cache_full_blocks` caches nothing and `find_longest_prefix` finds nothing.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from kvstore.errors import OutOfBlocks
from kvstore.fade import FADE_STEPS, Fade
from kvstore.free_queue import Block as _Block, BlockId, FreeQueue as _FreeQueue, eviction_order
from kvstore.hash_index import HashIndex, NullHashIndex
from kvstore.keys import BlockHash
from kvstore.pool_check import check_pool_args, check_pool_integrity
from kvstore.pool_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvstore.pool_types import BlockInfo, PoolStats
from kvstore.quota import CachedQuota, Owner, OwnerUsage

PROTECT_TURNOVERS = 1.0   # the fade (module docstring); measured: kvmesh.bench.routing_sweeps.sweep_protect_turnovers


EvictCallback = Callable[[list[BlockId], list[BlockHash]], None]


class BlockPool:
    """Ref-counted blocks `0..num_blocks-1` with a segmented LRU free queue (probation, then
    protected: see the module docstring) and a prefix cache.

    Ownership: `allocate` returns blocks at ref_cnt 1, owned by the caller; `touch` adds
    one reference per block for a request reusing cached blocks; `free` drops one. A block
    id is safe to read/write while the caller holds a reference. Only free blocks are ever
    evicted, and only by `allocate` (least recently freed first, never-reused blocks before
    reused ones) or `reset_prefix_cache`.
    `on_evict(block_ids, block_hashes)` runs once per `allocate` that drops cached hashes,
    before it drops them, while the blocks still hold that content (the host tier offloads
    them there in one batch); if it raises, the pool is unchanged. Events are recorded only with
    `enable_kv_cache_events` (drain them with `take_events`, or the list grows).
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True,
                 on_evict: EvictCallback | None = None,
                 enable_kv_cache_events: bool = True, protected_frac: float = 0.8,
                 max_cached_frac: float = 1.0, protect_turnovers: float | None = PROTECT_TURNOVERS,
                 fade_steps: float | None = FADE_STEPS) -> None:
        check_pool_args(num_blocks, protected_frac, protect_turnovers)
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free = _FreeQueue(self._blocks)           # probation: allocate takes these first
        self._protected = _FreeQueue(())                # free blocks a later request reused
        self._max_protected = int(protected_frac * num_blocks)
        self._fade = None if protect_turnovers is None else Fade(num_blocks, protect_turnovers, fade_steps)
        self._allocated = 0  # blocks handed out since the pool was built: the fade's clock
        self._num_reused = 0
        self._quota = CachedQuota(num_blocks, max_cached_frac)
        self._index: HashIndex = HashIndex() if enable_prefix_caching else NullHashIndex()
        self._on_evict = on_evict
        self._record_events = enable_kv_cache_events
        self._events: list[KVEvent] = []
        self._queries = self._hits = self._query_blocks = self._hit_blocks = self._evictions = 0

    def allocate(self, n: int) -> list[BlockId]:
        """Take `n` blocks from the head of the free queue (least recently freed first).

        Cached hashes of the taken blocks are evicted (`on_evict`, then a `BlockRemoved`
        event). The blocks come back at ref_cnt 1, owned by the caller. Raises `OutOfBlocks`
        (pool unchanged) when fewer than `n` blocks are free.
        """
        if n < 0:
            raise ValueError(f"n={n} must be >= 0")
        if n > self.num_free_blocks:
            raise OutOfBlocks(n, self.num_free_blocks)
        taken = self._victims(n)
        if self._on_evict is not None:
            evicted = [b for b in taken if b.block_hash is not None]
            if evicted:
                self._on_evict([b.block_id for b in evicted], [b.block_hash for b in evicted])  # type: ignore[misc]
        for block in taken:
            (self._protected if block.protected else self._free).remove(block)
            self._quota.unfreed(block.block_id)
            if block.block_hash is not None:
                if self._fade is not None:
                    self._fade.evicted(block.block_hash, block.protected)
                self._drop_hash(block)
            block.protected = False
            block.ref_cnt = 1
        self._allocated += n
        return [block.block_id for block in taken]

    def _victims(self, n: int) -> list[_Block]:
        """The `n` blocks `allocate(n)` would take, in order: the quota's choice (while an owner
        is over its cap), then the free queues' heads."""
        first = self._quota.victims(n)
        if first is None:
            head = self._free.walk(forward=True, limit=n)
            if self._fade is None or not len(self._protected):
                return head + self._protected.walk(forward=True, limit=n - len(head))
            return eviction_order(head, self._protected.walk(forward=True, limit=n), n,
                                  self._allocated - int(self._fade.window))
        chosen = [self._blocks[b] for b in first]
        skip = set(first)
        for queue in (self._free, self._protected):
            for block in queue.walk(forward=True, limit=n - len(chosen) + len(skip)):
                if len(chosen) < n and block.block_id not in skip:
                    chosen.append(block)
        return chosen

    def protected_victims(self, n: int, keep: Sequence[BlockId] = ()) -> int:
        """How many of the `n` blocks `allocate(n)` would take next, passing over `keep` (cached
        blocks the caller is about to reuse; those in use are in no free queue anyway), cache
        a reused prefix that is not stale yet: the shared blocks the allocation would evict.
        A query: nothing changes."""
        if n <= 0 or not len(self._protected):
            return 0
        skip = set(keep)
        taken = [b for b in self._victims(min(self.num_free_blocks, n + len(skip))) if b.block_id not in skip][:n]
        stale_before = self._allocated - int(self._fade.window) if self._fade is not None else None
        return sum(1 for b in taken if b.protected and (stale_before is None or b.freed_at > stale_before))

    def free(self, block_ids: Sequence[BlockId]) -> None:
        """Drop one reference per listed block; blocks reaching 0 join the free queue tail
        IN THE ORDER GIVEN (first listed = evicted first). Give a finished sequence's blocks
        tail first, or use `free_sequence`. Over-freeing raises ValueError, pool unchanged.
        """
        blocks = self._lookup(block_ids)
        for block_id, count in Counter(b.block_id for b in blocks).items():
            ref_cnt = self._blocks[block_id].ref_cnt
            if count > ref_cnt:
                raise ValueError(f"freeing block {block_id} {count} time(s) but its ref_cnt "
                                 f"is {ref_cnt} (double free?)")
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._release(block)

    def _release(self, block: _Block) -> None:
        """A block at ref_cnt 0 joins its free queue's tail (a reused cached block the
        protected one, whose oldest block moves to probation when it is over its cap)."""
        block.freed_at = self._allocated
        if block.reused and block.block_hash is not None and self._max_protected > 0:
            block.protected = True
            self._protected.append(block)
            self._quota.freed(block.block_id, True, True)
            if len(self._protected) > self._max_protected:
                oldest = self._protected.popleft()
                oldest.protected = False
                self._free.append(oldest)
                self._quota.demoted(oldest.block_id)
        else:
            self._free.append(block)
            self._quota.freed(block.block_id, block.block_hash is not None, False)

    def free_sequence(self, block_ids: Sequence[BlockId]) -> None:
        """Free a sequence's blocks given in sequence order: its tail is evicted first."""
        self.free(list(reversed(block_ids)))

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        """Add one reference per listed block (a new request reusing cached blocks).

        A free block leaves the free queue, so it can no longer be evicted. Touching a free
        block that caches nothing is an error (its content is gone): ValueError, unchanged.
        """
        blocks = self._lookup(block_ids)
        for block in blocks:
            if block.ref_cnt == 0 and block.block_hash is None:
                raise ValueError(f"touching free block {block.block_id}, which caches nothing")
        for block in blocks:
            if block.ref_cnt == 0:
                (self._protected if block.protected else self._free).remove(block)
                self._quota.unfreed(block.block_id)
                block.protected = False
            block.ref_cnt += 1
            if block.block_hash is not None and not block.reused:
                block.reused = True
                self._num_reused += 1

    def cache_full_blocks(self, block_ids: Sequence[BlockId], block_hashes: Sequence[BlockHash],
                          parent_hash: BlockHash | None = None, owner: Owner | None = None,
                          shared: int = 0) -> None:
        """Register `block_hashes[i]` → `block_ids[i]` for FULL blocks the caller holds; newly
        cached blocks belong to `owner` (a tenant; None or "": no owner, never capped).

        `block_ids` may be longer than `block_hashes` (a trailing partial block is simply
        not cached). A block already caching that hash is left alone; a hash already cached
        by ANOTHER block keeps its block, and this one stays uncached. Each newly cached
        block records `BlockStored` whose parent is the previous hash in the list
        (`parent_hash` for the first). A no-op with prefix caching off. `shared`: the first
        `shared` listed blocks are a prefix the caller expects other requests to share (a
        router's hint): newly cached, they count as reused at once (protected when freed).
        """
        if len(block_hashes) > len(block_ids):
            raise ValueError(f"{len(block_hashes)} hashes for {len(block_ids)} blocks")
        blocks = self._lookup(block_ids[:len(block_hashes)])
        for block, block_hash in zip(blocks, block_hashes):
            if block.ref_cnt == 0:
                raise ValueError(f"caching free block {block.block_id}: hold a reference")
            if block.block_hash is not None and block.block_hash != block_hash:
                raise ValueError(f"block {block.block_id} already caches another hash")
        parent = parent_hash
        for i, (block, block_hash) in enumerate(zip(blocks, block_hashes)):
            if block.block_hash is None and self._index.add(block_hash, block.block_id):
                block.block_hash = block_hash
                self._quota.cached(block.block_id, owner)
                ghost = self._fade is not None and self._fade.recached(block_hash)
                if (ghost or i < shared) and not block.reused:
                    block.reused = True
                    self._num_reused += 1
                self._record(BlockStored(block_hash, parent, block.block_id))
            parent = block_hash

    def find_longest_prefix(self, block_hashes: Sequence[BlockHash]) -> list[BlockId]:
        """Blocks caching the longest run of leading `block_hashes`.

        Ref counts are NOT changed: `touch` the blocks you use before the next `allocate`,
        which may evict them. Mutates only the query/hit counters of `stats()`.
        """
        found: list[BlockId] = []
        for block_hash in block_hashes:
            block_id = self._index.map.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        self._queries += 1
        self._hits += bool(found)
        self._query_blocks += len(block_hashes)
        self._hit_blocks += len(found)
        return found

    def get_cached_block(self, block_hash: BlockHash) -> BlockId | None:
        """The block caching `block_hash`, if any (it may be free: touch it to keep it)."""
        return self._index.map.get(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash if no block is in use (True); otherwise do nothing (False).

        The free queue order is kept. Records `AllBlocksCleared`.
        """
        if self.num_used_blocks:
            return False
        while len(self._protected):       # nothing is reused any more: all back to probation
            block = self._protected.popleft()
            block.protected = False
            self._free.append(block)
        for block in self._blocks:
            block.block_hash = None
            block.reused = False
        self._num_reused = 0
        self._index.map.clear()
        if self._fade is not None:
            self._fade.clear()
        self._quota.reset([b.block_id for b in self._free.walk(forward=True, limit=len(self._blocks))])
        self._record(AllBlocksCleared())
        return True

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can take now, including cached ones nobody references."""
        return len(self._free) + len(self._protected)

    @property
    def num_protected_blocks(self) -> int:
        """Free blocks caching a reused prefix: evicted last until stale (module docstring)."""
        return len(self._protected)

    @property
    def protect_window(self) -> float | None:
        """Allocations a protected block stays protected unused (kvstore/fade.py); None: forever."""
        return None if self._fade is None else self._fade.window

    @property
    def num_reused_blocks(self) -> int:
        """Cached blocks (in use or free) that a later request reused."""
        return self._num_reused

    @property
    def num_cached_blocks(self) -> int:
        return len(self._index.map)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref_cnt > 0."""
        return len(self._blocks) - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (0.0 … 1.0)."""
        return self.num_used_blocks / len(self._blocks)

    def set_owner_cap(self, owner: Owner, max_blocks: int | None) -> None:
        """At most `max_blocks` cached blocks for `owner` before its own are evicted first
        (None: `max_cached_frac` of the pool). See `kvstore.quota`."""
        self._quota.set_cap(owner, max_blocks)

    def owner_usage(self) -> dict[Owner, OwnerUsage]:
        """Cached blocks, free cached blocks and cap of every owner holding cached blocks."""
        return self._quota.usage()

    def owner_of(self, block_id: BlockId) -> Owner | None:
        """The owner of the hash `block_id` caches (None: uncached or no owner)."""
        return self._quota.owner_of(self._lookup([block_id])[0].block_id)

    def ref_cnt(self, block_id: BlockId) -> int:
        return self._lookup([block_id])[0].ref_cnt

    def block_info(self, block_id: BlockId) -> BlockInfo:
        block = self._lookup([block_id])[0]
        return BlockInfo(block.block_id, block.ref_cnt, block.block_hash)

    def free_block_ids(self) -> list[BlockId]:
        """The free queue, head first: the order in which `allocate` would take blocks."""
        return [b.block_id for b in self._victims(len(self._blocks))]

    def stats(self) -> PoolStats:
        return PoolStats(self._queries, self._hits, self._query_blocks, self._hit_blocks, self._evictions)

    def cached_hashes(self) -> list[BlockHash]:
        """Every block hash the pool can serve now (a worker's inventory for the block index)."""
        return list(self._index.map)

    def set_event_recording(self, enabled: bool) -> None:
        """Start or stop recording KV events for `take_events` (dropping what is queued)."""
        self._record_events = enabled
        self._events = []

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first; clears the list."""
        events, self._events = self._events, []
        return events

    def check_integrity(self) -> None:
        """Raise AssertionError describing the first broken invariant, if any."""
        check_pool_integrity(self._blocks, self._free, self._protected, self._max_protected, self._num_reused,
                             self._index.map, self._quota)

    def _lookup(self, block_ids: Sequence[BlockId]) -> list[_Block]:
        n = len(self._blocks)
        for block_id in block_ids:
            if not 0 <= block_id < n:
                raise ValueError(f"block id {block_id} is outside [0, {n})")
        return [self._blocks[block_id] for block_id in block_ids]

    def _drop_hash(self, block: _Block) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        del self._index.map[block_hash]
        block.block_hash = None
        self._quota.uncached(block.block_id)
        if block.reused:
            block.reused = False
            self._num_reused -= 1
        self._evictions += 1
        self._record(BlockRemoved(block_hash, block.block_id))

    def _record(self, event: KVEvent) -> None:
        if self._record_events:
            self._events.append(event)

"""The KV store of one worker: the device block pool, the paged KV tensors, the host tier
and the event log behind one typed API.

`KVStore` owns
- the `BlockPool` (block ids, ref counts, LRU free queue, hash → block map; no torch),
- the `KVTensors` the model reads and writes by block id,
- an optional `HostTier` behind the pool: with `offload_bytes > 0` the pool's evictions are
  copied into it (the store wires that; nobody else sees the callback), or a staging tier
  attached later (`ensure_host_tier`) that only receives blocks staged from a peer,
- an optional `DiskTier` (`kvstore.disk`) below the host tier: blocks the host tier's LRU
  drops are copied out and written behind on the disk tier's thread (`DiskStaging.spill`); a waiting
  admission whose prefix goes on on disk asks for it with `read_ahead` and waits; `poll_disk`
  (the scheduler, each step) stages what was read into the host tier, where `lookup` finds it
  and `take` onloads it: disk → host → device. The disk key includes the salt root of the
  request that cached the block (`cache(..., salt_root)`), kept here per hash while the
  block is on the device or in host memory (`kvstore.store_disk.DiskStaging`),
- the copies for peers (`read`, `read_now`: `kvstore.store_read`),
- one event log: what the pool and the tiers record, tagged with their `Tier`, in the
  order it happened (an eviction that offloads reads: host stored, then device removed).

Who calls it: the scheduler (`lookup`, `take`, `allocate`, `free*`, `cache`), the engine
(`fence_device`, `usage`, `check_integrity`), the peer plane through engine commands
(`lookup`, `read`, `stage`) and the metadata publisher (`take_events`, `inventory`). All of
them on the engine thread: the store is not thread-safe, and between two engine steps no
block is evicted or rewritten, which is what makes `read` a consistent copy.

Ownership: block ids returned by `take` / `allocate` carry one reference each, owned by the
caller until it gives them back with `free` / `free_sequence`. Only unreferenced blocks are
ever evicted (by a later allocation). Imports no model, request or gRPC code.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from kvstore.disk import DiskTier
from kvstore.disk_record import DiskSpec
from kvstore.disk_stats import DiskTierStats
from kvstore.errors import OutOfBlocks
from kvstore.events import Tier, TieredEvent
from kvstore.hot import HitTracker
from kvstore.keys import BlockHash
from kvstore.layout import KVLayout
from kvstore.pool import BlockId, BlockPool
from kvstore.quota import Owner
from kvstore.store_disk import DiskStaging
from kvstore.store_read import read_device_run, read_held
from kvstore.store_types import HeldBlocks, Match, NoHostTier, StoreUsage
from kvstore.tensors import KVTensors
from kvstore.tiers import BlockCopy, HostTier


class KVStore:
    """One worker's KV blocks on the device and in host memory (see the module docstring)."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu", *,
                 enable_prefix_caching: bool = True, offload_bytes: int = 0,
                 copy_blocks: BlockCopy | None = None, disk: DiskSpec | None = None,
                 max_cached_frac: float = 1.0) -> None:
        if offload_bytes < 0:
            raise ValueError(f"offload_bytes={offload_bytes} must be >= 0")
        if offload_bytes and not enable_prefix_caching:
            raise ValueError("offload_bytes needs prefix caching: the host tier keys blocks by hash")
        if disk is not None and not offload_bytes:
            raise ValueError("a disk tier needs a host tier (offload_bytes > 0): it writes what the host tier evicts")
        self.layout = layout
        self.kv = KVTensors(layout, num_blocks, device)
        self.device = self.kv.device
        self.disk: DiskTier | None = None
        self._staging: DiskStaging | None = None
        self.host: HostTier | None = None
        if offload_bytes:
            self.host = HostTier.for_budget(layout, offload_bytes, pin_memory=self.device.type == "cuda",
                                            copy_blocks=copy_blocks,
                                            on_evict=self._spill if disk is not None else None,
                                            max_cached_frac=max_cached_frac)
            if disk is not None:
                self.disk = DiskTier.open(disk.path, disk.num_bytes, layout, self.host.data.dtype,
                                          self.host.data.shape[1:], disk.fingerprint, max_cached_frac=max_cached_frac)
        self.pool = BlockPool(num_blocks, enable_prefix_caching=enable_prefix_caching,
                              on_evict=self._offload if self.host is not None else None,
                              enable_kv_cache_events=False, max_cached_frac=max_cached_frac)
        if self.disk is not None:
            assert self.host is not None
            self._staging = DiskStaging(self.disk, self.host, self.pool, self.kv)
        self._write_through = disk is not None and disk.write_through
        self.hot = HitTracker()    # prefix hits per hash (`take`): the hand-over's and warm start's order
        self._events: list[TieredEvent] = []
        self._recording = False
        self._queries = self._query_blocks = self._hit_blocks = self._onloaded = 0

    # -- queries --------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def host_num_blocks(self) -> int:
        return self.host.num_blocks if self.host is not None else 0

    def lookup(self, block_hashes: Sequence[BlockHash], salt_root: BlockHash | None = None) -> Match:
        """The leading `block_hashes` held here: the device pool's run, then the host tier's,
        then the disk tier's under `salt_root` (the chain's `cache_salt_root`). A query: no
        ref count, LRU order or counter changes."""
        device: list[BlockId] = []
        for h in block_hashes:
            block_id = self.pool.get_cached_block(h)
            if block_id is None:
                break
            device.append(block_id)
        rest = block_hashes[len(device):]
        num_host = self.host.match_prefix(rest) if self.host is not None else 0
        num_disk = self.disk.match_prefix(salt_root, rest[num_host:]) if self.disk is not None else 0
        return Match(tuple(device), num_host, num_disk)

    def usage(self) -> StoreUsage:
        p, h = self.pool, self.host
        return StoreUsage(p.num_blocks, p.num_free_blocks, p.num_used_blocks, p.num_cached_blocks,
                          h.num_blocks if h else 0, h.num_used_blocks if h else 0, self._queries,
                          self._query_blocks, self._hit_blocks, self._onloaded, p.num_protected_blocks,
                          p.num_reused_blocks, self._staging.num_staged if self._staging else 0)

    def disk_stats(self) -> DiskTierStats | None:
        return self.disk.stats() if self.disk is not None else None

    def inventory(self) -> dict[Tier, list[BlockHash]]:
        """Every hash the store can serve now, per tier (a full snapshot for the block index)."""
        out = {Tier.DEVICE: self.pool.cached_hashes()}
        if self.host is not None:
            out[Tier.HOST] = self.host.cached_hashes()
        if self.disk is not None:
            out[Tier.DISK] = self.disk.cached_hashes()
        return out

    # -- blocks for sequences -------------------------------------------------------------
    def take(self, block_hashes: Sequence[BlockHash], match: Match, num_blocks: int,
             owner: Owner | None = None) -> list[BlockId]:
        """The first `num_blocks` blocks of a sequence whose hash chain is `block_hashes`, given
        `match = lookup(...)` made with no store change in between: the matched device blocks
        are referenced, the host run is copied into new device blocks (which then cache their
        hashes), and fresh blocks follow. All returned blocks are owned by the caller.
        Raises `OutOfBlocks`, store unchanged, when the pool cannot give them now."""
        cached = list(match.device)
        if num_blocks < match.num_blocks:
            raise ValueError(f"num_blocks={num_blocks} < the {match.num_blocks} matched blocks")
        # touching a cached block at ref 0 takes it off the free queue: count those too
        reused_free = sum(1 for b in cached if self.pool.ref_cnt(b) == 0)
        if num_blocks - len(cached) + reused_free > self.pool.num_free_blocks:
            raise OutOfBlocks(num_blocks - len(cached) + reused_free, self.pool.num_free_blocks)
        self.pool.touch(cached)
        loaded_hashes = list(block_hashes[len(cached):match.num_blocks])
        loaded = self._onload(loaded_hashes)
        if self._staging is not None:
            self._staging.taken(loaded_hashes)
        if loaded:
            self.pool.cache_full_blocks(loaded, loaded_hashes,
                                        parent_hash=block_hashes[len(cached) - 1] if cached else None,
                                        owner=owner)
        self.hot.hit(block_hashes[:match.num_blocks])
        self._queries += 1
        self._query_blocks += len(block_hashes)
        self._hit_blocks += len(cached)
        self._onloaded += len(loaded)
        out = cached + loaded + self.pool.allocate(num_blocks - match.num_blocks)
        self._drain()
        return out

    def allocate(self, n: int) -> list[BlockId]:
        """`n` fresh blocks owned by the caller (evicting unreferenced cached ones, offloaded
        to the host tier when it has one). Raises `OutOfBlocks`, store unchanged."""
        out = self.pool.allocate(n)
        self._drain()
        return out

    def free(self, block_ids: Sequence[BlockId]) -> None:
        """Drop one reference per block, in the order given (see `BlockPool.free`)."""
        self.pool.free(block_ids)

    def free_sequence(self, block_ids: Sequence[BlockId]) -> None:
        """Give back a sequence's blocks in sequence order: its tail is evicted first."""
        self.pool.free_sequence(block_ids)

    def refresh(self, block_hashes: Sequence[BlockHash]) -> int:
        """Move the free device blocks of the leading `block_hashes` cached here to their free
        queue's tail (a waiting request will reuse them: they count as reused and are evicted
        after every other free block, tail first); returns how many. No event, no counter."""
        free = [b for b in self.lookup(block_hashes).device if self.pool.ref_cnt(b) == 0]
        if free:
            self.pool.touch(free)
            self.pool.free_sequence(free)
        return len(free)

    def cache(self, block_ids: Sequence[BlockId], block_hashes: Sequence[BlockHash],
              parent_hash: BlockHash | None = None, salt_root: BlockHash | None = None,
              owner: Owner | None = None, shared: int = 0) -> None:
        """Publish full blocks the caller holds under their hashes (`cache_full_blocks`);
        `salt_root`: their chain's `cache_salt_root` (kept for the disk tier's key); newly
        cached blocks belong to `owner` (a tenant; its cap: `set_owner_cap`, kvstore.quota);
        the first `shared` listed are a prefix others will share (protected from their first use)."""
        self.pool.cache_full_blocks(block_ids, block_hashes, parent_hash, owner, shared)
        if salt_root is not None and self._staging is not None:
            self._staging.roots.update(dict.fromkeys(block_hashes, salt_root))
        if self._staging is not None and self._write_through:
            self._staging.write_through(block_ids, block_hashes, salt_root, owner)
        self._drain()

    def set_owner_cap(self, owner: Owner, max_blocks: int | None) -> None:
        """`owner`'s cap on cached blocks in each tier: device pool, host tier, disk tier
        (None: the store's `max_cached_frac` of each; kvstore.quota)."""
        self.pool.set_owner_cap(owner, max_blocks)
        if self.host is not None:
            self.host.quota.set_cap(owner, max_blocks)
        if self.disk is not None:
            self.disk.set_owner_cap(owner, max_blocks)

    def share(self, block_ids: Sequence[BlockId]) -> None:
        """One more reference per block: a forked sequence (n > 1) shares its parent's blocks."""
        self.pool.touch(block_ids)

    def is_shared(self, block_id: BlockId) -> bool:
        return self.pool.ref_cnt(block_id) > 1

    def copy_on_write(self, block_id: BlockId) -> BlockId:
        """A private copy of a shared block for a sequence about to write into it: a fresh
        block with the same K/V; the caller's reference to `block_id` is dropped. Raises
        `OutOfBlocks`, store unchanged."""
        (copy,) = self.allocate(1)
        self.kv.copy_blocks([block_id], [copy])
        self.pool.free([block_id])
        return copy

    def reset_prefix_cache(self) -> bool:
        """Drop every device-cached hash if no block is in use (True), else nothing (False)."""
        done = self.pool.reset_prefix_cache()
        self._drain()
        return done

    def fence_device(self) -> None:
        """Before a forward pass: the device stream waits for pending offload copies of the
        blocks it may rewrite (a no-op on CPU and without a host tier)."""
        if self.host is not None:
            self.host.wait_on_device()

    # -- the disk tier ----------------------------------------------------------------------
    def read_ahead(self, block_hashes: Sequence[BlockHash], salt_root: BlockHash | None = None) -> bool:
        """Have the disk tier read the run `block_hashes` (a `Match`'s disk run) back; True
        when the caller should wait for it (`poll_disk` stages it into the host tier). A run is
        cut to the host tier's size, and a block already staged twice without being taken (the
        host tier dropped it again) is not read a third time: False, compute it instead."""
        return self._staging is not None and self._staging.read_ahead(block_hashes, salt_root)

    def poll_disk(self) -> int:
        """Stage the disk tier's finished reads into the host tier (engine thread), as many
        leading blocks of each as there is room for; returns how many were staged. Staged
        blocks stay pinned in the host tier until the next call, so that the admissions of
        the scheduling pass that follows find them (their allocations offload into it)."""
        if self._staging is None:
            return 0
        staged = self._staging.poll()
        self._drain()
        return staged

    def wait_for_disk(self, timeout_s: float) -> bool:
        """Block until a read-ahead finishes or `timeout_s` passes (an idle engine whose
        waiting requests wait for the disk); False at once when none is in flight."""
        return self.disk is not None and self.disk.wait_reads(timeout_s)

    def close(self) -> None:
        """Stop the disk tier's threads (queued writes are dropped)."""
        if self.disk is not None:
            self.disk.close()

    # -- blocks for peers -----------------------------------------------------------------
    def read(self, block_hashes: Sequence[BlockHash], device: torch.device) -> HeldBlocks:
        """A copy on `device` of the leading run of `block_hashes` held in the device pool, the
        host tier or the disk tier (host blocks become the tier's youngest; disk records are
        read in this thread, under the salt root they were written with). Nothing is
        referenced: the copy is consistent because no step runs while the engine thread reads."""
        held = read_held(self.pool, self.kv, self.host, self.disk, block_hashes, device)
        self._drain()                                            # a bad disk record's removal
        return held

    def hottest(self, max_blocks: int) -> list[BlockHash]:
        """Up to `max_blocks` hashes held here (any tier), most hit recently first, parents
        before children (`kvstore.hot.HitTracker.hottest`). A query."""
        def held(h: BlockHash) -> bool:
            return (self.pool.get_cached_block(h) is not None or (self.host is not None and h in self.host)
                    or (self.disk is not None and self.disk.key_of(h) is not None))
        return self.hot.hottest(held, max_blocks)

    def read_now(self, block_hashes: Sequence[BlockHash], device: torch.device) -> HeldBlocks | None:
        """`read` from a thread other than the engine's, without waiting for the step it may
        be running: the leading run of `block_hashes` in the device pool, copied, then checked —
        the copy keeps the blocks whose hash still maps to the block it was read from (a
        step evicts a block, dropping its hash, before it writes into it; full cached blocks
        are never written otherwise). None where only `read` on the engine thread can answer:
        a pool off the CPU (its writes are queued on a stream), a run that goes on in the host
        or disk tier, or a first block evicted during the copy. Nothing is referenced or reordered."""
        match = self.lookup(block_hashes)                      # a query: safe beside a step
        return read_device_run(self.pool, self.kv, self.disk, block_hashes, match, device)

    def stage(self, block_hashes: Sequence[BlockHash], data: torch.Tensor) -> int:
        """Put blocks that arrived from a peer (`data` as `read` returns it) in the host tier,
        where the next admission finds them; returns how many were written (hashes already
        held are only refreshed). Raises `NoHostTier` without a host tier."""
        if self.host is None:
            raise NoHostTier("staging blocks needs a host tier (ensure_host_tier)")
        written = self.host.store(block_hashes, data)
        self._drain()
        return written

    def ensure_host_tier(self, num_blocks: int) -> HostTier:
        """The host tier, attaching a staging tier of `num_blocks` if there is none. A staging
        tier receives only staged blocks: the pool's evictions are not offloaded into it.
        On CPU its memory is committed as blocks arrive (pinned on CUDA: at once)."""
        if self.host is None:
            self.host = HostTier(self.layout, num_blocks, pin_memory=self.device.type == "cuda")
            self.host.set_event_recording(self._recording)
        return self.host

    # -- events and checks ----------------------------------------------------------------
    def set_event_recording(self, enabled: bool) -> None:
        """Start or stop recording events for `take_events` (dropping what is queued)."""
        self._recording = enabled
        self.pool.set_event_recording(enabled)
        if self.host is not None:
            self.host.set_event_recording(enabled)
        if self.disk is not None:
            self.disk.set_event_recording(enabled)
        self._events = []

    def take_events(self) -> list[TieredEvent]:
        """Every event since the last call, oldest first, each tagged with its tier; clears them."""
        self._drain()
        events, self._events = self._events, []
        return events

    def check_integrity(self, holders: Iterable[Sequence[BlockId]] | None = None) -> None:
        """Raise AssertionError on the first broken invariant of the pool and the host tier;
        with `holders` (the block lists of everything holding references), also that every
        reference is accounted for."""
        self.pool.check_integrity()
        if self.host is not None:
            self.host.check_integrity()
        if self.disk is not None:
            self.disk.check_integrity()
        if holders is None:
            return
        held = Counter(b for blocks in holders for b in blocks)
        for b, n in held.items():
            assert self.pool.ref_cnt(b) == n, f"block {b}: ref_cnt {self.pool.ref_cnt(b)} but {n} holders"
        assert self.pool.num_used_blocks == len(held), (
            f"{self.pool.num_used_blocks} blocks referenced, {len(held)} held")

    # -- internals ------------------------------------------------------------------------
    def _onload(self, block_hashes: list[BlockHash]) -> list[BlockId]:
        """Device blocks filled from the host tier. The held blocks are pinned while the
        allocation runs: it may evict device blocks into this very tier."""
        if not block_hashes:
            return []
        assert self.host is not None
        self.host.pin(block_hashes)
        try:
            block_ids = self.pool.allocate(len(block_hashes))
        finally:
            self.host.unpin(block_hashes)
        self.host.onload(self.kv, block_hashes, block_ids)
        return block_ids

    def _offload(self, block_ids: list[BlockId], block_hashes: list[BlockHash]) -> None:
        """The pool's eviction callback: copy the evicted blocks into the host tier first."""
        assert self.host is not None
        self._drain()                      # what the pool recorded before comes first
        self.host.offload(self.kv, block_ids, block_hashes, [self.pool.owner_of(b) for b in block_ids])
        dropped = [i for i, h in enumerate(block_hashes) if h not in self.host]
        if dropped and self._staging is not None:   # no room in host memory: straight to the disk tier
            self._staging.offload_dropped(block_ids, block_hashes, dropped)
        self._drain()

    def _spill(self, block_hashes: list[BlockHash], slots: list[int]) -> None:
        """The host tier's eviction callback (the disk tier's writer takes what it wants)."""
        assert self._staging is not None
        self._staging.spill(block_hashes, slots)

    def _drain(self) -> None:
        if not self._recording:
            return
        self._events.extend(TieredEvent(Tier.DEVICE, e) for e in self.pool.take_events())
        if self.host is not None:
            self._events.extend(TieredEvent(Tier.HOST, e) for e in self.host.take_events())
        if self.disk is not None:
            self._events.extend(TieredEvent(Tier.DISK, e) for e in self.disk.take_events())

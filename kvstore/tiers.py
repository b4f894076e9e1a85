"""The host-memory tier: a second pool of blocks, keyed by block hash, behind the device pool.

The device pool (`kvstore.pool.BlockPool` + `kvstore.tensors.KVTensors`) keeps every cached
block it can; when `allocate` must evict unreferenced cached blocks, the store
(`kvstore.store.KVStore`, which wires the pool's `on_evict` here) has `HostTier.offload` copy
them into host memory instead of letting them be lost. A later admission whose prefix
continues past what the device pool holds finds them with `match_prefix`, and `onload` copies
them back into freshly allocated device blocks, which the store then registers in the device
pool's prefix cache like computed ones.

- Storage is one CPU tensor `data` [num_blocks, L, 2, block_size, H, D | slot_bytes] (pinned
  when the device pool is on CUDA): block-major, so a host block is one contiguous run and a
  block moves between tiers as one strided `copy_` straight into its destination, over all
  layers, K and V, values and quantization scales alike (the bytes are never reinterpreted).
  Gathering into a fresh tensor first and scattering after ran at a few percent of memcpy
  speed here (page faults of the new tensor, two passes over the bytes).
- Its own LRU: an `OrderedDict` hash → host slot, least recently used first. `offload` of a
  hash already held only refreshes it (no copy); when full, the oldest entries are dropped.
- Copies: on CPU both pools are host memory and `offload` is one batched gather at eviction
  time, a memcpy of the evicted bytes: one parallel loop of per-row memcpys when the worker
  passes its native `copy_blocks` (`worker.kernels.native.block_copier`; kvstore imports no
  worker code), else one torch `copy_` per block (~0.7x memcpy here; the `kvmesh bench transfer`
  figure `offload_vs_memcpy` compares it with a raw copy of the same bytes). On CUDA the device→host copy is issued on a
  side stream into pinned memory after the compute stream's pending work, and an event is
  recorded; `onload` and `read` wait on it, and the compute stream waits on it before the
  evicted device blocks are written again (`fence`), so the decode loop never blocks on it.
- Every change is recorded as a pool-style event (`BlockStored` / `BlockRemoved` with the host
  slot as `block_id`), for the worker to publish with `Tier.HOST`.
- Per-owner caps (`kvstore.quota.OwnerLRU`, `quota`): an offloaded block keeps the owner (tenant)
  it had in the device pool; when the tier must drop blocks it drops those of owners over their
  cap (`max_cached_frac` of the tier, or `quota.set_cap`) first, then its oldest.
- `on_evict(hashes, slots)` (the store's, when it has a disk tier) runs when the LRU drops
  blocks, before their slots are reused: it may read `data[slots]` then (the disk tier's
  write-behind copies them out).

Not thread-safe: the store owns it, on the engine thread (blocks from peers are staged there).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

from kvstore.keys import BlockHash
from kvstore.layout import KVLayout
from kvstore.pool import AllBlocksCleared, BlockId, BlockRemoved, BlockStored, KVEvent
from kvstore.quota import Owner, OwnerLRU
from kvstore.tensors import KVTensors


class BlockCopy(Protocol):
    """host[slots[k]] <-> pool[:, :, ids[k]] for every k, CPU tensors, contiguous, int64 index
    tensors; `to_host` picks the direction (`worker.kernels.native.block_copier()` gives one)."""

    def __call__(self, host: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor, ids: torch.Tensor,
                 to_host: bool) -> None: ...


HostEvictCallback = Callable[[list[BlockHash], list[int]], None]


class HostTierStats(NamedTuple):
    """Counters since the tier was built (blocks, not calls)."""

    offloaded: int       # blocks copied in from the device pool
    refreshed: int       # offloads of a hash already held (no copy)
    onloaded: int        # blocks copied back to the device pool
    evicted: int         # blocks dropped by the tier's own LRU
    stored: int          # blocks written from outside (a peer)


class HostTier:
    """`num_blocks` host blocks of `layout`, keyed by block hash, with an LRU (see module doc)."""

    def __init__(self, layout: KVLayout, num_blocks: int, pin_memory: bool = False,
                 copy_blocks: BlockCopy | None = None, on_evict: HostEvictCallback | None = None,
                 max_cached_frac: float = 1.0) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks!r} must be a positive integer")
        self.layout = layout
        shape = KVTensors(layout, 1, "meta").kv.shape          # [L, 2, 1, bs, H, D | bytes]
        self.dtype = KVTensors(layout, 1, "meta").dtype
        # empty: a slot is read only after it was written; on CPU pages commit as blocks arrive
        self.data = torch.empty(num_blocks, shape[0], shape[1], *shape[3:], dtype=self.dtype,
                                pin_memory=pin_memory)           # [N, L, 2, bs, H, D | bytes]
        self._pinned: set[BlockHash] = set()                     # held for a load in progress
        self._lru: OrderedDict[BlockHash, int] = OrderedDict()   # hash -> slot, oldest first
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives slot 0 first
        self._events: list[KVEvent] = []
        self._record = False
        self._pending: list[tuple[torch.cuda.Event, torch.Tensor, list[int]]] = []
        self._stream: torch.cuda.Stream | None = None
        self._offloaded = self._refreshed = self._onloaded = self._evicted = self._stored = 0
        self._copy_blocks = copy_blocks
        self._on_evict = on_evict
        self.quota: OwnerLRU[BlockHash] = OwnerLRU(num_blocks, max_cached_frac)   # owners of held blocks

    @classmethod
    def for_budget(cls, layout: KVLayout, num_bytes: int, pin_memory: bool = False,
                   copy_blocks: BlockCopy | None = None, on_evict: HostEvictCallback | None = None,
                   max_cached_frac: float = 1.0) -> HostTier:
        num_blocks = layout.num_blocks_in(num_bytes)
        if num_blocks < 1:
            raise ValueError(f"{num_bytes} bytes do not hold one block ({layout.bytes_per_block} bytes)")
        return cls(layout, num_blocks, pin_memory, copy_blocks, on_evict, max_cached_frac)

    # -- queries --------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    @property
    def num_used_blocks(self) -> int:
        return len(self._lru)

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._pinned)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._lru

    def match_prefix(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading `block_hashes` the tier holds (a query: the LRU is untouched)."""
        n = 0
        for h in block_hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._lru)

    def stats(self) -> HostTierStats:
        return HostTierStats(self._offloaded, self._refreshed, self._onloaded, self._evicted, self._stored)

    # -- moves ----------------------------------------------------------------------------
    def offload(self, src: KVTensors, block_ids: Sequence[BlockId], block_hashes: Sequence[BlockHash],
                owners: Sequence[Owner | None] | None = None) -> int:
        """Copy device blocks `block_ids` (caching `block_hashes`, owned by `owners`: None, no
        owner) into the tier; returns how many were copied. Hashes already held are only moved
        to the LRU's young end. With fewer unpinned slots than new blocks (a load in progress pins its blocks while its
        allocation evicts into this tier) the oldest new ones are dropped, as without a tier.
        The caller must not overwrite the source blocks before `fence()` (a no-op on CPU)."""
        if len(block_ids) != len(block_hashes):
            raise ValueError(f"{len(block_ids)} block ids for {len(block_hashes)} hashes")
        new_ids: list[int] = []
        new_hashes: list[BlockHash] = []
        new_owners: list[Owner | None] = []
        for b, h, o in zip(block_ids, block_hashes, owners or [None] * len(block_ids)):
            if h in self._lru:
                self._lru.move_to_end(h)
                self.quota.touched(h)
                self._refreshed += 1
            else:
                new_ids.append(int(b))
                new_hashes.append(h)
                new_owners.append(o)
        if len(set(new_hashes)) != len(new_hashes):
            raise ValueError("block_hashes repeats a hash")
        room = self._room()              # a load in progress pins its blocks: the rest are dropped
        drop = max(0, len(new_ids) - room)
        new_ids, new_hashes, new_owners = new_ids[drop:], new_hashes[drop:], new_owners[drop:]
        if not new_ids:
            return 0
        slots = self._take_slots(len(new_ids), new_owners)
        if src.device.type == "cuda":
            self._copy_from_cuda(src, new_ids, slots)
        else:
            self._move(src.kv, slots, new_ids, to_host=True)
        self._insert(new_hashes, slots, new_owners)
        self._offloaded += len(new_ids)
        self._order(block_hashes)
        return len(new_ids)

    def onload(self, dst: KVTensors, block_hashes: Sequence[BlockHash], dst_block_ids: Sequence[BlockId]) -> None:
        """Copy the held blocks `block_hashes` into device blocks `dst_block_ids` (which the
        caller owns); they become the LRU's youngest. KeyError if one is not held."""
        if len(block_hashes) != len(dst_block_ids):
            raise ValueError(f"{len(block_hashes)} hashes for {len(dst_block_ids)} block ids")
        if not block_hashes:
            return
        self.fence()
        slots = [self._lru[h] for h in block_hashes]
        self._move(dst.kv, slots, [int(b) for b in dst_block_ids], to_host=False)
        self._order(block_hashes)
        self._onloaded += len(block_hashes)

    def read(self, block_hashes: Sequence[BlockHash]) -> torch.Tensor:
        """A copy of held blocks `[L, 2, n, block_size, H, D | slot_bytes]` (for onload or a
        peer); they become the LRU's youngest. KeyError if one is not held."""
        self.fence()
        slots = [self._lru[h] for h in block_hashes]
        self._order(block_hashes)
        out = torch.empty(self.data.shape[1], 2, len(slots), *self.data.shape[3:], dtype=self.dtype)
        self._move(out, slots, range(len(slots)), to_host=False)
        return out

    def store(self, block_hashes: Sequence[BlockHash], data: torch.Tensor) -> int:
        """Write blocks that arrived from elsewhere (a peer), `data` as `read` returns it;
        hashes already held are refreshed, not rewritten. Returns how many were written."""
        if data.shape[2] != len(block_hashes):
            raise ValueError(f"data holds {data.shape[2]} blocks for {len(block_hashes)} hashes")
        keep = [i for i, h in enumerate(block_hashes) if h not in self._lru]
        for h in block_hashes:
            if h in self._lru:
                self._lru.move_to_end(h)
                self.quota.touched(h)
        keep = keep[max(0, len(keep) - self._room()):]
        if not keep:
            return 0
        slots = self._take_slots(len(keep))
        self.fence()
        self._move(data, slots, keep, to_host=True)
        self._insert([block_hashes[i] for i in keep], slots)
        self._stored += len(keep)
        self._order(block_hashes)
        return len(keep)

    def fence(self) -> None:
        """Make pending device→host copies complete before what follows (CUDA); a no-op on CPU."""
        for event, host, slots in self._pending:
            event.synchronize()
            self._move(host, slots, range(len(slots)), to_host=True)
        self._pending = []

    def wait_on_device(self) -> None:
        """Make the current CUDA stream wait for pending copies without blocking the host
        (call before work that rewrites evicted device blocks); a no-op on CPU."""
        for event, _, _ in self._pending:
            torch.cuda.current_stream().wait_event(event)

    def clear(self) -> None:
        """Drop everything (records `AllBlocksCleared`)."""
        self.fence()
        self._free.extend(reversed(list(self._lru.values())))
        self._lru.clear()
        self.quota.clear()
        self._pinned.clear()
        self._emit(AllBlocksCleared())

    # -- events ---------------------------------------------------------------------------
    def set_event_recording(self, enabled: bool) -> None:
        self._record = enabled
        self._events = []

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def check_integrity(self) -> None:
        """Raise AssertionError describing the first broken invariant, if any."""
        used = list(self._lru.values())
        assert len(set(used)) == len(used), "two hashes share a host slot"
        assert len(set(self._free)) == len(self._free), "a free host slot is listed twice"
        assert not set(used) & set(self._free), "a host slot is both used and free"
        assert len(used) + len(self._free) == self.num_blocks, \
            f"{len(used)} used + {len(self._free)} free != {self.num_blocks} host slots"
        assert all(0 <= s < self.num_blocks for s in used + self._free), "host slot out of range"
        assert self._pinned <= set(self._lru), "a pinned hash is not held"
        self.quota.check_integrity(list(self._lru))

    # -- internals ------------------------------------------------------------------------
    def _room(self) -> int:
        """How many blocks can be written now: every slot not pinned by a load in progress."""
        return self.num_blocks - len(self._pinned)

    def _take_slots(self, n: int, owners: Sequence[Owner | None] = ()) -> list[int]:
        """n free slots (for blocks of `owners`), evicting entries when there are too few: those
        of owners over their cap first, counting the new blocks (`quota`), then the LRU's oldest."""
        assert n <= self.num_blocks
        if len(self._free) < n:
            self.fence()  # a slot about to be reused may still have a copy in flight
            need = n - len(self._free)
            victims = self.quota.victims(need, self._pinned, owners)
            if len(victims) < need:
                chosen = set(victims)
                victims += [h for h in self._lru if h not in self._pinned and h not in chosen][:need - len(victims)]
            assert len(self._free) + len(victims) >= n, "the host tier's blocks are all pinned"
            if self._on_evict is not None and victims:
                self._on_evict(victims, [self._lru[h] for h in victims])
            for h in victims:
                slot = self._lru.pop(h)
                self.quota.removed(h)
                self._free.append(slot)
                self._evicted += 1
                self._emit(BlockRemoved(h, BlockId(slot)))
        return [self._free.pop() for _ in range(n)]

    def pin(self, block_hashes: Sequence[BlockHash]) -> None:
        """Keep held `block_hashes` from being evicted until `unpin` (a load in progress)."""
        self._pinned.update(h for h in block_hashes if h in self._lru)

    def unpin(self, block_hashes: Sequence[BlockHash]) -> None:
        self._pinned.difference_update(block_hashes)

    def _order(self, block_hashes: Sequence[BlockHash]) -> None:
        """Make the held ones of `block_hashes` the youngest, in the order given."""
        for h in block_hashes:
            if h in self._lru:
                self._lru.move_to_end(h)
                self.quota.touched(h)

    def _insert(self, block_hashes: Sequence[BlockHash], slots: Sequence[int],
                owners: Sequence[Owner | None] | None = None) -> None:
        for h, slot, owner in zip(block_hashes, slots, owners or [None] * len(slots)):
            self._lru[h] = slot
            self.quota.added(h, owner)
            self._emit(BlockStored(h, None, BlockId(slot)))

    def _move(self, pool: torch.Tensor, slots: Sequence[int], ids: Sequence[int], to_host: bool) -> None:
        """self.data[slots[k]] <-> pool[:, :, ids[k]] (`pool` is [L, 2, N, ...]: the device pool,
        a peer's blocks, a CUDA staging buffer): the native copy on CPU, else a copy_ per block."""
        if self._copy_blocks is not None and pool.device.type == "cpu" and pool.is_contiguous():
            self._copy_blocks(self.data, torch.tensor(list(slots), dtype=torch.long), pool,
                              torch.tensor(list(ids), dtype=torch.long), to_host)
            return
        for slot, i in zip(slots, ids):
            if to_host:
                self.data[slot].copy_(pool[:, :, i])
            else:
                pool[:, :, i].copy_(self.data[slot], non_blocking=pool.device.type == "cuda")

    def _copy_from_cuda(self, src: KVTensors, block_ids: list[int], slots: list[int]) -> None:
        # After the compute stream's pending writes, gather on a side stream into pinned
        # staging; the staged bytes land in the tier's slots at the next `fence`.
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=src.device)
        self._stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(self._stream):
            staged = src.kv.index_select(2, torch.tensor(block_ids, device=src.device))
            host = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
            host.copy_(staged, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._pending.append((event, host, slots))

    def _emit(self, event: KVEvent) -> None:
        if self._record:
            self._events.append(event)

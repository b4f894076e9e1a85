"""The disk tier: KV blocks the host tier evicts, kept as checksummed records in a local directory.

Below the host tier (`kvstore.tiers.HostTier`): when the host tier drops a block from its LRU,
the store (`kvstore.store.KVStore`) hands a copy of its bytes to `write_behind`, which queues it
for this tier's writer threads (`kvstore/disk_write.py`: `WriteBehind`; a bounded queue: when
it is full the write is dropped and counted, the engine thread never waits). A later
admission whose prefix goes on past the device pool and the host tier finds the rest with
`match_prefix`; `read_ahead` has the reader thread read it back (`kvstore/disk_read.py`:
`ReadAhead`), the engine thread picks the blocks up with `take_reads` and stages them into the
host tier, and the admission onloads them from there like any host hit.

Records: one checksummed record per block, in slots of two slab files (`kvstore/disk_record.py`:
layout, record format); another fingerprint's records are never read (said once at open).
`match_prefix` and `read_ahead` find a block only under the salt root the asking request has.
A record that fails any check (a torn write, flipped bytes, a file cut short) is never served:
its slot is erased and freed, and it is counted (`dropped_checksum`). A slot being read is not
given to a writer until the read ends (an evicted record's slot waits for it).

Reopen: a tier opened on a directory that holds records of its fingerprint reads every slot's
header (88 bytes, not its payload): magic, header checksum, version, fingerprint and payload
length are checked, a bad slot is erased and counted; the LRU order is the records' write
sequence numbers. Cost per 10^5 blocks: `test_disk_tier.py::test_reopen_cost` (slow; docs/kv-memory.md).

Errors: any OSError while writing or reading (disk full, read-only, the directory gone) logs
one line naming the path and the error and turns the tier off (`enabled` False, every hash
dropped with `AllBlocksCleared`); serving goes on without it. A directory another live process
holds (the lock) or cannot create leaves the tier off from the start, with one line.

Per-owner caps (`quota`, `kvstore.quota.OwnerLRU`): a block written with an owner (the tenant
that cached it) counts against that owner's cap (`max_cached_frac` of the records the tier
holds, or `set_owner_cap`); to make room the tier frees the oldest records of owners over
their cap first, then its oldest (the index and its choice: `kvstore/disk_index.py`).
Reopened records have no owner (owners are not on disk).

Threads: `write_behind`, `match_prefix`, `read_ahead`, `take_reads`, `take_events` and the
queries may be called from any thread (the store calls them on the engine thread); the index
(`DiskIndex`) and the free slots are guarded by one lock; file I/O happens outside it on the tier's
daemon threads (a write: its checksum, then its slot; commits in queue order; a read).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kvstore.disk_index import DiskIndex
from kvstore.disk_read import DiskRead, ReadAhead
from kvstore.disk_record import (
    FORMAT_VERSION,
    HEADER_BYTES,
    SLAB_FILES,
    DiskKey,
    RecordError,
    SlabIO,
    encode_header,
    lock_dir,
    read_record,
    scan_slots,
    slot_bytes,
)
from kvstore.disk_slots import SlotTable
from kvstore.disk_stats import DiskTierStats, Histogram
from kvstore.disk_write import WriteBehind
from kvstore.keys import BlockHash
from kvstore.layout import KVLayout
from kvstore.pool import AllBlocksCleared, BlockId, BlockRemoved, BlockStored, KVEvent
from kvstore.quota import Owner, OwnerLRU

log = logging.getLogger("kvmesh.disk")


class DiskTier:
    """Blocks of `layout` on disk under `path`, at most `capacity_bytes` of records (see the
    module docstring). Build it with `open`; `enabled` says whether it serves."""

    def __init__(self, path: Path, capacity_bytes: int, layout: KVLayout, dtype: torch.dtype,
                 block_shape: tuple[int, ...], fingerprint: bytes, max_queue: int, io: SlabIO,
                 max_cached_frac: float = 1.0) -> None:
        self.root_dir = Path(path)
        self.dir = self.root_dir / f"v{FORMAT_VERSION}-{fingerprint.hex()}"
        self.capacity_bytes = capacity_bytes
        self.layout, self.dtype, self.block_shape = layout, dtype, block_shape
        self.payload_bytes = int(torch.Size(block_shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        self.record_bytes = slot_bytes(self.payload_bytes)   # a record's slot on disk
        self.num_slots = capacity_bytes // self.record_bytes
        self.fingerprint = fingerprint
        self.io = io
        self.enabled = False
        self._lock = threading.Lock()
        self._dir_s = str(self.dir)
        self._slots = SlotTable(0, SLAB_FILES)   # made at open, from the slots the scan found used
        self._seq = 0                         # the next record's write sequence number
        self.quota: OwnerLRU[DiskKey] = OwnerLRU(max(1, self.num_slots), max_cached_frac)
        self._index = DiskIndex(self.quota)     # the records held, oldest first
        self._writer = WriteBehind(max_queue, self._encode, self._write)
        self._reads = ReadAhead(self._read)
        self._events: list[KVEvent] = []
        self._record = False
        self._counts = dict.fromkeys(("written", "read", "checksum", "fingerprint",
                                      "evicted", "reopened"), 0)
        self._write_s, self._read_s = Histogram(), Histogram()
        self._lock_fd: int | None = None

    @classmethod
    def open(cls, path: str | Path, capacity_bytes: int, layout: KVLayout, dtype: torch.dtype,
             block_shape: Sequence[int], fingerprint: bytes, *, max_queue: int | None = None,
             io: SlabIO | None = None, max_cached_frac: float = 1.0) -> DiskTier:
        """The tier on `path`, its records of `fingerprint` reopened (headers only). Never
        raises for the directory: a failure leaves it off with one log line."""
        shape = tuple(int(s) for s in block_shape)
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes={capacity_bytes} must be > 0")
        if len(fingerprint) != 16:
            raise ValueError("fingerprint must be 16 bytes")
        block_bytes = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        if max_queue is None:   # the write-behind queue holds up to 256 MiB of blocks
            max_queue = max(4, min(1024, (256 << 20) // block_bytes))
        tier = cls(Path(path), capacity_bytes, layout, dtype, shape, fingerprint, max_queue, io or SlabIO(),
                   max_cached_frac)
        try:
            tier._open()
        except OSError as e:
            log.error("KV disk tier off: cannot use %s: %s", tier.dir, e)
            return tier
        tier.enabled = True
        tier._writer.start()
        tier._reads.start()
        return tier

    # -- queries --------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self._index)

    @property
    def used_bytes(self) -> int:
        return len(self._index) * self.record_bytes

    def match_prefix(self, root: BlockHash | None, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading `block_hashes` the tier holds under salt root `root` (a query)."""
        with self._lock:
            return self._index.match_prefix(root, block_hashes)

    def key_of(self, block_hash: BlockHash) -> DiskKey | None:
        """The key of the record holding `block_hash`, under whichever salt root (a hash is
        chained from its root, so it names one); None when none is held."""
        with self._lock:
            return self._index.key_of(block_hash)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._index

    def cached_hashes(self) -> list[BlockHash]:
        with self._lock:
            return [h for _, h in self._index]

    def busy(self) -> bool:
        """Whether a read-ahead is in flight or done and not taken yet."""
        return self._reads.busy()

    def stats(self) -> DiskTierStats:
        c = self._counts
        with self._lock:
            return DiskTierStats(self.enabled, self.capacity_bytes, self.used_bytes, len(self._index), c["written"],
                                 c["read"], c["checksum"], self._writer.num_dropped, c["fingerprint"], c["evicted"],
                                 c["reopened"], self._write_s.snapshot(), self._read_s.snapshot())

    # -- moves ----------------------------------------------------------------------------
    def wants(self, key: DiskKey) -> bool:
        """Whether `write_behind(key, ...)` would queue a write: the tier is on and neither
        holds nor queued the block (a held one becomes the LRU's youngest: a query that
        refreshes)."""
        with self._lock:
            if not self.enabled or self._writer.queued(key):
                return False
            return not self._index.touch(key)

    def set_owner_cap(self, owner: Owner, max_blocks: int | None) -> None:
        """`owner`'s cap on records (None: `max_cached_frac` of the tier's records)."""
        with self._lock:
            self.quota.set_cap(owner, max_blocks)

    def write_behind(self, key: DiskKey, block: torch.Tensor, owner: Owner | None = None) -> bool:
        """Queue `block` (`block_shape`, contiguous, owned by the tier from now on) to be
        written; False when the tier is off, holds it, or the queue is full (counted)."""
        assert tuple(block.shape) == self.block_shape and block.is_contiguous(), block.shape
        with self._lock:
            if not self.enabled or key in self._index:
                return False
            return self._writer.submit(key, block, owner or None)

    def read_ahead(self, keys: Sequence[DiskKey]) -> bool:
        """Have the reader thread read `keys` (a prefix run) back; True when they are being
        read (now or already): the caller picks them up with `take_reads`."""
        if not self.enabled or not keys:
            return False
        self._reads.submit(keys)
        return True

    def read_now(self, keys: Sequence[DiskKey]) -> tuple[tuple[DiskKey, ...], torch.Tensor | None]:
        """Read the leading run of `keys` held here in the calling thread (a peer's copy):
        the keys read and their blocks `[L, 2, n, bs, H, D]` (None when none was); a bad record
        is dropped and counted as on a read-ahead."""
        return self._read(tuple(keys))

    def take_reads(self) -> list[DiskRead]:
        """Finished read-aheads, oldest first (their keys are no longer in flight)."""
        return self._reads.take()

    def wait_reads(self, timeout_s: float) -> bool:
        """Block until a read-ahead finishes or `timeout_s` passes; False if none is in flight."""
        return self._reads.wait(timeout_s)

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued write is on disk (tests and benchmarks)."""
        self._writer.flush(timeout_s)

    def close(self) -> None:
        """Stop the threads (queued writes are dropped) and release the directory's lock."""
        self._writer.stop()
        self._reads.stop()
        self.io.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self.enabled = False

    # -- events ---------------------------------------------------------------------------
    def set_event_recording(self, enabled: bool) -> None:
        with self._lock:
            self._record = enabled
            self._events = []

    def take_events(self) -> list[KVEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def check_integrity(self) -> None:
        with self._lock:
            assert self.used_bytes <= self.capacity_bytes or not self.enabled, "disk tier over its capacity"
            assert self.enabled or not self._index, "a disk tier that is off holds records"
            self._index.check_integrity()
            self._slots.check_integrity(self._index.slots(), self.num_slots)

    # -- internals: open ------------------------------------------------------------------
    def record_location(self, key: DiskKey) -> tuple[str, int] | None:
        """The slab file and byte offset of `key`'s record (None: not held); for tests and tools."""
        with self._lock:
            slot = self._index.slot_of(key)
        return None if slot is None else self.io.location(slot)

    def _open(self) -> None:
        self._lock_fd = lock_dir(self.dir)
        others = [p for p in self.root_dir.iterdir() if p.is_dir() and p.name.startswith("v") and p != self.dir]
        if others:
            self._counts["fingerprint"] = len(others)
            log.warning("KV disk tier %s: %d director(ies) of another model/KV layout fingerprint or format version "
                        "ignored (%s)", self.root_dir, len(others), ", ".join(sorted(p.name for p in others)))
        self.io.open(self.dir, self.num_slots, self.record_bytes)
        found = scan_slots(self.io, self.fingerprint, self.payload_bytes, self._count_bad)
        self.io.resize()
        self._slots = SlotTable(self.num_slots, SLAB_FILES, (slot for _, slot, _ in found))
        self._index.add_reopened([(key, slot) for key, slot, _ in found])
        self._seq = max((seq for _, _, seq in found), default=-1) + 1
        self._counts["reopened"] = len(found)
        if found:
            log.info("KV disk tier %s: reopened %d blocks (%.1f MiB)", self.dir, len(self._index),
                     self.used_bytes / 2**20)

    # -- internals: the writer's and the reader's work ------------------------------------
    def _encode(self, key: DiskKey, payload: memoryview) -> bytes:
        """A record's header (the write-behind's first stage); nothing once the tier is off."""
        if not self.enabled:
            return b""
        with self._lock:
            seq, self._seq = self._seq, self._seq + 1
        return encode_header(self.fingerprint, key, payload, seq)

    def _write(self, key: DiskKey, payload: memoryview, header: bytes,
               owner: Owner | None) -> Callable[[], None] | None:
        """A record into a free slot (a writer thread's work); returns what adds it to the
        index and emits its event, which the write-behind runs in queue order (None: nothing
        to add)."""
        if not self.enabled:
            return None
        t0 = time.perf_counter()
        with self._lock:
            slot = self._take_slot(owner)
            if slot is None:
                self._writer.num_dropped += 1        # every slot is being read or written
                return None
        try:
            self.io.write(slot, header, payload)
        except OSError as e:
            with self._lock:
                self._slots.written(slot)
                self._slots.free(slot)
            path, offset = self.io.location(slot)
            self._turn_off(f"writing {path} at {offset}", e)
            return None
        seconds = time.perf_counter() - t0
        with self._lock:
            self._slots.written(slot)

        def commit() -> None:
            with self._lock:
                self._write_s.observe(seconds)
                if not self.enabled:
                    return
                self._index.add(key, owner, slot)
                self._counts["written"] += 1
                self._emit(BlockStored(key[1], None, BlockId(0)))
        return commit

    def _read(self, keys: tuple[DiskKey, ...]) -> tuple[tuple[DiskKey, ...], torch.Tensor | None]:
        """The leading run of `keys` held and valid, read in the calling thread (the reader's or
        a peer copy's): the keys read and their blocks; a bad record is dropped and counted."""
        t0 = time.perf_counter()
        out = torch.empty(len(keys), self.payload_bytes, dtype=torch.uint8)   # [n, bytes]
        header = bytearray(HEADER_BYTES)
        n = 0
        for key in keys:
            with self._lock:
                slot = self._index.slot_of(key) if self.enabled else None
                if slot is None:
                    break
                self._slots.pin(slot)                # not reused while read
            row = out[n].numpy().data.cast("B")
            try:
                read_record(self.io, slot, header, row, self.fingerprint, key)
            except RecordError as e:
                path, offset = self.io.location(slot)
                log.warning("KV disk tier: dropping the record at %s:%d: %s", path, offset, e)
                self.io.erase(slot)
                with self._lock:
                    self._counts["checksum"] += 1
                    self._drop(key)
                    self._slots.unpin(slot)
                break
            except OSError as e:
                with self._lock:
                    self._slots.unpin(slot)
                path, offset = self.io.location(slot)
                self._turn_off(f"reading {path} at {offset}", e)
                break
            with self._lock:
                self._slots.unpin(slot)
                self._index.touch(key)
                self._counts["read"] += 1
            n += 1
        if n == 0:
            return (), None
        with self._lock:
            self._read_s.observe(time.perf_counter() - t0)
        shape = self.block_shape                                # [L, 2, bs, H, D | bytes]
        blocks = out[:n].view(self.dtype).view(n, *shape).movedim(0, 2)  # [L, 2, n, bs, H, D]
        return keys[:n], blocks

    # -- internals: bookkeeping (under the lock) ------------------------------------------
    def _take_slot(self, owner: Owner | None) -> int | None:
        """A free slot for a record of `owner`, evicting the index's victims until one is free,
        from the slab file fewer writers are writing now; None when every slot is being read
        or written."""
        while not self._slots.has_free():
            if not self._index:
                return None
            key = self._index.victim(owner, for_write=True)
            self._counts["evicted"] += 1
            self._drop(key)
        return self._slots.take()

    def _drop(self, key: DiskKey) -> None:
        """Forget `key`'s record; its slot is free (once no read holds it)."""
        slot = self._index.remove(key)
        if slot is not None:
            self._slots.free(slot)
            self._emit(BlockRemoved(key[1], BlockId(0)))

    def _count_bad(self) -> None:
        self._counts["checksum"] += 1

    def _turn_off(self, what: str, error: OSError) -> None:
        with self._lock:
            if not self.enabled:
                return
            self.enabled = False
            self._index.clear()
            self._emit(AllBlocksCleared())
        log.error("KV disk tier off (serving goes on without it): %s: %s", what, error)

    def _emit(self, event: KVEvent) -> None:
        if self._record:
            self._events.append(event)

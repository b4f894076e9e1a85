"""The disk tier: KV blocks the host tier evicts, kept as checksummed files in a local directory.

Below the host tier (`kvstore.tiers.HostTier`): when the host tier drops a block from its LRU,
the store (`kvstore.store.KVStore`) hands a copy of its bytes to `write_behind`, which queues it
for this tier's writer threads (`kvstore/disk_write.py`: `WriteBehind`; a bounded queue: when
it is full the write is dropped and counted, the engine thread never waits). A later
admission whose prefix goes on past the device pool and the host tier finds the rest with
`match_prefix`; `read_ahead` has the reader thread read it back (`kvstore/disk_read.py`:
`ReadAhead`), the engine thread picks the blocks up with `take_reads` and stages them into the
host tier, and the admission onloads them from there like any host hit.

Records: one checksummed file per block (`kvstore/disk_record.py`: file layout, record format);
another fingerprint's records are never read (said once at open). `match_prefix` and `read_ahead`
find a block only under the salt root the asking request has. A record that fails any check (a
torn write, flipped bytes, a truncated file) is never served: deleted and counted (`dropped_checksum`).

Reopen: a tier opened on a directory that holds records of its fingerprint reads every
record's header (72 bytes, not its payload): name, size, magic, version, fingerprint and key
are checked, a bad record is deleted; the LRU order is the files' mtimes (write order). Cost: 9.0 s per 10^5
blocks on the 2-core development box while other jobs shared it (2.1 s per 2x10^4; about 90 us
a record, mostly Python per file: open, readv, fstat, close), measured by
`tests/kvstore/test_disk_tier.py::test_reopen_cost` (marked slow).

Errors: any OSError while writing or reading (disk full, read-only, the directory gone) logs
one line naming the path and the error and turns the tier off (`enabled` False, every hash
dropped with `AllBlocksCleared`); serving goes on without it. A directory another live process
holds (the lock) or cannot create leaves the tier off from the start, with one line.

Per-owner caps (`quota`, `kvstore.quota.OwnerLRU`): a block written with an owner (the tenant
that cached it) counts against that owner's cap (`max_cached_frac` of the records the tier
holds, or `set_owner_cap`); to make room the tier deletes the oldest records of owners over
their cap first, then its oldest (the index and its choice: `kvstore/disk_index.py`).
Reopened records have no owner (owners are not on disk).

Threads: `write_behind`, `match_prefix`, `read_ahead`, `take_reads`, `take_events` and the
queries may be called from any thread (the store calls them on the engine thread); the index
(`DiskIndex`) is guarded by one lock, file I/O happens outside it on the tier's daemon threads (a write:
checksum, then file, two stages in queue order; a read).
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
    DiskKey,
    FileIO,
    RecordError,
    encode_header,
    lock_dir,
    read_record,
    record_name,
    scan_records,
)
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
                 block_shape: tuple[int, ...], fingerprint: bytes, max_queue: int, io: FileIO,
                 max_cached_frac: float = 1.0) -> None:
        self.root_dir = Path(path)
        self.dir = self.root_dir / f"v{FORMAT_VERSION}-{fingerprint.hex()}"
        self.capacity_bytes = capacity_bytes
        self.layout, self.dtype, self.block_shape = layout, dtype, block_shape
        self.payload_bytes = int(torch.Size(block_shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        self.record_bytes = HEADER_BYTES + self.payload_bytes
        self.fingerprint = fingerprint
        self.io = io
        self.enabled = False
        self._lock = threading.Lock()
        self._dir_s = str(self.dir)
        self._subdirs: set[str] = set()      # record subdirectories made (or found) by the writers
        self._writing = 0                     # bytes of the records being written now (room kept for them)
        self.quota: OwnerLRU[DiskKey] = OwnerLRU(max(1, capacity_bytes // self.record_bytes), max_cached_frac)
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
             io: FileIO | None = None, max_cached_frac: float = 1.0) -> DiskTier:
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
        tier = cls(Path(path), capacity_bytes, layout, dtype, shape, fingerprint, max_queue, io or FileIO(),
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

    # -- internals: open ------------------------------------------------------------------
    def _path(self, key: DiskKey) -> str:
        name = record_name(key)
        return f"{self._dir_s}/{name[:2]}/{name}"

    def _open(self) -> None:
        self._lock_fd = lock_dir(self.dir)
        others = [p for p in self.root_dir.iterdir() if p.is_dir() and p.name.startswith("v") and p != self.dir]
        if others:
            self._counts["fingerprint"] = sum(1 for d in others for _ in d.glob("*/*.kvb"))
            log.warning("KV disk tier %s: %d record(s) of another model/KV layout fingerprint or format version "
                        "ignored (%s)", self.root_dir, self._counts["fingerprint"],
                        ", ".join(sorted(p.name for p in others)))
        found = scan_records(self.dir, self.fingerprint, self.payload_bytes, self.io, self._count_bad)
        self._index.add_reopened(found)
        self._counts["reopened"] = len(found)
        self._evict_to(0)
        if found:
            log.info("KV disk tier %s: reopened %d blocks (%.1f MiB)", self.dir, len(self._index),
                     self.used_bytes / 2**20)

    # -- internals: the writer's and the reader's work ------------------------------------
    def _encode(self, key: DiskKey, payload: memoryview) -> bytes:
        """A record's header (the write-behind's first stage); nothing once the tier is off."""
        return encode_header(self.fingerprint, key, payload) if self.enabled else b""

    def _write(self, key: DiskKey, payload: memoryview, header: bytes,
               owner: Owner | None) -> Callable[[], None] | None:
        """A record's file (a writer thread's work); returns what adds it to the index and
        emits its event, which the write-behind runs in queue order (None: nothing to add)."""
        if not self.enabled:
            return None
        path = self._path(key)
        t0 = time.perf_counter()
        try:
            with self._lock:   # room for this record and those the other writers are writing now
                self._evict_to(self.record_bytes + self._writing, owner)
                self._writing += self.record_bytes
            subdir = os.path.dirname(path)
            if subdir not in self._subdirs:
                try:
                    os.mkdir(subdir)   # not makedirs: a tier whose directory is gone turns off
                except FileExistsError:
                    pass
                self._subdirs.add(subdir)
            self.io.write(path, (header, payload))
        except OSError as e:
            with self._lock:
                self._writing -= self.record_bytes
            self._turn_off(f"writing {path}", e)
            return None
        seconds = time.perf_counter() - t0

        def commit() -> None:
            with self._lock:
                self._writing -= self.record_bytes
                self._write_s.observe(seconds)
                if not self.enabled:
                    return
                self._evict_to(self.record_bytes, owner)   # a tier of fewer records than writers: still in bounds
                self._index.add(key, owner)
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
                held = self.enabled and key in self._index
            if not held:
                break
            path = self._path(key)
            row = out[n].numpy().data.cast("B")
            try:
                read_record(self.io, path, header, row, self.fingerprint, key)
            except FileNotFoundError:
                with self._lock:
                    self._drop(key, None)
                break
            except RecordError as e:
                log.warning("KV disk tier: dropping %s: %s", path, e)
                with self._lock:
                    self._counts["checksum"] += 1
                    self._drop(key, path)
                break
            except OSError as e:
                self._turn_off(f"reading {path}", e)
                break
            with self._lock:
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
    def _evict_to(self, room: int, owner: Owner | None = None) -> None:
        while self._index and self.used_bytes + room > self.capacity_bytes:
            key = self._index.victim(owner, for_write=room > 0)
            self._index.remove(key)
            self._counts["evicted"] += 1
            self.io.unlink(self._path(key))
            self._emit(BlockRemoved(key[1], BlockId(0)))

    def _drop(self, key: DiskKey, path: str | None) -> None:
        if self._index.remove(key):
            self._emit(BlockRemoved(key[1], BlockId(0)))
        if path is not None:
            try:
                self.io.unlink(path)
            except OSError:
                pass   # the read already failed its check: it is out of the index either way

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

"""The disk tier's write-behind: blocks queued by the engine thread, written on two daemon threads.

`kvstore.disk.DiskTier.write_behind` submits a block; when the bounded queue is full the write
is dropped and counted (`num_dropped`), the caller never waits. A write runs in two stages, in
queue order, each on its own thread: `encode` (the record header, i.e. the checksum over the
payload), then `write` (the file, then the tier's index and event). Two stages: one block's
checksum (~25% of the CPU time of copying its bytes into the page cache) overlaps the file calls
of the one before (both release the GIL); in one thread they run in series, at about half the
speed of a plain sequential write (kvmesh bench transfer). A key stays queued, with its owner,
from its submit until its `write` returned. Every method may be called from any thread; `encode`
and `write` run outside this object's lock.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

from kvstore.disk_record import DiskKey
from kvstore.quota import Owner

EncodeFn = Callable[[DiskKey, memoryview], bytes]
WriteFn = Callable[[DiskKey, memoryview, bytes, Owner | None], None]


class WriteBehind:
    """At most `max_queue` blocks waiting for `encode` and `write` (see the module docstring)."""

    def __init__(self, max_queue: int, encode: EncodeFn, write: WriteFn) -> None:
        self._encode, self._write = encode, write
        self._lock = threading.Lock()
        self._writes: queue.Queue[tuple[DiskKey, torch.Tensor] | None] = queue.Queue(max_queue)
        self._headed: queue.Queue[tuple[DiskKey, memoryview, bytes] | None] = queue.Queue(4)   # checksummed
        self._queued: dict[DiskKey, Owner | None] = {}     # submitted, not yet written -> owner
        self._threads: list[threading.Thread] = []
        self.num_dropped = 0

    def start(self) -> None:
        for target, name in ((self._checksum_loop, "kv-disk-checksum"), (self._write_loop, "kv-disk-write")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def queued(self, key: DiskKey) -> bool:
        with self._lock:
            return key in self._queued

    def submit(self, key: DiskKey, block: torch.Tensor, owner: Owner | None) -> bool:
        """Queue `block` (owned by the writer from now on); False when `key` is queued already or
        the queue is full (counted in `num_dropped`)."""
        with self._lock:
            if key in self._queued:
                return False
            try:
                self._writes.put_nowait((key, block))
            except queue.Full:
                self.num_dropped += 1
                return False
            self._queued[key] = owner
            return True

    def flush(self, timeout_s: float) -> None:
        """Wait until every queued write returned, or `timeout_s` passed."""
        deadline = time.monotonic() + timeout_s
        done = self._writes.all_tasks_done   # notified when the last queued write returned: no polling
        with done:
            while self._writes.unfinished_tasks and (left := deadline - time.monotonic()) > 0:
                done.wait(left)

    def stop(self) -> None:
        """Drop the queued writes and stop the threads."""
        for q in (self._writes, self._headed):
            while True:
                try:
                    q.get_nowait()
                    self._writes.task_done()
                except queue.Empty:
                    break
        self._writes.put(None)          # the checksum stage hands it on to the write stage
        for t in self._threads:
            t.join(timeout=5)
        self._threads = []

    def _checksum_loop(self) -> None:
        """A write's first stage, in queue order: `encode`, handed to the write stage."""
        while True:
            item = self._writes.get()
            if item is None:
                self._headed.put(None)
                return
            key, block = item
            payload = block.view(torch.uint8).numpy().data.cast("B")
            self._headed.put((key, payload, self._encode(key, payload)))

    def _write_loop(self) -> None:
        """A write's second stage, in queue order: `write`, then the key is no longer queued."""
        while True:
            item = self._headed.get()
            if item is None:
                return
            key, payload, header = item
            try:
                with self._lock:
                    owner = self._queued.get(key)
                self._write(key, payload, header, owner)
                with self._lock:
                    self._queued.pop(key, None)
            finally:
                self._writes.task_done()

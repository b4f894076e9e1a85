"""The disk tier's write-behind: blocks queued by the engine thread, written by writer threads.

`kvstore.disk.DiskTier.write_behind` submits a block; when the bounded queue is full the write
is dropped and counted (`num_dropped`), the caller never waits. Each of `writers` daemon threads
takes the oldest queued block and runs both steps of its write: `encode` (the record header,
i.e. the checksum over the payload), then `write` (the record into a slot), which returns the block's commit
(the tier's index and event); commits run one at a time in queue order.
Two writers by default: a block's bytes are read twice (the checksum, then write(2)'s copy into
the page cache, which is the larger part) and both release the GIL, so two blocks written at
once keep two cores busy where one writer — or one checksum thread feeding one file thread —
ran at 0.6-0.7x a plain sequential write of the same bytes (`kvmesh bench transfer`). Blocks
are taken in queue order, their records may be finished out of it, and a block's commit waits
for those of the blocks queued before it, so the index, the events and the LRU follow queue order
as with one writer. A key stays queued, with its owner, from its
submit until its `write` returned. Every method may be called from any thread; `encode` and
`write` run outside this object's lock.
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
WriteFn = Callable[[DiskKey, memoryview, bytes, Owner | None], Callable[[], None] | None]   # -> its commit
DEFAULT_WRITERS = 2


class WriteBehind:
    """At most `max_queue` blocks waiting for `encode` and `write` (see the module docstring)."""

    def __init__(self, max_queue: int, encode: EncodeFn, write: WriteFn, writers: int = DEFAULT_WRITERS) -> None:
        if writers < 1:
            raise ValueError(f"writers={writers} must be >= 1")
        self._encode, self._write = encode, write
        self._lock = threading.Lock()
        self._writes: queue.Queue[tuple[DiskKey, torch.Tensor] | None] = queue.Queue(max_queue)
        self._queued: dict[DiskKey, Owner | None] = {}     # submitted, not yet written -> owner
        self._threads: list[threading.Thread] = []
        self._take = threading.Lock()               # a block's take and its turn number, together
        self._taken = 0                             # turn numbers given out
        self._turn = threading.Condition()          # commits in turn order
        self._next = 0                              # the turn whose commit runs next
        self.writers = writers
        self.num_dropped = 0

    def start(self) -> None:
        for i in range(self.writers):
            t = threading.Thread(target=self._loop, name=f"kv-disk-write-{i}", daemon=True)
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
        """Drop the queued writes and stop the threads (a write in progress finishes)."""
        while True:
            try:
                self._writes.get_nowait()
                self._writes.task_done()
            except queue.Empty:
                break
        for _ in self._threads:
            self._writes.put(None)          # one stop for each writer
        for t in self._threads:
            t.join(timeout=5)
        self._threads = []

    def _loop(self) -> None:
        """One writer: take the oldest queued block, `encode` and `write` it, then run its
        commit in its turn; the key is no longer queued after that."""
        while True:
            with self._take:
                item = self._writes.get()
                turn = self._taken
                if item is not None:
                    self._taken += 1
            if item is None:
                self._writes.task_done()
                return
            key, block = item
            commit = None
            try:
                payload = block.view(torch.uint8).numpy().data.cast("B")
                header = self._encode(key, payload)
                with self._lock:
                    owner = self._queued.get(key)
                commit = self._write(key, payload, header, owner)
            finally:
                with self._turn:
                    while self._next != turn:
                        self._turn.wait()
                    try:
                        if commit is not None:
                            commit()
                    finally:
                        self._next += 1
                        self._turn.notify_all()
                with self._lock:
                    self._queued.pop(key, None)
                self._writes.task_done()

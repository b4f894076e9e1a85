"""The disk tier's read-ahead: runs of records read back on a daemon thread, picked up later.

`kvstore.disk.DiskTier.read_ahead` submits a run of keys (a `Match`'s disk run); the reader
thread reads it with the tier's `read` (the leading records held and valid); the engine thread
picks the finished reads up with `take` (`DiskTier.take_reads`) and stages them into the host
tier, or waits for one with `wait` when it has nothing else to do. A key stays in flight from
its submit until the read holding it is taken, so a run asked for twice is read once.
Every method may be called from any thread; `read` runs outside this object's lock.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from kvstore.disk_record import DiskKey

ReadFn = Callable[[tuple[DiskKey, ...]], tuple[tuple[DiskKey, ...], torch.Tensor | None]]


class DiskRead(NamedTuple):
    """A finished `read_ahead`: the leading `keys` that were read, their blocks
    `[L, 2, n, bs, H, D | bytes]` (None when none was), and the keys asked for."""

    asked: tuple[DiskKey, ...]
    keys: tuple[DiskKey, ...]
    blocks: torch.Tensor | None


class ReadAhead:
    """Runs of keys read by `read` on one daemon thread (see the module docstring)."""

    def __init__(self, read: ReadFn) -> None:
        self._read = read
        self._queue: queue.Queue[tuple[DiskKey, ...] | None] = queue.Queue()
        self._cv = threading.Condition()
        self._reading: set[DiskKey] = set()      # submitted, not yet taken
        self._done: list[DiskRead] = []
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kv-disk-read", daemon=True)
        self._thread.start()

    def submit(self, keys: Sequence[DiskKey]) -> None:
        """Have the thread read `keys` (non-empty), unless their first one is in flight already."""
        with self._cv:
            if keys[0] in self._reading:
                return
            todo = tuple(k for k in keys if k not in self._reading)
            self._reading.update(todo)
        self._queue.put(todo)

    def take(self) -> list[DiskRead]:
        """Finished reads, oldest first (their keys are no longer in flight)."""
        with self._cv:
            done, self._done = self._done, []
            for d in done:
                self._reading.difference_update(d.asked)
        return done

    def wait(self, timeout_s: float) -> bool:
        """Block until a read finishes or `timeout_s` passes; False if none is in flight."""
        with self._cv:
            if not self._reading:
                return False
            if not self._done:
                self._cv.wait(timeout_s)
            return True

    def busy(self) -> bool:
        """Whether a read is in flight or done and not taken yet."""
        with self._cv:
            return bool(self._reading or self._done)

    def stop(self) -> None:
        """Drop the runs not started yet and stop the thread."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _loop(self) -> None:
        while True:
            keys = self._queue.get()
            if keys is None:
                return
            got, blocks = self._read(keys)
            with self._cv:
                self._done.append(DiskRead(keys, got, blocks))
                self._cv.notify_all()

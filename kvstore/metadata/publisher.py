"""KV event streams in Redis, the worker's side: `EventPublisher` appends each pool event to the
worker's stream (`Keys.events`) in the `kvstore.events` wire format, with a `seq` that grows by one
per entry within the worker's epoch, and answers the router's inventory requests (`Keys.resync`).
It runs on worker threads (sync) and never raises into its caller while Redis is down. The router's
side is `kvstore.metadata.streams.EventConsumer`.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from kvstore.events import (
    Tier,
    WireEvent,
    WorkerId,
    encode_event,
    from_pool_events,
    inventory_events,
)
from kvstore.keys import BlockHash
from kvstore.metadata.connection import SyncClient
from kvstore.metadata.registry import (
    MetadataError,
    RedisConfig,
    check_worker_id,
    link,
    redis_errors,
)
from kvstore.pool import KVEvent

log = logging.getLogger("kvmesh.streams")


InventoryFn = Callable[[], Mapping[Tier, Sequence[BlockHash]]]


class PublisherStats(NamedTuple):
    """`pending`: events waiting for Redis; `dropped`: events dropped from a full buffer
    (an inventory replaces them); `inventories`: full snapshots written."""

    next_seq: int
    pending: int
    dropped: int
    inventories: int
    failures: int
    connected: bool


class EventPublisher:
    """Appends one worker's KV events to its stream, each entry with the next `seq`.

    Never raises into its caller when Redis is down: events wait in a buffer of at most
    `max_pending`; overflowing it drops them all and schedules a full inventory instead.
    The inventory comes from `inventory_fn`, which must reflect at least every event
    already handed to `publish` (call it on the thread that takes the pool's events). It
    is published at start (so a new epoch begins with one), after drops, after a Redis
    restart, and when the router asks (`poll`). Thread-safe; `inventory_fn` runs under
    the publisher's lock and must not call back into the publisher.

    Entries are written in one MULTI/EXEC per call (one key: one node of a cluster). If a write
    fails it is retried with the same `seq`s; should the failed one have landed after all, the
    consumer sees the repeat as a gap and asks for an inventory.
    """

    def __init__(self, config: RedisConfig, worker_id: WorkerId, epoch: int,
                 inventory_fn: InventoryFn, *, max_pending: int = 10_000,
                 max_backoff_s: float = 1.0, client: SyncClient | None = None) -> None:
        check_worker_id(worker_id)
        if max_pending <= 0:
            raise ValueError(f"max_pending={max_pending!r} must be > 0")
        self.config, self.worker_id, self.epoch = config, worker_id, epoch
        self._inventory_fn = inventory_fn
        self._max_pending, self._max_backoff_s = max_pending, max_backoff_s
        self._link = link(config, client)
        self._stream = config.keys.events(worker_id)
        self._resync_key = config.keys.resync(worker_id)
        self._lock = threading.RLock()
        self._pending: list[WireEvent] = []
        self._next_seq = 1
        self._needs_inventory = True
        self._run_id: str | None = None
        self._next_check = 0.0
        self._retry_at, self._backoff_s = 0.0, 0.0
        self._dropped = self._inventories = self._failures = 0

    def publish(self, events: Sequence[KVEvent], tier: Tier = Tier.DEVICE) -> bool:
        """Queue `BlockPool.take_events()` output and try to write it; True if it is in Redis."""
        return self.publish_wire(from_pool_events(events, tier))

    def publish_wire(self, events: Sequence[WireEvent]) -> bool:
        """Like `publish`, for events already in wire form (e.g. tier moves)."""
        with self._lock:
            self._pending.extend(events)
            if len(self._pending) > self._max_pending:
                self._dropped += len(self._pending)
                self._pending.clear()
                self._needs_inventory = True
            return self._flush()

    def publish_inventory(self, hashes_by_tier: Mapping[Tier, Sequence[BlockHash]]) -> bool:
        """Write a full snapshot now; it replaces every event queued before it."""
        with self._lock:
            return self._flush(inventory_events(hashes_by_tier))

    def poll(self) -> bool:
        """Serve a resync request, notice a Redis restart, retry what is queued.
        Call it every few tens of ms. True when nothing is left waiting for Redis."""
        with self._lock:
            now = time.monotonic()
            if now < self._retry_at:
                return False
            try:
                with redis_errors("poll"):
                    if self._link.client.getdel(self._resync_key) is not None:
                        self._needs_inventory = True
                    if now >= self._next_check:
                        self._check_run_id()
                        self._next_check = now + self.config.heartbeat_interval_s
            except MetadataError as e:
                self._fail(e)
                return False
            return self._flush()

    def stats(self) -> PublisherStats:
        with self._lock:
            return PublisherStats(self._next_seq, len(self._pending), self._dropped,
                                  self._inventories, self._failures, self._retry_at == 0.0)

    def close(self) -> None:
        self._link.close()

    def _check_run_id(self) -> None:
        run_id = self._link.server_id(self._stream)
        if self._run_id is not None and run_id != self._run_id:
            log.warning("worker %s: Redis restarted or failed over; republishing the inventory", self.worker_id)
            self._needs_inventory = True
        self._run_id = run_id

    def _flush(self, inventory: list[WireEvent] | None = None) -> bool:
        if inventory is None and time.monotonic() < self._retry_at:
            return False
        try:
            with redis_errors("publish"):
                if self._run_id is None or self._retry_at:
                    self._check_run_id()  # first contact, or back after a failure
                if inventory is None and self._needs_inventory:
                    inventory = inventory_events(self._inventory_fn())
                batch = inventory if inventory is not None else self._pending
                if batch:
                    p = self._link.client.pipeline(transaction=True)
                    for i, event in enumerate(batch):
                        fields = encode_event(event, self.epoch, self._next_seq + i)
                        p.xadd(self._stream, fields,  # type: ignore[arg-type]
                               maxlen=self.config.stream_maxlen, approximate=True)
                    p.execute()
        except MetadataError as e:
            self._fail(e)
            if inventory is not None:  # it will be taken again, fresh, on the next try
                self._pending.clear()
                self._needs_inventory = True
            return False
        self._next_seq += len(batch)
        self._pending.clear()  # an inventory supersedes what was queued before it
        if inventory is not None:
            self._needs_inventory = False
            self._inventories += 1
        self._retry_at, self._backoff_s = 0.0, 0.0
        return True

    def _fail(self, error: MetadataError) -> None:
        self._failures += 1
        self._backoff_s = min(self._max_backoff_s, max(0.05, 2 * self._backoff_s))
        self._retry_at = time.monotonic() + self._backoff_s
        log.warning("worker %s: events wait for Redis (%d queued): %s", self.worker_id,
                    len(self._pending), error)

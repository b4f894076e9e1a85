"""The worker's side of the Redis metadata: registry + heartbeat, and the KV event stream.

Redis appears only here and in kvstore (metadata.py, streams.py); the module imports them
lazily, so a worker without --redis-url never loads a Redis client.

No Redis call runs on the engine thread: `after_step` only hands the store's events to a
`PublishThread`, whose own thread does every write, retry and resync poll. (Found by the pod
network partition test: with the worker cut off from Redis by dropped packets, each publish
retry blocked the engine thread for the 2 s socket timeout and generation ran ~4x slower.)
The publisher's inventories come from a `Shadow` of the store: the hashes per tier that the
events handed over add up to, so an inventory never touches the store from another thread.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from kvstore.events import EventType, Tier, WireEvent, WorkerId as EventWorkerId, from_tiered_events
from kvstore.keys import BlockHash

if TYPE_CHECKING:
    from kvstore.metadata.publisher import EventPublisher
    from worker.engine.engine import Engine

log = logging.getLogger("kvmesh.worker")


class MetadataConfig(Protocol):
    """What the hook reads of the worker's config (WorkerServerConfig satisfies it)."""

    @property
    def redis_url(self) -> str | None: ...
    @property
    def cluster_name(self) -> str: ...
    @property
    def worker_id(self) -> str: ...


class Shadow:
    """The block hashes per tier that a store's events add up to, from a starting inventory.
    Owned by the `PublishThread` (one thread applies and reads it)."""

    def __init__(self, initial: Mapping[Tier, Sequence[BlockHash]]) -> None:
        self._held: dict[Tier, dict[BlockHash, None]] = {t: dict.fromkeys(initial.get(t, ())) for t in Tier}

    def apply(self, events: Sequence[WireEvent]) -> None:
        for e in events:
            held = self._held[e.tier]
            if e.type is EventType.STORED:
                held.update(dict.fromkeys(e.hashes))
            elif e.type is EventType.REMOVED:
                for h in e.hashes:
                    held.pop(h, None)
            elif e.type is EventType.CLEARED:
                held.clear()
            elif e.type is EventType.INVENTORY_BEGIN:
                for t in Tier:
                    self._held[t].clear()

    def inventory(self) -> dict[Tier, list[BlockHash]]:
        return {t: list(held) for t, held in self._held.items()}


class PublishThread:
    """An `EventPublisher` driven from its own thread. `put` (any thread) queues events and
    returns at once; the thread hands them to the publisher (after the shadow, so an inventory
    reflects every event handed over) and calls `poll` every `poll_interval_s`."""

    def __init__(self, make_publisher: Callable[[Callable[[], dict[Tier, list[BlockHash]]]], EventPublisher],
                 initial: Mapping[Tier, Sequence[BlockHash]], poll_interval_s: float = 0.05,
                 name: str = "kv-events") -> None:
        self.shadow = Shadow(initial)
        self.publisher = make_publisher(self.shadow.inventory)
        self.poll_interval_s = poll_interval_s
        self._lock = threading.Lock()
        self._queue: list[WireEvent] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, events: Sequence[WireEvent]) -> None:
        with self._lock:
            self._queue.extend(events)
        self._wake.set()

    def _run(self) -> None:
        next_poll = 0.0
        while not self._stop.is_set():
            self._wake.wait(timeout=self.poll_interval_s)
            self._wake.clear()
            self._drain()
            now = time.monotonic()
            if now >= next_poll:
                next_poll = now + self.poll_interval_s
                self.publisher.poll()

    def _drain(self) -> None:
        with self._lock:
            batch, self._queue = self._queue, []
        if batch:
            self.shadow.apply(batch)
            self.publisher.publish_wire(batch)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (after its current Redis call, bounded by the socket timeout) and
        close the publisher."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            log.warning("event publisher thread still in a Redis call after %.0f s; closing anyway", timeout_s)
        self.publisher.close()


class WorkerMetadata:
    """The worker's side of the Redis metadata: registry + heartbeat, and the KV event
    stream of its KV store (device pool and host tier, one ordered log). `after_step` runs on
    the engine thread (AsyncEngine's hook): it takes the store's events in step with the store
    and queues them; a `PublishThread` writes them to Redis."""

    POLL_INTERVAL_S = 0.05

    def __init__(self, cfg: MetadataConfig, address: str, engine: Engine) -> None:
        from kvstore.metadata.publisher import EventPublisher
        from kvstore.metadata.registry import Heartbeater, RedisConfig, WorkerRecord, WorkerRegistry

        assert cfg.redis_url is not None
        rcfg = RedisConfig(url=cfg.redis_url, cluster_name=cfg.cluster_name)
        self.registry = WorkerRegistry(rcfg)
        worker_id = EventWorkerId(cfg.worker_id)
        epoch = self.registry.new_epoch(worker_id)
        record = WorkerRecord(worker_id=cfg.worker_id, address=address, model=engine.model_config.name,
                              block_size=engine.cfg.block_size, num_blocks=engine.store.num_blocks,
                              hash_salt_hex=engine.salt.hex(), epoch=epoch, role=cfg.role.value)
        sched = engine.scheduler
        self.heartbeater = Heartbeater(self.registry, record,
                                       load_fn=lambda: float(len(sched.running) + len(sched.waiting)))
        self.store = engine.store
        # built before the engine thread runs: recording on and the snapshot are one instant
        self.store.set_event_recording(True)
        self.events = PublishThread(lambda inventory: EventPublisher(rcfg, worker_id, epoch, inventory_fn=inventory),
                                    self.store.inventory(), self.POLL_INTERVAL_S)
        self._muted = False

    @property
    def publisher(self) -> EventPublisher:
        return self.events.publisher

    def mute(self) -> None:
        """Stop publishing KV events (the worker is leaving: not live); `after_step` does
        nothing from its next call on. The heartbeater is stopped apart (`heartbeater.stop`)."""
        self._muted = True

    def after_step(self) -> None:
        if self._muted:
            return
        events = self.store.take_events()
        if events:
            self.events.put(from_tiered_events(events))

    def close(self) -> None:
        self.heartbeater.stop(deregister=True)
        self.events.close()
        self.registry.close()

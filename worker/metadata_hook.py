"""The worker's side of the Redis metadata: registry + heartbeat, and the KV event stream.

Redis appears only here and in kvstore (metadata.py, streams.py); the module imports them
lazily, so a worker without --redis-url never loads a Redis client.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from kvstore.events import WorkerId as EventWorkerId, from_tiered_events   # pure data: no Redis, no torch

if TYPE_CHECKING:
    from worker.engine import Engine


class MetadataConfig(Protocol):
    """What the hook reads of the worker's config (WorkerServerConfig satisfies it)."""

    @property
    def redis_url(self) -> str | None: ...
    @property
    def cluster_name(self) -> str: ...
    @property
    def worker_id(self) -> str: ...


class WorkerMetadata:
    """The worker's side of the Redis metadata: registry + heartbeat, and the KV event
    stream of its KV store (device pool and host tier, one ordered log). `after_step` runs on
    the engine thread (AsyncEngine's hook), so the events and the inventory it publishes are
    always in step with the store."""

    def __init__(self, cfg: MetadataConfig, address: str, engine: Engine) -> None:
        from kvstore.metadata import Heartbeater, RedisConfig, WorkerRecord, WorkerRegistry
        from kvstore.streams import EventPublisher

        assert cfg.redis_url is not None
        rcfg = RedisConfig(url=cfg.redis_url, cluster_name=cfg.cluster_name)
        self.registry = WorkerRegistry(rcfg)
        worker_id = EventWorkerId(cfg.worker_id)
        epoch = self.registry.new_epoch(worker_id)
        record = WorkerRecord(worker_id=cfg.worker_id, address=address, model=engine.model_config.name,
                              block_size=engine.cfg.block_size, num_blocks=engine.store.num_blocks,
                              hash_salt_hex=engine.salt.hex(), epoch=epoch)
        sched = engine.scheduler
        self.heartbeater = Heartbeater(self.registry, record,
                                       load_fn=lambda: float(len(sched.running) + len(sched.waiting)))
        self.store = engine.store
        self.store.set_event_recording(True)
        self.publisher = EventPublisher(rcfg, worker_id, epoch, inventory_fn=self.store.inventory)
        self._next_poll = 0.0
        self._muted = False

    POLL_INTERVAL_S = 0.05

    def mute(self) -> None:
        """Stop publishing KV events (the worker is leaving: not live); `after_step` does
        nothing from its next call on. The heartbeater is stopped apart (`heartbeater.stop`)."""
        self._muted = True

    def after_step(self) -> None:
        if self._muted:
            return
        events = self.store.take_events()
        if events:
            self.publisher.publish_wire(from_tiered_events(events))
        # Resync requests and retries need no Redis round trip on every decode step.
        now = time.monotonic()
        if now >= self._next_poll:
            self._next_poll = now + self.POLL_INTERVAL_S
            self.publisher.poll()

    def close(self) -> None:
        self.heartbeater.stop(deregister=True)
        self.publisher.close()
        self.registry.close()

"""The worker's event publishing off the engine thread (worker/server/metadata_hook.py): the `Shadow`
inventory equals the pool it follows, `PublishThread.put` never waits for Redis (a Redis that
accepts the connection and never answers, as a partition looks), and against a real
redis-server the router's BlockIndex ends up holding exactly what the pool caches."""
from __future__ import annotations

import asyncio
import random
import socket
import time

import pytest

from kvstore.events import EventType, Tier, WireEvent, WorkerId, from_pool_events
from kvstore.keys import BlockHash, HashSalt, block_hashes
from kvstore.metadata.publisher import EventPublisher
from kvstore.metadata.registry import RedisConfig
from kvstore.metadata.streams import EventConsumer
from kvstore.pool import BlockPool
from router.index.blocks import BlockIndex
from tests.support.redis_server import RedisServer
from worker.server.metadata_hook import PublishThread, Shadow

BS = 4
SALT = HashSalt("test-model", "test-tok", "fp16", BS).digest()


def serve(pool: BlockPool, tokens: list[int]) -> None:
    hashes = block_hashes(tokens, BS, SALT)
    n = min(len(hashes), pool.num_free_blocks)
    ids = pool.allocate(n)
    pool.cache_full_blocks(ids, hashes[:n])
    pool.free_sequence(ids)


def test_shadow_follows_the_pool_through_stores_evictions_and_a_reset() -> None:
    pool = BlockPool(16, enable_kv_cache_events=True)
    serve(pool, list(range(12)))
    shadow = Shadow({Tier.DEVICE: pool.cached_hashes()})
    pool.take_events()
    rng = random.Random(0)
    for step in range(60):
        if step == 30:
            assert pool.reset_prefix_cache()
        else:
            serve(pool, [rng.randrange(50) for _ in range(rng.randrange(4, 40))])
        shadow.apply(from_pool_events(pool.take_events()))
        assert set(shadow.inventory()[Tier.DEVICE]) == set(pool.cached_hashes())
    shadow.apply([WireEvent(EventType.STORED, (BlockHash(7),), None, Tier.HOST)])
    assert shadow.inventory()[Tier.HOST] == [BlockHash(7)]
    shadow.apply([WireEvent(EventType.CLEARED, tier=Tier.HOST)])
    assert shadow.inventory()[Tier.HOST] == []


def test_put_never_waits_for_a_redis_that_does_not_answer() -> None:
    silent = socket.socket()            # accepts connections (the kernel does), answers nothing
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    cfg = RedisConfig(f"redis://127.0.0.1:{silent.getsockname()[1]}/0", "test-silent", socket_timeout_s=1.0)
    worker = WorkerId("w0")
    events = PublishThread(lambda inv: EventPublisher(cfg, worker, 1, inventory_fn=inv), {Tier.DEVICE: []})
    try:
        time.sleep(0.2)                 # the thread is now inside a Redis call that will time out
        worst = 0.0
        for i in range(50):
            t0 = time.monotonic()
            events.put([WireEvent(EventType.STORED, (BlockHash(i),), None, Tier.DEVICE)])
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.01)
        assert worst < 0.05, f"put waited {worst:.3f} s"
        assert events.publisher.stats().failures >= 1
    finally:
        events.close()
        silent.close()


@pytest.mark.redis
def test_events_put_from_the_engine_side_reach_the_index(redis_server: RedisServer) -> None:  # noqa: F811
    cfg = RedisConfig(redis_server.url, "test-hook", heartbeat_ttl_s=1.0, heartbeat_interval_s=0.2,
                      socket_timeout_s=1.0)
    from kvstore.metadata.registry import Heartbeater, WorkerRecord, WorkerRegistry
    worker = WorkerId("w0")
    registry = WorkerRegistry(cfg)
    epoch = registry.new_epoch(worker)
    beat = Heartbeater(registry, WorkerRecord(worker, "127.0.0.1:9000", "m", BS, 16, SALT.hex(), epoch))
    beat.start()
    pool = BlockPool(16, enable_kv_cache_events=True)
    serve(pool, list(range(20)))       # held before the publisher starts: its first inventory
    pool.take_events()
    events = PublishThread(lambda inv: EventPublisher(cfg, worker, epoch, inventory_fn=inv),
                           {Tier.DEVICE: pool.cached_hashes()}, poll_interval_s=0.02)

    async def main() -> None:
        index = BlockIndex()
        consumer = EventConsumer(cfg, index, block_ms=20, max_backoff_s=0.2)
        try:
            rng = random.Random(1)
            for _ in range(20):
                serve(pool, [rng.randrange(60) for _ in range(rng.randrange(4, 30))])
                events.put(from_pool_events(pool.take_events()))
                await consumer.poll()
            deadline = time.monotonic() + 10
            truth = {h: frozenset({Tier.DEVICE}) for h in pool.cached_hashes()}
            while index.holdings(worker) != truth:
                assert time.monotonic() < deadline, (len(index.holdings(worker)), len(truth), consumer.stats())
                await consumer.poll()
            index.check_integrity()
        finally:
            await consumer.aclose()
    try:
        asyncio.run(main())
    finally:
        events.close()
        beat.stop(deregister=True)
        registry.close()

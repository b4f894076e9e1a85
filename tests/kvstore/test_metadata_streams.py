"""Redis metadata, against a real redis-server: the event streams feeding a BlockIndex
through gaps, worker restarts and Redis restarts. The oracle for the index is each
worker's own BlockPool: after every scenario, what the router believes a worker holds
must equal what that worker's pool caches."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from kvstore.events import Tier, WorkerId
from kvstore.keys import BlockHash, block_hashes
from kvstore.metadata.publisher import EventPublisher
from kvstore.metadata.registry import Heartbeater, RedisConfig, WorkerRegistry
from kvstore.metadata.streams import EventConsumer
from kvstore.pool import BlockId, BlockPool
from router.index.blocks import BlockIndex
from tests.kvstore.test_metadata import BS, SALT, cfg_for, record
from tests.support.redis_server import RedisServer

# ---- event streams → BlockIndex ----------------------------------------------------------


class PoolWorker:
    """The KV side of one worker: a real BlockPool whose events go to Redis, registered and
    heartbeating. Its pool is the oracle for what the router's index must say it holds."""

    def __init__(self, cfg: RedisConfig, worker_id: str, max_pending: int = 10_000) -> None:
        self.worker_id = WorkerId(worker_id)
        self.registry = WorkerRegistry(cfg)
        self.epoch = self.registry.new_epoch(self.worker_id)
        self.heartbeater = Heartbeater(self.registry, record(worker_id, self.epoch))
        self.heartbeater.start()
        self.pool = BlockPool(16, enable_kv_cache_events=True)
        self.pub = EventPublisher(cfg, self.worker_id, self.epoch, self.inventory,
                                  max_pending=max_pending)

    def inventory(self) -> dict[Tier, list[BlockHash]]:
        return {Tier.DEVICE: list(self.truth())}

    def truth(self) -> dict[BlockHash, frozenset[Tier]]:
        infos = (self.pool.block_info(BlockId(i)) for i in range(self.pool.num_blocks))
        return {i.block_hash: frozenset({Tier.DEVICE}) for i in infos if i.block_hash is not None}

    def serve(self, tokens: list[int]) -> list[BlockHash]:
        """Cache the full blocks of `tokens`, free them, publish the pool's events."""
        hashes = block_hashes(tokens, BS, SALT)
        ids = self.pool.allocate(len(hashes))
        self.pool.cache_full_blocks(ids, hashes)
        self.pool.free_sequence(ids)
        self.flush()
        return hashes

    def flush(self) -> bool:
        return self.pub.publish(self.pool.take_events())

    def stop(self, deregister: bool = True) -> None:
        self.heartbeater.stop(deregister)
        self.pub.close()
        self.registry.close()


async def synced(consumer: EventConsumer, workers: list[PoolWorker], timeout_s: float = 5.0) -> None:
    """Poll publishers and consumer until the index holds exactly what each pool caches."""
    index = consumer.index
    assert isinstance(index, BlockIndex)
    deadline = time.monotonic() + timeout_s
    while not (all(w.worker_id in consumer.workers and index.holdings(w.worker_id) == w.truth()
                   for w in workers) and not consumer.degraded):
        assert time.monotonic() < deadline, f"index never matched the pools: {consumer.stats()}"
        for w in workers:
            w.pub.poll()
        await consumer.poll()
    index.check_integrity()


def run_scenario(cfg: RedisConfig, workers: list[PoolWorker],
                 scenario: Callable[[EventConsumer, BlockIndex], object]) -> None:
    async def main() -> None:
        index = BlockIndex()
        consumer = EventConsumer(cfg, index, block_ms=20, max_backoff_s=0.2)
        try:
            await scenario(consumer, index)  # type: ignore[misc]
        finally:
            await consumer.aclose()
    try:
        asyncio.run(main())
    finally:
        for w in workers:
            w.stop()


@pytest.mark.redis
def test_stored_removed_cleared_flow(redis_server: RedisServer) -> None:
    cfg = cfg_for(redis_server.url)
    w = PoolWorker(cfg, "w0")

    async def scenario(consumer: EventConsumer, index: BlockIndex) -> None:
        await synced(consumer, [w])  # first sight: a resync, the (empty) inventory
        a = w.serve(list(range(16)))
        b = w.serve(list(range(8)) + list(range(50, 58)))  # shares a's first 2 blocks
        await synced(consumer, [w])
        assert index.match_prefix(a) == {"w0": 4} and index.match_prefix(b) == {"w0": 4}
        assert index.match_prefix(a[:1] + [BlockHash(12345)] + a[2:]) == {"w0": 1}
        w.serve(list(range(100, 164)))  # 16 new blocks: evicts every cached one
        await synced(consumer, [w])
        assert index.match_prefix(a, ["w0", "w9"]) == {"w0": 0, "w9": 0}
        assert w.pool.reset_prefix_cache() and w.flush()
        await synced(consumer, [w])
        assert index.holdings(w.worker_id) == {} and index.stats().num_blocks == 0
        s = consumer.stats()
        assert (s.gaps, s.new_epochs, s.resyncs_requested, s.bad_entries) == (0, 0, 1, 0)
        entries = redis_server.client().xrange(cfg.keys.events("w0"))
        assert [int(f["seq"]) for _, f in entries] == list(range(1, len(entries) + 1))
        assert {f["epoch"] for _, f in entries} == {str(w.epoch)}
        assert [f["type"] for _, f in entries][-1] == "cleared"

    run_scenario(cfg, [w], scenario)


@pytest.mark.redis
def test_gap_clears_worker_and_resync_restores(redis_server: RedisServer) -> None:
    cfg = cfg_for(redis_server.url)
    w = PoolWorker(cfg, "w0")

    async def scenario(consumer: EventConsumer, index: BlockIndex) -> None:
        a = w.serve(list(range(8)))
        await synced(consumer, [w])
        lost, kept = w.serve(list(range(20, 28))), w.serve(list(range(40, 48)))
        newest = redis_server.client().xrevrange(cfg.keys.events("w0"), count=2)
        assert redis_server.client().xdel(cfg.keys.events("w0"), newest[1][0]) == 1  # `lost`
        deadline = time.monotonic() + 5.0
        while consumer.stats().gaps == 0:
            assert time.monotonic() < deadline, "the gap went unnoticed"
            await consumer.poll()  # the publisher does not poll yet: no resync served
        assert set(index.holdings(w.worker_id)) == set(kept)  # cleared, then `kept` applied
        assert index.match_prefix(a) == {"w0": 0} and index.match_prefix(lost) == {"w0": 0}
        assert redis_server.client().exists(cfg.keys.resync("w0"))
        inventories = w.pub.stats().inventories
        await synced(consumer, [w])
        assert w.pub.stats().inventories == inventories + 1
        assert index.match_prefix(a) == index.match_prefix(lost) == {"w0": 2}

    run_scenario(cfg, [w], scenario)


@pytest.mark.redis
def test_worker_restart_new_epoch(redis_server: RedisServer) -> None:
    cfg = cfg_for(redis_server.url)
    old = PoolWorker(cfg, "w0")
    workers = [old]

    async def scenario(consumer: EventConsumer, index: BlockIndex) -> None:
        a = old.serve(list(range(16)))
        await synced(consumer, [old])
        old.stop(deregister=False)  # a crash: the record stays until the new process
        new = PoolWorker(cfg, "w0")  # registers again with the next epoch
        workers.append(new)
        assert new.epoch == old.epoch + 1
        deadline = time.monotonic() + 2.0
        while index.holdings(new.worker_id):  # the registry shows the new epoch first
            assert time.monotonic() < deadline, "stale blocks of the old epoch stayed"
            await consumer.poll()
        b = new.serve(list(range(4)) + list(range(60, 68)))
        await synced(consumer, [new])
        assert index.match_prefix(a) == {"w0": 1} and index.match_prefix(b) == {"w0": 3}
        assert consumer.stats().new_epochs == 1 and consumer.workers["w0"].epoch == new.epoch

    run_scenario(cfg, workers, scenario)


@pytest.mark.redis
def test_expired_worker_leaves_routing(redis_server: RedisServer) -> None:
    cfg = cfg_for(redis_server.url)
    w0, w1 = PoolWorker(cfg, "w0"), PoolWorker(cfg, "w1")

    async def scenario(consumer: EventConsumer, index: BlockIndex) -> None:
        a = w0.serve(list(range(8)))
        w1.serve(list(range(8)))
        await synced(consumer, [w0, w1])
        assert index.match_prefix(a) == {"w0": 2, "w1": 2}
        w1.heartbeater.stop(deregister=False)  # silent, not deregistered
        start = time.monotonic()
        while "w1" in consumer.workers:
            assert time.monotonic() - start < 5.0, "w1 never left routing"
            await consumer.poll()
            w0.pub.poll()
        assert time.monotonic() - start < cfg.heartbeat_ttl_s + cfg.heartbeat_interval_s + 1.0
        assert index.match_prefix(a) == {"w0": 2} and index.workers() == ["w0"]

    run_scenario(cfg, [w0, w1], scenario)


@pytest.mark.redis
def test_redis_restart_degrades_then_rebuilds(redis_server: RedisServer) -> None:
    cfg = cfg_for(redis_server.url)
    w0, w1 = PoolWorker(cfg, "w0"), PoolWorker(cfg, "w1", max_pending=2)

    async def scenario(consumer: EventConsumer, index: BlockIndex) -> None:
        a = w0.serve(list(range(12)))
        w1.serve(list(range(8)))
        await synced(consumer, [w0, w1])
        before = index.match_prefix(a)
        assert before == {"w0": 3, "w1": 2}
        redis_server.stop()
        assert not w0.pub.poll()  # never raises; neither do publish (below) nor heartbeats
        c = w0.serve(list(range(200, 208)))
        assert w0.pub.stats().pending >= 1 and not w0.pub.stats().connected
        for start in range(300, 340, 8):  # w1 overflows its buffer of 2
            w1.serve(list(range(start, start + 8)))
        assert w1.pub.stats().dropped > 0
        while consumer.stats().failures < 3:  # each poll in the outage fails fast
            await consumer.poll()
            assert consumer.degraded and index.match_prefix(a) == before  # last known index
            assert set(consumer.workers) == {"w0", "w1"}
        assert index.match_prefix(c) == {"w0": 0, "w1": 0}
        redis_server.start()  # same port, empty: registry, epochs and streams are gone
        await synced(consumer, [w0, w1], timeout_s=8.0)
        assert index.match_prefix(c)["w0"] == 2
        assert consumer.stats().redis_restarts == 1 and not consumer.degraded
        assert w0.pub.stats().pending == 0 and w0.pub.stats().connected

    run_scenario(cfg, [w0, w1], scenario)


@pytest.mark.redis
def test_quick_redis_restart_is_noticed(redis_server: RedisServer) -> None:
    """A restart between two polls may raise nothing (redis-py reconnects on its own): the
    new run_id still makes the consumer reread the streams and ask for inventories."""
    cfg = cfg_for(redis_server.url)
    w = PoolWorker(cfg, "w0")

    async def scenario(consumer: EventConsumer, index: BlockIndex) -> None:
        a = w.serve(list(range(12)))
        await synced(consumer, [w])
        redis_server.restart()
        b = w.serve(list(range(40, 48)))  # lands in the new, empty Redis (or waits)
        deadline = time.monotonic() + 5.0
        while consumer.stats().redis_restarts == 0:
            assert time.monotonic() < deadline, "the restart went unnoticed"
            await consumer.poll()
            w.pub.poll()
        await synced(consumer, [w])
        assert index.match_prefix(a) == {"w0": 3} and index.match_prefix(b) == {"w0": 2}

    run_scenario(cfg, [w], scenario)

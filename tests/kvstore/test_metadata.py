"""Redis metadata: URL/config parsing, the wire format, and — against a real redis-server —
the registry, heartbeats, ACL users, TLS, and the event streams feeding a BlockIndex
through gaps, worker restarts and Redis restarts. The oracle for the index is each
worker's own BlockPool: after every scenario, what the router believes a worker holds
must equal what that worker's pool caches."""
from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import replace
from itertools import count
from pathlib import Path

import pytest

from kvstore.events import (
    MAX_HASHES_PER_ENTRY,
    EventDecodeError,
    EventType,
    Tier,
    Verdict,
    WireEvent,
    WorkerCursor,
    WorkerId,
    decode_event,
    encode_event,
    from_pool_events,
    inventory_events,
)
from kvstore.keys import BlockHash, HashSalt, block_hashes
from kvstore.metadata.publisher import EventPublisher
from kvstore.metadata.registry import (
    Heartbeater,
    MetadataError,
    MetadataUnavailable,
    RedisConfig,
    WorkerRecord,
    WorkerRegistry,
    parse_redis_url,
)
from kvstore.metadata.streams import EventConsumer
from kvstore.pool import AllBlocksCleared, BlockId, BlockPool, BlockRemoved, BlockStored
from router.index.blocks import BlockIndex
from tests.support.redis_server import RedisServer

BS = 4
SALT = HashSalt("test-model", "test-tok", "fp16", BS).digest()
_names = count()


def cfg_for(url: str, cluster: str | None = None, **kw: float) -> RedisConfig:
    return RedisConfig(url, cluster or f"test-{next(_names)}", **({"heartbeat_ttl_s": 1.0,
                       "heartbeat_interval_s": 0.2, "socket_timeout_s": 1.0} | kw))


def record(worker_id: str, epoch: int = 1) -> WorkerRecord:
    return WorkerRecord(WorkerId(worker_id), "127.0.0.1:9000", "m", BS, 32, SALT.hex(), epoch)


# ---- URL, config, wire format (no Redis) ---------------------------------------------

def test_parse_redis_url() -> None:
    u = parse_redis_url("rediss://alice:p%40ss@redis.example:6380/2?ssl_ca_certs=/ca.pem")
    assert (u.tls, u.host, u.port, u.db, u.username, u.password) == \
        (True, "redis.example", 6380, 2, "alice", "p@ss")
    assert u.redacted() == "rediss://alice:***@redis.example:6380/2"
    assert parse_redis_url("redis://:pw@h").port == 6379 and not parse_redis_url("redis://h").tls
    for bad, why in [("http://u:secret@h:1", "scheme"), ("h:6379", "scheme"), ("redis://", "host"),
                     ("redis://h/x", "database"), ("redis://h:99999", "--redis-url"),
                     ("redis://h?foo=1", "unknown options")]:
        with pytest.raises(ValueError, match="--redis-url") as e:
            parse_redis_url(bad)
        assert why in str(e.value) and "secret" not in str(e.value)


def test_config_validation() -> None:
    RedisConfig("redis://h", "a-b-0")
    for kw, field in [({"cluster_name": "A"}, "cluster_name"), ({"cluster_name": "a:b"}, "cluster_name"),
                      ({"heartbeat_ttl_s": 1.0}, "heartbeat_interval_s"),
                      ({"heartbeat_interval_s": 0}, "heartbeat_interval_s"),
                      ({"stream_maxlen": 0}, "stream_maxlen"), ({"url": "unix:///s"}, "--redis-url")]:
        with pytest.raises(ValueError, match=field):
            RedisConfig(**({"url": "redis://h"} | kw))  # type: ignore[arg-type]
    assert RedisConfig("redis://h", "c1").keys.events("w") == "kvmesh:c1:{w:w}:events"   # hash tag: one slot per worker


def test_pool_events_batch_into_chains() -> None:
    pool = BlockPool(16, enable_kv_cache_events=True)
    a = block_hashes(list(range(12)), BS, SALT)
    b = block_hashes(list(range(100, 108)), BS, SALT)
    ids_a, ids_b = pool.allocate(3), pool.allocate(2)
    pool.cache_full_blocks(ids_a, a)
    pool.cache_full_blocks(ids_b, b)
    pool.free_sequence(ids_a)
    pool.free_sequence(ids_b)
    pool.reset_prefix_cache()
    events = pool.take_events()
    wire = from_pool_events(events + [BlockRemoved(a[0], BlockId(0)), BlockRemoved(a[1], BlockId(1))],
                            Tier.HOST)
    assert [(w.type, w.hashes, w.parent) for w in wire] == [
        (EventType.STORED, tuple(a), None), (EventType.STORED, tuple(b), None),
        (EventType.CLEARED, (), None), (EventType.REMOVED, (a[0], a[1]), None)]
    assert all(w.tier is Tier.HOST for w in wire)
    long = [BlockStored(BlockHash(i + 1), BlockHash(i) if i else None, BlockId(i)) for i in range(600)]
    assert [len(w.hashes) for w in from_pool_events(long)] == [256, 256, 88]
    inv = inventory_events({Tier.DISK: [BlockHash(i + 1) for i in range(300)], Tier.DEVICE: [a[0]]})
    assert [(w.type, w.tier, len(w.hashes)) for w in inv] == [
        (EventType.INVENTORY_BEGIN, Tier.DEVICE, 0), (EventType.STORED, Tier.DEVICE, 1),
        (EventType.STORED, Tier.DISK, MAX_HASHES_PER_ENTRY), (EventType.STORED, Tier.DISK, 44),
        (EventType.INVENTORY_END, Tier.DEVICE, 0)]
    for w in wire + inv:
        assert decode_event(encode_event(w, 7, 42)).event == w
    assert from_pool_events([AllBlocksCleared()]) == [WireEvent(EventType.CLEARED)]


def test_decode_rejects_bad_entries() -> None:
    good = encode_event(WireEvent(EventType.STORED, (BlockHash(5),), BlockHash(4)), 1, 1)
    assert decode_event(good).seq == 1 and decode_event(good).event.parent == 4
    for change in [{"type": "nope"}, {"seq": "x"}, {"hashes": "abc"}, {"tier": "gpu"},
                   {"type": "cleared"}]:
        with pytest.raises(EventDecodeError):
            decode_event(good | change)
    with pytest.raises(EventDecodeError):
        decode_event({"type": "stored"})


def test_cursor_verdicts() -> None:
    c = WorkerCursor()
    assert [c.check(e, s) for e, s in [(3, 10), (3, 11), (3, 13), (3, 14), (3, 14), (4, 1), (4, 2)]] == \
        [Verdict.NEXT, Verdict.NEXT, Verdict.GAP, Verdict.NEXT, Verdict.GAP, Verdict.NEW_EPOCH, Verdict.NEXT]
    c = WorkerCursor(epoch=5)  # an epoch known from the registry, before any entry
    assert c.check(5, 3) is Verdict.NEXT and WorkerCursor(epoch=5).check(6, 1) is Verdict.NEW_EPOCH


# ---- registry --------------------------------------------------------------------------

@pytest.mark.redis
def test_register_heartbeat_and_ttl_expiry(redis_server: RedisServer) -> None:
    reg = WorkerRegistry(cfg_for(redis_server.url))
    w = WorkerId("w0")
    e1, e2 = reg.new_epoch(w), reg.new_epoch(w)
    assert e2 == e1 + 1
    reg.register(record(w, e2))
    reg.register(record("w1", 1))
    assert [r.worker_id for r in reg.live_workers()] == ["w0", "w1"]
    assert reg.heartbeat(w, load=0.5) and reg.live_workers()[0].load == 0.5
    assert reg.live_workers()[0] == replace(record(w, e2), load=0.5)
    start = time.monotonic()
    while [r.worker_id for r in reg.live_workers()] != ["w0"]:  # w1 sends no heartbeats
        reg.heartbeat(w)
        assert time.monotonic() - start < 1.0 + 1.0, "w1 outlived its TTL"
        time.sleep(0.05)
    assert time.monotonic() - start > 0.5  # it was live until close to its TTL
    reg.deregister(w)
    assert reg.live_workers() == [] and not reg.heartbeat(w)


@pytest.mark.redis
def test_clusters_share_one_redis(redis_server: RedisServer) -> None:
    a, b = WorkerRegistry(cfg_for(redis_server.url, "alpha")), WorkerRegistry(cfg_for(redis_server.url, "beta"))
    a.register(record("w0"))
    b.register(record("w0"))
    b.register(record("w9"))
    assert [r.worker_id for r in a.live_workers()] == ["w0"]
    assert [r.worker_id for r in b.live_workers()] == ["w0", "w9"]
    a.deregister(WorkerId("w0"))
    assert a.live_workers() == [] and len(b.live_workers()) == 2
    keys = redis_server.client().keys("*")
    assert keys and all(k.startswith(("kvmesh:alpha:", "kvmesh:beta:")) for k in keys)


@pytest.mark.redis
def test_acl_user_and_password(redis_server_factory: Callable[..., RedisServer]) -> None:
    server = redis_server_factory(["--requirepass", "adminpw",
                                   "--user", "alice", "on", ">alice pw", "~kvmesh:ours:*", "+@all"])
    url = f"redis://alice:alice%20pw@127.0.0.1:{server.port}/0"
    reg = WorkerRegistry(cfg_for(url, "ours"))
    reg.register(record("w0"))
    assert [r.worker_id for r in reg.live_workers()] == ["w0"]
    assert WorkerRegistry(cfg_for(server.url, "ours")).live_workers()[0].worker_id == "w0"  # :adminpw@
    with pytest.raises(MetadataError, match="No permissions|NOPERM|no permissions"):
        WorkerRegistry(cfg_for(url, "theirs")).register(record("w0"))
    bad = f"redis://alice:wrong@127.0.0.1:{server.port}/0"
    with pytest.raises(MetadataError, match="credentials") as e:
        WorkerRegistry(cfg_for(bad)).live_workers()
    assert not isinstance(e.value, MetadataUnavailable)


@pytest.mark.redis
def test_rediss_tls(tmp_path: Path, redis_server_factory: Callable[..., RedisServer]) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    server = redis_server_factory(["--tls-cert-file", str(cert), "--tls-key-file", str(key),
                                   "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"], tls=True)
    reg = WorkerRegistry(cfg_for(f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={cert}"))
    reg.register(record("w0"))
    assert [r.worker_id for r in reg.live_workers()] == ["w0"]
    with pytest.raises(MetadataUnavailable):  # plain redis:// to a TLS port
        WorkerRegistry(cfg_for(f"redis://127.0.0.1:{server.port}/0")).live_workers()


@pytest.mark.redis
def test_heartbeater_reregisters_after_redis_restart(redis_server: RedisServer) -> None:
    cfg = cfg_for(redis_server.url, heartbeat_interval_s=0.05)
    reg = WorkerRegistry(cfg)
    rec = record("w0", reg.new_epoch(WorkerId("w0")) + 4)
    beat = Heartbeater(reg, rec, load_fn=lambda: 0.25)
    beat.start()
    try:
        assert reg.live_workers() == [replace(rec, load=0.25)]
        redis_server.restart()
        assert wait_for(lambda: reg.live_workers() == [replace(rec, load=0.25)])
        assert beat.num_registrations == 2  # a quick restart may raise no error at all
        assert reg.new_epoch(rec.worker_id) == rec.epoch + 1  # the epoch counter came back too
    finally:
        beat.stop()
    assert reg.live_workers() == []


def wait_for(cond: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


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

"""Redis metadata on a real Redis Cluster (3 primaries on loopback) and on a Sentinel-managed
primary: the URL forms, cluster detection, the consumer reading every shard, and a primary killed
while workers publish. The oracle is each worker's own BlockPool, as in test_metadata_streams.py: after
every scenario the index must hold exactly what each pool caches."""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import pytest
import redis
import redis.cluster

from kvstore.events import WorkerId
from kvstore.keys import BlockHash
from kvstore.metadata.connection import AsyncLink, ClientOptions, SyncLink, parse_redis_url
from kvstore.metadata.registry import RedisConfig, WorkerRegistry
from kvstore.metadata.streams import EventConsumer
from router.index.blocks import BlockIndex
from tests.kvstore.test_metadata import cfg_for, wait_for
from tests.kvstore.test_metadata_streams import PoolWorker, run_scenario, synced
from tests.support.redis_server import RedisServer
from tests.support.redis_topologies import PASSWORD, RedisClusterNodes, RedisSentinelGroup

# ---- URL forms (no Redis) -----------------------------------------------------------------


def test_parse_sentinel_url() -> None:
    u = parse_redis_url("redis+sentinel://:p%40ss@s1:26379,s2:26380,[::1]:26381/mymaster/3"
                        "?sentinel_password=spw")
    assert u.sentinel and u.sentinels == (("s1", 26379), ("s2", 26380), ("::1", 26381))
    assert (u.master_name, u.db, u.password, u.username, u.tls) == ("mymaster", 3, "p@ss", None, False)
    assert dict(u.options) == {"sentinel_password": "spw"}
    assert u.redacted() == "redis+sentinel://:***@s1:26379,s2:26380,::1:26381/mymaster/3"
    assert parse_redis_url("rediss+sentinel://h:1/m").tls and parse_redis_url("rediss+sentinel://h:1/m").db == 0
    assert not parse_redis_url("redis://h:1").sentinel
    for bad, why in [("redis+sentinel://h:1", "primary name"), ("redis+sentinel://h/m", "HOST:PORT"),
                     ("redis+sentinel://h:1,h2:x/m", "HOST:PORT"), ("redis+sentinel://h:1/m/x", "database"),
                     ("redis+sentinel://h:1/m?foo=1", "unknown options"), ("sentinel://h:1/m", "scheme")]:
        with pytest.raises(ValueError, match=why):
            parse_redis_url(bad)
    RedisConfig("redis+sentinel://h:1,h:2/m", "c")     # a valid config URL


# ---- Redis Cluster ------------------------------------------------------------------------


def node_of(cluster: RedisClusterNodes, key: str) -> int:
    """The index (into cluster.nodes) of the node serving `key`'s slot now."""
    with redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port, password=PASSWORD) as rc:
        port = rc.get_node_from_key(key).port
    return next(i for i, n in enumerate(cluster.nodes) if n.port == port)


def worker_ids_on(cluster: RedisClusterNodes, cfg: RedisConfig, node: int, n: int) -> list[str]:
    """`n` worker ids whose keys hash to the slots of `node`."""
    ids = (f"w{i}" for i in itertools.count())
    return list(itertools.islice((w for w in ids if node_of(cluster, cfg.keys.events(w)) == node), n))


@pytest.mark.redis
def test_cluster_mode_is_detected_from_any_node(redis_cluster: RedisClusterNodes,
                                                redis_server: RedisServer) -> None:
    for node in redis_cluster.primaries:
        assert SyncLink(node.url, ClientOptions(1.0)).cluster
    assert not SyncLink(redis_server.url, ClientOptions(1.0)).cluster

    async def detect() -> bool:
        link = AsyncLink(redis_cluster.nodes[2].url, ClientOptions(1.0))
        try:
            return isinstance(await link.client(), redis.asyncio.cluster.RedisCluster)
        finally:
            await link.aclose()
    assert asyncio.run(detect())


@pytest.mark.redis
def test_cluster_router_consumes_every_shard(redis_cluster: RedisClusterNodes) -> None:
    """Workers spread over the 3 primaries by their hash tags; the consumer follows every one's
    stream (one pipelined read per primary) and finds a worker that joins later."""
    cfg = cfg_for(redis_cluster.nodes[1].url)      # any node's URL
    ids = [w for node in range(3) for w in worker_ids_on(redis_cluster, cfg, node, 2)]
    workers = [PoolWorker(cfg, w) for w in ids]
    late: list[PoolWorker] = []

    async def scenario(consumer: EventConsumer, index: BlockIndex) -> None:
        prompts = [list(range(100 * i, 100 * i + 12)) for i in range(len(workers))]
        hashes = [w.serve(p) for w, p in zip(workers, prompts)]
        await synced(consumer, workers)
        for w, h in zip(workers, hashes):
            assert index.match_prefix(h)[w.worker_id] == 3
        assert {node_of(redis_cluster, cfg.keys.events(w.worker_id)) for w in workers} == {0, 1, 2}
        late.append(PoolWorker(cfg, worker_ids_on(redis_cluster, cfg, 2, 3)[-1]))
        b = late[0].serve(list(range(900, 916)))
        await synced(consumer, [*workers, *late])
        assert index.match_prefix(b)[late[0].worker_id] == 4
        assert consumer.stats().gaps == 0 and consumer.stats().redis_restarts == 0
        assert {r.worker_id for r in WorkerRegistry(cfg).live_workers()} == {*ids, late[0].worker_id}

    try:
        run_scenario(cfg, workers, scenario)
    finally:
        for w in late:
            w.stop()


async def serve_through(failover: Callable[[], None], consumer: EventConsumer,
                        workers: list[PoolWorker]) -> int:
    """Run `failover` in a thread while the workers keep serving new prompts and the consumer
    keeps polling (nothing here may raise); returns how many prompts were served."""
    task = asyncio.create_task(asyncio.to_thread(failover))
    served = 0
    while not task.done():
        for w in workers:
            w.serve(list(range(5000 + 8 * served, 5000 + 8 * served + 8)))
            w.pub.poll()
        served += 1
        await consumer.poll()
    await task
    return served


@pytest.mark.redis
def test_cluster_primary_failover_heals_the_index(
        redis_cluster_factory: Callable[..., RedisClusterNodes]) -> None:
    """Kill the primary holding two workers' streams while they publish: its replica takes over,
    events lost in the failover are healed by inventories, the index is exact afterwards."""
    cluster = redis_cluster_factory(3, replicas=1)
    cfg = cfg_for(cluster.nodes[2].url)
    workers = [PoolWorker(cfg, w) for w in [*worker_ids_on(cluster, cfg, 0, 2), *worker_ids_on(cluster, cfg, 1, 1)]]

    async def scenario(consumer: EventConsumer, index: BlockIndex) -> None:
        a = workers[0].serve(list(range(12)))
        await synced(consumer, workers)
        served = await serve_through(lambda: cluster.kill_primary(0), consumer, workers)
        assert served > 0
        await synced(consumer, workers, timeout_s=15.0)
        assert consumer.stats().redis_restarts >= 1       # the primaries' run_ids changed
        recent = workers[0].serve(list(range(7000, 7008)))
        await synced(consumer, workers)
        assert index.match_prefix(recent)[workers[0].worker_id] == 2
        assert index.match_prefix(a)[workers[0].worker_id] == len(
            [h for h in a if BlockHash(h) in workers[0].truth()])

    run_scenario(cfg, workers, scenario)


@pytest.mark.slow
@pytest.mark.redis
def test_cluster_two_primaries_fail_over_one_after_the_other(
        redis_cluster_factory: Callable[..., RedisClusterNodes]) -> None:
    """The long run: 9 workers over 3 primaries, each primary with a replica; primary 0, then primary
    1 SIGKILLed while every worker publishes. After each failover the index is exact again."""
    cluster = redis_cluster_factory(3, replicas=3)
    cfg = cfg_for(cluster.nodes[4].url)
    workers = [PoolWorker(cfg, w) for node in range(3) for w in worker_ids_on(cluster, cfg, node, 3)]

    async def scenario(consumer: EventConsumer, index: BlockIndex) -> None:
        for w in workers:
            w.serve(list(range(40)))
        await synced(consumer, workers)
        for victim in (0, 1):
            assert await serve_through(lambda v=victim: cluster.kill_primary(v), consumer, workers) > 0
            await synced(consumer, workers, timeout_s=20.0)
            fresh = [w.serve(list(range(9000 + 8 * i, 9008 + 8 * i))) for i, w in enumerate(workers)]
            await synced(consumer, workers)
            assert [index.match_prefix(h)[w.worker_id] for w, h in zip(workers, fresh)] == [2] * len(workers)
        assert consumer.stats().redis_restarts >= 2

    run_scenario(cfg, workers, scenario)


# ---- Sentinel -----------------------------------------------------------------------------


@pytest.mark.redis
def test_sentinel_failover_heals_the_index(redis_sentinel: RedisSentinelGroup) -> None:
    """Through the sentinels: kill the primary while workers publish; clients follow the failover to
    the promoted replica, the index is exact afterwards."""
    cfg = cfg_for(redis_sentinel.url)
    workers = [PoolWorker(cfg, "w0"), PoolWorker(cfg, "w1")]

    async def scenario(consumer: EventConsumer, index: BlockIndex) -> None:
        a = workers[0].serve(list(range(12)))
        await synced(consumer, workers)
        assert index.match_prefix(a)[WorkerId("w0")] == 3
        await serve_through(redis_sentinel.kill_primary, consumer, workers)
        await synced(consumer, workers, timeout_s=15.0)
        assert consumer.stats().redis_restarts == 1
        b = workers[1].serve(list(range(800, 816)))
        await synced(consumer, workers)
        assert index.match_prefix(b)[WorkerId("w1")] == 4
        assert {r.worker_id for r in WorkerRegistry(cfg).live_workers()} == {"w0", "w1"}

    run_scenario(cfg, workers, scenario)


# The per-role ACL lists of docs/security.md, plus what a cluster client needs on a Redis Cluster.
ROUTER_ACL = "+ping +info +multi +exec +smembers +srem +hgetall +get +set +xread +xrevrange"
WORKER_ACL = "+ping +info +multi +exec +get +set +getdel +del +incrby +hset +hgetall +sadd +srem +smembers " \
             "+pexpire +xadd +eval"
CLUSTER_ACL = "+cluster|slots +command"


@pytest.mark.redis
def test_cluster_acl_users_of_the_docs(redis_cluster: RedisClusterNodes) -> None:
    for node in redis_cluster.nodes:
        with redis_cluster.admin(node) as r:
            for user, pw, cmds in (("kvr", "rpw", ROUTER_ACL), ("kvw", "wpw", WORKER_ACL)):
                r.execute_command("ACL", "SETUSER", user, "on", f">{pw}", "~kvmesh:acl:*",
                                  *cmds.split(), *CLUSTER_ACL.split())
    port = redis_cluster.nodes[0].port
    wcfg = cfg_for(f"redis://kvw:wpw@127.0.0.1:{port}/0", "acl")
    workers = [PoolWorker(wcfg, f"w{i}") for i in range(4)]

    async def scenario(consumer: EventConsumer, index: BlockIndex) -> None:
        hashes = [w.serve(list(range(10 * i, 10 * i + 8))) for i, w in enumerate(workers)]
        await synced(consumer, workers)
        assert [index.match_prefix(h)[w.worker_id] for w, h in zip(workers, hashes)] == [2] * 4

    run_scenario(cfg_for(f"redis://kvr:rpw@127.0.0.1:{port}/0", "acl"), workers, scenario)


@pytest.mark.redis
def test_router_replicas_share_pending_notes_on_a_cluster(redis_cluster: RedisClusterNodes) -> None:
    """`--share-pending` on a cluster: each router names a different node; the notes stream is one
    key, reached through the cluster client wherever its slot lives."""
    from kvstore.metadata.pending import NoteKind, PendingLog, PendingNote

    async def main() -> list[PendingNote]:
        a = PendingLog(cfg_for(redis_cluster.nodes[0].url, "pend"), "r-a")
        b = PendingLog(cfg_for(redis_cluster.nodes[2].url, "pend"), "r-b")
        try:
            assert await b.read() == []             # from the stream's end on
            note = PendingNote(NoteKind.SENT, "r-a", "req-1", WorkerId("w0"), (BlockHash(7),), 12)
            await a.publish([note])
            got = await b.read()
            assert await a.read() == []             # its own notes are not returned to it
            return got
        finally:
            await a.aclose()
            await b.aclose()

    got = asyncio.run(main())
    assert [(n.request_id, n.hashes, n.queued_tokens) for n in got] == [("req-1", (BlockHash(7),), 12)]


@pytest.mark.redis
def test_a_worker_id_lost_from_the_registry_set_comes_back(redis_cluster: RedisClusterNodes) -> None:
    """On a cluster the `workers` set and a worker's record live on different primaries: a failover
    of the set's primary may lose the id while the record stays. The next heartbeat adds it again."""
    cfg = cfg_for(redis_cluster.url)
    w = PoolWorker(cfg, worker_ids_on(redis_cluster, cfg, (node_of(redis_cluster, cfg.keys.workers) + 1) % 3, 1)[0])
    registry = WorkerRegistry(cfg)
    try:
        assert node_of(redis_cluster, cfg.keys.workers) != node_of(redis_cluster, cfg.keys.record(w.worker_id))
        assert [r.worker_id for r in registry.live_workers()] == [w.worker_id]
        with redis.cluster.RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port, password=PASSWORD) as rc:
            assert rc.srem(cfg.keys.workers, w.worker_id) == 1       # what a lost SADD leaves
        assert registry.live_workers() == []
        assert wait_for(lambda: [r.worker_id for r in registry.live_workers()] == [w.worker_id], 3.0)
    finally:
        registry.close()
        w.stop()

"""Redis metadata: URL/config parsing, the wire format, and — against a real redis-server —
the registry, heartbeats, ACL users and TLS. The event streams feeding a BlockIndex are
tested in test_metadata_streams.py."""
from __future__ import annotations

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
from kvstore.metadata.registry import (
    Heartbeater,
    MetadataError,
    MetadataUnavailable,
    RedisConfig,
    WorkerRecord,
    WorkerRegistry,
    parse_redis_url,
)
from kvstore.pool import AllBlocksCleared, BlockId, BlockPool, BlockRemoved, BlockStored
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

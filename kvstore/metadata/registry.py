"""Redis metadata: the worker registry with heartbeats, and per-worker KV event streams.

Every key lives under `kvmesh:<cluster_name>:`, so two clusters can share one Redis; a worker's
keys carry the hash tag `{w:<worker_id>}`, so on a Redis Cluster they share one slot (a worker's
writes are one MULTI/EXEC on one node) and the workers spread over the primaries:

    workers              SET     ids of registered workers (pruned once a record has expired)
    {w:<id>}:worker      HASH    the `WorkerRecord` fields; expires `record_ttl_s` after the
                                 last heartbeat
    {w:<id>}:alive       STRING  the worker's load; expires `heartbeat_ttl_s` after the last
                                 heartbeat. A worker is live (routable) iff this key exists.
    {w:<id>}:epoch       STRING  INCRed once per worker start: a restarted worker has a new epoch
    {w:<id>}:events      STREAM  the worker's KV events (`kvstore.events` wire format), each
                                 entry with the next `seq` of its epoch; MAXLEN ~ stream_maxlen
    {w:<id>}:resync      STRING  set by the router to ask the worker for a full inventory; the
                                 worker takes it with GETDEL

This module: the config (`RedisConfig`), the key names (`Keys`), the registry (`WorkerRegistry`,
sync redis-py) and the worker's `Heartbeater` thread. The URL forms (one Redis, a Redis Cluster,
Sentinel) and the clients are in `kvstore.metadata.connection`; the event streams are
`kvstore.metadata.publisher.EventPublisher` (worker, sync) and
`kvstore.metadata.streams.EventConsumer` (router, redis.asyncio), in the `kvstore.events` format.

Redis restarts and failovers are recognised by the server's `run_id` (INFO server; of every
primary on a cluster): the pooled connection of redis-py reconnects on its own, so a quick
restart may raise no error.
"""
from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple, cast

from redis.typing import EncodableT, FieldT

from contracts.roles import WorkerRole
from kvstore.events import WorkerId
from kvstore.metadata.connection import (
    AsyncClient,
    ClientOptions,
    MetadataError,
    MetadataUnavailable,
    RedisURL,
    SyncClient,
    SyncLink,
    connect_async as _connect_async,
    parse_redis_url,
    redis_errors,
)

log = logging.getLogger("kvmesh.metadata")

_CLUSTER_NAME = re.compile(r"[a-z0-9-]+")
__all__ = ["MetadataError", "MetadataUnavailable", "RedisURL", "parse_redis_url", "redis_errors"]


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """Where the metadata lives and how fast liveness is judged.

    A worker whose heartbeats stop leaves routing `heartbeat_ttl_s` after its last one.
    `socket_timeout_s` bounds every Redis call (and so how long a worker thread can stall).
    """

    url: str
    cluster_name: str = "kvmesh"
    heartbeat_ttl_s: float = 3.0
    heartbeat_interval_s: float = 1.0
    stream_maxlen: int = 100_000
    socket_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        parse_redis_url(self.url)
        if not isinstance(self.cluster_name, str) or not _CLUSTER_NAME.fullmatch(self.cluster_name):
            raise ValueError(f"cluster_name={self.cluster_name!r} must match [a-z0-9-]+")
        for name in ("heartbeat_ttl_s", "heartbeat_interval_s", "socket_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if not self.heartbeat_interval_s < self.heartbeat_ttl_s:
            raise ValueError(f"heartbeat_interval_s={self.heartbeat_interval_s!r} must be < "
                             f"heartbeat_ttl_s={self.heartbeat_ttl_s!r}")
        if isinstance(self.stream_maxlen, bool) or not isinstance(self.stream_maxlen, int) \
                or self.stream_maxlen <= 0:
            raise ValueError(f"stream_maxlen={self.stream_maxlen!r} must be a positive integer")

    @property
    def keys(self) -> Keys:
        return Keys(f"kvmesh:{self.cluster_name}:")

    @property
    def record_ttl_s(self) -> float:
        """How long a silent worker's record outlives its liveness key."""
        return max(60.0, 10 * self.heartbeat_ttl_s)


class Keys(NamedTuple):
    """The key names of one cluster (see the module docstring)."""

    prefix: str

    @property
    def workers(self) -> str:
        return self.prefix + "workers"

    def record(self, worker_id: str) -> str:
        return f"{self.prefix}{{w:{worker_id}}}:worker"

    def alive(self, worker_id: str) -> str:
        return f"{self.prefix}{{w:{worker_id}}}:alive"

    def epoch(self, worker_id: str) -> str:
        return f"{self.prefix}{{w:{worker_id}}}:epoch"

    def events(self, worker_id: str) -> str:
        return f"{self.prefix}{{w:{worker_id}}}:events"

    def resync(self, worker_id: str) -> str:
        return f"{self.prefix}{{w:{worker_id}}}:resync"


def link(config: RedisConfig, client: SyncClient | None = None) -> SyncLink:
    """The sync client of `config`, built (one Redis, a cluster, or Sentinel) at first use."""
    return SyncLink(config.url, ClientOptions(config.socket_timeout_s), client)


def connect(config: RedisConfig) -> SyncClient:
    """A sync client: str replies, bounded timeouts, no silent retries (failures surface). Detects
    a cluster now (raises MetadataUnavailable when Redis does not answer)."""
    with redis_errors("connect"):
        return link(config).client


def connect_async(config: RedisConfig, read_timeout_s: float = 0.0) -> AsyncClient:
    """The asyncio twin of `connect` for one Redis or Sentinel (no cluster detection: see
    `kvstore.metadata.connection.AsyncLink`); `read_timeout_s` is added to the socket timeout
    (blocking XREADs must return before it)."""
    return _connect_async(config.url, ClientOptions(config.socket_timeout_s, read_timeout_s))


def check_worker_id(worker_id: str) -> None:
    """Raise ValueError unless `worker_id` is usable in key names (non-empty, no spaces)."""
    if not isinstance(worker_id, str) or not worker_id or any(c.isspace() for c in worker_id):
        raise ValueError(f"worker_id={worker_id!r} must be non-empty without spaces")


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """What the router needs to route to a worker. `load` is not stored in the record: it
    is the value of the worker's last heartbeat, filled in by `live_workers`. `role`: the
    worker's `contracts.roles.WorkerRole` spelling (a record without one is "mixed")."""

    worker_id: WorkerId
    address: str
    model: str
    block_size: int
    num_blocks: int
    hash_salt_hex: str
    epoch: int
    load: float = 0.0
    role: str = WorkerRole.MIXED.value

    def __post_init__(self) -> None:
        check_worker_id(self.worker_id)
        WorkerRole.parse(self.role)
        if not isinstance(self.address, str) or ":" not in self.address:
            raise ValueError(f"address={self.address!r} is not HOST:PORT")
        for name in ("block_size", "num_blocks", "epoch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not isinstance(self.model, str):
            raise ValueError(f"model={self.model!r} must be a string")
        if not isinstance(self.hash_salt_hex, str) or not re.fullmatch(r"[0-9a-f]*", self.hash_salt_hex):
            raise ValueError(f"hash_salt_hex={self.hash_salt_hex!r} must be lowercase hex")

    def to_fields(self) -> dict[str, str]:
        return {"worker_id": self.worker_id, "address": self.address, "model": self.model,
                "block_size": str(self.block_size), "num_blocks": str(self.num_blocks),
                "hash_salt_hex": self.hash_salt_hex, "epoch": str(self.epoch), "role": self.role}

    @classmethod
    def from_fields(cls, fields: Mapping[str, str], load: float = 0.0) -> WorkerRecord:
        """Inverse of `to_fields`; raises MetadataError for a malformed record."""
        try:
            return cls(WorkerId(fields["worker_id"]), fields["address"], fields["model"],
                       int(fields["block_size"]), int(fields["num_blocks"]),
                       fields["hash_salt_hex"], int(fields["epoch"]), load,
                       WorkerRole.parse(fields.get("role", "")).value)
        except (KeyError, ValueError) as e:
            raise MetadataError(f"bad worker record {dict(fields)!r}: {e}") from None


def texts(replies: Iterable[str | bytes]) -> list[str]:
    """The replies of a client from `connect` / `connect_async` (decode_responses=True) as the str
    they are; redis-py types every reply `str | bytes` whatever the client's options."""
    return [r if isinstance(r, str) else r.decode() for r in replies]


def decode_live(ids: Sequence[str], replies: Sequence[object]) -> tuple[list[WorkerRecord], list[str]]:
    """From ids and the pipelined (HGETALL record, GET alive) replies of each: the live
    records (sorted by id) and the ids whose record is gone (to prune from the set)."""
    live: list[WorkerRecord] = []
    gone: list[str] = []
    for worker_id, fields, load in zip(ids, replies[0::2], replies[1::2]):
        if not fields:
            gone.append(worker_id)
        elif load is not None:
            assert isinstance(fields, dict) and isinstance(load, str)
            try:
                live.append(WorkerRecord.from_fields(fields, float(load)))
            except (MetadataError, ValueError) as e:
                log.warning("skipping worker %s: %s", worker_id, e)
    return sorted(live, key=lambda r: r.worker_id), gone


_MAX_EPOCH = ("local cur = tonumber(redis.call('GET', KEYS[1]) or '0') "
              "if cur < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end return 1")


class WorkerRegistry:
    """Register / heartbeat / list workers. Every method raises MetadataUnavailable while
    Redis is down and MetadataError when Redis refuses. Thread-safe (redis-py's pool)."""

    def __init__(self, config: RedisConfig, client: SyncClient | None = None) -> None:
        self.config = config
        self.keys = config.keys
        self._link = link(config, client)

    def new_epoch(self, worker_id: WorkerId) -> int:
        """The epoch of a worker that is starting: one more than any epoch it had before."""
        check_worker_id(worker_id)
        with redis_errors("new_epoch"):
            return int(self._link.client.incr(self.keys.epoch(worker_id)))

    def register(self, record: WorkerRecord) -> None:
        """Write the record, mark the worker live, and keep the epoch counter >= its epoch
        (after a Redis restart the counter is gone; the next start must still go higher)."""
        k, w, cfg = self.keys, record.worker_id, self.config
        with redis_errors("register"):
            r = self._link.client
            p = r.pipeline(transaction=True)    # the worker's own keys: one hash slot
            p.delete(k.record(w))
            p.hset(k.record(w), mapping=cast("Mapping[FieldT, EncodableT]", record.to_fields()))
            p.pexpire(k.record(w), int(cfg.record_ttl_s * 1000))
            p.set(k.alive(w), repr(float(record.load)), px=int(cfg.heartbeat_ttl_s * 1000))
            p.execute_command("EVAL", _MAX_EPOCH, 1, k.epoch(w), str(record.epoch))    # (a cluster
            p.execute()                                             # pipeline has no .eval)
            r.sadd(k.workers, w)    # a set of its own slot; until it lands the worker is not listed

    def heartbeat(self, worker_id: WorkerId, load: float = 0.0) -> bool:
        """Refresh the worker's liveness; False if its record is gone (expired, deregistered,
        or Redis restarted): then it must `register` again. A live record's id is added to the
        `workers` set again: on a Redis Cluster the set lives on another primary than the record,
        and a failover there may lose the id while the record stays."""
        k, cfg = self.keys, self.config
        with redis_errors("heartbeat"):
            r = self._link.client
            p = r.pipeline(transaction=True)
            p.pexpire(k.record(worker_id), int(cfg.record_ttl_s * 1000))
            p.set(k.alive(worker_id), repr(float(load)), px=int(cfg.heartbeat_ttl_s * 1000))
            exists, _ = p.execute()
            if exists:
                r.sadd(k.workers, worker_id)
        return bool(exists)

    def deregister(self, worker_id: WorkerId) -> None:
        """Remove the worker from routing at once, with its stream and pending requests."""
        k = self.keys
        with redis_errors("deregister"):
            r = self._link.client
            r.delete(k.alive(worker_id), k.record(worker_id), k.events(worker_id), k.resync(worker_id))
            r.srem(k.workers, worker_id)

    def live_workers(self) -> list[WorkerRecord]:
        """Workers whose liveness key exists, sorted by id. Prunes expired records' ids."""
        k = self.keys
        with redis_errors("live_workers"):
            r = self._link.client
            ids = sorted(texts(r.smembers(k.workers)))
            p = r.pipeline(transaction=False)
            for w in ids:
                p.hgetall(k.record(w))
                p.get(k.alive(w))
            live, gone = decode_live(ids, p.execute())
            if gone:
                r.srem(k.workers, *gone)
        return live

    def close(self) -> None:
        self._link.close()


class Heartbeater:
    """A daemon thread that keeps one worker registered: it heartbeats every
    `heartbeat_interval_s` and registers again whenever the record is gone (a Redis
    restart empties the registry). Redis errors are logged and retried, never raised."""

    def __init__(self, registry: WorkerRegistry, record: WorkerRecord,
                 load_fn: Callable[[], float] | None = None) -> None:
        self.registry = registry
        self.record = record
        self._load_fn = load_fn
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_registrations = 0
        self.num_failures = 0

    def start(self) -> None:
        """Register once now (best effort), then heartbeat in the background."""
        assert self._thread is None, "Heartbeater.start called twice"
        self._beat(registered=False)
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"heartbeat-{self.record.worker_id}")
        self._thread.start()

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if deregister:
            try:
                self.registry.deregister(self.record.worker_id)
            except MetadataError as e:
                log.warning("deregister %s failed: %s", self.record.worker_id, e)

    def _run(self) -> None:
        registered = self.num_registrations > 0
        while not self._stop.wait(self.registry.config.heartbeat_interval_s):
            registered = self._beat(registered)

    def _beat(self, registered: bool) -> bool:
        load = self._load_fn() if self._load_fn is not None else 0.0
        try:
            if registered and self.registry.heartbeat(self.record.worker_id, load):
                return True
            self.registry.register(replace(self.record, load=load))
            self.num_registrations += 1
            return True
        except MetadataError as e:
            self.num_failures += 1
            log.warning("heartbeat of %s failed: %s", self.record.worker_id, e)
            return registered

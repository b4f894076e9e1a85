"""Redis metadata: the worker registry with heartbeats, and per-worker KV event streams.

Every key lives under `kvmesh:{cluster_name}:`, so two clusters can share one Redis:

    workers        SET     ids of registered workers (pruned once a record has expired)
    worker:{id}    HASH    the `WorkerRecord` fields; expires `record_ttl_s` after the
                           last heartbeat
    alive:{id}     STRING  the worker's load; expires `heartbeat_ttl_s` after the last
                           heartbeat. A worker is live (routable) iff this key exists.
    epoch:{id}     STRING  INCRed once per worker start: a restarted worker has a new epoch
    events:{id}    STREAM  the worker's KV events (`kvstore.events` wire format), each
                           entry with the next `seq` of its epoch; MAXLEN ~ stream_maxlen
    resync:{id}    STRING  set by the router to ask the worker for a full inventory; the
                           worker takes it with GETDEL

This module: the config (`RedisConfig`, `parse_redis_url`), the key names (`Keys`), the
registry (`WorkerRegistry`, sync redis-py) and the worker's `Heartbeater` thread. The event
streams are in `kvstore.metadata.streams`: `EventPublisher` (worker, sync) and `EventConsumer`
(router, redis.asyncio); their entry format is in `kvstore.events`.

Redis restarts are recognised by the server's `run_id` (INFO server): the pooled
connection of redis-py reconnects on its own, so a quick restart may raise no error.
"""
from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import NamedTuple, cast
from urllib.parse import parse_qs, unquote, urlsplit

import redis
import redis.asyncio
import redis.asyncio.retry
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, AuthorizationError, RedisError
from redis.typing import EncodableT, FieldT

from kvstore.errors import KVStoreError
from kvstore.events import WorkerId

log = logging.getLogger("kvmesh.metadata")

_CLUSTER_NAME = re.compile(r"[a-z0-9-]+")
_URL_OPTIONS = frozenset({"ssl_ca_certs", "ssl_cert_reqs", "ssl_certfile", "ssl_keyfile",
                          "ssl_check_hostname"})


class MetadataError(KVStoreError):
    """Redis refused an operation (bad credentials, missing permission, wrong key type)."""


class MetadataUnavailable(MetadataError):
    """Redis cannot be reached, timed out, or is still loading: retry later."""


class RedisURL(NamedTuple):
    """A parsed `--redis-url`; `password` is never shown by `redacted`."""

    tls: bool
    host: str
    port: int
    db: int
    username: str | None
    password: str | None

    def redacted(self) -> str:
        auth = f"{self.username or ''}{':***' if self.password else ''}"
        return f"{'rediss' if self.tls else 'redis'}://{auth + '@' if auth else ''}" \
               f"{self.host}:{self.port}/{self.db}"


def _redact(url: str) -> str:
    return re.sub(r"(//[^/@]*?:)[^/@]*@", r"\1***@", url)


def parse_redis_url(url: str) -> RedisURL:
    """Validate `redis://[user:password@]host[:port][/db][?ssl_...]` (or `rediss://` for TLS).

    Raises ValueError naming --redis-url (with the password masked) for anything else.
    """
    if not isinstance(url, str):
        raise ValueError(f"--redis-url {url!r} must be a string")
    shown = _redact(url)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"--redis-url {shown}: {e}") from None
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"--redis-url {shown}: the scheme must be redis:// or rediss:// "
                         f"(with TLS), not {parts.scheme + '://' if parts.scheme else 'none'}")
    if not parts.hostname:
        raise ValueError(f"--redis-url {shown}: no host")
    path = parts.path.lstrip("/")
    if path and not path.isdigit():
        raise ValueError(f"--redis-url {shown}: the path must be a database number, not {path!r}")
    unknown = set(parse_qs(parts.query, keep_blank_values=True)) - _URL_OPTIONS
    if unknown:
        raise ValueError(f"--redis-url {shown}: unknown options {sorted(unknown)}; "
                         f"allowed: {sorted(_URL_OPTIONS)}")
    return RedisURL(parts.scheme == "rediss", parts.hostname, port or 6379, int(path or 0),
                    unquote(parts.username) if parts.username else None,
                    unquote(parts.password) if parts.password else None)


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
        return f"{self.prefix}worker:{worker_id}"

    def alive(self, worker_id: str) -> str:
        return f"{self.prefix}alive:{worker_id}"

    def epoch(self, worker_id: str) -> str:
        return f"{self.prefix}epoch:{worker_id}"

    def events(self, worker_id: str) -> str:
        return f"{self.prefix}events:{worker_id}"

    def resync(self, worker_id: str) -> str:
        return f"{self.prefix}resync:{worker_id}"


def connect(config: RedisConfig) -> redis.Redis:
    """A sync client: str replies, bounded timeouts, no silent retries (failures surface)."""
    return redis.Redis.from_url(config.url, decode_responses=True,
                                socket_timeout=config.socket_timeout_s,
                                socket_connect_timeout=config.socket_timeout_s,
                                retry=redis.retry.Retry(NoBackoff(), 0))


def connect_async(config: RedisConfig, read_timeout_s: float = 0.0) -> redis.asyncio.Redis:
    """The asyncio twin of `connect`; `read_timeout_s` is added to the socket timeout
    (blocking XREADs must return before it)."""
    return redis.asyncio.Redis.from_url(
        config.url, decode_responses=True,
        socket_timeout=config.socket_timeout_s + read_timeout_s,
        socket_connect_timeout=config.socket_timeout_s,
        retry=redis.asyncio.retry.Retry(NoBackoff(), 0))


@contextmanager
def redis_errors(what: str) -> Iterator[None]:
    """Turn redis-py and socket errors into MetadataUnavailable / MetadataError."""
    try:
        yield
    except (AuthenticationError, AuthorizationError) as e:
        raise MetadataError(f"{what}: Redis refused the credentials: {e}") from e
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as e:
        raise MetadataUnavailable(f"{what}: Redis is unavailable: {e}") from e
    except RedisError as e:
        raise MetadataError(f"{what}: {e}") from e


def check_worker_id(worker_id: str) -> None:
    """Raise ValueError unless `worker_id` is usable in key names (non-empty, no spaces)."""
    if not isinstance(worker_id, str) or not worker_id or any(c.isspace() for c in worker_id):
        raise ValueError(f"worker_id={worker_id!r} must be non-empty without spaces")


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """What the router needs to route to a worker. `load` is not stored in the record: it
    is the value of the worker's last heartbeat, filled in by `live_workers`."""

    worker_id: WorkerId
    address: str
    model: str
    block_size: int
    num_blocks: int
    hash_salt_hex: str
    epoch: int
    load: float = 0.0

    def __post_init__(self) -> None:
        check_worker_id(self.worker_id)
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
                "hash_salt_hex": self.hash_salt_hex, "epoch": str(self.epoch)}

    @classmethod
    def from_fields(cls, fields: Mapping[str, str], load: float = 0.0) -> WorkerRecord:
        """Inverse of `to_fields`; raises MetadataError for a malformed record."""
        try:
            return cls(WorkerId(fields["worker_id"]), fields["address"], fields["model"],
                       int(fields["block_size"]), int(fields["num_blocks"]),
                       fields["hash_salt_hex"], int(fields["epoch"]), load)
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

    def __init__(self, config: RedisConfig, client: redis.Redis | None = None) -> None:
        self.config = config
        self.keys = config.keys
        self._r = client if client is not None else connect(config)

    def new_epoch(self, worker_id: WorkerId) -> int:
        """The epoch of a worker that is starting: one more than any epoch it had before."""
        check_worker_id(worker_id)
        with redis_errors("new_epoch"):
            return int(self._r.incr(self.keys.epoch(worker_id)))

    def register(self, record: WorkerRecord) -> None:
        """Write the record, mark the worker live, and keep the epoch counter >= its epoch
        (after a Redis restart the counter is gone; the next start must still go higher)."""
        k, w, cfg = self.keys, record.worker_id, self.config
        with redis_errors("register"):
            p = self._r.pipeline(transaction=True)
            p.delete(k.record(w))
            p.hset(k.record(w), mapping=cast("Mapping[FieldT, EncodableT]", record.to_fields()))
            p.pexpire(k.record(w), int(cfg.record_ttl_s * 1000))
            p.set(k.alive(w), repr(float(record.load)), px=int(cfg.heartbeat_ttl_s * 1000))
            p.sadd(k.workers, w)
            p.eval(_MAX_EPOCH, 1, k.epoch(w), str(record.epoch))
            p.execute()

    def heartbeat(self, worker_id: WorkerId, load: float = 0.0) -> bool:
        """Refresh the worker's liveness; False if its record is gone (expired, deregistered,
        or Redis restarted): then it must `register` again."""
        k, cfg = self.keys, self.config
        with redis_errors("heartbeat"):
            p = self._r.pipeline(transaction=True)
            p.pexpire(k.record(worker_id), int(cfg.record_ttl_s * 1000))
            p.set(k.alive(worker_id), repr(float(load)), px=int(cfg.heartbeat_ttl_s * 1000))
            exists, _ = p.execute()
        return bool(exists)

    def deregister(self, worker_id: WorkerId) -> None:
        """Remove the worker from routing at once, with its stream and pending requests."""
        k = self.keys
        with redis_errors("deregister"):
            self._r.delete(k.alive(worker_id), k.record(worker_id), k.events(worker_id),
                           k.resync(worker_id))
            self._r.srem(k.workers, worker_id)

    def live_workers(self) -> list[WorkerRecord]:
        """Workers whose liveness key exists, sorted by id. Prunes expired records' ids."""
        k = self.keys
        with redis_errors("live_workers"):
            ids = sorted(texts(self._r.smembers(k.workers)))
            p = self._r.pipeline(transaction=False)
            for w in ids:
                p.hgetall(k.record(w))
                p.get(k.alive(w))
            live, gone = decode_live(ids, p.execute())
            if gone:
                self._r.srem(k.workers, *gone)
        return live

    def close(self) -> None:
        self._r.close()


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

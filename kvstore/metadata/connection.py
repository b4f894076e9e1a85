"""How the metadata reaches Redis: the `--redis-url` forms, and the clients built from them.

Three topologies, one URL option each:
- one Redis: `redis://[user:password@]host[:port][/db]` (`rediss://` for TLS);
- a Redis Cluster: the same URL naming any one node. Cluster mode is detected at the first
  call (`INFO cluster` says `cluster_enabled:1`) and a cluster client (redis-py's `RedisCluster`)
  learns the slots of every primary from that node; the database must be 0;
- a Sentinel-managed primary: `redis+sentinel://[user:password@]host:port[,host:port...]/name[/db]`
  (`rediss+sentinel://` for TLS to the data nodes): the hosts are sentinels, `name` the primary's
  name they monitor; the credentials are the data nodes'; `?sentinel_password=...` when the
  sentinels want one. The client asks the sentinels for the primary on every new connection, so it
  follows a failover (redis-py's `Sentinel`).

Every client: str replies, bounded timeouts, no silent retries (a failure surfaces as
`MetadataUnavailable` and the caller retries on its own schedule). `SyncLink` / `AsyncLink` build
theirs at first use, so a Redis that is down when a worker or router starts is an outage like any
other, not a failed start.
"""
from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NamedTuple, cast
from urllib.parse import parse_qs, quote, unquote, urlsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.retry
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, AuthorizationError, RedisError
from redis.typing import KeyT, StreamIdT

from kvstore.errors import KVStoreError

SyncClient = redis.Redis | redis.cluster.RedisCluster
AsyncClient = redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster
# Stream replies on a decode_responses client: an entry is (entry id, {field: value}); XREAD's
# reply is [(stream key, [entry, ...])]. redis-py types them with bytes in every position.
XEntry = tuple[str, dict[str, str]]
XReadReply = list[tuple[str, list[XEntry]]]

_SSL_OPTIONS = frozenset({"ssl_ca_certs", "ssl_cert_reqs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname"})
_SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}
# A cluster read with nothing new waits this long (at least) before the next one: cluster reads
# cannot block (one XREAD per stream, streams live in different slots).
CLUSTER_IDLE_S = 0.01


class MetadataError(KVStoreError):
    """Redis refused an operation (bad credentials, missing permission, wrong key type)."""


class MetadataUnavailable(MetadataError):
    """Redis cannot be reached, timed out, or is still loading: retry later."""


class RedisURL(NamedTuple):
    """A parsed `--redis-url`; `password` is never shown by `redacted`. For a Sentinel URL,
    `sentinels` lists the (host, port) of each sentinel (`host`/`port` are the first one's) and
    `master_name` is the monitored primary's name."""

    tls: bool
    host: str
    port: int
    db: int
    username: str | None
    password: str | None
    sentinels: tuple[tuple[str, int], ...] = ()
    master_name: str = ""
    options: tuple[tuple[str, str], ...] = ()

    @property
    def sentinel(self) -> bool:
        return bool(self.sentinels)

    def redacted(self) -> str:
        auth = f"{self.username or ''}{':***' if self.password else ''}"
        at = auth + "@" if auth else ""
        if self.sentinel:
            hosts = ",".join(f"{h}:{p}" for h, p in self.sentinels)
            return f"{'rediss' if self.tls else 'redis'}+sentinel://{at}{hosts}/{self.master_name}/{self.db}"
        return f"{'rediss' if self.tls else 'redis'}://{at}{self.host}:{self.port}/{self.db}"


def _redact(url: str) -> str:
    return re.sub(r"(//[^/@]*?:)[^/@]*@", r"\1***@", url)


def parse_redis_url(url: str) -> RedisURL:
    """Validate `redis://[user:password@]host[:port][/db][?ssl_...]` (or `rediss://` for TLS), or
    `redis+sentinel://[user:password@]host:port[,host:port...]/name[/db][?sentinel_password=..]`.

    Raises ValueError naming --redis-url (with the password masked) for anything else.
    """
    if not isinstance(url, str):
        raise ValueError(f"--redis-url {url!r} must be a string")
    shown = _redact(url)
    scheme = url.partition("://")[0] if "://" in url else ""
    if scheme in _SENTINEL_SCHEMES:
        return _parse_sentinel_url(url, shown, _SENTINEL_SCHEMES[scheme])
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"--redis-url {shown}: {e}") from None
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"--redis-url {shown}: the scheme must be redis://, rediss:// (with TLS) or "
                         f"redis+sentinel://, not {parts.scheme + '://' if parts.scheme else 'none'}")
    if not parts.hostname:
        raise ValueError(f"--redis-url {shown}: no host")
    path = parts.path.lstrip("/")
    if path and not path.isdigit():
        raise ValueError(f"--redis-url {shown}: the path must be a database number, not {path!r}")
    options = _options(parts.query, shown, _SSL_OPTIONS)
    return RedisURL(parts.scheme == "rediss", parts.hostname, port or 6379, int(path or 0),
                    unquote(parts.username) if parts.username else None,
                    unquote(parts.password) if parts.password else None, options=options)


def _options(query: str, shown: str, allowed: frozenset[str]) -> tuple[tuple[str, str], ...]:
    parsed = parse_qs(query, keep_blank_values=True)
    unknown = set(parsed) - allowed
    if unknown:
        raise ValueError(f"--redis-url {shown}: unknown options {sorted(unknown)}; allowed: {sorted(allowed)}")
    return tuple(sorted((k, v[-1]) for k, v in parsed.items()))


def _parse_sentinel_url(url: str, shown: str, tls: bool) -> RedisURL:
    rest = url.partition("://")[2]
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    auth, _, hosts = netloc.rpartition("@")
    username, _, password = auth.partition(":") if auth else ("", "", "")
    sentinels: list[tuple[str, int]] = []
    for host_port in hosts.split(","):
        host, _, port = host_port.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--redis-url {shown}: each sentinel must be HOST:PORT, not {host_port!r}")
        sentinels.append((host.strip("[]"), int(port)))
    name, _, db = path.partition("/")
    if not name:
        raise ValueError(f"--redis-url {shown}: no primary name (redis+sentinel://HOST:PORT[,...]/NAME[/DB])")
    if db and not db.isdigit():
        raise ValueError(f"--redis-url {shown}: the database must be a number, not {db!r}")
    options = _options(query, shown, _SSL_OPTIONS | {"sentinel_password"})
    return RedisURL(tls, sentinels[0][0], sentinels[0][1], int(db or 0), unquote(username) or None,
                    unquote(password) or None, tuple(sentinels), unquote(name), options)


class ClientOptions(NamedTuple):
    """The timeouts every client is built with: `read_timeout_s` is added to the socket timeout
    (a blocking XREAD must return before it)."""

    socket_timeout_s: float
    read_timeout_s: float = 0.0


def _kwargs(opts: ClientOptions) -> dict[str, Any]:
    return {"decode_responses": True, "socket_timeout": opts.socket_timeout_s + opts.read_timeout_s,
            "socket_connect_timeout": opts.socket_timeout_s}


def _data_node_kwargs(url: RedisURL) -> dict[str, Any]:
    """The connection arguments of a Sentinel URL's data nodes (credentials, db, TLS options), as
    redis-py's own URL parser turns them into arguments."""
    auth = f"{quote(url.username or '', safe='')}:{quote(url.password or '', safe='')}@" \
        if url.username or url.password else ""
    query = "&".join(f"{k}={quote(v, safe='')}" for k, v in url.options if k != "sentinel_password")
    kwargs = redis.connection.parse_url(f"{'rediss' if url.tls else 'redis'}://{auth}x/{url.db}?{query}")
    kwargs.pop("host", None)
    kwargs.pop("port", None)
    return kwargs


def _sentinel_kwargs(url: RedisURL, opts: ClientOptions) -> dict[str, Any]:
    password = dict(url.options).get("sentinel_password")
    return {"socket_timeout": opts.socket_timeout_s, "socket_connect_timeout": opts.socket_timeout_s,
            **({"password": password} if password else {})}


def connect(url: str, opts: ClientOptions, *, cluster: bool = False) -> SyncClient:
    """A sync client for `url` (cluster: a cluster client; decided by the caller, see `SyncLink`)."""
    parsed = parse_redis_url(url)
    kw = _kwargs(opts)
    if parsed.sentinel:
        manager = redis.sentinel.Sentinel(parsed.sentinels, sentinel_kwargs=_sentinel_kwargs(parsed, opts))
        return manager.master_for(parsed.master_name, redis_class=redis.Redis,
                                  retry=redis.retry.Retry(NoBackoff(), 0), **_data_node_kwargs(parsed), **kw)
    if cluster:
        if parsed.db != 0:
            raise MetadataError(f"--redis-url {parsed.redacted()}: a Redis Cluster has database 0 only")
        return redis.cluster.RedisCluster.from_url(url, retry=redis.retry.Retry(NoBackoff(), 0), **kw)
    return redis.Redis.from_url(url, retry=redis.retry.Retry(NoBackoff(), 0), **kw)


def connect_async(url: str, opts: ClientOptions, *, cluster: bool = False) -> AsyncClient:
    """The asyncio twin of `connect`."""
    parsed = parse_redis_url(url)
    kw = _kwargs(opts)
    if parsed.sentinel:
        manager = redis.asyncio.sentinel.Sentinel(parsed.sentinels,
                                                  sentinel_kwargs=_sentinel_kwargs(parsed, opts))
        return manager.master_for(parsed.master_name, redis_class=redis.asyncio.Redis,
                                  retry=redis.asyncio.retry.Retry(NoBackoff(), 0),
                                  **_data_node_kwargs(parsed), **kw)
    if cluster:
        if parsed.db != 0:
            raise MetadataError(f"--redis-url {parsed.redacted()}: a Redis Cluster has database 0 only")
        return redis.asyncio.cluster.RedisCluster.from_url(url, retry=redis.asyncio.retry.Retry(NoBackoff(), 0),
                                                           **kw)
    return redis.asyncio.Redis.from_url(url, retry=redis.asyncio.retry.Retry(NoBackoff(), 0), **kw)


def _cluster_enabled(info: Mapping[str, object]) -> bool:
    return str(info.get("cluster_enabled", "0")) == "1"


class SyncLink:
    """A sync client built at first use: a cluster client when the node at a `redis://` URL has
    cluster mode on (one INFO on a throwaway connection), else a plain (or Sentinel) client. Raises
    as `redis_errors` does while Redis cannot be reached; thread-safe after the first call."""

    def __init__(self, url: str, opts: ClientOptions, client: SyncClient | None = None) -> None:
        self.url, self.opts = url, opts
        self._client = client

    @property
    def client(self) -> SyncClient:
        if self._client is None:
            cluster = False
            if not parse_redis_url(self.url).sentinel:
                with redis.Redis.from_url(self.url, retry=redis.retry.Retry(NoBackoff(), 0),
                                          **_kwargs(self.opts)) as probe:
                    cluster = _cluster_enabled(cast("Mapping[str, object]", probe.info("cluster")))
            self._client = connect(self.url, self.opts, cluster=cluster)
        return self._client

    @property
    def cluster(self) -> bool:
        return isinstance(self.client, redis.cluster.RedisCluster)

    def server_id(self, key: str | None = None) -> str:
        """The `run_id` of the Redis serving this client: on a cluster, of the primary serving
        `key` (None: of each primary, sorted and joined). It changes when Redis restarts or fails
        over (or, for None, a cluster changes its primaries)."""
        c = self.client
        if isinstance(c, redis.cluster.RedisCluster):
            nodes = c.PRIMARIES if key is None else c.get_node_from_key(key)
            return _run_ids(c.info("server", target_nodes=nodes))
        return _run_ids(c.info("server"))

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


class AsyncLink:
    """The asyncio twin of `SyncLink` (`await client()`), with the consumer's stream read."""

    def __init__(self, url: str, opts: ClientOptions, client: AsyncClient | None = None) -> None:
        self.url, self.opts = url, opts
        self._client = client

    async def client(self) -> AsyncClient:
        if self._client is None:
            cluster = False
            if not parse_redis_url(self.url).sentinel:
                probe = redis.asyncio.Redis.from_url(self.url, retry=redis.asyncio.retry.Retry(NoBackoff(), 0),
                                                     **_kwargs(self.opts))
                try:
                    cluster = _cluster_enabled(cast("Mapping[str, object]", await probe.info("cluster")))
                finally:
                    await probe.aclose()
            self._client = connect_async(self.url, self.opts, cluster=cluster)
        return self._client

    async def server_id(self) -> str:
        """See `SyncLink.server_id`."""
        c = await self.client()
        if isinstance(c, redis.asyncio.cluster.RedisCluster):
            return _run_ids(await c.info("server", target_nodes=redis.asyncio.cluster.RedisCluster.PRIMARIES))
        return _run_ids(await c.info("server"))

    async def read_streams(self, streams: Mapping[str, str], count: int, block_ms: int,
                           idle_s: float) -> XReadReply:
        """New entries of `streams` (key -> last id read), at most `count` per stream. One Redis:
        one XREAD naming every stream, blocking up to `block_ms`. A cluster: one XREAD per stream,
        pipelined (one round trip per primary), not blocking; when nothing is new it sleeps
        `max(idle_s, CLUSTER_IDLE_S)` before returning."""
        c = await self.client()
        if not isinstance(c, redis.asyncio.cluster.RedisCluster):
            named: dict[KeyT, StreamIdT] = {k: v for k, v in streams.items()}
            return cast(XReadReply, await c.xread(named, count=count, block=block_ms) or [])
        await c.initialize()        # the slot map (refreshed here after a failover or a MOVED)
        p = c.pipeline(transaction=False)
        for key, last_id in streams.items():
            # the node named here from the cached slot map: without it redis-py asks a node
            # COMMAND GETKEYS for every XREAD (its keys are "movable"), a round trip each
            p.execute_command("XREAD", "COUNT", count, "STREAMS", key, last_id,
                              target_nodes=c.get_node_from_key(key))
        reply: XReadReply = []
        for one in cast("list[XReadReply | None]", await p.execute()):
            reply.extend(one or ())
        if not reply:
            await asyncio.sleep(max(idle_s, CLUSTER_IDLE_S))
        return reply

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def _run_ids(info: object) -> str:
    """`run_id` of an INFO reply, or of each node's reply of a multi-node INFO (node -> reply)."""
    assert isinstance(info, dict)
    if "run_id" in info:
        return str(info["run_id"])
    return ",".join(sorted(str(node_info["run_id"]) for node_info in info.values()))


@contextmanager
def redis_errors(what: str) -> Iterator[None]:
    """Turn redis-py and socket errors into MetadataUnavailable / MetadataError."""
    try:
        yield
    except (AuthenticationError, AuthorizationError) as e:
        raise MetadataError(f"{what}: Redis refused the credentials: {e}") from e
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as e:
        raise MetadataUnavailable(f"{what}: Redis is unavailable: {e}") from e
    except (redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError, redis.exceptions.MasterDownError,
            redis.exceptions.ReadOnlyError, redis.exceptions.BusyLoadingError) as e:
        raise MetadataUnavailable(f"{what}: Redis is failing over or loading: {e}") from e
    except redis.exceptions.RedisClusterException as e:
        raise MetadataUnavailable(f"{what}: the Redis Cluster is unavailable: {e}") from e
    except RedisError as e:
        raise MetadataError(f"{what}: {e}") from e

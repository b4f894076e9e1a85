"""KV event streams in Redis: the router's `EventConsumer` (the worker's `EventPublisher` is
`kvstore.metadata.publisher`).

One stream per worker (`Keys.events`), entries in the `kvstore.events` wire format with a
`seq` that grows by one per entry within the worker's epoch. The publisher (sync, worker
threads) never raises into its caller while Redis is down; the consumer (redis.asyncio,
the router's event loop) never loses its index while Redis is down: it serves the last
known one (degraded) and retries with backoff.

How the consumer keeps its index right (each case: clear that worker's entries, then ask
it for a full inventory through `Keys.resync`, unless the entry at hand already begins one):
- a hole or a repeat in `seq` (entries trimmed, lost in a Redis crash, or a bad entry);
- an epoch it has not seen (a worker restart), in the stream or in the registry; an entry of
  an epoch BELOW the highest known for its worker is from an earlier incarnation and is
  dropped, not applied (generation fencing: `Verdict.STALE`);
- a worker seen for the first time (it reads that stream from its current end);
- a Redis restart (a new `run_id`): every stream is read again from its start, and every
  known worker is asked for an inventory. Workers missing from the registry are kept for
  a grace period of one TTL after a restart or an outage, while heartbeats re-register.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, cast

from kvstore.events import (
    EventDecodeError,
    EventType,
    IndexSink,
    Tier,
    Verdict,
    WorkerCursor,
    WorkerId,
    decode_event,
)
from kvstore.keys import BlockHash
from kvstore.metadata.connection import AsyncClient, AsyncLink, ClientOptions, XEntry
from kvstore.metadata.registry import (
    MetadataError,
    RedisConfig,
    WorkerRecord,
    decode_live,
    redis_errors,
    texts,
)

log = logging.getLogger("kvmesh.streams")


InventoryFn = Callable[[], Mapping[Tier, Sequence[BlockHash]]]


class ConsumerStats(NamedTuple):
    """Counters since the consumer was built; `degraded`: Redis is unreachable right now."""

    degraded: bool
    num_workers: int
    entries: int
    gaps: int
    new_epochs: int
    bad_entries: int
    resyncs_requested: int
    redis_restarts: int
    failures: int
    stale: int = 0          # entries of an earlier generation of their worker, dropped


class EventConsumer:
    """Router side: follows every live worker's stream and keeps `index` up to date.

    Drive it with `await poll()` in a loop (or `run(stop)`); it must run on one event loop,
    the one that reads `index`, so the index needs no lock. `workers` is the last known
    registry (kept while Redis is unreachable). Redis errors never escape `poll`.
    `lag_observer`, when given, is called with each applied entry's lag in seconds: the
    router's wall clock at apply less the entry's stream id time (Redis's clock at XADD).

    Reads are batched: one XREAD names every followed stream, so its cost grows with the
    workers, and while any of them publishes, reads back to back would each return a handful of
    entries. Consecutive reads start at least `read_interval_s` apart (None: 20 µs per followed
    stream, at most 50 ms: 20 ms at 1,000 workers — `kvmesh bench scale` measures it; 0: back to
    back; a read after one that filled some stream's COUNT does not wait: that stream has a
    backlog), which bounds the per-read cost a second and adds at most that to the lag. One read
    returns at most about `max_entries_per_read` entries (COUNT per stream: that over the
    streams, at least 1, at most `count`): redis-py parses a whole reply within the socket
    timeout, and a reply of `count` entries from each of 1,000 streams (a backlog after a
    restart) takes longer than that to parse, so every read would time out again.

    On a Redis Cluster (detected at the first poll, `kvstore.metadata.connection`) every shard is
    read: the registry set lives on one node, each worker's stream on the node of its hash tag,
    and a read is one XREAD per followed stream, pipelined (one round trip per primary); a
    read that finds nothing waits the read interval (at least 10 ms) instead of blocking. A
    change in any primary's `run_id` (a failover) is handled as a restart.
    """

    def __init__(self, config: RedisConfig, index: IndexSink, *, block_ms: int = 100,
                 count: int = 1000, max_backoff_s: float = 2.0,
                 client: AsyncClient | None = None,
                 lag_observer: Callable[[float], None] | None = None,
                 read_interval_s: float | None = None, max_entries_per_read: int = 2000) -> None:
        if block_ms <= 0 or count <= 0:
            raise ValueError(f"block_ms={block_ms!r} and count={count!r} must be > 0")
        self.config, self.index = config, index
        self._lag_observer = lag_observer
        if read_interval_s is not None and not read_interval_s >= 0:
            raise ValueError(f"read_interval_s={read_interval_s!r} must be >= 0 (or None: by the streams)")
        self._read_interval_s = read_interval_s
        if max_entries_per_read <= 0:
            raise ValueError(f"max_entries_per_read={max_entries_per_read!r} must be > 0")
        self._max_entries = max_entries_per_read
        self._read_at = 0.0
        self._backlog = False       # the last read filled some stream's COUNT
        self._block_ms, self._count, self._max_backoff_s = block_ms, count, max_backoff_s
        self._link = AsyncLink(config.url, ClientOptions(config.socket_timeout_s, block_ms / 1000), client)
        self._keys = config.keys
        self._cursors: dict[WorkerId, WorkerCursor] = {}
        self._workers: dict[WorkerId, WorkerRecord] = {}
        self._run_id: str | None = None
        self._degraded = False
        self._next_refresh = self._grace_until = 0.0
        self._retry_at, self._backoff_s = 0.0, 0.0
        self._entries = self._gaps = self._new_epochs = self._bad = 0
        self._resyncs = self._restarts = self._failures = self._stale = 0

    @property
    def workers(self) -> dict[WorkerId, WorkerRecord]:
        """The live workers as last seen in the registry (a copy)."""
        return dict(self._workers)

    @property
    def degraded(self) -> bool:
        return self._degraded

    async def poll(self) -> int:
        """Refresh the registry when due, then read (blocking up to `block_ms`) and apply
        new entries. Returns the number of entries applied."""
        now = time.monotonic()
        if now < self._retry_at:
            await asyncio.sleep(min(self._retry_at - now, self._block_ms / 1000))
            return 0
        try:
            with redis_errors("consume events"):
                if now >= self._next_refresh:
                    await self._refresh(now)
                return await self._read()
        except MetadataError as e:
            self._failures += 1
            if not self._degraded:
                log.warning("routing on the last known block index: %s", e)
            self._degraded = True
            self._next_refresh = 0.0
            self._backoff_s = min(self._max_backoff_s, max(0.05, 2 * self._backoff_s))
            self._retry_at = time.monotonic() + self._backoff_s
            return 0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.poll()

    async def request_resync(self, *worker_ids: WorkerId) -> None:
        """Ask workers for a full inventory (they take the request on their next poll)."""
        if not worker_ids:
            return
        p = (await self._link.client()).pipeline(transaction=False)
        for w in worker_ids:
            p.set(self._keys.resync(w), "1", px=int(self.config.record_ttl_s * 1000))
        await p.execute()
        self._resyncs += len(worker_ids)

    async def lag_s(self) -> dict[WorkerId, float]:
        """Per followed worker: how far behind the newest entry of its stream the last entry
        read is, in stream time (both ids are Redis clock milliseconds), in seconds. Raises
        MetadataError when Redis does not answer."""
        workers = sorted(self._cursors)
        with redis_errors("read stream heads"):
            p = (await self._link.client()).pipeline(transaction=False)
            for w in workers:
                p.xrevrange(self._keys.events(w), count=1)
            heads = await p.execute()
        return {w: max(_id_ms(head[0][0]) - _id_ms(self._cursors[w].last_id), 0) / 1000 if head else 0.0
                for w, head in zip(workers, heads)}

    def stats(self) -> ConsumerStats:
        return ConsumerStats(self._degraded, len(self._workers), self._entries, self._gaps,
                             self._new_epochs, self._bad, self._resyncs, self._restarts,
                             self._failures, self._stale)

    async def aclose(self) -> None:
        await self._link.aclose()

    async def _refresh(self, now: float) -> None:
        r = await self._link.client()
        run_id = await self._link.server_id()
        restarted = self._run_id is not None and run_id != self._run_id
        self._run_id = run_id
        resync: set[WorkerId] = set()
        if restarted:
            log.warning("Redis restarted or failed over: rereading every stream, asking for inventories")
            self._restarts += 1
            for reread in self._cursors.values():
                reread.last_id = "0-0"
            resync.update(self._cursors)
        if restarted or self._degraded:
            self._grace_until = now + self.config.heartbeat_ttl_s + self.config.heartbeat_interval_s
        ids = sorted(texts(await r.smembers(self._keys.workers)))
        p = r.pipeline(transaction=False)
        for w in ids:
            p.hgetall(self._keys.record(w))
            p.get(self._keys.alive(w))
        live, gone = decode_live(ids, await p.execute())
        if gone:
            await r.srem(self._keys.workers, *gone)
        new = [r.worker_id for r in live if r.worker_id not in self._cursors]
        heads: dict[WorkerId, list[XEntry]] = {}
        if new:     # each new stream's current end, in one round trip (a router start meets them all)
            p = r.pipeline(transaction=False)
            for w in new:
                p.xrevrange(self._keys.events(w), count=1)
            heads = dict(zip(new, cast("list[list[XEntry]]", await p.execute())))
        for record in live:
            w, cursor = record.worker_id, self._cursors.get(record.worker_id)
            if cursor is None:
                last = heads[w]
                cursor = WorkerCursor(last[0][0] if last else "0-0", record_epoch=record.epoch)
                self._cursors[w] = cursor
                self.index.clear_worker(w)
                resync.add(w)
            elif cursor.record_epoch != record.epoch:
                cursor.record_epoch = record.epoch
                if cursor.epoch != record.epoch:  # restarted; its events may not be out yet
                    self._new_epochs += 1
                    cursor.epoch, cursor.next_seq = record.epoch, None
                    self.index.clear_worker(w)
                    resync.add(w)
            self._workers[w] = record
        live_ids = {r.worker_id for r in live}
        if now >= self._grace_until:
            for w in [w for w in self._cursors if w not in live_ids]:
                del self._cursors[w]
                self._workers.pop(w, None)
                self.index.remove_worker(w)
        await self.request_resync(*sorted(resync))
        if self._degraded:
            log.warning("Redis is back: block index live again")
        self._degraded = False
        self._retry_at, self._backoff_s = 0.0, 0.0
        self._next_refresh = now + self.config.heartbeat_interval_s

    async def _read(self) -> int:
        if not self._cursors:
            await asyncio.sleep(self._block_ms / 1000)
            return 0
        interval = self._read_interval_s
        if interval is None:
            interval = min(0.05, 20e-6 * len(self._cursors))
        wait = self._read_at + interval - time.monotonic()
        if wait > 0 and not self._backlog:
            await asyncio.sleep(wait)
        self._read_at = time.monotonic()
        by_key = {self._keys.events(w): w for w in self._cursors}
        streams = {k: self._cursors[w].last_id for k, w in by_key.items()}
        count = max(1, min(self._count, self._max_entries // len(streams)))
        reply = await self._link.read_streams(streams, count, self._block_ms, interval)
        self._backlog = any(len(entries) >= count for _, entries in reply)
        resync: set[WorkerId] = set()
        applied = 0
        for key, entries in reply:
            w = by_key[key]
            cursor = self._cursors[w]
            for entry_id, fields in entries:
                cursor.last_id = entry_id
                try:
                    entry = decode_event(fields)
                except EventDecodeError as e:
                    log.warning("worker %s: %s", w, e)
                    self._bad += 1
                    cursor.next_seq = None
                    self.index.clear_worker(w)
                    resync.add(w)
                    continue
                verdict = cursor.check(entry.epoch, entry.seq)
                if verdict is Verdict.STALE:     # an earlier incarnation of the worker: fenced off
                    self._stale += 1
                    continue
                if verdict is not Verdict.NEXT:
                    self._gaps += verdict is Verdict.GAP
                    self._new_epochs += verdict is Verdict.NEW_EPOCH
                    self.index.clear_worker(w)
                    resync.add(w)
                if entry.event.type is EventType.INVENTORY_BEGIN:
                    resync.discard(w)  # the inventory that begins here restores the worker
                self.index.apply(w, entry.event, entry.epoch)
                applied += 1
                if self._lag_observer is not None:
                    self._lag_observer(time.time() - _id_ms(entry_id) / 1000)
        self._entries += applied
        await self.request_resync(*sorted(resync))
        return applied


def _id_ms(entry_id: str) -> int:
    """The millisecond part of a stream entry id (`<ms>-<seq>`)."""
    return int(str(entry_id).partition("-")[0])

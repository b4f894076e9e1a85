"""The router side of `kvmesh bench scale`, in the bench's own process (one asyncio loop, as
the router runs it): the router's real `EventConsumer` (kvstore/metadata/streams.py) feeding
its real block index through the registry's `GatedIndex`, the real `WorkerRegistry` entries and
the real `Router.pick` (router/routing/core.py: the kv_aware policy's filter → scorers → pick
over the live workers, the index and the in-flight table). What is not the router's: no gRPC
worker answers — each worker the consumer finds in the Redis registry is marked ready as a
probe would mark it (`WorkerEntry.info`, its pool size), and a routed request is not sent:
its prediction is recorded (`InFlightPrefills.dispatched`) and it ends `service_s` later.

One pass: a fresh consumer finds every worker for the first time, so it asks each for an
inventory (as after a router restart) — the fill; then `steady_s` of the fleet's traffic with
decisions at `decision_rate`; then the fleet pauses, the index catches up and is compared with
what the fleet holds (the oracle) and measured by a size walk.
"""
from __future__ import annotations

import asyncio
import gc
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvmesh.bench.scale_baseline import AsksLoopIndex, TrackedCompactIndex, rebuild_per_pick
from kvmesh.bench.scale_memory import deep_size, full_collection_ms
from kvstore.events import IndexSink, WireEvent, WorkerId
from kvstore.metadata.registry import RedisConfig, connect_async
from kvstore.metadata.streams import EventConsumer
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.config import RouterConfig
from router.heap import freeze_startup_heap
from router.index.blocks import BlockIndex
from router.index.compact import CompactBlockIndex
from router.index.gate import GatedIndex
from router.routing.core import Router
from router.routing.pick import pick_worker, reference_view
from router.routing.types import RouteRequest, WorkerInfo
from router.workers.registry import WorkerEntry, WorkerRegistry

# The router variants a pass runs (`--index`): its index structure, its consumer's read_interval_s,
# its pick and whether its start-up heap is frozen (router/heap.py). `legacy` is the router before
# the changes this bench showed (dict-per-block index, reads back to back, the pick over per-worker
# dicts); `compact-dicts` the compact index and batched reads with that pick
# (router/routing/pick.py `reference_view` + `Policy.pick`); `compact-tracked` the column pick
# (router/routing/fastpick.py) over the compact index as it was before it left the garbage
# collector's sight (kvmesh/bench/scale_baseline.py); `compact-per-pick` the router as it is but
# for the live workers' columns, built afresh at every pick as the view was before they were
# kept between picks (router/workers/live.py; kvmesh/bench/scale_baseline.py `rebuild_per_pick`);
# `compact-asks-loop` the router as it is but for a routed prompt's asks counted holder by holder
# (scale_baseline.py `AsksLoopIndex`); `compact` the router as it is.
INDEXES: dict[str, Callable[[], BlockIndex]] = {"legacy": BlockIndex, "compact-dicts": CompactBlockIndex,
                                                "compact-tracked": TrackedCompactIndex,
                                                "compact-per-pick": CompactBlockIndex,
                                                "compact-asks-loop": AsksLoopIndex,
                                                "compact": CompactBlockIndex}
READ_INTERVAL_S: dict[str, float | None] = {"legacy": 0.0, "compact-dicts": None, "compact-tracked": None,
                                            "compact-per-pick": None, "compact-asks-loop": None, "compact": None}
COLUMN_PICK: dict[str, bool] = {"legacy": False, "compact-dicts": False, "compact-tracked": True,
                                "compact-per-pick": True, "compact-asks-loop": True, "compact": True}
FREEZE: dict[str, bool] = {"legacy": False, "compact-dicts": False, "compact-tracked": False,
                           "compact-per-pick": True, "compact-asks-loop": True, "compact": True}
DECISION_DUTY = 0.5     # the most of the loop's time picks may take


@dataclass(frozen=True, slots=True)
class PassConfig:
    redis: RedisConfig
    index: str                      # a key of INDEXES
    expected_entries: int           # what the fleet holds: the fill is done at 99% of it
    steady_s: float
    decision_rate: float            # decisions per second during the steady phase
    service_s: float                # how long a routed request stays in flight
    pool_blocks: int
    block_size: int
    fill_timeout_s: float


class PassResult(NamedTuple):
    decision_ms: list[float]
    lag_ms: list[float]             # steady phase only
    hash_events: int                # stored/removed hashes applied, steady phase
    entries: int                    # stream entries applied, steady phase
    ingest_cpu_s: float             # process CPU less the decisions' thread CPU, steady phase
    decision_cpu_s: float
    wall_s: float
    fill_s: float
    fill_hash_events: int
    fill_cpu_s: float
    redis_cpu_s: float              # used_cpu_sys + used_cpu_user, steady phase
    redis_mem_bytes: int
    index_entries: int
    index_blocks: int
    index_bytes: int
    consumer_gaps: int
    decision_parts_ms: dict[str, float]
    held: int                       # what the fleet holds once paused (the oracle)
    decisions_shed: int
    decision_cpu_ms: list[float]    # each pick's thread CPU time (wall time less descheduling)
    gc_pauses_ms: list[float]       # the garbage collector's passes during the steady phase
    gc_full_ms: list[float]         # of those, the full (gen-2) ones
    decision_gc_ms: list[float]     # the collector's time inside each pick (aligned with decision_ms)
    warm_pick_ms: float             # the first pick, before the steady phase (builds the ring)
    full_gc_ms: float               # one gc.collect() with the index full, fleet paused (best of 3)
    gc_tracked: int                 # the objects the collector tracks then (frozen ones not counted)
    dispatch_ms: list[float]        # each routed request's bookkeeping after its pick (`dispatched`)


class CountingSink:
    """The consumer's sink: the registry's `GatedIndex`, counting hashes applied."""

    def __init__(self, inner: IndexSink) -> None:
        self.inner = inner
        self.hashes = 0

    def apply(self, worker_id: WorkerId, event: WireEvent, generation: int | None = None) -> None:
        self.hashes += len(event.hashes)
        self.inner.apply(worker_id, event, generation)

    def clear_worker(self, worker_id: WorkerId) -> None:
        self.inner.clear_worker(worker_id)

    def remove_worker(self, worker_id: WorkerId) -> None:
        self.inner.remove_worker(worker_id)


async def _noop(ready: bool) -> None:
    return None


class RouterPass:
    def __init__(self, cfg: PassConfig, trace: Sequence[RouteRequest]) -> None:
        self.cfg = cfg
        self.trace = trace
        self.index = INDEXES[cfg.index]()
        self.registry = WorkerRegistry(RouterConfig(redis_url=cfg.redis.url, cluster_name=cfg.redis.cluster_name,
                                                    http_port=None), _noop)
        self.registry.index = self.index
        self.registry.model_info = pb.ModelInfo(model="scale-model", block_size=cfg.block_size,
                                                hash_salt_hex="5ca1e", vocab_size=50000, max_model_len=8192)
        self.router = Router(self.registry.cfg, self.registry)
        self.router.column_pick = COLUMN_PICK[cfg.index]
        if cfg.index == "compact-per-pick":
            rebuild_per_pick(self.registry)
        self.lags: list[float] = []
        self.sink = CountingSink(GatedIndex(self.index))
        self.consumer = EventConsumer(cfg.redis, self.sink, lag_observer=self.lags.append,
                                      read_interval_s=READ_INTERVAL_S[cfg.index])
        self._stop = asyncio.Event()
        self._known: set[str] = set()
        self._flights: dict[str, WorkerEntry] = {}
        self.shed = 0                   # decisions due while the loop was the consumer's
        self.pick_cpu_ms: list[float] = []
        self.dispatch_ms: list[float] = []
        self.warm_pick_ms = 0.0
        self.gc_ms: list[float] = []
        self.gc_full_ms: list[float] = []
        self.gc_total_ms = 0.0
        self._gc_t0 = 0.0

    def _gc_timer(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            ms = (time.perf_counter() - self._gc_t0) * 1000
            self.gc_ms.append(ms)
            self.gc_total_ms += ms
            if info["generation"] == 2:
                self.gc_full_ms.append(ms)

    async def _consume(self) -> None:
        """The registry's consume loop: a poll, then its membership follows the Redis registry."""
        while not self._stop.is_set():
            await self.consumer.poll()
            records = self.consumer.workers
            ids = {r.address: r.worker_id for r in records.values()}
            if set(ids) != self._known:
                self.registry.set_workers(ids, probe=False, worker_ids=ids)
                for address, wid in ids.items():
                    entry = self.registry.entry(address)
                    if entry.info is None:        # what a probe that found it SERVING sets
                        entry.info = WorkerInfo(wid, address)
                        entry.num_blocks = self.cfg.pool_blocks
                self._known = set(ids)

    async def run(self, pause_fleet: Callable[[], int], fleet_alive: Callable[[], bool]) -> PassResult:
        """`pause_fleet()` stops the fleet's traffic and returns the blocks it holds."""
        cfg = self.cfg
        if FREEZE[cfg.index]:           # as the router process does once started (router/server.py)
            freeze_startup_heap()
        try:
            return await self._run(pause_fleet, fleet_alive)
        finally:
            gc.unfreeze()

    async def _run(self, pause_fleet: Callable[[], int], fleet_alive: Callable[[], bool]) -> PassResult:
        cfg = self.cfg
        task = asyncio.create_task(self._consume())
        t0, cpu0 = time.monotonic(), time.process_time()
        while (self.index.stats().num_entries < 0.99 * cfg.expected_entries
               and time.monotonic() - t0 < cfg.fill_timeout_s):
            if not fleet_alive():
                raise RuntimeError("the worker fleet exited during the fill")
            await asyncio.sleep(0.05)
        fill_s, fill_cpu = time.monotonic() - t0, time.process_time() - cpu0
        fill_hashes = self.sink.hashes
        drained = await self._drain()
        print(f"kvmesh bench scale: {cfg.index} index filled to {self.index.stats().num_entries} entries "
              f"in {fill_s:.1f} s, its streams read to {drained:.2f} s of their heads",
              file=sys.stderr, flush=True)
        # one pick first, as a router's first request does: the hash ring is built once per worker set
        warm = time.perf_counter()
        self.router.pick(self.trace[0], set())
        self.warm_pick_ms = (time.perf_counter() - warm) * 1000
        self.lags.clear()
        admin = connect_async(cfg.redis)
        redis_cpu0 = _redis_cpu(await admin.info("cpu"))
        hashes0, entries0 = self.sink.hashes, self.consumer.stats().entries
        cpu0, wall0 = time.process_time(), time.monotonic()
        gc.callbacks.append(self._gc_timer)
        try:
            decision_ms, decision_gc, decision_cpu = await self._decide(cfg.steady_s)
        finally:
            gc.callbacks.remove(self._gc_timer)
        wall, cpu = time.monotonic() - wall0, time.process_time() - cpu0
        redis_cpu = _redis_cpu(await admin.info("cpu")) - redis_cpu0
        hashes, entries = self.sink.hashes - hashes0, self.consumer.stats().entries - entries0
        lags = [x * 1000 for x in self.lags]
        held = await asyncio.to_thread(pause_fleet)
        await self._settle(held)
        full_gc_ms = full_collection_ms()
        gc_tracked = len(gc.get_objects())      # tracked and not frozen
        self._stop.set()
        await task
        mem = int((await admin.info("memory"))["used_memory"])
        await admin.aclose()
        parts = self._parts()
        stats = self.index.stats()
        result = PassResult(decision_ms, lags, hashes, entries, max(0.0, cpu - decision_cpu), decision_cpu, wall,
                            fill_s, fill_hashes, fill_cpu, redis_cpu, mem, stats.num_entries, stats.num_blocks,
                            deep_size(self.index), self.consumer.stats().gaps, parts, held, self.shed,
                            self.pick_cpu_ms, self.gc_ms, self.gc_full_ms, decision_gc, self.warm_pick_ms,
                            full_gc_ms, gc_tracked, self.dispatch_ms)
        await self.consumer.aclose()
        await self.registry.stop()
        return result

    async def _drain(self, timeout_s: float = 60.0) -> float:
        """Until every stream is read to within 0.5 s of its head (the inventories' tail and the
        traffic that came meanwhile), so the steady phase starts without a backlog; returns the
        largest lag last seen (`EventConsumer.lag_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            worst = max((await self.consumer.lag_s()).values(), default=0.0)
            if worst < 0.5 or time.monotonic() > deadline:
                return worst
            await asyncio.sleep(0.5)

    async def _decide(self, seconds: float) -> tuple[list[float], list[float], float]:
        """Route trace requests at `decision_rate` for `seconds`: the time of each `pick` and the
        garbage collector's time within it, and the picks' thread CPU seconds. Picks
        take at most `DECISION_DUTY` of the loop: after a pick of t seconds the loop is the
        consumer's for t × (1 − duty) / duty (decisions due meanwhile are shed, counted in
        `shed`), so that ingest is measured while a pick is slower than the rate allows."""
        cfg, router, index = self.cfg, self.router, self.index
        times: list[float] = []
        in_gc: list[float] = []
        cpu = 0.0
        in_flight: deque[tuple[float, str]] = deque()
        start = time.monotonic()
        i = 0
        free_at = start
        while (now := time.monotonic()) - start < seconds:
            while in_flight and in_flight[0][0] <= now:
                _, rid = in_flight.popleft()
                self._end(rid)
            due = max(start + (i + self.shed) / cfg.decision_rate, free_at)
            if due > now:
                await asyncio.sleep(due - now)
                continue
            behind = int((now - start) * cfg.decision_rate) - i - self.shed
            if behind > 0:          # due while the loop was the consumer's: not routed
                self.shed += behind
            route = self.trace[i % len(self.trace)]
            rid = f"scale-{i}"
            c0, g0, t0 = time.thread_time(), self.gc_total_ms, time.perf_counter()
            pick = router.pick(route, set())
            took = time.perf_counter() - t0
            times.append(took * 1000)
            in_gc.append(self.gc_total_ms - g0)
            self.pick_cpu_ms.append((time.thread_time() - c0) * 1000)
            free_at = time.monotonic() + took * (1 - DECISION_DUTY) / DECISION_DUTY
            t1 = time.perf_counter()
            router.prefills.dispatched(index, rid, pick.worker.info.worker_id,  # type: ignore[union-attr]
                                       route, pick.predicted_tokens)
            self.dispatch_ms.append((time.perf_counter() - t1) * 1000)
            pick.worker.in_flight += 1
            self._flights[rid] = pick.worker
            cpu += time.thread_time() - c0
            in_flight.append((now + cfg.service_s, rid))
            i += 1
            await asyncio.sleep(0)      # let the consumer in between decisions, as requests do
        for _, rid in in_flight:
            self._end(rid)
        return times, in_gc, cpu

    def _end(self, rid: str) -> None:
        worker = self._flights.pop(rid)
        worker.in_flight -= 1
        self.router.prefills.done(self.index, rid, streamed=True)

    async def _settle(self, held: int, timeout_s: float = 60.0) -> None:
        """Until the index holds what the fleet holds (or nothing has arrived for 2 s)."""
        deadline = time.monotonic() + timeout_s
        last, quiet = -1, time.monotonic()
        while time.monotonic() < deadline:
            n = self.consumer.stats().entries
            if self.index.stats().num_entries == held and n == last:
                return
            if n != last:
                last, quiet = n, time.monotonic()
            elif time.monotonic() - quiet > 2.0:
                return
            await asyncio.sleep(0.2)

    def _parts(self, samples: int = 20) -> dict[str, float]:
        """Mean ms of the pick's parts on a few trace requests (each part timed alone): for the
        column pick its view (`routing_view`: the index's sparse lookups, the shared-blocks pass,
        the columns) and the pick over the columns; for the reference, the dict state's parts
        and `Policy.pick` on it."""
        router, index = self.router, self.index
        live = router.live_workers()
        ids = [w.worker_id for w in live]
        bs = self.cfg.block_size
        if router.column_pick:
            out = dict.fromkeys(("match_leading_pair", "shared_blocks_of", "routing_view", "pick"), 0.0)
            for route in self.trace[:samples]:
                t = time.perf_counter()
                index.match_leading_pair(route.block_hashes)
                out["match_leading_pair"] += time.perf_counter() - t
                t = time.perf_counter()
                index.shared_blocks_of(ids)
                out["shared_blocks_of"] += time.perf_counter() - t
                t = time.perf_counter()
                view = router._routing_view(route)
                out["routing_view"] += time.perf_counter() - t
                t = time.perf_counter()
                pick_worker(router.policy, self.registry, view, view.decode_pool, route, set(), bs,
                            router.column_picker)
                out["pick"] += time.perf_counter() - t
            return {k: round(v * 1000 / samples, 3) for k, v in out.items()}
        out = dict.fromkeys(("match_prefix_x2", "shared_blocks", "queued_tokens", "routing_state", "policy"), 0.0)
        for route in self.trace[:samples]:
            t = time.perf_counter()
            index.match_prefix(route.block_hashes, ids)
            index.match_prefix(route.block_hashes, ids, pending=False)
            out["match_prefix_x2"] += time.perf_counter() - t
            t = time.perf_counter()
            for w in ids:
                index.shared_blocks(w)
            out["shared_blocks"] += time.perf_counter() - t
            t = time.perf_counter()
            router.prefills.queued_tokens(index, ids, route)
            out["queued_tokens"] += time.perf_counter() - t
            t = time.perf_counter()
            state = reference_view(self.registry, router.prefills, route, bs).state
            out["routing_state"] += time.perf_counter() - t
            t = time.perf_counter()
            router.policy.pick(live, route, state)
            out["policy"] += time.perf_counter() - t
        return {k: round(v * 1000 / samples, 3) for k, v in out.items()}


def _redis_cpu(info: dict[str, Any]) -> float:
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])

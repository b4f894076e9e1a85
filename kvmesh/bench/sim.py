"""Trace-driven simulation of the routing policies (the first half of `kvmesh bench router`).

A multi-tenant trace: `num_prompts` system prompts with Zipf popularity, each request a
system prompt plus a unique user suffix, Poisson arrivals. Each worker has a KV pool of
`cache_blocks` blocks and prefills one request at a time at `prefill_tokens_per_s` (its
queue is FIFO), then decodes for an exponential time. The pool is the workers' own
`kvstore.pool.BlockPool`, used as the engine uses it: a request's cached prefix is pinned
when it is routed, its other blocks are allocated (evicting the least recently freed) and
cached when its prefill is done, and all are freed tail first when it ends — so blocks in
use are never evicted and a finished prompt's unique tail goes before its shared prefix, as
in the live pool. What the live runs showed is modelled: a worker stores a
prompt's blocks only when its prefill is done, and the router's real `BlockIndex` learns of
them (and of evictions) from the pool's events; the router's `InFlightPrefills` runs here as
in the router, so `kv_aware` sees the blocks a worker is computing (pending), each worker's
queued prefill tokens and its sustained load, while a request's hit is what its worker has
stored or is computing ahead of it in its queue. The policies under test are the real ones
from router.routing.policy. The oracle is one pool of the combined size that sees every request,
each done at once.
"""
from __future__ import annotations

import heapq
import itertools
import random
import statistics
from dataclasses import dataclass, replace

from kvstore.events import Tier
from kvstore.fade import FADE_STEPS
from kvstore.keys import BlockHash, block_hashes
from kvstore.pool import PROTECT_TURNOVERS, BlockId, BlockPool, BlockRemoved, BlockStored
from router.index.asks import ASK_HALF_LIFE, cluster_fill
from router.index.blocks import BlockIndex
from router.routing.inflight import InFlightConfig, InFlightPrefills
from router.routing.policy import Weighted, make_policy
from router.routing.scorers import DEFAULT_LOAD_FACTOR, BoundedLoadFilter, PrefillCostScorer
from router.routing.types import RouteRequest, RoutingPolicy, RoutingState, WorkerId, WorkerInfo, WorkerLoad

_SALT = b"kvmesh-sim"


@dataclass(frozen=True, slots=True)
class SimConfig:
    num_workers: int = 8
    cache_blocks: int = 320          # per worker
    num_prompts: int = 64
    zipf_s: float = 1.1
    system_blocks: int = 32          # blocks in each system prompt
    suffix_blocks: tuple[int, int] = (1, 6)
    num_requests: int = 4000
    mean_in_flight: float = 4.0      # offered load per worker (Little's law)
    block_size: int = 16
    load_factor: float = DEFAULT_LOAD_FACTOR
    prefill_tokens_per_s: float = 4096.0   # a cold 38-block prompt: ~0.15 of the mean decode time
    seed: int = 0
    ask_half_life: float = ASK_HALF_LIFE   # the router index's (router/index/asks.py)
    protect_turnovers: float | None = PROTECT_TURNOVERS   # the workers' pools' (kvstore/pool.py)
    fade_steps: float | None = FADE_STEPS                 # the workers' pools' (kvstore/fade.py)
    copy_room_frac: float | None = None    # kv_aware's PrefillCostScorer.copy_room_frac (None: its default)
    tolerance_exponent: float | None = None   # kv_aware's PrefillCostScorer.tolerance_exponent (None: its default)
    holder_factor: float | None = None     # kv_aware's BoundedLoadFilter.holder_factor (None: its default)
    # The router tells the worker which leading blocks other requests will share (the index's
    # `BlockIndex.shared_prefix`, proto GenerateRequest.shared_prefix_blocks) and the pool protects
    # them from their first use; False: no hint (kvmesh.bench.routing_sweeps.sweep_prefix_hint)
    prefix_hint: bool = True


@dataclass(frozen=True, slots=True)
class SimResult:
    hit_rate: float                  # cached prompt blocks / prompt blocks
    imbalance: float                 # max / mean of time-averaged in-flight per worker
    ttft_p50: float = 0.0            # in units of the mean decode time: queue + own prefill
    cold_requests: int = 0           # requests that found less than their system prompt cached


class WorkerPool:
    """One simulated worker's KV pool: a `BlockPool` whose events reach `index` (if given)
    as the worker's KV event stream does."""

    def __init__(self, worker_id: WorkerId, num_blocks: int, index: BlockIndex | None,
                 protect_turnovers: float | None = PROTECT_TURNOVERS, fade_steps: float | None = FADE_STEPS) -> None:
        self.worker_id = worker_id
        self.pool = BlockPool(num_blocks, enable_kv_cache_events=index is not None,
                              protect_turnovers=protect_turnovers, fade_steps=fade_steps)
        self.index = index

    def pin(self, hashes: tuple[BlockHash, ...]) -> list[BlockId]:
        """Take a reference on the leading blocks the pool holds (they are the request's now)."""
        found = self.pool.find_longest_prefix(hashes)
        self.pool.touch(found)
        return found

    def store(self, held: list[BlockId], hashes: tuple[BlockHash, ...], shared: int = 0) -> list[BlockId]:
        """The prefill is done: the request holds blocks for all of `hashes` it could get
        (what others stored meanwhile, then fresh blocks while any is free) and they are
        cached, the first `shared` protected from their first use (the router's hint);
        returns its blocks in sequence order."""
        found = self.pool.find_longest_prefix(hashes)
        assert found[:len(held)] == held, "a pinned block lost its hash"
        self.pool.touch(found[len(held):])
        rest = hashes[len(found):]
        fresh = self.pool.allocate(min(len(rest), self.pool.num_free_blocks))
        self.pool.cache_full_blocks(fresh, rest[:len(fresh)], hashes[len(found) - 1] if found else None,
                                    shared=max(0, shared - len(found)))
        self._publish()
        return found + fresh

    def release(self, blocks: list[BlockId]) -> None:
        self.pool.free_sequence(blocks)

    def _publish(self) -> None:
        if self.index is None:
            return
        for event in self.pool.take_events():
            if isinstance(event, BlockStored):
                self.index.add(self.worker_id, (event.block_hash,), Tier.DEVICE)
            elif isinstance(event, BlockRemoved):
                self.index.discard(self.worker_id, (event.block_hash,), Tier.DEVICE)


def make_trace(cfg: SimConfig) -> list[RouteRequest]:
    rng = random.Random(cfg.seed)
    weights = [1.0 / (k + 1) ** cfg.zipf_s for k in range(cfg.num_prompts)]
    bs = cfg.block_size
    systems = [[rng.randrange(100, 40000) for _ in range(cfg.system_blocks * bs)] for _ in range(cfg.num_prompts)]
    trace = []
    for _ in range(cfg.num_requests):
        p = rng.choices(range(cfg.num_prompts), weights)[0]
        suffix = [rng.randrange(100, 40000) for _ in range(rng.randint(*cfg.suffix_blocks) * bs)]
        ids = tuple(systems[p] + suffix)
        trace.append(RouteRequest(ids, tuple(block_hashes(ids, bs, _SALT))))
    return trace


def simulate(policy_name: RoutingPolicy | str, cfg: SimConfig, trace: list[RouteRequest]) -> SimResult:
    return _Sim(cfg, policy_name).run(trace)


class _Sim:
    """Event loop of one simulation: arrivals, prefill completions ("stored": the worker's
    cache and the router's index get the blocks) and departures."""

    def __init__(self, cfg: SimConfig, policy_name: RoutingPolicy | str) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed + 1)
        self.workers = [WorkerInfo(WorkerId(f"w{i}"), f"sim:{i}") for i in range(cfg.num_workers)]
        self.policy = make_policy(policy_name, cfg.load_factor)
        scorer = {k: v for k, v in (("copy_room_frac", cfg.copy_room_frac),
                                    ("tolerance_exponent", cfg.tolerance_exponent)) if v is not None}
        if scorer:
            self.policy = replace(self.policy, scorers=tuple(
                Weighted(replace(w.scorer, **scorer), w.weight)  # type: ignore[arg-type]
                if isinstance(w.scorer, PrefillCostScorer) else w for w in self.policy.scorers))
        if cfg.holder_factor is not None and self.policy.name is RoutingPolicy.KV_AWARE:
            self.policy = replace(self.policy, filters=tuple(
                replace(f, holder_factor=cfg.holder_factor) if isinstance(f, BoundedLoadFilter) else f
                for f in self.policy.filters))
        self.index = BlockIndex(ask_half_life=cfg.ask_half_life)
        self.index.set_capacity(cfg.cache_blocks * cfg.num_workers)
        self.pools = {w.worker_id: WorkerPool(w.worker_id, cfg.cache_blocks, self.index, cfg.protect_turnovers,
                                                 cfg.fade_steps)
                      for w in self.workers}
        self.blocks: dict[str, list[BlockId]] = {}    # request id → the blocks it holds
        self.hints: dict[str, int] = {}               # request id → the router's shared-prefix hint
        self.now = 0.0
        # Time is in mean decode times here: the sustained load is averaged over 4 of them.
        self.prefills = InFlightPrefills(InFlightConfig(load_window_s=4.0), clock=lambda: self.now)
        self.in_flight = {w.worker_id: 0 for w in self.workers}
        self.free_at = {w.worker_id: 0.0 for w in self.workers}   # when each worker's prefill queue drains
        self.area = {w.worker_id: 0.0 for w in self.workers}      # ∫ in_flight dt
        self.events: list[tuple[float, int, str, str, WorkerId, tuple[BlockHash, ...]]] = []
        self.hit = self.total = self.cold = 0
        self.ttfts: list[float] = []
        self._seq = itertools.count()

    def run(self, trace: list[RouteRequest]) -> SimResult:
        rate = self.cfg.mean_in_flight * self.cfg.num_workers
        t = 0.0
        for i, route in enumerate(trace):
            t += self.rng.expovariate(rate)
            self._until(t)
            self._arrive(f"r{i}", route)
        self._until(float("inf"))
        averages = [a / self.now for a in self.area.values()]
        mean = sum(averages) / len(averages)
        return SimResult(self.hit / self.total, max(averages) / mean if mean else 1.0, statistics.median(self.ttfts),
                         self.cold)

    def _until(self, t: float) -> None:
        while self.events and self.events[0][0] <= t:
            when, _, what, rid, wid, hashes = heapq.heappop(self.events)
            self._advance(when)
            if what == "departed":
                self.in_flight[wid] -= 1
                self.prefills.done(self.index, rid, streamed=True)
                self.pools[wid].release(self.blocks.pop(rid))
            else:   # prefill done: the worker stores the blocks, its events reach the index
                self.prefills.prefilled(self.index, rid)
                self.blocks[rid] = self.pools[wid].store(self.blocks[rid], hashes, self.hints.pop(rid))
        if t != float("inf"):
            self._advance(t)

    def _advance(self, t: float) -> None:
        for wid, n in self.in_flight.items():
            self.area[wid] += n * (t - self.now)
        self.now = t

    def _arrive(self, rid: str, route: RouteRequest) -> None:
        cfg = self.cfg
        ids = [w.worker_id for w in self.workers]
        self.prefills.expire(self.index)
        pools = self.pools
        state = RoutingState({w: WorkerLoad(self.in_flight[w], pools[w].pool.num_free_blocks, cfg.cache_blocks,
                                            pools[w].pool.num_reused_blocks, self.index.shared_blocks(w)) for w in ids},
                             {WorkerId(k): v for k, v in self.index.match_prefix(route.block_hashes, ids).items()},
                             self.prefills.queued_tokens(self.index, ids, route), cfg.block_size,
                             self.prefills.mean_in_flight(ids),
                             cluster_committed=cluster_fill(self.index, cfg.cache_blocks * len(ids)))
        chosen = self.policy.pick(self.workers, route, state)
        assert chosen is not None
        wid = chosen.worker_id
        # What the worker will find when its FIFO queue reaches this request: what it stores
        # now plus what the requests ahead of it are computing.
        self.blocks[rid] = held = self.pools[wid].pin(route.block_hashes)
        cached = max(len(held), self.index.match_prefix(route.block_hashes, [wid])[wid])
        self.hit += cached
        self.cold += cached < self.cfg.system_blocks
        self.total += len(route.block_hashes)
        self.hints[rid] = self.index.shared_prefix(route.block_hashes) if cfg.prefix_hint else 0
        self.prefills.dispatched(self.index, rid, wid, route, cached * cfg.block_size)
        start = max(self.now, self.free_at[wid])
        self.free_at[wid] = done = start + (len(route.token_ids) - cached * cfg.block_size) / cfg.prefill_tokens_per_s
        self.ttfts.append(done - self.now)
        self.in_flight[wid] += 1
        heapq.heappush(self.events, (done, next(self._seq), "prefilled", rid, wid, route.block_hashes))
        heapq.heappush(self.events, (done + self.rng.expovariate(1.0), next(self._seq), "departed", rid, wid, ()))


def oracle_hit_rate(cfg: SimConfig, trace: list[RouteRequest]) -> float:
    pool = WorkerPool(WorkerId("oracle"), cfg.cache_blocks * cfg.num_workers, None, cfg.protect_turnovers,
                      cfg.fade_steps)
    hit = total = 0
    for route in trace:
        held = pool.pin(route.block_hashes)
        hit += len(held)
        total += len(route.block_hashes)
        pool.release(pool.store(held, route.block_hashes))
    return hit / total

"""Trace-driven simulation of the routing policies (the first half of `kvmesh bench router`).

A multi-tenant trace: `num_prompts` system prompts with Zipf popularity, each request a
system prompt plus a unique user suffix, Poisson arrivals, exponential service times.
Each worker keeps an LRU cache of `cache_blocks` blocks; the policies under test are the
real ones from router.policy, fed the exact per-worker prefix matches an up-to-date block
index would give and the router's in-flight counts. The oracle is one LRU cache of the
combined size that sees every request.
"""
from __future__ import annotations

import heapq
import random
from collections import OrderedDict
from dataclasses import dataclass

from kvstore.keys import BlockHash, block_hashes
from router.policy import make_policy
from router.routing import RouteRequest, RoutingPolicy, RoutingState, WorkerId, WorkerInfo, WorkerLoad

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
    load_factor: float = 1.25
    seed: int = 0


@dataclass(frozen=True, slots=True)
class SimResult:
    hit_rate: float                  # cached prompt blocks / prompt blocks
    imbalance: float                 # max / mean of time-averaged in-flight per worker


class LRUCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[BlockHash, None] = OrderedDict()

    def match(self, hashes: tuple[BlockHash, ...]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def insert(self, hashes: tuple[BlockHash, ...]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


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
    rng = random.Random(cfg.seed + 1)
    workers = [WorkerInfo(WorkerId(f"w{i}"), f"sim:{i}") for i in range(cfg.num_workers)]
    caches = {w.worker_id: LRUCache(cfg.cache_blocks) for w in workers}
    policy = make_policy(policy_name, cfg.load_factor)
    in_flight = {w.worker_id: 0 for w in workers}
    area = {w.worker_id: 0.0 for w in workers}     # ∫ in_flight dt
    departures: list[tuple[float, WorkerId]] = []
    service = 1.0
    rate = cfg.mean_in_flight * cfg.num_workers / service
    now = hit = total = 0.0

    def advance(t: float) -> None:
        nonlocal now
        for wid, n in in_flight.items():
            area[wid] += n * (t - now)
        now = t

    t = 0.0
    for route in trace:
        t += rng.expovariate(rate)
        while departures and departures[0][0] <= t:
            when, wid = heapq.heappop(departures)
            advance(when)
            in_flight[wid] -= 1
        advance(t)
        state = RoutingState({wid: WorkerLoad(n, cfg.cache_blocks, cfg.cache_blocks) for wid, n in in_flight.items()},
                             {wid: c.match(route.block_hashes) for wid, c in caches.items()})
        chosen = policy.pick(workers, route, state)
        assert chosen is not None
        wid = chosen.worker_id
        hit += caches[wid].match(route.block_hashes)
        total += len(route.block_hashes)
        caches[wid].insert(route.block_hashes)
        in_flight[wid] += 1
        heapq.heappush(departures, (t + rng.expovariate(1.0 / service), wid))
    averages = [a / now for a in area.values()]
    mean = sum(averages) / len(averages)
    return SimResult(hit / total, max(averages) / mean if mean else 1.0)


def oracle_hit_rate(cfg: SimConfig, trace: list[RouteRequest]) -> float:
    cache = LRUCache(cfg.cache_blocks * cfg.num_workers)
    hit = total = 0
    for route in trace:
        hit += cache.match(route.block_hashes)
        total += len(route.block_hashes)
        cache.insert(route.block_hashes)
    return hit / total

"""The parts routing policies are made of (llm-d style): scorers returning a score in [0, 1]
per worker, and the bounded-load filter. Each reads only the `RoutingState` it is given;
missing data scores 0 and never raises.

- `InverseLoadScorer`  1 / (1 + in_flight): fewest in-flight requests scores highest.
- `RingScorer`         position on a consistent-hash ring keyed by the first K prompt blocks:
                       the first worker clockwise from the key scores 1, the last ~0.
- `RotationScorer`     a rotating order over worker ids (round robin; spreads ties).
- `PrefillCostScorer`  holder-first placement: 1 − cost / max cost, cost the prompt tokens a
                       request must prefill (or fetch from a peer, at a fraction) on the worker
                       plus the prefill queued there plus κ per running request plus κ̄ per
                       request of sustained load plus the shared prefixes it would displace
                       (see the class).
- `BoundedLoadFilter`  consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam
                       2018): keeps workers under ceil(c × (m + 1) / n) in-flight requests
                       (the prefix's holders, optionally, under h × that).
"""
from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.routing.types import RouteRequest, RoutingState, WorkerId, WorkerInfo


def route_key(request: RouteRequest, num_prefix_blocks: int) -> int:
    """A 64-bit key for the first `num_prefix_blocks` blocks (chained: the K-th covers all);
    a prompt shorter than one block is keyed by its token ids."""
    if request.block_hashes:
        last = request.block_hashes[min(num_prefix_blocks, len(request.block_hashes)) - 1]
        data = b"B" + last.to_bytes(16, "big")
    else:
        ids = request.token_ids
        data = b"T" + struct.pack(f"<{len(ids)}I", *ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def load_cap(total_in_flight: int, num_workers: int, load_factor: float) -> int:
    """Bounded-load capacity for the next request: ceil(c × (m + 1) / n), m already in flight."""
    return max(1, math.ceil(load_factor * (total_in_flight + 1) / max(1, num_workers)))


def _pool_cap(pool: Sequence[WorkerInfo], state: RoutingState, load_factor: float) -> int:
    return load_cap(sum(state.load(w.worker_id).in_flight for w in pool), len(pool), load_factor)


def fair_share(pool: Sequence[WorkerInfo], state: RoutingState) -> float:
    """A worker's share of the pool's sustained load plus one request: (Σ mean_in_flight + 1) / n,
    the bounded-load cap's form at c = 1 — so an idle pool (everything under one request)
    has no sustained excess anywhere, and a loaded one balances to its average."""
    return (sum(max(0.0, state.mean_in_flight.get(w.worker_id, 0.0)) for w in pool) + 1.0) / max(1, len(pool))


DEFAULT_LOAD_FACTOR = 1.25   # c of the bounded-load filter: `--load-factor`, RouterConfig, the simulator


def check_load_factor(load_factor: float) -> None:
    """ValueError naming `load_factor` unless it is >= 1 (below 1 no worker may be under the cap)."""
    if not load_factor >= 1.0:
        raise ValueError(f"load_factor={load_factor!r} must be >= 1 ({DEFAULT_LOAD_FACTOR} is the default)")


_VNODES: dict[tuple[WorkerId, int], list[int]] = {}


def vnode_points(worker_id: WorkerId, vnodes: int) -> list[int]:
    """`worker_id`'s points on a ring of `vnodes` points per worker, ascending (memoized: they
    depend on nothing else)."""
    key = (worker_id, vnodes)
    points = _VNODES.get(key)
    if points is None:
        if len(_VNODES) >= 1 << 16:       # worker ids come and go: keep the memo bounded
            _VNODES.clear()
        points = _VNODES[key] = sorted(
            int.from_bytes(hashlib.blake2b(f"{worker_id}#{v}".encode(), digest_size=8).digest(), "big")
            for v in range(vnodes))
    return points


class HashRing:
    """Consistent-hash ring with `vnodes` points per worker; rebuilt when the worker set changes."""

    def __init__(self, vnodes: int = 64) -> None:
        self.vnodes = vnodes
        self._ids: tuple[WorkerId, ...] = ()
        self._points: list[int] = []
        self._owners: list[WorkerId] = []

    def walk(self, workers: Sequence[WorkerInfo], key: int) -> list[WorkerId]:
        """Distinct workers in clockwise order from `key`."""
        ids = tuple(sorted(w.worker_id for w in workers))
        if ids != self._ids:
            self._build(ids)
        if not self._points:
            return []
        start = bisect.bisect_left(self._points, key)
        order: list[WorkerId] = []
        seen: set[WorkerId] = set()
        n = len(self._points)
        for i in range(n):
            owner = self._owners[(start + i) % n]
            if owner not in seen:
                seen.add(owner)
                order.append(owner)
                if len(order) == len(ids):
                    break
        return order

    def _build(self, ids: tuple[WorkerId, ...]) -> None:
        points = sorted((p, wid) for wid in ids for p in vnode_points(wid, self.vnodes))
        self._ids = ids
        self._points = [p for p, _ in points]
        self._owners = [w for _, w in points]


@dataclass(frozen=True, slots=True)
class InverseLoadScorer:
    """1 / (1 + in_flight): strictly decreasing in the router's in-flight count, no cap."""

    def score(self, pool: Sequence[WorkerInfo], request: RouteRequest, state: RoutingState) -> dict[WorkerId, float]:
        return {w.worker_id: 1.0 / (1 + max(0, state.load(w.worker_id).in_flight)) for w in pool}


@dataclass(slots=True)
class RingScorer:
    """1 − position / n on the hash ring walked from the key of the first
    `num_prefix_blocks` blocks: the same prompt prefix ranks the workers the same way."""

    num_prefix_blocks: int = 4
    ring: HashRing = field(default_factory=HashRing)

    def __post_init__(self) -> None:
        if self.num_prefix_blocks <= 0:
            raise ValueError(f"num_prefix_blocks={self.num_prefix_blocks!r} must be positive")

    def order(self, pool: Sequence[WorkerInfo], request: RouteRequest) -> list[WorkerId]:
        return self.ring.walk(pool, route_key(request, self.num_prefix_blocks))

    def score(self, pool: Sequence[WorkerInfo], request: RouteRequest, state: RoutingState) -> dict[WorkerId, float]:
        order = self.order(pool, request)
        return {wid: 1.0 - i / len(order) for i, wid in enumerate(order)}


@dataclass(slots=True)
class RotationScorer:
    """Workers sorted by id, rotated one step per call: the turn's worker scores 1, the next
    (n−1)/n, … (mutates its counter: call it once per pick)."""

    _turns: itertools.count = field(default_factory=itertools.count)

    def score(self, pool: Sequence[WorkerInfo], request: RouteRequest, state: RoutingState) -> dict[WorkerId, float]:
        ids = sorted(w.worker_id for w in pool)
        if not ids:
            return {}
        turn = next(self._turns)
        n = len(ids)
        return {wid: 1.0 - ((i - turn) % n) / n for i, wid in enumerate(ids)}


MAX_DISPLACE = 0.9   # p's cap in PrefillCostScorer: the cascade p / (1 − p) stays finite (9)


def _cascade(p: float) -> float:
    """u = p / (1 − p), p capped at 0.9: each displaced block is recomputed later, displacing
    another with the same chance (p + p² + …)."""
    p = min(MAX_DISPLACE, max(0.0, p))
    return p / (1.0 - p)


def cascade_past(committed: float, room: float) -> float:
    """The cascade at the chance p = the committed fraction past `room`, rising linearly to 1."""
    return _cascade(max(0.0, committed - room) / (1.0 - room))


@dataclass(frozen=True, slots=True)
class PrefillCostScorer:
    """Holder-first placement. The work, in prompt tokens, the request adds to a
    worker and waits behind there:

        cost(w) = β × (L − bs × (cached(w) + fetched(w)) + φ × bs × fetched(w)
                       + u(w) × (L − bs × (cached(w) + copies(w))) + u'(w) × bs × copies(w)
                       + ψ(w) × bs × disk(w))
                  + γ × queued(w) + κ × in_flight(w) + κ̄ × excess(w)

    L the prompt's tokens; cached(w) the leading blocks w holds or is computing (pending), of
    which disk(w) it holds in its disk tier only, priced at ψ(w) = `WorkerLoad.disk_read_cost`
    of their prefill (the worker's measured read time of a block over its compute time; 0 while
    unmeasured, as a device or host hit);
    fetched(w) the further leading blocks a peer has stored, which w would fetch (peer transfer)
    at φ = `fetch_cost_ratio` of their prefill; u(w) the recompute each new block placed there
    (computed or fetched) causes by displacing shared prefix blocks: with p the chance that it
    displaces one — 0 while shared prefixes fill at most `room_frac` of w's pool
    (`WorkerLoad.committed`: the router index's expected shared blocks on it, whose evidence
    fades with the traffic that passes them by, router/index/asks.py, so cold prefixes count as
    room), rising linearly to 1 when they
    fill all of it (so a roomy pool's small differences never outweigh prefix affinity), capped
    at 0.9 — a later request recomputes the displaced block, which displaces another with the
    same chance: u = p + p² + … = p / (1 − p); copies(w) the blocks beyond cached(w) that
    another worker holds or computes (w would hold a second copy), at u'(w), the larger of w's
    u and the cascade with p the cluster's `RoutingState.cluster_committed` (the fraction of all
    the workers' pools the prompts' blocks fill with one copy each, at their fading weight,
    router/index/asks.py `cluster_fill`) past `copy_room_frac` (0.2, w's own room): a replica
    takes space some prefix's only copy will need once the cluster fills, even while w itself
    still has room, where a new prefix must go somewhere anyway and costs only w's own u; in a
    cluster its prompts fill at most a fifth of, a copy costs its fetch alone. Priced from 0
    there, a copy cost as much as several running requests in `kvmesh bench routing-live`'s
    default no-pressure run (large pools, R small): a hot prefix stayed on its one busy holder
    while the other worker ran fewer, and its warm requests shared their prefill steps
    (docs/routing.md). Under pressure R passes the room with the first prefills, and R,
    counted as the expected shared blocks instead, once ran behind the pools (a prefix asked
    once so far counts there at its depth's reuse rate: a replica priced at u' = 0.07 with the
    pools ~60% full took their last slack); queued(w) the prompt
    tokens requests sent to w that have not started streaming will compute there (less their
    cached blocks and those a peer hint fetches), less those computing this prompt's own prefix
    (they are the prefill it saves), weighted γ = `queue_weight` because a request sent where
    prefills are queued shares their step: it waits for them and they for it (in a closed loop
    the least loaded worker is the one whose requests just finished together, and all their
    successors would otherwise prefill there in one step); κ = `running_cost_tokens`, what one
    running request costs a new one (it shares every step); β = `prefill_weight`: a prefill
    counts once as this request's wait and once more as the worker time it takes from every
    request queued behind it. κ̄ =
    `sustained_cost_tokens` prices the worker's sustained load above its fair share (in-flight
    averaged over the last `load_window_s`, router/routing/inflight.py): routing to a holder is a
    decision for all the prefix's later requests too, so a worker that has carried more load
    than another for a while loses its prefixes' new traffic once κ̄ × the difference exceeds β
    × the prefill saved — that is when a prefix is replicated (load-demanded), by a peer fetch
    where a peer has it stored, while a momentary burst (κ, queued) rarely outweighs the saving.
    Through u, under cache pressure a new prefix goes where its blocks displace the fewest
    shared ones, and a replica costs the recompute of what it displaces, while in a roomy cluster
    a replica costs little more than its fetch. Score 1 − cost(w) / max cost over the pool: the worker holding
    the prefix wins unless its queue and load exceed β × the prefill it saves; equal costs tie."""

    running_cost_tokens: float = 16.0
    prefill_weight: float = 2.0
    sustained_cost_tokens: float = 8192.0
    fetch_cost_ratio: float = 0.03
    queue_weight: float = 2.0
    room_frac: float = 0.2
    sustained_tolerance: float = 0.1
    copy_room_frac: float = 0.2
    tolerance_exponent: float = 0.25

    def __post_init__(self) -> None:
        for name in ("running_cost_tokens", "sustained_cost_tokens", "queue_weight"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0")
        if not self.prefill_weight >= 1.0:
            raise ValueError(f"prefill_weight={self.prefill_weight!r} must be >= 1")
        if not 0.0 <= self.fetch_cost_ratio <= 1.0:
            raise ValueError(f"fetch_cost_ratio={self.fetch_cost_ratio!r} must be in [0, 1]")
        if not self.sustained_tolerance >= 0.0:
            raise ValueError(f"sustained_tolerance={self.sustained_tolerance!r} must be >= 0")
        if not self.tolerance_exponent >= 0.0:
            raise ValueError(f"tolerance_exponent={self.tolerance_exponent!r} must be >= 0")
        for name in ("room_frac", "copy_room_frac"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be in [0, 1)")

    def tolerance(self, pool_size: int) -> float:
        """The sustained load a worker carries above its fair share, as a fraction of it, before
        κ̄ prices it: `sustained_tolerance` in a pool of 2, × (2 / n)^`tolerance_exponent` in a
        pool of n > 2. The fleet's imbalance is its most loaded worker's, the largest of n, so the
        slack each worker keeps shrinks as n grows; 2 workers (where the live benches measured
        the tolerance) keep it whole. Measured: `kvmesh.bench.routing_sweeps.sweep_balance`."""
        return self.sustained_tolerance * min(1.0, (2.0 / max(1, pool_size)) ** self.tolerance_exponent)

    def cost(self, worker_id: WorkerId, request: RouteRequest, state: RoutingState, fair_share: float = 0.0,
             most_cached: int | None = None, pool_size: int = 2) -> float:
        """The cost on `worker_id`; its sustained load counts above `fair_share` × (1 +
        `tolerance(pool_size)`) only. `most_cached`: the largest of `state.cached_blocks` (None:
        taken here; `score` takes it once for the pool, so a pick stays linear in the workers)."""
        bs, total = state.block_size, len(request.token_ids)
        own = max(0, state.cached_blocks.get(worker_id, 0))
        cached = min(total, bs * own)
        fetched = min(total - cached, bs * max(0, state.fetchable_blocks.get(worker_id, 0)))
        excess = max(0.0, state.mean_in_flight.get(worker_id, 0.0) - fair_share * (1.0 + self.tolerance(pool_size)))
        queued = max(0, state.queued_tokens.get(worker_id, 0))
        load = state.load(worker_id)
        # blocks another worker holds or computes: placed here they are a second copy
        if most_cached is None:
            most_cached = max(state.cached_blocks.values(), default=0)
        copies = min(total - cached, bs * max(0, most_cached - own))
        displaced = cascade_past(load.committed, self.room_frac)
        on_disk = min(cached, bs * max(0, state.disk_blocks.get(worker_id, 0)))
        return (self.prefill_weight * (total - cached - fetched + self.fetch_cost_ratio * fetched
                                       + displaced * (total - cached - copies)
                                       + max(displaced, cascade_past(state.cluster_committed, self.copy_room_frac))
                                       * copies + load.disk_read_cost * on_disk)
                + self.queue_weight * queued + self.running_cost_tokens * max(0, load.in_flight)
                + self.sustained_cost_tokens * excess)

    def score(self, pool: Sequence[WorkerInfo], request: RouteRequest, state: RoutingState) -> dict[WorkerId, float]:
        share = fair_share(pool, state)
        most = max(state.cached_blocks.values(), default=0)
        costs = {w.worker_id: self.cost(w.worker_id, request, state, share, most, len(pool)) for w in pool}
        top = max(costs.values(), default=0.0)
        return {wid: 1.0 - c / top if top > 0 else 1.0 for wid, c in costs.items()}


@dataclass(frozen=True, slots=True)
class BoundedLoadFilter:
    """Keeps workers with fewer in-flight requests than the pool's bounded-load cap; when none
    is under it (cannot happen for c ≥ 1 with exact counts), keeps the whole pool.

    `holder_factor` h ≥ 1 lets the workers holding the longest cached prefix of the prompt
    (held or pending, the most leading blocks of any worker, at least one) keep requests up
    to h × the cap: a burst then waits on the holder instead of replicating its prefix on
    another worker, which in a full cache evicts someone else's prefix. Placing a prefix on a
    worker (every other case) stays under the cap itself."""

    load_factor: float = DEFAULT_LOAD_FACTOR
    holder_factor: float = 1.0

    def __post_init__(self) -> None:
        check_load_factor(self.load_factor)
        if not self.holder_factor >= 1.0:
            raise ValueError(f"holder_factor={self.holder_factor!r} must be >= 1")

    def keep(self, pool: Sequence[WorkerInfo], request: RouteRequest, state: RoutingState) -> list[WorkerInfo]:
        cap = _pool_cap(pool, state, self.load_factor)
        best = max((state.cached_blocks.get(w.worker_id, 0) for w in pool), default=0)
        holder_cap = self.holder_factor * cap if best > 0 else cap
        return [w for w in pool
                if state.load(w.worker_id).in_flight < (holder_cap if state.cached_blocks.get(w.worker_id, 0) == best
                                                       else cap)] or list(pool)

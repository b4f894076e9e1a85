"""Which worker serves a request: filter → score → pick (in the spirit of llm-d's scorers).

Policies see plain data — the live workers, their load as the router counts it, and how
many leading prompt blocks each one holds (from the block index) — never gRPC. Scores are
floats in [0, 1]; missing data scores 0 and never raises.

- `round_robin`   the baseline.
- `least_loaded`  fewest in-flight requests (router-side count, exact and instant).
- `prefix_hash`   consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam
                  2018) on the hash of the first K prompt blocks: no worker takes more than
                  ceil(c × average) in-flight requests; overflow walks the ring. Needs no index.
- `kv_aware`      (default) cached-prefix score against load and free KV, among workers
                  under the same bounded-load cap; the ring order of `prefix_hash` breaks
                  ties, so equal scores never send a burst to one worker.
"""
from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import struct
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NewType, Protocol

from kvstore.keys import BlockHash

WorkerId = NewType("WorkerId", str)
ROUTING_POLICIES = ("kv_aware", "prefix_hash", "round_robin", "least_loaded")


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker the router may send to: its id (from the worker) and gRPC address."""

    worker_id: WorkerId
    address: str


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    in_flight: int = 0            # requests the router has open on it
    free_blocks: int = 0          # from the worker's last GetLoad
    num_blocks: int = 0


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What routing may look at: the prompt's token ids and the keys of its full blocks."""

    token_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class RoutingState:
    """Per-request view: load per worker and leading prompt blocks each worker holds."""

    loads: Mapping[WorkerId, WorkerLoad] = field(default_factory=dict)
    cached_blocks: Mapping[WorkerId, int] = field(default_factory=dict)


class BlockIndexView(Protocol):
    """What routing reads from the block index (router/index.py)."""

    def match_prefix(self, block_hashes: Sequence[BlockHash], workers: Sequence[str]) -> Mapping[str, int]: ...


class Policy(Protocol):
    name: str

    def pick(self, workers: Sequence[WorkerInfo], request: RouteRequest, state: RoutingState,
             exclude: Collection[WorkerId] = ()) -> WorkerInfo | None: ...


def route_key(request: RouteRequest, num_prefix_blocks: int) -> int:
    """A 64-bit key for the first `num_prefix_blocks` blocks (chained: the K-th covers all)."""
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
        points = sorted((int.from_bytes(hashlib.blake2b(f"{wid}#{v}".encode(), digest_size=8).digest(), "big"), wid)
                        for wid in ids for v in range(self.vnodes))
        self._ids = ids
        self._points = [p for p, _ in points]
        self._owners = [w for _, w in points]


def _candidates(workers: Sequence[WorkerInfo], exclude: Collection[WorkerId]) -> list[WorkerInfo]:
    return [w for w in workers if w.worker_id not in exclude]


@dataclass
class RoundRobinPolicy:
    name: str = "round_robin"
    _counter: itertools.count = field(default_factory=itertools.count)

    def pick(self, workers: Sequence[WorkerInfo], request: RouteRequest, state: RoutingState,
             exclude: Collection[WorkerId] = ()) -> WorkerInfo | None:
        cands = sorted(_candidates(workers, exclude), key=lambda w: w.worker_id)
        return cands[next(self._counter) % len(cands)] if cands else None


@dataclass
class LeastLoadedPolicy:
    name: str = "least_loaded"
    _counter: itertools.count = field(default_factory=itertools.count)

    def pick(self, workers: Sequence[WorkerInfo], request: RouteRequest, state: RoutingState,
             exclude: Collection[WorkerId] = ()) -> WorkerInfo | None:
        cands = sorted(_candidates(workers, exclude), key=lambda w: w.worker_id)
        if not cands:
            return None
        # Rotate the tie order so equal loads spread instead of always picking the first id.
        turn = next(self._counter)
        return min(cands, key=lambda w: (state.loads.get(w.worker_id, WorkerLoad()).in_flight,
                                         (cands.index(w) - turn) % len(cands)))


@dataclass
class PrefixHashPolicy:
    """Bounded-load consistent hashing on the first `num_prefix_blocks` prompt blocks."""

    load_factor: float = 1.25
    num_prefix_blocks: int = 4
    name: str = "prefix_hash"
    ring: HashRing = field(default_factory=HashRing)

    def __post_init__(self) -> None:
        if not self.load_factor >= 1.0:
            raise ValueError(f"load_factor={self.load_factor} must be >= 1")
        if self.num_prefix_blocks <= 0:
            raise ValueError(f"num_prefix_blocks={self.num_prefix_blocks} must be positive")

    def order(self, workers: Sequence[WorkerInfo], request: RouteRequest) -> list[WorkerId]:
        return self.ring.walk(workers, route_key(request, self.num_prefix_blocks))

    def pick(self, workers: Sequence[WorkerInfo], request: RouteRequest, state: RoutingState,
             exclude: Collection[WorkerId] = ()) -> WorkerInfo | None:
        cands = _candidates(workers, exclude)
        if not cands:
            return None
        by_id = {w.worker_id: w for w in cands}
        in_flight = {wid: state.loads.get(wid, WorkerLoad()).in_flight for wid in by_id}
        cap = load_cap(sum(in_flight.values()), len(by_id), self.load_factor)
        order = self.order(cands, request)
        for wid in order:
            if in_flight[wid] < cap:
                return by_id[wid]
        return by_id[order[0]]


@dataclass
class KVAwarePolicy:
    """Score = w_prefix·(cached leading blocks / prompt blocks) + w_load·(1 − in_flight/cap)
    + w_kv·min(1, free fraction / low_kv_frac), over workers under the bounded-load cap; the
    ring order of prefix_hash breaks ties (so a cold index keeps prefix affinity)."""

    load_factor: float = 1.25
    w_prefix: float = 1.0
    w_load: float = 0.3
    w_kv: float = 0.1
    low_kv_frac: float = 0.1
    name: str = "kv_aware"
    tiebreak: PrefixHashPolicy = field(default_factory=PrefixHashPolicy)

    def __post_init__(self) -> None:
        if not self.load_factor >= 1.0:
            raise ValueError(f"load_factor={self.load_factor} must be >= 1")
        self.tiebreak = PrefixHashPolicy(load_factor=self.load_factor)

    def pick(self, workers: Sequence[WorkerInfo], request: RouteRequest, state: RoutingState,
             exclude: Collection[WorkerId] = ()) -> WorkerInfo | None:
        cands = _candidates(workers, exclude)
        if not cands:
            return None
        loads = {w.worker_id: state.loads.get(w.worker_id, WorkerLoad()) for w in cands}
        cap = load_cap(sum(ld.in_flight for ld in loads.values()), len(cands), self.load_factor)
        under = [w for w in cands if loads[w.worker_id].in_flight < cap] or cands
        rank = {wid: i for i, wid in enumerate(self.tiebreak.order(cands, request))}
        n_blocks = max(1, len(request.block_hashes))

        def score(w: WorkerInfo) -> tuple[float, int]:
            ld = loads[w.worker_id]
            prefix = min(1.0, state.cached_blocks.get(w.worker_id, 0) / n_blocks)
            load = 1.0 - min(1.0, ld.in_flight / cap)
            # Free KV only counts when it runs low: small differences are noise from stale GetLoad.
            kv = min(1.0, ld.free_blocks / (self.low_kv_frac * ld.num_blocks)) if ld.num_blocks else 1.0
            # Round to keep float noise from beating the ring's tie-break.
            return (round(self.w_prefix * prefix + self.w_load * load + self.w_kv * kv, 9), -rank[w.worker_id])

        return max(under, key=score)


def make_policy(name: str, load_factor: float = 1.25) -> Policy:
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy()
    if name == "prefix_hash":
        return PrefixHashPolicy(load_factor=load_factor)
    if name == "kv_aware":
        return KVAwarePolicy(load_factor=load_factor)
    raise ValueError(f"routing_policy={name!r}; accepted: {', '.join(ROUTING_POLICIES)}")

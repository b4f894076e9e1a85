"""Which worker serves a request: filters → scorers in [0, 1] → a weighted pick (as the
llm-d scheduler does it). The parts live in router/routing/scorers.py; this module combines them
and names the combinations `--routing-policy` offers (`RoutingPolicy`, router/routing/types.py):

- `round_robin`   a rotation scorer alone: the baseline.
- `least_loaded`  fewest in-flight requests (router-side count, exact and instant); ties
                  rotate so equal loads spread.
- `prefix_hash`   the ring scorer on the first K prompt blocks behind the bounded-load filter:
                  no worker takes more than ceil(c × average) in-flight requests, overflow
                  walks the ring. Needs no index.
- `kv_aware`      (default) holder-first: the least prefill cost (`PrefillCostScorer`: prompt
                  tokens not cached or being computed there + the worker's queued prefill +
                  κ per running request + κ̄ per request of sustained load) behind the
                  bounded-load filter, which lets the prefix's holders go to 1.5x the cap
                  (`HOLDER_FACTOR`; a burst waits on the holder; sustained overload, priced by κ̄, is what
                  replicates a prefix); ring position breaks ties, so a cold index keeps
                  prefix affinity and equal scores never send a burst to one worker.

Policies see plain data (router/routing/types.py), never gRPC; missing data scores 0.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from router.routing.scorers import (
    DEFAULT_LOAD_FACTOR,
    BoundedLoadFilter,
    InverseLoadScorer,
    PrefillCostScorer,
    RingScorer,
    RotationScorer,
    check_load_factor,
)
from router.routing.types import Filter, RouteRequest, RoutingPolicy, RoutingState, Scorer, WorkerId, WorkerInfo

# Scores are rounded before comparing so float noise cannot beat the tie-break.
ROUND_DIGITS = 9
# kv_aware's holder allowance (BoundedLoadFilter.holder_factor). 2 (until 2026-12-07) let the
# holders of a hot prefix in a fleet of 8-16 carry the fleet's imbalance past 1.15; measured
# with `kvmesh.bench.routing_sweeps.sweep_balance` (docs/routing.md, "Balance at 8 and 16 workers").
HOLDER_FACTOR = 1.5


@dataclass(frozen=True, slots=True)
class Weighted:
    scorer: Scorer
    weight: float

    def __post_init__(self) -> None:
        if not self.weight >= 0.0:
            raise ValueError(f"weight={self.weight!r} must be >= 0")


@dataclass(frozen=True, slots=True)
class Policy:
    """Filters narrow the candidates, weighted scorers rank them, `tiebreak` (a scorer too)
    orders equal totals; the highest wins. Every scorer runs on the whole pool (the
    candidates not excluded), so pool-wide figures such as the load cap do not depend on
    what the filters dropped."""

    name: RoutingPolicy
    scorers: tuple[Weighted, ...]
    filters: tuple[Filter, ...] = ()
    tiebreak: Scorer | None = None

    def pick(self, workers: Sequence[WorkerInfo], request: RouteRequest, state: RoutingState,
             exclude: Collection[WorkerId] = ()) -> WorkerInfo | None:
        """The chosen worker among `workers` not in `exclude`; None when there is none."""
        pool = [w for w in workers if w.worker_id not in exclude]
        if not pool:
            return None
        eligible = pool
        for f in self.filters:
            eligible = f.keep(eligible, request, state) or eligible
        totals = dict.fromkeys((w.worker_id for w in pool), 0.0)
        for part in self.scorers:
            scores = part.scorer.score(pool, request, state)
            for wid in totals:
                totals[wid] += part.weight * scores.get(wid, 0.0)
        ties = self.tiebreak.score(pool, request, state) if self.tiebreak is not None else {}
        return max(eligible, key=lambda w: (round(totals[w.worker_id], ROUND_DIGITS), ties.get(w.worker_id, 0.0)))


def _round_robin(load_factor: float) -> Policy:
    return Policy(RoutingPolicy.ROUND_ROBIN, (Weighted(RotationScorer(), 1.0),))


def _least_loaded(load_factor: float) -> Policy:
    return Policy(RoutingPolicy.LEAST_LOADED, (Weighted(InverseLoadScorer(), 1.0),), tiebreak=RotationScorer())


def _prefix_hash(load_factor: float) -> Policy:
    return Policy(RoutingPolicy.PREFIX_HASH, (Weighted(RingScorer(), 1.0),), (BoundedLoadFilter(load_factor),))


def _kv_aware(load_factor: float) -> Policy:
    return Policy(RoutingPolicy.KV_AWARE, (Weighted(PrefillCostScorer(), 1.0),),
                  (BoundedLoadFilter(load_factor, holder_factor=HOLDER_FACTOR),), tiebreak=RingScorer())


POLICIES: dict[RoutingPolicy, Callable[[float], Policy]] = {
    RoutingPolicy.ROUND_ROBIN: _round_robin,
    RoutingPolicy.LEAST_LOADED: _least_loaded,
    RoutingPolicy.PREFIX_HASH: _prefix_hash,
    RoutingPolicy.KV_AWARE: _kv_aware,
}


def make_policy(name: RoutingPolicy | str, load_factor: float = DEFAULT_LOAD_FACTOR) -> Policy:
    """A fresh policy (its rotation and ring state are its own); raises ValueError for an
    unknown name or a load_factor below 1."""
    check_load_factor(load_factor)
    return POLICIES[RoutingPolicy.parse(name)](load_factor)

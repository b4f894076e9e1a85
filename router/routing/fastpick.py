"""The kv_aware pick in columns: the worker `Policy.pick` (router/routing/policy.py) chooses for the
kv_aware policy — bounded-load filter → prefill-cost scorer → ring tie-break — computed over
numpy arrays indexed by the pool's workers instead of dicts rebuilt per worker, so a decision
over 1,000 workers costs a few vectorized passes, not thousands of Python calls.

The reference stays `Policy.pick`; this is the same arithmetic, proved equal by
tests/router/test_fastpick.py (random states, the reference's pick every time):

- the cost of every worker is `PrefillCostScorer.cost`'s expression, term by term and in its
  order, on float64 arrays: IEEE additions, products and quotients round alike in numpy and in
  Python floats, so each cost is the very float the scorer computes;
- the scores are rounded to `ROUND_DIGITS` in Python (numpy's rounding differs) on the few
  workers within a rounding step of the best eligible score;
- equal rounded scores go to the worker first on the hash ring clockwise from the request's
  key (`RingScorer`'s order): a worker's first point from the key does not depend on the other
  workers of the ring, so only the tied workers' points are looked at (a bisection each), or,
  when many tie (a cold index, an idle pool), the ring of the pool walked in numpy.

`KvAwareFast.of(policy)` is None for any other policy (the caller uses `Policy.pick`). torch-free.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from router.routing.policy import ROUND_DIGITS, Policy
from router.routing.scorers import (
    MAX_DISPLACE as _MAX_DISPLACE,
    BoundedLoadFilter,
    PrefillCostScorer,
    RingScorer,
    cascade_past,
    load_cap,
    route_key,
    vnode_points,
)
from router.routing.types import RouteRequest, RoutingState, WorkerId, WorkerInfo

_MANY_TIED = 48     # more tied workers than this: walk the pool's ring in numpy
_WALK = 256         # ring points looked at first in that walk (then 4x as many each time)


def _cascade_past(committed: np.ndarray, room: float) -> np.ndarray:
    """scorers.cascade_past on an array, op for op."""
    p = np.maximum(0.0, committed - room) / (1.0 - room)
    p = np.minimum(_MAX_DISPLACE, np.maximum(0.0, p))
    return p / (1.0 - p)


class Columns(NamedTuple):
    """A pool's per-worker figures, aligned with `ids` (the pool's order): what `RoutingState`
    maps, as arrays — the raw values the scorers read, missing data as its default."""

    ids: Sequence[WorkerId]
    in_flight: np.ndarray       # int64: WorkerLoad.in_flight
    num_blocks: np.ndarray      # int64: WorkerLoad.num_blocks
    shared: np.ndarray          # float64: WorkerLoad.shared_blocks
    mean: np.ndarray            # float64: mean_in_flight
    queued: np.ndarray          # int64: queued_tokens
    cached: np.ndarray          # int64: cached_blocks
    fetchable: np.ndarray       # int64: fetchable_blocks
    disk: np.ndarray            # int64: disk_blocks
    disk_cost: np.ndarray       # float64: WorkerLoad.disk_read_cost (read only where disk > 0)

    @classmethod
    def from_state(cls, pool: Sequence[WorkerInfo], state: RoutingState) -> Columns:
        """The columns of `pool` as `state` gives them (a worker missing from a map: its default)."""
        ids = [w.worker_id for w in pool]
        loads = [state.load(w) for w in ids]
        n = len(ids)

        def ints(values: object) -> np.ndarray:
            return np.fromiter(values, dtype=np.int64, count=n)  # type: ignore[call-overload]

        return cls(ids, ints(ld.in_flight for ld in loads), ints(ld.num_blocks for ld in loads),
                   np.fromiter((ld.shared_blocks for ld in loads), dtype=float, count=n),
                   np.fromiter((state.mean_in_flight.get(w, 0.0) for w in ids), dtype=float, count=n),
                   ints(state.queued_tokens.get(w, 0) for w in ids), ints(state.cached_blocks.get(w, 0) for w in ids),
                   ints(state.fetchable_blocks.get(w, 0) for w in ids), ints(state.disk_blocks.get(w, 0) for w in ids),
                   np.fromiter((ld.disk_read_cost for ld in loads), dtype=float, count=n))

    def take(self, rows: np.ndarray) -> Columns:
        """The columns of the workers at `rows`, in that order."""
        return Columns([self.ids[i] for i in rows], *(a[rows] for a in self[1:]))


class KvAwareFast:
    """The pick of one kv_aware `Policy` over `Columns` (module docstring). Keeps the pool's
    ring (rebuilt when the pool changes), as the policy's `RingScorer` does."""

    def __init__(self, cost: PrefillCostScorer, weight: float, bounded: BoundedLoadFilter, ring: RingScorer) -> None:
        self.cost_scorer = cost
        self.weight = weight
        self.bounded = bounded
        self.ring = ring
        self._ring_ids: tuple[WorkerId, ...] | None = None
        self._ring_of: Sequence[WorkerId] | None = None     # the `ids` the ring was last asked for
        self._ring_points = np.zeros(0, dtype=np.uint64)
        self._ring_owners = np.zeros(0, dtype=np.intp)

    @classmethod
    def of(cls, policy: Policy) -> KvAwareFast | None:
        """The fast pick of `policy` when it has kv_aware's shape (one prefill-cost scorer, the
        bounded-load filter, the ring tie-break), else None."""
        if (len(policy.scorers) == 1 and type(policy.scorers[0].scorer) is PrefillCostScorer
                and len(policy.filters) == 1 and type(policy.filters[0]) is BoundedLoadFilter
                and type(policy.tiebreak) is RingScorer):
            return cls(policy.scorers[0].scorer, policy.scorers[0].weight, policy.filters[0], policy.tiebreak)
        return None

    def costs(self, cols: Columns, request: RouteRequest, block_size: int, most_cached: int,
              cluster_committed: float) -> np.ndarray:
        """`PrefillCostScorer.cost` of every worker of `cols` (the pool), as the scorer computes it."""
        sc = self.cost_scorer
        n = len(cols.ids)
        bs, total = block_size, len(request.token_ids)
        # fair_share: the pool's sustained load summed left to right, as Python's sum does
        clipped = np.maximum(0.0, cols.mean)
        share = ((float(np.cumsum(clipped)[-1]) if n else 0) + 1.0) / max(1, n)
        own = np.maximum(0, cols.cached)
        cached = np.minimum(total, bs * own)
        rest = total - cached
        fetched = np.minimum(rest, bs * np.maximum(0, cols.fetchable))
        excess = np.maximum(0.0, cols.mean - share * (1.0 + sc.tolerance(n)))
        queued = np.maximum(0, cols.queued)
        copies = np.minimum(rest, bs * np.maximum(0, most_cached - own))
        has_pool = cols.num_blocks > 0
        committed = np.where(has_pool, np.minimum(1.0, np.maximum(0.0, cols.shared)
                                                  / np.where(has_pool, cols.num_blocks, 1)), 0.0)
        displaced = _cascade_past(committed, sc.room_frac)
        cluster = cascade_past(cluster_committed, sc.copy_room_frac)
        on_disk = np.minimum(cached, bs * np.maximum(0, cols.disk))
        inner = ((rest - fetched) + sc.fetch_cost_ratio * fetched + displaced * (rest - copies)
                 + np.maximum(displaced, cluster) * copies + cols.disk_cost * on_disk)
        return (sc.prefill_weight * inner + sc.queue_weight * queued
                + sc.running_cost_tokens * np.maximum(0, cols.in_flight) + sc.sustained_cost_tokens * excess)

    def pick(self, cols: Columns, request: RouteRequest, block_size: int, most_cached: int,
             cluster_committed: float) -> int | None:
        """The position in `cols` of the worker `Policy.pick` chooses over the pool `cols`
        (None: an empty pool). `most_cached`: the largest of the state's `cached_blocks` (over
        every worker it maps, the pool's or not), 0 without any."""
        n = len(cols.ids)
        if n == 0:
            return None
        # the bounded-load filter
        b = self.bounded
        cap = load_cap(int(cols.in_flight.sum()), n, b.load_factor)
        best = int(cols.cached.max())
        holder_cap = b.holder_factor * cap if best > 0 else cap
        keep = cols.in_flight < np.where(cols.cached == best, holder_cap, cap)
        if not keep.any():
            keep[:] = True
        # the scorer, weighted
        cost = self.costs(cols, request, block_size, most_cached, cluster_committed)
        top = float(cost.max())
        score = 1.0 - cost / top if top > 0 else np.ones(n)
        total = 0.0 + self.weight * score
        # the best rounded score among the eligible, in Python's rounding
        best_total = float(total[keep].max())
        rounded = round(best_total, ROUND_DIGITS)
        near = np.flatnonzero(keep & (total >= best_total - 2.0 * 10.0 ** -ROUND_DIGITS))
        # rounded once per distinct score (an idle pool's workers share one)
        values, which = np.unique(total[near], return_inverse=True)
        hit = np.array([round(float(v), ROUND_DIGITS) == rounded for v in values.tolist()], dtype=bool)
        tied = near[hit[which.reshape(-1)]].tolist()
        if len(tied) == 1:
            return tied[0]
        return self._first_on_ring(cols.ids, tied, route_key(request, self.ring.num_prefix_blocks))

    def _first_on_ring(self, ids: Sequence[WorkerId], tied: list[int], key: int) -> int:
        """Of the workers at `tied`, the one the ring's walk from `key` meets first."""
        vnodes = self.ring.ring.vnodes
        if vnodes <= 0:             # an empty ring scores no one: the first eligible in pool order wins
            return tied[0]
        if len(tied) <= _MANY_TIED:
            def rank(i: int) -> tuple[int, int, WorkerId]:
                points = vnode_points(ids[i], vnodes)
                j = bisect.bisect_left(points, key)
                return (0, points[j], ids[i]) if j < len(points) else (1, points[0], ids[i])
            return min(tied, key=rank)
        points, owners = self._pool_ring(ids, vnodes)
        hit = np.zeros(len(ids), dtype=bool)
        hit[tied] = True
        # the walk from the key, a stretch of points at a time (with many tied the first
        # stretch holds one), wrapping round once
        start = int(np.searchsorted(points, np.uint64(key), side="left"))
        m, step, at = len(points), _WALK, start
        while at < start + m:
            stretch = owners[np.arange(at, min(at + step, start + m)) % m]
            found = np.flatnonzero(hit[stretch])
            if len(found):
                return int(stretch[found[0]])
            at, step = at + step, step * 4
        raise AssertionError("a tied worker has no point on the ring")

    def prepare(self, ids: Sequence[WorkerId]) -> None:
        """Build the ring of the pool `ids` now (the live pool, once per ready set), so that the
        first request whose scores tie widely does not pay for it (64 points a worker)."""
        if self.ring.ring.vnodes > 0:
            self._pool_ring(ids, self.ring.ring.vnodes)

    def _pool_ring(self, ids: Sequence[WorkerId], vnodes: int) -> tuple[np.ndarray, np.ndarray]:
        """The ring of `ids`: every point ascending (equal points by worker id, as `HashRing`
        sorts them) and the position in `ids` of its owner."""
        if ids is self._ring_of:     # the live columns' ids: one list per ready set, never changed in place
            return self._ring_points, self._ring_owners
        key = tuple(ids)
        self._ring_of = ids
        if key != self._ring_ids:
            n = len(ids)
            points = np.array([p for w in ids for p in vnode_points(w, vnodes)], dtype=np.uint64)
            owners = np.repeat(np.arange(n, dtype=np.intp), vnodes)
            rank = np.empty(n, dtype=np.intp)
            rank[sorted(range(n), key=ids.__getitem__)] = np.arange(n)
            order = np.lexsort((rank[owners], points))
            self._ring_ids, self._ring_points, self._ring_owners = key, points[order], owners[order]
        return self._ring_points, self._ring_owners

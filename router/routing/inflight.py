"""Requests the router has sent and that have not started streaming yet: what
the router knows of each worker's prefill queue, and the pending blocks it predicts in the
block index.

Owned by the router core (router/routing/core.py), which calls, per attempt on a worker:
`dispatched` (before the call: records the prompt's blocks as pending on the worker and its
uncached tokens as queued there), `wait_for_leaders` (holds a request whose prefix another
request is still computing on that worker until that one's prefill is done, so the worker
finds the prefix cached instead of computing it twice in one batch), `prefilled` (first
response: the blocks are stored, the pending entry only waits for its `BlockStored` event)
and `done` (the attempt ended: a request that never streamed drops its prediction; one that
did keeps it `settle_s` more — while it ran its blocks were in use on the worker, so they
could not be evicted, however late the events come when the machine is loaded). Between
`dispatched` and `done` an attempt counts in its worker's *sustained load*: the in-flight
attempts averaged over the last `load_window_s` (an exponentially weighted time average), the
long-run imbalance that the instantaneous count hides. The policy reads `queued_tokens` and
`mean_in_flight` through `RoutingState`. On the router's loop only; torch-free.

Router replicas (router/routing/replicas.py): a `listener` hears each of this router's own
attempts (`sent`, `prefilled`, `done`), and `joined` enters another router's attempt, which
then counts here as this router's own do (pending blocks, queue, sustained load, a leader to
wait for) until its `prefilled` and `done` come.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from router.index.blocks import BlockIndex
from router.routing.going import GoingPrefixes
from router.routing.types import RouteRequest, WorkerId


@dataclass(frozen=True, slots=True)
class InFlightConfig:
    pending_ttl_s: float = 60.0     # a prediction never confirmed nor settled goes after this
    settle_s: float = 5.0           # after the request ends, how long its BlockStored events may take
    max_wait_s: float = 30.0        # longest a request waits for another's prefill of its prefix
    load_window_s: float = 30.0     # time constant of the sustained (time-averaged) in-flight load

    def __post_init__(self) -> None:
        for name in ("pending_ttl_s", "settle_s", "max_wait_s"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0")
        if not self.load_window_s > 0.0:
            raise ValueError(f"load_window_s={self.load_window_s!r} must be > 0")


class _Queued(NamedTuple):
    worker_id: WorkerId
    tokens: int                     # prompt tokens the worker is predicted to compute
    started: asyncio.Event          # set at the first response, or when the attempt ends


class PrefillListener(Protocol):
    """Hears this router's own attempts (not those entered by `joined`)."""

    def sent(self, request_id: str, worker_id: WorkerId, route: RouteRequest, queued_tokens: int) -> None: ...

    def prefilled(self, request_id: str) -> None: ...

    def done(self, request_id: str, streamed: bool) -> None: ...


class InFlightPrefills:
    """See the module docstring. The `index` of every call is the router's block index (one
    that is not `fed` records no pending blocks: then only the queue is tracked)."""

    def __init__(self, cfg: InFlightConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg if cfg is not None else InFlightConfig()
        self._clock = clock
        self._queued: dict[str, _Queued] = {}
        self._queued_sum: dict[WorkerId, int] = {}  # per worker: the tokens of its `_queued` entries
        self._leaders: dict[str, set[str]] = {}     # request id → the requests computing its prefix
        self._attempts: dict[str, WorkerId] = {}    # request id → its worker, dispatched to done
        # per worker (a slot each, numbered as workers are first dispatched to): its attempts,
        # and their time average as of `_mean_at` (arrays: one vectorized step brings all to now)
        self._slots: dict[WorkerId, int] = {}
        self._running = np.zeros(16)
        self._mean = np.zeros(16)
        self._rows: tuple[tuple[WorkerId, ...], np.ndarray] = ((), np.zeros(0, dtype=np.intp))
        # each worker's position in `_rows`' key (None: a key naming a worker twice)
        self._row_at: dict[WorkerId, int] | None = {}
        self._mean_at = clock()
        self.waits = 0                              # requests held for another's prefill
        self.wait_s = 0.0
        self.listener: PrefillListener | None = None
        self._joined: set[str] = set()              # request ids of other routers' attempts
        self.going = GoingPrefixes(clock=clock)     # prefixes a worker is evicting (router/routing/going.py)

    def dispatched(self, index: BlockIndex, request_id: str, worker_id: WorkerId, route: RouteRequest,
                   predicted_tokens: int, resubmitted: bool = False) -> None:
        """`request_id` is about to be sent to `worker_id`, which is predicted to find
        `predicted_tokens` of its prompt cached (held or being computed, or fetched from a
        peer): it queues the rest for prefill. `resubmitted` for a retry or a migration of a
        request whose prompt the index has counted (`BlockIndex.add_pending`)."""
        self.done(index, request_id, streamed=False)
        self._count(worker_id, +1)
        self._attempts[request_id] = worker_id
        self.going.started(request_id, worker_id, route.block_hashes)
        self._leaders[request_id] = {r for r in index.computing(worker_id, route.block_hashes) if r in self._queued}
        index.add_pending(request_id, worker_id, route.block_hashes, self._clock() + self.cfg.pending_ttl_s,
                          resubmitted)
        queued = max(0, len(route.token_ids) - predicted_tokens)
        self._enqueue(request_id, _Queued(worker_id, queued, asyncio.Event()))
        if self.listener is not None:
            self.listener.sent(request_id, worker_id, route, queued)

    def joined(self, index: BlockIndex, request_id: str, worker_id: WorkerId, route: RouteRequest,
               queued_tokens: int) -> None:
        """Another router sent `request_id` (an id unique across routers) to `worker_id`, which
        computes `queued_tokens` of its prompt: counted as if this router had sent it."""
        self.done(index, request_id, streamed=False)
        self._joined.add(request_id)
        self._count(worker_id, +1)
        self._attempts[request_id] = worker_id
        self.going.started(request_id, worker_id, route.block_hashes)
        index.add_pending(request_id, worker_id, route.block_hashes, self._clock() + self.cfg.pending_ttl_s)
        self._enqueue(request_id, _Queued(worker_id, max(0, queued_tokens), asyncio.Event()))

    async def wait_for_leaders(self, request_id: str, timeout_s: float) -> None:
        """Until every request computing this one's prefix on its worker has started
        streaming (or ended), `max_wait_s` and `timeout_s` at most."""
        events = [q.started for r in self._leaders.get(request_id, ()) if (q := self._queued.get(r)) is not None
                  and not q.started.is_set()]
        if not events:
            return
        self.waits += 1
        t0 = self._clock()
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)),
                                   max(0.0, min(self.cfg.max_wait_s, timeout_s)))
        except asyncio.TimeoutError:
            pass   # the leader is slow: compute the prefix here rather than wait longer
        self.wait_s += self._clock() - t0

    def prefilled(self, index: BlockIndex, request_id: str) -> None:
        """The first response of `request_id` came: its prompt's blocks are on the worker (and
        stay there, in use, until it ends)."""
        q = self._dequeue(request_id)
        self._leaders.pop(request_id, None)
        if q is not None:
            q.started.set()
        if self.listener is not None and request_id not in self._joined:
            self.listener.prefilled(request_id)

    def done(self, index: BlockIndex, request_id: str, streamed: bool) -> None:
        """The attempt ended; one that never streamed (failed, aborted) drops its prediction,
        one that streamed keeps it `settle_s` more for its `BlockStored` events to arrive."""
        q = self._dequeue(request_id)
        self._leaders.pop(request_id, None)
        if q is not None:
            q.started.set()
        worker_id = self._attempts.pop(request_id, None)
        if worker_id is not None:
            self._count(worker_id, -1)
            if self.listener is not None and request_id not in self._joined:
                self.listener.done(request_id, streamed)
        self._joined.discard(request_id)
        self.going.ended(request_id, streamed)
        if streamed:
            index.settle_pending(request_id, self._clock() + self.cfg.settle_s)
        else:
            index.drop_pending(request_id)

    def going_less(self, cached: Mapping[WorkerId, int], route: RouteRequest) -> Mapping[WorkerId, int]:
        """`cached` (leading prompt blocks per worker) without the workers evicting the prompt's
        prefix (router/routing/going.py): the pick counts none of it there."""
        return self.going.less(cached, route.block_hashes)

    def expire(self, index: BlockIndex) -> None:
        """Drop the index's predictions that are past their expiry now."""
        index.expire_pending(self._clock())

    def _enqueue(self, request_id: str, q: _Queued) -> None:
        assert request_id not in self._queued, f"{request_id} is queued already"
        self._queued[request_id] = q
        self._queued_sum[q.worker_id] = self._queued_sum.get(q.worker_id, 0) + q.tokens

    def _dequeue(self, request_id: str) -> _Queued | None:
        q = self._queued.pop(request_id, None)
        if q is not None:
            left = self._queued_sum[q.worker_id] - q.tokens
            if left:
                self._queued_sum[q.worker_id] = left
            else:
                del self._queued_sum[q.worker_id]
        return q

    def queued_tokens(self, index: BlockIndex, workers: Iterable[WorkerId], route: RouteRequest) -> dict[WorkerId, int]:
        """Per worker: the prompt tokens queued for prefill there, less those of requests
        computing `route`'s own prefix there (waiting on them is the prefill it saves)."""
        base, less = self._queued_sum, self.queued_less(index, route)
        return {w: base.get(w, 0) - less.get(w, 0) for w in workers}

    def queued_base(self) -> dict[WorkerId, int]:
        """Per worker with any: the prompt tokens queued for prefill there (the prefill queue,
        kept as requests come and go; read-only)."""
        return self._queued_sum

    def queued_less(self, index: BlockIndex, route: RouteRequest) -> dict[WorkerId, int]:
        """What `queued_tokens` takes off `queued_base`, per worker where it is not 0: the
        tokens of the requests computing `route`'s own prefix there (sparse: the prompt's
        pending blocks name them)."""
        out: dict[WorkerId, int] = {}
        for w, rids in index.computing_any(route.block_hashes).items():
            for r in rids:
                leader = self._queued.get(r)
                if leader is not None and leader.worker_id == w:
                    out[w] = out.get(w, 0) + leader.tokens
        return out

    def mean_in_flight(self, workers: Iterable[WorkerId]) -> dict[WorkerId, float]:
        """Per worker: its attempts in flight averaged over time, each past moment weighted by
        exp(−age / `load_window_s`) (0 for a worker never dispatched to)."""
        workers = list(workers)
        return dict(zip(workers, self.mean_column(workers).tolist()))

    def mean_column(self, workers: Sequence[WorkerId]) -> np.ndarray:
        """`mean_in_flight` of `workers` as an array, in their order."""
        self._advance()
        key = tuple(workers)
        if key != self._rows[0]:
            self._rows = (key, np.array([self._slots.get(w, -1) for w in key], dtype=np.intp))
            row_at = {w: i for i, w in enumerate(key)}
            self._row_at = row_at if len(row_at) == len(key) else None
        rows = self._rows[1]
        out = self._mean[np.where(rows >= 0, rows, 0)]
        out[rows < 0] = 0.0
        return out

    def _count(self, worker_id: WorkerId, delta: int) -> None:
        self._advance()
        slot = self._slots.get(worker_id)
        if slot is None:
            slot = self._slots[worker_id] = len(self._slots)
            if self._row_at is None:
                self._rows = ((), self._rows[1])
            elif (at := self._row_at.get(worker_id)) is not None:    # its row in the last map, in place
                self._rows[1][at] = slot
            if slot == len(self._running):
                self._running = np.concatenate([self._running, np.zeros(slot)])
                self._mean = np.concatenate([self._mean, np.zeros(slot)])
        n = int(self._running[slot]) + delta
        assert n >= 0, f"{worker_id} would have {n} attempts in flight"
        self._running[slot] = n

    def _advance(self) -> None:
        """Bring every worker's average to now: the count held constant since the last change."""
        now = self._clock()
        dt = now - self._mean_at
        if dt <= 0.0:
            return
        keep = math.exp(-dt / self.cfg.load_window_s)
        n = self._running
        mean = n + (self._mean - n) * keep
        mean[(n == 0) & (mean < 1e-9)] = 0.0       # a worker long idle or gone: nothing left
        self._mean = mean
        self._mean_at = now

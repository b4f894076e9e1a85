"""Requests the router has sent and that have not started streaming yet (issue #23): what
the router knows of each worker's prefill queue, and the pending blocks it predicts in the
block index.

Owned by the router core (router/core.py), which calls, per attempt on a worker:
`dispatched` (before the call: records the prompt's blocks as pending on the worker and its
uncached tokens as queued there), `wait_for_leaders` (holds a request whose prefix another
request is still computing on that worker until that one's prefill is done, so the worker
finds the prefix cached instead of computing it twice in one batch), `prefilled` (first
response: the blocks are stored, the pending entry only waits for its `BlockStored` event)
and `done` (the attempt ended: a request that never streamed drops its prediction). The
policy reads `queued_tokens` through `RoutingState`. On the router's loop only; torch-free.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from router.index import BlockIndex
from router.routing import RouteRequest, WorkerId


@dataclass(frozen=True, slots=True)
class InFlightConfig:
    pending_ttl_s: float = 60.0     # a prediction never confirmed nor settled goes after this
    settle_s: float = 5.0           # after the prefill, how long the BlockStored event may take
    max_wait_s: float = 30.0        # longest a request waits for another's prefill of its prefix

    def __post_init__(self) -> None:
        for name in ("pending_ttl_s", "settle_s", "max_wait_s"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0")


class _Queued(NamedTuple):
    worker_id: WorkerId
    tokens: int                     # prompt tokens the worker is predicted to compute
    started: asyncio.Event          # set at the first response, or when the attempt ends


class InFlightPrefills:
    """See the module docstring. `index` arguments may be None or a view without pending
    support (then only the queue is tracked)."""

    def __init__(self, cfg: InFlightConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg if cfg is not None else InFlightConfig()
        self._clock = clock
        self._queued: dict[str, _Queued] = {}
        self._leaders: dict[str, set[str]] = {}     # request id → the requests computing its prefix
        self.waits = 0                              # requests held for another's prefill
        self.wait_s = 0.0

    def dispatched(self, index: object, request_id: str, worker_id: WorkerId, route: RouteRequest,
                   predicted_tokens: int) -> None:
        """`request_id` is about to be sent to `worker_id`, which is predicted to find
        `predicted_tokens` of its prompt cached (held or being computed)."""
        self.done(index, request_id, streamed=False)
        leaders: set[str] = set()
        if isinstance(index, BlockIndex):
            leaders = {r for r in index.computing(worker_id, route.block_hashes) if r in self._queued}
            index.add_pending(request_id, worker_id, route.block_hashes, self._clock() + self.cfg.pending_ttl_s)
        self._leaders[request_id] = leaders
        self._queued[request_id] = _Queued(worker_id, max(0, len(route.token_ids) - predicted_tokens),
                                           asyncio.Event())

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

    def prefilled(self, index: object, request_id: str) -> None:
        """The first response of `request_id` came: its prompt's blocks are on the worker."""
        q = self._queued.pop(request_id, None)
        self._leaders.pop(request_id, None)
        if q is not None:
            q.started.set()
        if isinstance(index, BlockIndex):
            index.settle_pending(request_id, self._clock() + self.cfg.settle_s)

    def done(self, index: object, request_id: str, streamed: bool) -> None:
        """The attempt ended; one that never streamed (failed, aborted) drops its prediction."""
        q = self._queued.pop(request_id, None)
        self._leaders.pop(request_id, None)
        if q is not None:
            q.started.set()
        if not streamed and isinstance(index, BlockIndex):
            index.drop_pending(request_id)

    def expire(self, index: object) -> None:
        if isinstance(index, BlockIndex):
            index.expire_pending(self._clock())

    def queued_tokens(self, index: object, workers: Iterable[WorkerId], route: RouteRequest) -> dict[WorkerId, int]:
        """Per worker: the prompt tokens queued for prefill there, less those of requests
        computing `route`'s own prefix there (waiting on them is the prefill it saves)."""
        out = dict.fromkeys(workers, 0)
        for q in self._queued.values():
            if q.worker_id in out:
                out[q.worker_id] += q.tokens
        if isinstance(index, BlockIndex):
            for w in out:
                for r in index.computing(w, route.block_hashes):
                    q = self._queued.get(r)
                    if q is not None and q.worker_id == w:
                        out[w] -= q.tokens
        return out

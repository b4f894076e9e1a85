"""Prefixes a worker is evicting: the part of the block index the pick must not count on.

A worker frees a finished request's blocks tail first (kvstore/pool.py `free_sequence`) and
evicts from the head of its free queue, so once the tail of a free prefix is evicted, the rest
of it is next: every allocation there (a step's admissions, running requests growing) takes
its next block. The index hears of each eviction one event later — milliseconds, or a CPU step
when the request queues behind the admissions of the next one — so a request sent to such a
worker for the head the index still lists finds less than it was promised (a hit mismatch: in
traces of `kvmesh bench routing-live --quick`, every mismatch was a prompt whose worker held
only the head of its prefix, the next block evicted within ms of the pick, or by an admission
ahead of it in the worker's queue).

`GoingPrefixes` tells such a worker apart from one that holds a shorter prefix for good: the
prompt's next block after the run the worker holds (`cached`) was in a prompt that ran on that
worker and ended within `window_s` (so the worker stored it, and it went since), and no request
running there now uses the last block of the run (blocks in use are not evicted). The pick then
counts none of the run on that worker (`less`): the request goes where the prediction holds, or,
sent there anyway, is promised nothing it may not find. A shorter prefix held for good (its
next block never sent there, or long ago: a system prompt whose users' documents came and
went) keeps its count.

Owned by `InFlightPrefills` (router/routing/inflight.py), which tells it each attempt's start
and end; on the router's loop only; torch-free. Memory: the running attempts' prompt blocks, and
(worker, block) stamps of the last `window_s` (at most `max_entries`).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvstore.keys import BlockHash
from router.routing.types import WorkerId


@dataclass(frozen=True, slots=True)
class GoingConfig:
    window_s: float = 10.0          # a block that ran on a worker this recently and went is being evicted
    max_entries: int = 1 << 16      # (worker, block) stamps kept at most

    def __post_init__(self) -> None:
        if not self.window_s >= 0.0:
            raise ValueError(f"window_s={self.window_s!r} must be >= 0")
        if self.max_entries < 1:
            raise ValueError(f"max_entries={self.max_entries!r} must be >= 1")


class GoingPrefixes:
    """See the module docstring."""

    def __init__(self, cfg: GoingConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg if cfg is not None else GoingConfig()
        self._clock = clock
        self._attempts: dict[str, tuple[WorkerId, Sequence[BlockHash]]] = {}
        self._in_use: dict[tuple[WorkerId, BlockHash], int] = {}
        self._ended: OrderedDict[tuple[WorkerId, BlockHash], float] = OrderedDict()   # oldest first
        self._ended_on: dict[BlockHash, dict[WorkerId, float]] = {}    # `_ended` by block, then worker
        self.discounted = 0          # picks that did not count a going prefix

    def started(self, request_id: str, worker_id: WorkerId, block_hashes: Sequence[BlockHash]) -> None:
        """An attempt of `request_id` on `worker_id` began: its prompt's blocks are in use there."""
        self.ended(request_id, streamed=False)
        self._attempts[request_id] = (worker_id, block_hashes)
        for h in block_hashes:
            key = (worker_id, h)
            self._in_use[key] = self._in_use.get(key, 0) + 1

    def ended(self, request_id: str, streamed: bool) -> None:
        """The attempt ended; one that `streamed` stored its prompt's blocks on its worker."""
        got = self._attempts.pop(request_id, None)
        if got is None:
            return
        worker_id, block_hashes = got
        now = self._clock()
        for h in block_hashes:
            key = (worker_id, h)
            n = self._in_use[key] - 1
            if n:
                self._in_use[key] = n
            else:
                del self._in_use[key]
            if streamed:
                self._ended[key] = now
                self._ended.move_to_end(key)
                self._ended_on.setdefault(h, {})[worker_id] = now
        self._prune(now)

    def less(self, cached: Mapping[WorkerId, int], block_hashes: Sequence[BlockHash]) -> Mapping[WorkerId, int]:
        """`cached` (leading prompt blocks per worker, zeros left out) without the workers
        evicting the prompt's prefix; `cached` itself when there is none. Looked up by the
        distinct counts (a popular prompt's hundreds of holders mostly share one): for each, the
        next block's recent ends — O(holders) in C, then O(those ends) in Python."""
        if not self._ended:
            return cached
        out: dict[WorkerId, int] | None = None
        now: float | None = None
        ended_on, n = self._ended_on, len(block_hashes)
        for k in set(cached.values()):
            if not 0 < k < n:
                continue
            ends = ended_on.get(block_hashes[k])
            if not ends:
                continue
            for w, at in ends.items():
                if cached.get(w) != k or (w, block_hashes[k - 1]) in self._in_use:
                    continue
                now = self._clock() if now is None else now
                if now - at > self.cfg.window_s:
                    continue
                if out is None:
                    out = dict(cached)
                del out[w]
                self.discounted += 1
        return cached if out is None else out

    def _prune(self, now: float) -> None:
        ended, horizon = self._ended, now - self.cfg.window_s
        while ended and (len(ended) > self.cfg.max_entries or next(iter(ended.values())) < horizon):
            (w, h), _ = ended.popitem(last=False)
            on = self._ended_on[h]
            del on[w]
            if not on:
                del self._ended_on[h]

    def check(self) -> None:
        """AssertionError unless the by-block map is `_ended` regrouped (a failure is a bug)."""
        regrouped: dict[BlockHash, dict[WorkerId, float]] = {}
        for (w, h), at in self._ended.items():
            regrouped.setdefault(h, {})[w] = at
        assert regrouped == self._ended_on, "the ends by block disagree with the ends"

"""The block index's pending blocks (router/index/blocks.py `BlockIndex`, which owns one
`PendingBlocks` and feeds it): per request sent to a worker and not yet settled, the blocks
of its prompt the worker will compute and store there, and the whole prompt it *asks* for
while it runs.

A request's blocks are pending when it is sent (`record`) unless the worker holds them or
another request computes them there; they are confirmed one by one by the worker's
`BlockStored` events (`confirm`), dropped when the request fails before its prefill or its
record expires (`drop`), and kept `settle`-long after it ends. A block a running request asks
for that goes from its worker — a `BlockRemoved` arrives (`lost`), or the request computing it
there is dropped — the request computes itself, so it becomes pending for it (one a correction
drops, the request stops asking for: the worker's events are in doubt then): a worker evicts
blocks when a step begins and reports it when the step ends, so a request sent in between is
told its prefix is held, finds part of it gone and stores it again (blocks in use by a running
request are not evicted, so a block that goes while the request runs went before it took its
blocks). Once settled a request asks for nothing more. Not thread-safe; torch-free.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Iterable, Sequence

from kvstore.events import WorkerId
from kvstore.keys import BlockHash
from router.index.check import Pending, check_pending


class PendingBlocks:
    """See the module docstring. `by_block`: block → worker → the requests computing it there
    (the index reads it; only this class writes it)."""

    def __init__(self) -> None:
        self.by_block: dict[BlockHash, dict[WorkerId, set[str]]] = {}
        # per block that 2+ workers compute, the requests of all of them (`by_block[h]`'s sets,
        # joined: a request is recorded on one worker), so `computing_any` is O(the prompt's
        # blocks and the requests computing them), not O(blocks × the workers computing each);
        # a block one worker computes (most) reads its one set, and costs no memory here
        self._rids: dict[BlockHash, set[str]] = {}
        self._requests: dict[str, Pending] = {}
        self._on: dict[WorkerId, int] = {}            # records per worker (none: no pending there)
        self._asking: dict[BlockHash, dict[WorkerId, set[str]]] = {}   # the running requests asking for it
        self._expiry: list[tuple[float, str]] = []    # (expires_at, request id), stale entries skipped

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def record(self, request_id: str, worker_id: WorkerId, hashes: tuple[BlockHash, ...],
               held: Collection[BlockHash], expires_at: float) -> None:
        """`request_id` (not recorded) was sent to `worker_id`, which holds `held`: the blocks
        of `hashes` it neither holds nor computes for another request are pending for it."""
        assert request_id not in self._requests, f"{request_id} is recorded already"
        todo = tuple(h for h in hashes if h not in held and worker_id not in self.by_block.get(h, {}))
        self._requests[request_id] = Pending(worker_id, todo, expires_at, hashes)
        self._on[worker_id] = self._on.get(worker_id, 0) + 1
        for h in todo:
            computing = self.by_block.setdefault(h, {})
            computing.setdefault(worker_id, set()).add(request_id)
            self._join(h, computing, (request_id,))
        for h in hashes:
            self._asking.setdefault(h, {}).setdefault(worker_id, set()).add(request_id)
        heapq.heappush(self._expiry, (expires_at, request_id))

    def settle(self, request_id: str, expires_at: float) -> None:
        """The request ended after its prefill: it asks for nothing more, and its unconfirmed
        blocks stay pending until `expires_at` at the latest."""
        p = self._requests.get(request_id)
        if p is None:
            return
        self._unask(request_id, p)
        p = self._requests[request_id] = p._replace(asking=())
        if expires_at < p.expires_at:
            self._requests[request_id] = p._replace(expires_at=expires_at)
            heapq.heappush(self._expiry, (expires_at, request_id))

    def drop(self, request_id: str) -> list[BlockHash]:
        """Forget `request_id`'s record; returns the blocks it made pending that now are pending
        nowhere (a running request asking for one on its worker takes it over)."""
        p = self._requests.pop(request_id, None)
        if p is None:
            return []
        self._unask(request_id, p)
        if self._on[p.worker_id] == 1:
            del self._on[p.worker_id]
        else:
            self._on[p.worker_id] -= 1
        gone: list[BlockHash] = []
        for h in p.hashes:
            computing = self.by_block.get(h)
            rids = computing.get(p.worker_id) if computing is not None else None
            if computing is None or rids is None:
                continue
            rids.discard(request_id)
            self._unlist(h, (request_id,))
            if not rids:
                del computing[p.worker_id]
                self._shrunk(h, computing)
                if not computing:
                    del self.by_block[h]
                self.lost(p.worker_id, h)
                if h not in self.by_block:
                    gone.append(h)
        return gone

    def lost(self, worker_id: WorkerId, h: BlockHash, evicted: bool = True) -> None:
        """`h` went from `worker_id` (neither held nor computed there now): the running requests
        there asking for it compute it, so it is pending for them — or, not `evicted` (dropped
        on a correction), they stop asking for it."""
        asking = self._asking.get(h)
        rids = asking.get(worker_id) if asking is not None else None
        if not rids:
            return
        if not evicted:
            for rid in list(rids):
                p = self._requests[rid]
                self._requests[rid] = p._replace(asking=tuple(a for a in p.asking if a != h))
            del self._asking[h][worker_id]
            if not self._asking[h]:
                del self._asking[h]
            return
        computing = self.by_block.setdefault(h, {})
        old = computing.get(worker_id)
        if old:
            self._unlist(h, old)
        computing[worker_id] = set(rids)
        self._join(h, computing, rids)
        for rid in rids:
            p = self._requests[rid]
            if h not in p.hashes:
                self._requests[rid] = p._replace(hashes=p.hashes + (h,))

    def confirm(self, worker_id: WorkerId, h: BlockHash) -> None:
        """`worker_id` stored `h`: no longer a prediction there."""
        computing = self.by_block.get(h)
        if computing is None:
            return
        rids = computing.pop(worker_id, None)
        if rids is not None:
            self._unlist(h, rids)
            self._shrunk(h, computing)
            if not computing:
                del self.by_block[h]

    def _join(self, h: BlockHash, computing: dict[WorkerId, set[str]], rids: Iterable[str]) -> None:
        """`rids` compute `h` now (on one of `computing`'s workers, `by_block[h]`): into
        `_rids[h]`, kept while 2+ workers compute `h`."""
        if len(computing) < 2:
            return
        listed = self._rids.get(h)
        if listed is None:
            self._rids[h] = set().union(*computing.values())
        else:
            listed.update(rids)

    def _unlist(self, h: BlockHash, rids: Iterable[str]) -> None:
        """`rids` compute `h` no more (on their worker): out of `_rids[h]`."""
        listed = self._rids.get(h)
        if listed is not None:
            listed.difference_update(rids)

    def _shrunk(self, h: BlockHash, computing: dict[WorkerId, set[str]]) -> None:
        """A worker stopped computing `h`: with one left (or none), `_rids[h]` goes."""
        if len(computing) < 2:
            self._rids.pop(h, None)

    def expired(self, now: float) -> list[str]:
        """The requests whose record expires at or before `now` (the caller drops them)."""
        out: dict[str, None] = {}
        while self._expiry and self._expiry[0][0] <= now:
            _, rid = heapq.heappop(self._expiry)
            p = self._requests.get(rid)
            if p is not None and p.expires_at <= now:
                out[rid] = None
        return list(out)

    def on_worker(self, worker_id: WorkerId) -> list[str]:
        """The requests recorded on `worker_id`."""
        return [r for r, p in self._requests.items() if p.worker_id == worker_id]

    def computing(self, worker_id: WorkerId, block_hashes: Sequence[BlockHash]) -> set[str]:
        """The requests whose pending blocks on `worker_id` cover any of `block_hashes`."""
        out: set[str] = set()
        if worker_id not in self._on:     # most workers of a large pool: O(1)
            return out
        for h in block_hashes:
            rids = self.by_block.get(h, {}).get(worker_id)
            if rids:
                out |= rids
        return out

    def computing_any(self, block_hashes: Sequence[BlockHash]) -> dict[WorkerId, set[str]]:
        """`computing` of every worker where it is not empty."""
        found: set[str] = set()
        by_block, listed = self.by_block, self._rids
        for h in block_hashes:
            computing = by_block.get(h)
            if not computing:
                continue
            if len(computing) > 1:
                found |= listed[h]
            else:
                for rids in computing.values():
                    found |= rids
        out: dict[WorkerId, set[str]] = {}
        requests = self._requests
        for rid in found:       # every request in by_block[h][w] is recorded on w (check_pending)
            w = requests[rid].worker_id
            got = out.get(w)
            if got is None:
                out[w] = {rid}
            else:
                got.add(rid)
        return out

    def requests(self) -> list[str]:
        return sorted(self._requests)

    def num_pending(self) -> int:
        """(block, worker) pairs predicted and not yet confirmed."""
        return sum(len(c) for c in self.by_block.values())

    def check(self, holders: Callable[[BlockHash], Collection[WorkerId]]) -> None:
        check_pending(self.by_block, self._requests, self._on, holders, self._asking)
        joined = {h: set().union(*computing.values()) for h, computing in self.by_block.items() if len(computing) > 1}
        assert joined == self._rids, "the requests computing each block disagree with the pending map"

    def _unask(self, request_id: str, p: Pending) -> None:
        for h in set(p.asking):
            by_worker = self._asking[h]
            rids = by_worker[p.worker_id]
            rids.discard(request_id)
            if not rids:
                del by_worker[p.worker_id]
                if not by_worker:
                    del self._asking[h]

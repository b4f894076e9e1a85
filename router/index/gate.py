"""What the router's EventConsumer feeds: the block index, minus the workers that left routing.

A worker leaves routing when it reports NOT_SERVING (draining after SIGTERM, or not loaded yet)
or leaves the Redis registry (deregistered, or its record expired). Its blocks must leave the
index at once, before the process exits, so that no request is drawn to it by prefix: `close`
drops them and from then on ignores the worker's stream entries (a draining worker still
stores the blocks of the requests it finishes). `reopen` lets them through again; the caller
then asks the worker for a full inventory (EventConsumer.request_resync), since what it stored
meanwhile was not applied. On the router's loop only, like the index.
"""
from __future__ import annotations

from kvstore.events import WireEvent, WorkerId
from router.index.blocks import BlockIndex


class GatedIndex:
    """An `IndexSink` (kvstore.events) over `index`: entries of closed workers are dropped."""

    def __init__(self, index: BlockIndex) -> None:
        self.index = index
        self._closed: set[WorkerId] = set()

    def apply(self, worker_id: WorkerId, event: WireEvent, generation: int | None = None) -> None:
        if worker_id not in self._closed:
            self.index.apply(worker_id, event, generation)

    def clear_worker(self, worker_id: WorkerId) -> None:
        self.index.clear_worker(worker_id)

    def remove_worker(self, worker_id: WorkerId) -> None:
        self.index.remove_worker(worker_id)

    def close(self, worker_id: WorkerId) -> None:
        """`worker_id` left routing: forget its blocks (and pending blocks) now, ignore its
        entries until `reopen`. Idempotent."""
        self._closed.add(worker_id)
        self.index.remove_worker(worker_id)

    def reopen(self, worker_id: WorkerId) -> bool:
        """`worker_id` serves again; True if it was closed (then its inventory must be asked for)."""
        if worker_id not in self._closed:
            return False
        self._closed.discard(worker_id)
        return True

    def is_closed(self, worker_id: WorkerId) -> bool:
        return worker_id in self._closed

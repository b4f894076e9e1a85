"""The ready workers as columns, kept between routing decisions (router/routing/pick.py
`routing_view` reads them): the entries, ids and slots, the decode pool, the peers, and one
numpy array per figure the kv_aware column pick reads from the entries (in-flight count, pool
size, peer plane). Rebuilt — O(workers), once — only when the ready set changes (a worker
joins, leaves, becomes ready or not, changes role or peer plane); a figure that changes on one
entry (`in_flight` as the router counts a request, `num_blocks` from a probe) is written into
its column there and then (`WorkerRegistry` hears every such assignment, router/workers/registry.py
`WorkerEntry.__setattr__`). So a decision does no Python work per worker for them.

The arrays and collections are read-only for their readers (a view takes copies of the
arrays that it keeps). torch-free.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Generic, Protocol, TypeVar

import numpy as np

from contracts.roles import WorkerRole
from router.routing.types import WorkerId, WorkerInfo, decode_pool


class _Entry(Hashable, Protocol):
    """What the columns read of a registry entry (router/workers/registry.py `WorkerEntry`)."""

    info: WorkerInfo | None
    address: str
    in_flight: int
    num_blocks: int
    peer_plane: bool


WorkerEntry = TypeVar("WorkerEntry", bound=_Entry)

# the entry fields kept in columns: a change of one of these updates its column in place
IN_PLACE = frozenset({"in_flight", "num_blocks"})
# the entry fields that decide the ready set, the pool or the peers: a change rebuilds
REBUILD = frozenset({"info", "peer_plane"})


class LiveColumns(Generic[WorkerEntry]):
    """The ready workers (`WorkerEntry.info` set) in the registry's order; see the module docstring."""

    def __init__(self, entries: Sequence[WorkerEntry]) -> None:
        live = [e for e in entries if e.info is not None]
        n = len(live)
        self.entries: list[WorkerEntry] = live
        self.infos: list[WorkerInfo] = [e.info for e in live]  # type: ignore[misc]
        self.ids: list[WorkerId] = [i.worker_id for i in self.infos]
        self.slots: dict[WorkerId, int] = {w: i for i, w in enumerate(self.ids)}
        self._at: dict[WorkerEntry, int] = {e: i for i, e in enumerate(live)}
        self.in_flight = np.fromiter((e.in_flight for e in live), dtype=np.int64, count=n)
        self.num_blocks = np.fromiter((e.num_blocks for e in live), dtype=np.int64, count=n)
        self.peer = np.fromiter((e.peer_plane for e in live), dtype=bool, count=n)
        self.peers: dict[WorkerId, str] = {self.ids[i]: live[i].address for i in np.flatnonzero(self.peer).tolist()}
        # `decode_pool` (the pool a request's decode worker comes from) and its rows in these columns
        prefill = any(i.role is WorkerRole.PREFILL for i in self.infos)
        self.decode_pool: list[WorkerInfo] = decode_pool(self.infos) if prefill else self.infos
        self.decode_rows: np.ndarray | None = (
            np.array([self.slots[i.worker_id] for i in self.decode_pool], dtype=np.intp) if prefill else None)

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, entry: object) -> bool:
        return entry in self._at

    def changed(self, entry: WorkerEntry, name: str) -> None:
        """`entry.<name>` (one of `IN_PLACE`) was assigned: its column follows."""
        i = self._at.get(entry)
        if i is None:
            return
        if name == "in_flight":
            self.in_flight[i] = entry.in_flight
        else:
            self.num_blocks[i] = entry.num_blocks

"""A worker's registry entry (`WorkerEntry`), and the ready workers as columns kept between
routing decisions (router/routing/pick.py `routing_view` reads them): the entries, ids and
slots, the decode pool, the peers, and one numpy array per figure the kv_aware column pick
reads from the entries (in-flight count, pool size, peer plane, disk read price). Rebuilt — O(workers), once —
only when the ready set changes (a worker joins, leaves, becomes ready or not, changes role or
peer plane); a figure that changes on one entry (`in_flight` as the router counts a request,
`num_blocks` from a probe) is written into its column there and then (`WorkerRegistry` hears
every such assignment through `WorkerEntry.__setattr__`). So a decision does no Python work
per worker for them.

The arrays and collections are read-only for their readers (a view takes copies of the
arrays that it keeps). torch-free.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np
from grpc_health.v1 import health_pb2_grpc

from contracts.roles import WorkerRole
from proto.kvmesh.v1 import kvmesh_pb2_grpc as pb_grpc
from router.routing.types import WorkerId, WorkerInfo, WorkerLoad, decode_pool

# the entry fields kept in columns: a change of one of these updates its column in place
IN_PLACE = frozenset({"in_flight", "num_blocks", "disk_read_cost"})
# the entry fields that decide the ready set, the pool or the peers: a change rebuilds
REBUILD = frozenset({"info", "peer_plane"})

_WATCHED = IN_PLACE | REBUILD


@dataclass(eq=False)
class WorkerEntry:
    """One worker address: its channel and stubs, and what the router knows of it. The
    router core counts `in_flight`; probes write the rest."""

    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.WorkerStub
    health: health_pb2_grpc.HealthStub
    info: WorkerInfo | None = None          # set while the worker is ready
    in_flight: int = 0                      # streams the router has open on it
    free_blocks: int = 0                    # from its last GetLoad
    num_blocks: int = 0
    reused_blocks: int = 0                  # cached blocks a later request reused
    peer_plane: bool = False                # it reported a peer plane (GetLoad's `peer`)
    num_waiting: int = 0                    # its queue at its last GetLoad (requests waiting for admission)
    disk_read_cost: float = 0.0             # GetLoad's disk_read_cost_ratio: a disk-held block's read / its prefill
    refused: str | None = None              # why it may never serve (logged once)
    lost: asyncio.Event = field(default_factory=asyncio.Event)   # set: streams on it move (router/routing/migrate.py)
    failed_probes: int = 0                  # consecutive probes that got no answer
    admitted: bool = False                  # passed router/security/attest.py's handshake on this connection
    worker_id: WorkerId | None = None       # last known (its Redis record, its GetLoad)
    mismatched: bool = False                # `refused` because it disagreed with the reference model
    probing: asyncio.Lock = field(default_factory=asyncio.Lock)
    # the registry's listener: hears every assignment of a field its live columns keep
    watch: Callable[[WorkerEntry, str], None] | None = field(default=None, repr=False)

    def __setattr__(self, name: str, value: object) -> None:
        watch = self.__dict__.get("watch") if name in _WATCHED else None
        if watch is None:
            object.__setattr__(self, name, value)
            return
        old = self.__dict__.get(name, value)
        object.__setattr__(self, name, value)
        if old != value:
            watch(self, name)

    @property
    def load(self) -> WorkerLoad:
        return WorkerLoad(self.in_flight, self.free_blocks, self.num_blocks, self.reused_blocks,
                          disk_read_cost=self.disk_read_cost)


class LiveColumns:
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
        self.disk_cost = np.fromiter((e.disk_read_cost for e in live), dtype=float, count=n)
        self.peers: dict[WorkerId, str] = {self.ids[i]: live[i].address for i in np.flatnonzero(self.peer).tolist()}
        # `decode_pool` (the pool a request's decode worker comes from) and its rows in these columns
        roles = frozenset(i.role for i in self.infos)
        prefill = WorkerRole.PREFILL in roles
        # a prefill and a decode worker are ready: disaggregated serving is on (router/routing/disagg.py
        # `is_active` of these workers, decided once per ready set)
        self.disaggregated = prefill and WorkerRole.DECODE in roles
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
        elif name == "num_blocks":
            self.num_blocks[i] = entry.num_blocks
        else:
            self.disk_cost[i] = entry.disk_read_cost

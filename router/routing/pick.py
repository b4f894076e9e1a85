"""The routing core's pick (router/routing/core.py `Router.pick`): the routing view of one
request — load and KV per live worker, the leading prompt blocks each holds by the block
index (pending ones too) and has stored (what a peer can send), the prefill queues — and the
policy's worker with the prompt tokens it will find cached and the peer to hint when another
worker holds more of the prompt. torch-free.
"""
from __future__ import annotations

import functools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from contracts.requests import PeerHint
from contracts.wire import to_peer_hint
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.index.asks import cluster_fill
from router.routing.fastpick import Columns, KvAwareFast
from router.routing.holders import best_peer_hint, holder_columns, live_only, peer_hint
from router.routing.inflight import InFlightPrefills
from router.routing.policy import Policy
from router.routing.types import RouteRequest, RoutingState, WorkerId, WorkerInfo, WorkerLoad
from router.workers.live import LiveColumns
from router.workers.registry import WorkerEntry, WorkerRegistry


class Pick(NamedTuple):
    """The chosen worker, the prompt tokens the index says it holds, the peer to hint and the
    further prompt tokens that peer is predicted to send (the worker computes neither)."""

    worker: WorkerEntry
    predicted_tokens: int
    hint: PeerHint | None
    fetched_tokens: int = 0


class RoutingView:
    """What the policy sees for one request, kept in columns over the live workers (`ids`,
    router/routing/fastpick.py `Columns`) with the request's sparse figures beside them: the
    leading prompt blocks each worker holds or computes (`cached`) and has stored (`stored`: a
    peer can send only those), zeros left out. The workers' own figures come from the
    registry's live columns, kept between decisions (router/workers/live.py `LiveColumns`);
    `state` (the dicts `Policy.pick` reads) is built only when asked for. `peers` (id → address
    of the workers with a peer plane) and `decode_pool` are the live columns' (read-only)."""

    def __init__(self, live: LiveColumns, cols: Columns, cached: dict[WorkerId, int], stored: dict[WorkerId, int],
                 block_size: int, cluster_committed: float,
                 peer_stored: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        self.live = live
        self.ids = live.ids
        self.slots = live.slots
        self.cols = cols
        self.cached = cached
        self.stored = stored
        self.peer_stored = peer_stored      # `stored` of the peers as (rows, counts) (None: few holders)
        self.peer = live.peer
        self.peers = live.peers
        self.decode_pool = live.decode_pool
        self.block_size = block_size
        self.cluster_committed = cluster_committed

    @functools.cached_property
    def state(self) -> RoutingState:
        cols, ids = self.cols, self.ids
        loads = {wid: WorkerLoad(int(cols.in_flight[i]), e.free_blocks, e.num_blocks, e.reused_blocks,
                                 float(cols.shared[i]), e.disk_read_cost)
                 for i, (wid, e) in enumerate(zip(ids, self.live.entries))}
        return RoutingState(loads, {w: self.cached.get(w, 0) for w in ids},
                            dict(zip(ids, cols.queued.tolist())), self.block_size, dict(zip(ids, cols.mean.tolist())),
                            {ids[i]: int(cols.fetchable[i]) for i in np.flatnonzero(self.peer).tolist()},
                            self.cluster_committed,
                            {ids[i]: int(cols.disk[i]) for i in np.flatnonzero(cols.disk).tolist()})

    def peer_hint(self, chosen: WorkerId, max_blocks: int) -> PeerHint | None:
        """`best_peer_hint(chosen, self.stored, self.peers, max_blocks)` (router/routing/holders.py)."""
        return peer_hint(self.live, self.stored, self.peer_stored, chosen, max_blocks)

    def pool(self, workers: Sequence[WorkerInfo], exclude: Collection[WorkerId]) -> Columns | None:
        """The columns of `workers` less `exclude`, in their order (None: a worker not in the view).
        The decode pool's are taken by its rows in the live columns (no per-worker Python)."""
        if workers is self.decode_pool:
            rows = self.live.decode_rows
            if not exclude:
                return self.cols if rows is None else self.cols.take(rows)
            keep = np.ones(len(self.ids), dtype=bool)
            keep[[self.slots[w] for w in exclude if w in self.slots]] = False
            rows = np.flatnonzero(keep) if rows is None else rows[keep[rows]]
            return self.cols.take(rows)
        slots = self.slots
        picked = [slots.get(w.worker_id, -1) for w in workers if w.worker_id not in exclude]
        if any(r < 0 for r in picked):
            return None
        return self.cols.take(np.array(picked, dtype=np.intp))


def routing_view(registry: WorkerRegistry, prefills: InFlightPrefills, route: RouteRequest,
                 block_size: int | None) -> RoutingView:
    """The view now (`block_size`: the model's, None before a worker told it). The workers'
    figures are the registry's live columns (copied: the view keeps them as they are now) and
    a few vectorized passes (expected shared blocks, sustained load); the request's own figures
    come from the index's sparse lookups (the prompt's blocks and their holders) — no Python
    work per worker."""
    live = registry.live_columns()
    ids, slots, n = live.ids, live.slots, len(live)
    index = registry.index
    prefills.expire(index)
    # the index's counts (fresh dicts, ours) of the live workers, and the request's columns
    # over their holders (router/routing/holders.py)
    cached, stored = (live_only(d, slots) for d in index.match_leading_pair(route.block_hashes))
    held = holder_columns(live, index, route.block_hashes, cached, stored)
    queued = np.zeros(n, dtype=np.int64)
    for w, t in prefills.queued_base().items():
        if w in slots:
            queued[slots[w]] = t
    for w, t in prefills.queued_less(index, route).items():
        if w in slots:
            queued[slots[w]] -= t
    num_blocks = live.num_blocks.copy()
    capacity = int(np.maximum(0, num_blocks).sum())
    index.set_capacity(capacity)     # the traffic clock of the index's fading evidence
    cols = Columns(ids, live.in_flight.copy(), num_blocks, index.shared_blocks_of(ids), prefills.mean_column(ids),
                   queued, held.cached, held.fetch, held.disk, held.disk_cost)
    return RoutingView(live, cols, cached, stored, block_size or 16, cluster_fill(index, capacity), held.peer_stored)


def pick_worker(policy: Policy, registry: WorkerRegistry, view: RoutingView, workers: Sequence[WorkerInfo],
                route: RouteRequest, tried: set[WorkerId], block_size: int,
                fast: KvAwareFast | None = None) -> Pick | None:
    """The policy's worker among `workers` (not in `tried`), or None. `fast`: the policy's
    column pick (router/routing/fastpick.py; None: `Policy.pick` on the view's state)."""
    pool = view.pool(workers, tried) if fast is not None else None
    if fast is not None and pool is not None:
        if pool is view.cols:       # the live pool: its ring is ready from its first pick on
            fast.prepare(pool.ids)
        at = fast.pick(pool, route, view.block_size, max(view.cached.values(), default=0), view.cluster_committed)
        if at is None:
            return None
        chosen_id = pool.ids[at]
        chosen_entry = view.live.entries[view.slots[chosen_id]]
    else:
        chosen = policy.pick(workers, route, view.state, exclude=tried)
        if chosen is None:
            return None
        chosen_id, chosen_entry = chosen.worker_id, registry.entry(chosen.address)
    bs = block_size
    # The worker recomputes at least the last prompt token, as the engine's lookup does.
    max_blocks = (len(route.token_ids) - 1) // bs if bs else 0
    blocks = min(view.cached.get(chosen_id, 0), max_blocks)
    hint = view.peer_hint(chosen_id, max_blocks) if view.stored else None
    fetched = max(0, hint.num_blocks - blocks) if hint is not None else 0
    return Pick(chosen_entry, blocks * bs, hint, fetched * bs)


class ReferenceView(NamedTuple):
    """The routing state as dicts computed per worker, as the router built it before the
    columns: dense index lookups, each peer's fetchable from every other peer's stored count —
    O(workers) Python per figure, O(peers × workers) for fetchable. The definition
    `routing_view` is held to (tests/router/test_fastpick.py), and `kvmesh bench scale`'s
    baseline pick."""

    state: RoutingState
    stored: dict[WorkerId, int]
    peers: dict[WorkerId, str]


def reference_view(registry: WorkerRegistry, prefills: InFlightPrefills, route: RouteRequest,
                   block_size: int | None) -> ReferenceView:
    live = [(w.info.worker_id, w) for w in registry.live() if w.info is not None]
    index = registry.index
    loads = {wid: replace(w.load, shared_blocks=index.shared_blocks(wid)) for wid, w in live}
    prefills.expire(index)
    cached = index.match_prefix(route.block_hashes, list(loads))
    stored = index.match_prefix(route.block_hashes, list(loads), pending=False)
    peers = {wid: w.address for wid, w in live if w.peer_plane}
    fetchable = {wid: max(0, max((n for o, n in stored.items() if o != wid and o in peers), default=0)
                          - cached.get(wid, 0))
                 for wid in peers}
    capacity = sum(max(0, ld.num_blocks) for ld in loads.values())
    index.set_capacity(capacity)
    disk = index.disk_only(route.block_hashes, {w: c for w, c in cached.items() if loads[w].disk_read_cost > 0})
    state = RoutingState(loads, cached, prefills.queued_tokens(index, loads, route), block_size or 16,
                         prefills.mean_in_flight(loads), fetchable, cluster_fill(index, capacity), disk)
    return ReferenceView(state, stored, peers)


def pick_reference(policy: Policy, registry: WorkerRegistry, view: ReferenceView, workers: Sequence[WorkerInfo],
                   route: RouteRequest, tried: set[WorkerId], block_size: int) -> Pick | None:
    """`pick_worker` by `Policy.pick` on a `reference_view`."""
    chosen = policy.pick(workers, route, view.state, exclude=tried)
    if chosen is None:
        return None
    bs = block_size
    max_blocks = (len(route.token_ids) - 1) // bs if bs else 0
    blocks = min(view.state.cached_blocks.get(chosen.worker_id, 0), max_blocks)
    hint = best_peer_hint(chosen.worker_id, view.stored, view.peers, max_blocks)
    fetched = max(0, hint.num_blocks - blocks) if hint is not None else 0
    return Pick(registry.entry(chosen.address), blocks * bs, hint, fetched * bs)


def discount_view(view: RoutingView, cached: Mapping[WorkerId, int]) -> RoutingView:
    """`view` with `cached` (its own less the going workers, `GoingPrefixes.less`) as the
    leading blocks each worker holds, in its map and its column (the same object if unchanged)."""
    if cached is view.cached:
        return view
    column = view.cols.cached.copy()
    for w in view.cached.keys() - cached.keys():
        column[view.slots[w]] = 0
    view.cached, view.cols = dict(cached), view.cols._replace(cached=column)
    return view


def as_listed(pick: Pick, listed: Mapping[WorkerId, int], route: RouteRequest, bs: int) -> Pick:
    """`pick` promising what the index lists on its worker (`listed`), and a peer hint fetching
    past that: a request sent to a worker evicting its prefix is promised what it may still find."""
    assert pick.worker.info is not None
    blocks = min(listed.get(pick.worker.info.worker_id, 0), (len(route.token_ids) - 1) // bs if bs else 0)
    fetched = max(0, pick.hint.num_blocks - blocks) if pick.hint is not None else 0
    return pick._replace(predicted_tokens=blocks * bs, fetched_tokens=fetched * bs)


def with_hint(request: pb.GenerateRequest, hint: PeerHint | None) -> pb.GenerateRequest:
    """`request` with `hint` among its peer hints (a copy; `request` itself when there is none)."""
    if hint is None:
        return request
    hinted = pb.GenerateRequest()
    hinted.CopyFrom(request)
    hinted.peer_hints.append(to_peer_hint(hint))
    return hinted

"""The routing core's pick (router/routing/core.py `Router.pick`): the routing view of one
request — load and KV per live worker, the leading prompt blocks each holds by the block
index (pending ones too) and has stored (what a peer can send), the prefill queues — and the
policy's worker with the prompt tokens it will find cached and the peer to hint when another
worker holds more of the prompt. torch-free.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import NamedTuple

from contracts.requests import PeerHint
from router.routing.inflight import InFlightPrefills
from router.routing.policy import Policy
from router.routing.types import RouteRequest, RoutingState, WorkerId, WorkerInfo
from router.workers.registry import WorkerEntry, WorkerRegistry


class Pick(NamedTuple):
    """The chosen worker, the prompt tokens the index says it holds, the peer to hint and the
    further prompt tokens that peer is predicted to send (the worker computes neither)."""

    worker: WorkerEntry
    predicted_tokens: int
    hint: PeerHint | None
    fetched_tokens: int = 0


class RoutingView(NamedTuple):
    """The policy's state, the leading blocks each worker has stored (not pending: a peer can
    send only those) and the workers with a peer plane (id → address)."""

    state: RoutingState
    stored: dict[WorkerId, int]
    peers: dict[WorkerId, str]


def routing_view(registry: WorkerRegistry, prefills: InFlightPrefills, route: RouteRequest,
                 block_size: int | None) -> RoutingView:
    """The view now (`block_size`: the model's, None before a worker told it)."""
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
    index.set_capacity(capacity)     # the traffic clock of the index's fading evidence
    state = RoutingState(loads, cached, prefills.queued_tokens(index, loads, route), block_size or 16,
                         prefills.mean_in_flight(loads), fetchable,
                         min(1.0, index.distinct_shared_blocks() / capacity) if capacity else 0.0)
    return RoutingView(state, stored, peers)


def pick_worker(policy: Policy, registry: WorkerRegistry, view: RoutingView, workers: Sequence[WorkerInfo],
                route: RouteRequest, tried: set[WorkerId], block_size: int) -> Pick | None:
    """The policy's worker among `workers` (not in `tried`), or None."""
    chosen = policy.pick(workers, route, view.state, exclude=tried)
    if chosen is None:
        return None
    bs = block_size
    # The worker recomputes at least the last prompt token, as the engine's lookup does.
    max_blocks = (len(route.token_ids) - 1) // bs if bs else 0
    blocks = min(view.state.cached_blocks.get(chosen.worker_id, 0), max_blocks)
    hint = best_peer_hint(chosen.worker_id, view.stored, view.peers, max_blocks)
    fetched = max(0, hint.num_blocks - blocks) if hint is not None else 0
    return Pick(registry.entry(chosen.address), blocks * bs, hint, fetched * bs)


def best_peer_hint(chosen: WorkerId, cached_blocks: Mapping[WorkerId, int],
                   peers: Mapping[WorkerId, str], max_blocks: int) -> PeerHint | None:
    """The worker other than `chosen` holding the most leading prompt blocks (at most
    `max_blocks` count), if it holds more than `chosen` and both have a peer plane (`peers`:
    worker id → address; any two such workers form a pair on demand); ties go to the lowest id."""
    if chosen not in peers:
        return None
    own = min(cached_blocks.get(chosen, 0), max_blocks)
    best: PeerHint | None = None
    for worker_id in sorted(cached_blocks):
        address = peers.get(worker_id)
        if worker_id == chosen or address is None:
            continue
        n = min(cached_blocks[worker_id], max_blocks)
        if n > own and (best is None or n > best.num_blocks):
            best = PeerHint(worker_id, address, n)
    return best

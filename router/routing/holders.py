"""A request's own figures in the routing view (router/routing/pick.py `routing_view`), over
the workers holding its prompt: the leading blocks each holds or computes (`cached`), those
on disk only where disk reads are priced, what each peer could fetch from the best other peer
(`fetchable`), and the peer hint for the chosen worker.

The index gives them as sparse dicts (holders only). A few holders — most prompts — are
cheapest in a Python loop over the dict; a popular prompt has hundreds (at 1,000 workers in
`kvmesh bench scale`'s trace, up to ~250), where the loops were the tail of a decision: past
`MANY_HOLDERS` the holders become (rows, counts) arrays and the figures numpy passes. Both
ways give the same columns and hints (tests/router/test_fastpick.py runs both). torch-free.
"""
from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from contracts.requests import PeerHint
from kvstore.keys import BlockHash
from router.routing.types import WorkerId
from router.workers.live import LiveColumns

# more holders than this: numpy over their rows (a handful of numpy calls costs about as much
# as a Python loop over ~50 holders; measured in one process on the 1,000-worker synthetic router)
MANY_HOLDERS = 48


class DiskOnly(Protocol):
    def disk_only(self, block_hashes: Sequence[BlockHash], counts: Mapping[WorkerId, int]) -> dict[WorkerId, int]: ...


class HolderColumns(NamedTuple):
    cached: np.ndarray          # int64 per live worker: leading blocks held or computed
    fetch: np.ndarray           # int64: fetchable from the best other peer (peers only)
    disk: np.ndarray            # int64: of the cached, on disk only (priced workers only)
    disk_cost: np.ndarray       # float64: their price, where disk > 0
    peer_stored: tuple[np.ndarray, np.ndarray] | None   # stored of the peers as (rows, counts); None: few


def live_only(counts: dict[WorkerId, int], slots: Mapping[WorkerId, int]) -> dict[WorkerId, int]:
    """`counts` less the workers not in `slots` (in place; rarely any). O(len(counts)): a set's
    difference with a dict looks each of its own up there (`keys() - keys()` would walk `slots`)."""
    for w in set(counts).difference(slots):
        del counts[w]
    return counts


def on_rows(counts: Mapping[WorkerId, int], slots: Mapping[WorkerId, int],
            keep: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`counts` (of workers in `slots`) as (rows, counts) arrays in its order; where `keep`
    (a bool column) is given, of its rows only."""
    k = len(counts)
    rows = np.fromiter(map(slots.__getitem__, counts), dtype=np.intp, count=k)
    values = np.fromiter(counts.values(), dtype=np.int64, count=k)
    if keep is not None:
        on = keep[rows]
        rows, values = rows[on], values[on]
    return rows, values


def holder_columns(live: LiveColumns, index: DiskOnly, block_hashes: Sequence[BlockHash], cached: dict[WorkerId, int],
                   stored: dict[WorkerId, int]) -> HolderColumns:
    """The columns of `cached` / `stored` (the live workers' leading counts with pending blocks
    and without) over `live`'s workers."""
    ids, slots, n, peer = live.ids, live.slots, len(live), live.peer
    cached_col = np.zeros(n, dtype=np.int64)
    if len(cached) > MANY_HOLDERS:
        rows, counts = on_rows(cached, slots)
        cached_col[rows] = counts
        priced = {ids[r]: int(cached_col[r]) for r in rows[live.disk_cost[rows] > 0].tolist()}
    else:
        for w, c in cached.items():
            cached_col[slots[w]] = c
        entries = live.entries
        priced = {w: c for w, c in cached.items() if entries[slots[w]].disk_read_cost > 0}
    # of the cached, those on disk only, where disk reads are priced (sparse: the holders only;
    # a worker with none costs nothing for them, whatever its price)
    disk = np.zeros(n, dtype=np.int64)
    disk_cost = np.zeros(n, dtype=float)
    for w, k in (index.disk_only(block_hashes, priced) if priced else {}).items():
        disk[slots[w]], disk_cost[slots[w]] = k, live.disk_cost[slots[w]]
    # fetchable, peers only: the most leading blocks another peer has stored, less its own cached
    # (`max(0, max(stored of the other peers, default 0) − cached)`, from the two best; which of
    # two equal best is "first" changes nothing)
    fetch = np.zeros(n, dtype=np.int64)
    peer_stored: tuple[np.ndarray, np.ndarray] | None = None
    top: list[tuple[int, int]] = []         # (count, row) of the best two
    if len(stored) > MANY_HOLDERS:
        peer_rows, peer_counts = peer_stored = on_rows(stored, slots, peer)
        if len(peer_rows):
            j = int(np.argmax(peer_counts))
            top.append((int(peer_counts[j]), int(peer_rows[j])))
            if len(peer_rows) > 1:
                peer_counts = peer_counts.copy()
                peer_counts[j] = -1
                top.append((int(peer_counts.max()), -1))
    else:
        top = heapq.nlargest(2, ((c, slots[w]) for w, c in stored.items() if peer[slots[w]]))
    if top:
        fetch = np.where(peer, np.maximum(0, top[0][0] - cached_col), 0)
        first = top[0][1]
        fetch[first] = max(0, (top[1][0] if len(top) > 1 else 0) - int(cached_col[first]))
    return HolderColumns(cached_col, fetch, disk, disk_cost, peer_stored)


def best_peer_hint(chosen: WorkerId, cached_blocks: Mapping[WorkerId, int],
                   peers: Mapping[WorkerId, str], max_blocks: int) -> PeerHint | None:
    """The worker other than `chosen` holding the most leading prompt blocks (at most
    `max_blocks` count), if it holds more than `chosen` and both have a peer plane (`peers`:
    worker id → address; any two such workers form a pair on demand); ties go to the lowest id."""
    if chosen not in peers:
        return None
    own = min(cached_blocks.get(chosen, 0), max_blocks)
    best: tuple[int, WorkerId, str] | None = None      # one pass over the holders, no sort
    for worker_id, count in cached_blocks.items():
        address = peers.get(worker_id)
        if worker_id == chosen or address is None:
            continue
        n = min(count, max_blocks)
        if n > own and (best is None or n > best[0] or (n == best[0] and worker_id < best[1])):
            best = (n, worker_id, address)
    return None if best is None else PeerHint(best[1], best[2], best[0])


def peer_hint(live: LiveColumns, stored: Mapping[WorkerId, int], peer_stored: tuple[np.ndarray, np.ndarray] | None,
              chosen: WorkerId, max_blocks: int) -> PeerHint | None:
    """`best_peer_hint(chosen, stored, live.peers, max_blocks)`; over `peer_stored`'s arrays
    when given (many holders)."""
    if peer_stored is None:
        return best_peer_hint(chosen, stored, live.peers, max_blocks)
    rows, counts = peer_stored
    at = live.slots.get(chosen)
    if at is None or not live.peer[at] or not len(rows):
        return None
    own = min(stored.get(chosen, 0), max_blocks)
    n = np.minimum(counts, max_blocks)
    n[rows == at] = 0
    best = int(n.max())
    if best <= own:
        return None
    ids = live.ids
    worker_id = min([ids[r] for r in rows[n == best].tolist()])     # ties: the lowest id
    return PeerHint(worker_id, live.peers[worker_id], best)

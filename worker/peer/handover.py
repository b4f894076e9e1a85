"""Scaling that keeps the cache, on the peer plane: what to move where, and the receiving side.

Two moves, both pulls over the peer plane (`PeerPlane.pull`: SendBlocks on the pair with the
holder, the blocks staged into the receiver's host tier, which publishes them as `stored` in
tier host, so the router's index follows):
- drain hand-over: a draining worker lists its hottest blocks (`KVStore.hottest`: decayed
  prefix hits) and asks the peers with free host-tier room to pull them from it (the
  PullBlocks RPC); `split_by_room` gives each peer a contiguous slice, hottest first to the
  peer with the most room, so chains stay together;
- warm start: a worker that just turned ready asks each peer for its hottest blocks (the
  HotBlocks RPC), merges them (`interleave`) up to its free room and pulls them in the
  background, at most `bytes_per_s` on average (`RateLimit`).

`pull_chunks` is the receiving loop of both: chunks of `CHUNK_BLOCKS`, each one transfer, until
the list, the room or the deadline runs out. A chunk that brings fewer blocks than asked (the
holder evicted one meanwhile, a transfer failed) ends that chunk only. Torch-free here; gRPC
lives in the server (worker/server/scaling.py).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple

from kvstore.keys import BlockHash

CHUNK_BLOCKS = 32


class PeerRoom(NamedTuple):
    """A peer that may receive blocks: its id, gRPC address and free host-tier blocks."""

    worker_id: str
    address: str
    room: int


class Pulled(NamedTuple):
    """What a receiving loop stored: blocks, chunks that brought fewer than asked, seconds."""

    num_blocks: int
    num_short: int
    seconds: float


def split_by_room(hashes: Sequence[BlockHash], peers: Sequence[PeerRoom]) -> list[tuple[PeerRoom, list[BlockHash]]]:
    """Contiguous slices of `hashes` (hottest first): the first to the peer with the most
    room, up to its room, the next to the next one; peers without room get nothing."""
    out: list[tuple[PeerRoom, list[BlockHash]]] = []
    start = 0
    for peer in sorted(peers, key=lambda p: (-p.room, p.worker_id)):
        if start >= len(hashes) or peer.room <= 0:
            break
        part = list(hashes[start:start + peer.room])
        out.append((peer, part))
        start += len(part)
    return out


def interleave(hot_by_peer: Sequence[tuple[str, Sequence[BlockHash]]], max_blocks: int,
               skip: Callable[[BlockHash], bool] = lambda h: False) -> dict[str, list[BlockHash]]:
    """Per peer, the hashes to pull from it: round robin over the peers' hot lists (each one
    hottest first), a hash taken from the first peer that lists it, `skip`ped ones left out,
    `max_blocks` in all. Each peer's list keeps its own order (parents before children)."""
    out: dict[str, list[BlockHash]] = {w: [] for w, _ in hot_by_peer}
    seen: set[BlockHash] = set()
    cursors = [0] * len(hot_by_peer)
    total = 0
    while total < max_blocks:
        moved = False
        for i, (worker_id, hot) in enumerate(hot_by_peer):
            while cursors[i] < len(hot) and (hot[cursors[i]] in seen or skip(hot[cursors[i]])):
                cursors[i] += 1
            if cursors[i] >= len(hot) or total >= max_blocks:
                continue
            h = hot[cursors[i]]
            cursors[i] += 1
            seen.add(h)
            out[worker_id].append(h)
            total += 1
            moved = True
        if not moved:
            break
    return {w: hs for w, hs in out.items() if hs}


class RateLimit:
    """At most `bytes_per_s` on average since the first `spent` (0 or less: no limit)."""

    def __init__(self, bytes_per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.bytes_per_s = bytes_per_s
        self._clock = clock
        self._t0: float | None = None
        self._bytes = 0

    def delay_s(self, nbytes: int) -> float:
        """Record `nbytes` moved now; how long to wait before the next move."""
        now = self._clock()
        if self._t0 is None:
            self._t0 = now
        self._bytes += nbytes
        if self.bytes_per_s <= 0:
            return 0.0
        return max(0.0, self._t0 + self._bytes / self.bytes_per_s - now)


PullChunk = Callable[[Sequence[BlockHash]], Awaitable[int]]


async def pull_chunks(pull: PullChunk, hashes: Sequence[BlockHash], bytes_per_block: int,
                      deadline: float | None = None, limit: RateLimit | None = None,
                      chunk_blocks: int = CHUNK_BLOCKS) -> Pulled:
    """Pull `hashes` chunk by chunk with `pull` (one transfer each: blocks stored), pausing
    per `limit`, stopping at `deadline` (time.monotonic)."""
    t0 = time.monotonic()
    stored = short = 0
    for start in range(0, len(hashes), chunk_blocks):
        if deadline is not None and time.monotonic() >= deadline:
            break
        part = hashes[start:start + chunk_blocks]
        n = await pull(part)
        stored += n
        short += n < len(part)
        if limit is not None:
            wait = limit.delay_s(n * bytes_per_block)
            if wait > 0:
                await asyncio.sleep(wait if deadline is None else min(wait, max(0.0, deadline - time.monotonic())))
    return Pulled(stored, short, time.monotonic() - t0)

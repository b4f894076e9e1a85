"""Replicas made off the request path: `kvmesh router --replicate-ahead` (on by default; kv_aware).

A kv_aware pick that sends a request to a worker lacking the prompt's prefix while a peer has
it stored comes with a peer hint, and that worker fetches the prefix before it prefills
(router/routing/holders.py): the fetch — asking the peer, the peer's engine reading the blocks
out, the transfer — is all in that request's TTFT (0.08–0.15 s a fetch in the mean on the
2-core development machine, `kvmesh bench routing-live`'s `peer_fetch_s_mean`; docs/routing.md).
With this on, such a request goes to the holder instead, when the holder is under the pick's
bounded-load cap times the holders' allowance (the cap `BoundedLoadFilter` keeps it under), and
the picked worker pulls the prefix from the holder in the background with its `PullBlocks` RPC —
into its host tier, as a draining peer's hand-over does (worker/server/scaling.py) — so the
prefix's later requests find it there (the index learns the copy from the worker's KV events).

One pull per (worker, prefix) at a time and at most `max_pulls` in all: a request whose pull is
already running goes to the holder too; with `max_pulls` running and none for it, the pick stays
as it was (the request fetches, as without this). A pull that fails (the worker has no peer
plane, is draining, the holder is gone) is logged and counted; nothing else changes.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import grpc

from kvstore.keys import BlockHash
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.routing.pick import Pick
from router.routing.scorers import load_cap
from router.routing.types import RouteRequest, WorkerId
from router.workers.live import LiveColumns, WorkerEntry

log = logging.getLogger("kvmesh.router")

MAX_PULLS = 4            # background pulls in flight at most (each one a peer transfer)
PULL_TIMEOUT_S = 30.0


@dataclass(slots=True)
class ReplicaCounters:
    """Since start: requests sent to the holder instead of fetching, pulls started, blocks the
    pulls stored, pulls that failed."""

    redirected: int = 0
    pulls: int = 0
    pulled_blocks: int = 0
    failed_pulls: int = 0


class ReplicaPulls:
    """See the module docstring. Runs on the router's loop."""

    def __init__(self, load_factor: float, holder_factor: float, max_pulls: int = MAX_PULLS,
                 timeout_s: float = PULL_TIMEOUT_S) -> None:
        if max_pulls < 1:
            raise ValueError(f"max_pulls={max_pulls!r} must be positive")
        self.load_factor, self.holder_factor = load_factor, holder_factor
        self.max_pulls, self.timeout_s = max_pulls, timeout_s
        self.counters = ReplicaCounters()
        self._pulling: set[tuple[WorkerId, BlockHash]] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def redirect(self, pick: Pick, live: LiveColumns, route: RouteRequest, block_size: int,
                 tried: Collection[WorkerId] = ()) -> Pick:
        """`pick`, or the holder its hint names with the prefix pulled to `pick`'s worker in the
        background (module docstring). `live`: the registry's ready workers (their columns)."""
        hint, target = pick.hint, pick.worker
        if (hint is None or hint.handoff or pick.fetched_tokens <= 0 or target.info is None
                or hint.worker_id in tried or hint.num_blocks <= 0):
            return pick
        at = live.slots.get(WorkerId(hint.worker_id))
        if at is None:
            return pick
        holder = live.entries[at]
        cap = load_cap(int(live.in_flight.sum()), len(live), self.load_factor)
        if holder.in_flight >= self.holder_factor * cap:
            return pick      # a busy holder: the request fetches where the pick sent it
        key = (target.info.worker_id, route.block_hashes[hint.num_blocks - 1])
        if key not in self._pulling:
            if len(self._pulling) >= self.max_pulls:
                return pick
            self._pulling.add(key)
            self.counters.pulls += 1
            task = asyncio.get_running_loop().create_task(
                self._pull(target, hint.worker_id, hint.address, route.block_hashes[:hint.num_blocks], key))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self.counters.redirected += 1
        return Pick(holder, hint.num_blocks * block_size, None, 0)

    async def _pull(self, target: WorkerEntry, sender_id: str, sender_address: str, hashes: Sequence[BlockHash],
                    key: tuple[WorkerId, BlockHash]) -> None:
        t0 = time.perf_counter()
        try:
            resp = await target.stub.PullBlocks(pb.PullBlocksRequest(
                block_hashes=[h.to_bytes(16, "big") for h in hashes], sender_id=sender_id,
                sender_address=sender_address, replica=True), timeout=self.timeout_s)
            self.counters.pulled_blocks += resp.num_blocks
            if resp.num_blocks == 0:
                self.counters.failed_pulls += 1
            log.info("replica of %d block(s) pulled by %s from %s: %d stored in %.3f s%s", len(hashes), key[0],
                     sender_id, resp.num_blocks, time.perf_counter() - t0, f" ({resp.reason})" if resp.reason else "")
        except grpc.aio.AioRpcError as e:
            self.counters.failed_pulls += 1
            log.warning("replica pull by %s from %s failed: %s %s", key[0], sender_id, e.code().name, e.details())
        finally:
            self._pulling.discard(key)

    async def close(self) -> None:
        """Cancel the pulls still running (the router is stopping)."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

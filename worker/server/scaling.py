"""The worker server's side of scaling that keeps the cache (worker/peer/handover.py: the plan).

- `serve_pull` (the PullBlocks RPC): a draining peer asks this worker to pull blocks from it;
  up to this worker's hand-over room (worker/server/responses.py `handover_room`: its free
  host-tier blocks, or with a disk tier its whole host tier, the displaced blocks going to
  disk), chunk by chunk over the peer plane, within the caller's deadline.
- `hand_over` (the server's drain, `WorkerServer.stop`): this worker's hottest blocks, split
  over the live peers of the same model by their hand-over room (GetLoad), each asked to
  pull its slice (PullBlocks), all within the drain's deadline.
- `warm` (a task started once the worker is ready): the live peers' hottest blocks (HotBlocks),
  merged up to this worker's free room, pulled in the background at most `warm_start_mb_s`.

Peers come from the Redis registry (`live_workers`), so both need `--redis-url` and
`--peer-transfer`. Failures (a peer gone, an RPC error, a transfer that breaks) end that
peer's part, logged; the drain and the serving go on. Counted in `ScalingCounters` (GetLoad's
blocks_handed_over / blocks_warmed) and the worker's metrics.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from contracts.requests import PeerHint
from kvstore.keys import BlockHash
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from worker.engine.commands import HottestBlocks
from worker.peer.handover import PeerRoom, RateLimit, interleave, pull_chunks, split_by_room
from worker.server.cluster_auth import peer_channel
from worker.server.config import WorkerServerConfig

if TYPE_CHECKING:
    from kvstore.metadata.registry import WorkerRecord, WorkerRegistry
    from worker.engine.async_engine import AsyncEngine
    from worker.peer.config import AskPeer
    from worker.peer.plane import PeerPlane

log = logging.getLogger("kvmesh.worker")

MAX_HOT_BLOCKS = 1 << 16          # HotBlocks answers at most this many hashes
_RPC_TIMEOUT_S = 5.0              # HotBlocks and GetLoad to a peer
_MARGIN_S = 1.0                   # a pull stops this long before its caller's deadline


@dataclass(slots=True)
class ScalingCounters:
    """Blocks moved since start: peers pulled from this worker on drain (`blocks_handed_over`),
    this worker pulled at start (`blocks_warmed`), this worker pulled for a draining peer
    (`blocks_taken_over`)."""

    blocks_handed_over: int = 0
    blocks_warmed: int = 0
    blocks_taken_over: int = 0


class Scaling:
    """One worker's drain hand-over, warm start and PullBlocks answer (see the module docstring)."""

    def __init__(self, cfg: WorkerServerConfig) -> None:
        self.cfg = cfg
        self.counters = ScalingCounters()
        self.on_handed_over: Callable[[int], None] | None = None   # the metrics' observers
        self.on_warmed: Callable[[int], None] | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> pb_grpc.WorkerStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = peer_channel(self.cfg, address)
        return pb_grpc.WorkerStub(channel)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    # -- the receiver ---------------------------------------------------------------------
    async def serve_pull(self, ae: AsyncEngine, plane: PeerPlane, ask: AskPeer, req: pb.PullBlocksRequest,
                         room: int, time_remaining: float | None) -> pb.PullBlocksResponse:
        hashes = [BlockHash(int.from_bytes(h, "big")) for h in req.block_hashes]
        if not req.sender_id or not req.sender_address:
            return pb.PullBlocksResponse(num_blocks=0, reason="sender_id and sender_address are required")
        take = hashes[:max(0, room)]
        hint = PeerHint(worker_id=req.sender_id, address=req.sender_address, num_blocks=len(take))
        deadline = None if time_remaining is None else time.monotonic() + time_remaining - _MARGIN_S
        got = await pull_chunks(lambda part: plane.pull(ae, hint, part, ask), take, plane.spec.bytes_per_block,
                                deadline)
        self.counters.blocks_taken_over += got.num_blocks
        reason = "" if got.num_blocks == len(hashes) else \
            f"room for {len(take)} of {len(hashes)}; {got.num_short} chunk(s) came short"
        log.info("worker %s took over %d block(s) from draining %s in %.2f s", self.cfg.worker_id,
                 got.num_blocks, req.sender_id, got.seconds)
        return pb.PullBlocksResponse(num_blocks=got.num_blocks, reason=reason)

    # -- peers ----------------------------------------------------------------------------
    async def _peers(self, registry: WorkerRegistry, hash_salt_hex: str) -> list[WorkerRecord]:
        records = await asyncio.to_thread(registry.live_workers)
        return [r for r in records if r.worker_id != self.cfg.worker_id and r.hash_salt_hex == hash_salt_hex]

    async def _room(self, record: WorkerRecord) -> PeerRoom | None:
        try:
            load = await self._stub(record.address).GetLoad(pb.LoadRequest(), timeout=_RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.warning("worker %s: GetLoad to %s: %s", self.cfg.worker_id, record.worker_id, e.code().name)
            return None
        # a worker from before handover_room_blocks answers 0 there: its free host room then
        return PeerRoom(str(record.worker_id), record.address,
                        max(load.handover_room_blocks, load.host_num_blocks - load.num_host_blocks))

    # -- the drain ------------------------------------------------------------------------
    async def hand_over(self, ae: AsyncEngine, registry: WorkerRegistry, hash_salt_hex: str, my_address: str,
                        deadline: float) -> int:
        """Hand this worker's hottest blocks to the peers with room before `deadline`
        (time.monotonic); returns the blocks the peers stored."""
        t0 = time.monotonic()
        rooms = [r for r in await asyncio.gather(*(self._room(p) for p in await self._peers(registry, hash_salt_hex)))
                 if r is not None]
        want = min(MAX_HOT_BLOCKS, sum(r.room for r in rooms))
        hot: tuple[BlockHash, ...] = await ae.run(HottestBlocks(want)) if want > 0 else ()
        if not hot:
            log.info("worker %s: nothing to hand over (%d peer(s), room for %d block(s))", self.cfg.worker_id,
                     len(rooms), want)
            return 0

        async def ask(peer: PeerRoom, part: Sequence[BlockHash]) -> int:
            timeout = deadline - time.monotonic()
            if timeout <= _MARGIN_S:
                return 0
            req = pb.PullBlocksRequest(block_hashes=[h.to_bytes(16, "big") for h in part],
                                       sender_id=self.cfg.worker_id, sender_address=my_address)
            try:
                resp = await self._stub(peer.address).PullBlocks(req, timeout=timeout)
            except grpc.aio.AioRpcError as e:
                log.warning("worker %s: hand-over to %s failed: %s %s", self.cfg.worker_id, peer.worker_id,
                            e.code().name, e.details())
                return 0
            return int(resp.num_blocks)
        parts = split_by_room(hot, rooms)
        done = sum(await asyncio.gather(*(ask(peer, part) for peer, part in parts)))
        self.counters.blocks_handed_over += done
        if self.on_handed_over is not None:
            self.on_handed_over(done)
        log.info("worker %s handed over %d of its %d hottest block(s) to %s in %.2f s", self.cfg.worker_id, done,
                 len(hot), ", ".join(p.worker_id for p, _ in parts), time.monotonic() - t0)
        return done

    # -- the warm start -------------------------------------------------------------------
    async def warm(self, ae: AsyncEngine, plane: PeerPlane, ask: AskPeer, registry: WorkerRegistry,
                   hash_salt_hex: str, room: int) -> int:
        """Pull the peers' hottest blocks, up to `room`, at most cfg.warm_start_mb_s; returns
        the blocks stored."""
        t0 = time.monotonic()
        peers = await self._peers(registry, hash_salt_hex)
        lists: list[tuple[str, Sequence[BlockHash]]] = []
        for p in peers:
            try:
                resp = await self._stub(p.address).HotBlocks(pb.HotBlocksRequest(max_blocks=room),
                                                             timeout=_RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                log.warning("worker %s: HotBlocks to %s: %s", self.cfg.worker_id, p.worker_id, e.code().name)
                continue
            lists.append((str(p.worker_id), [BlockHash(int.from_bytes(h, "big")) for h in resp.block_hashes]))
        plan = interleave(lists, room)
        limit = RateLimit(self.cfg.warm_start_mb_s * 1e6)
        address = {str(p.worker_id): p.address for p in peers}
        stored = 0
        for worker_id, hashes in plan.items():
            hint = PeerHint(worker_id=worker_id, address=address[worker_id], num_blocks=len(hashes))
            got = await pull_chunks(lambda part, h=hint: plane.pull(ae, h, part, ask), hashes,  # type: ignore[misc]
                                    plane.spec.bytes_per_block, limit=limit)
            stored += got.num_blocks
        self.counters.blocks_warmed += stored
        if self.on_warmed is not None:
            self.on_warmed(stored)
        log.info("worker %s warmed %d block(s) from %d peer(s) in %.2f s", self.cfg.worker_id, stored, len(plan),
                 time.monotonic() - t0)
        return stored

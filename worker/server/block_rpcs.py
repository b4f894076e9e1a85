"""The Worker's block RPCs, between workers: `SendBlocks` (a peer fetches blocks over the peer
plane), `HotBlocks` (this worker's hottest block hashes, for a peer's warm start) and `PullBlocks`
(a draining peer asks this worker to pull blocks from it; worker/server/scaling.py). Each passes
the server's `RpcGate` first; with peer transfer off, SendBlocks and PullBlocks answer
FAILED_PRECONDITION. Torch-free."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from contracts.wire import to_send_blocks_input
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from worker.peer.errors import PeerTransferOff
from worker.server.responses import LOAD_WAIT_S, handover_room

if TYPE_CHECKING:
    from worker.engine.async_engine import AsyncEngine
    from worker.peer.config import AskPeer
    from worker.peer.plane import PeerPlane
    from worker.server.scaling import Scaling
    from worker.server.status import RpcGate

_SEND_MARGIN_S = 1.0     # SendBlocks: no send is queued with less of the caller's deadline left


class BlockRPCs:
    """The three handlers of one WorkerServer. `peer()` is its peer plane (None until loaded, or
    with peer transfer off); `draining()` is True once its drain began (PullBlocks: UNAVAILABLE)."""

    def __init__(self, worker_id: str, gate: RpcGate, scaling: Scaling, ask: AskPeer,
                 peer: Callable[[], PeerPlane | None], draining: Callable[[], bool]) -> None:
        self.worker_id = worker_id
        self._gate = gate
        self._scaling = scaling
        self._ask = ask
        self._peer = peer
        self._draining = draining

    async def send_blocks(self, request: pb.SendBlocksRequest | str,
                          context: grpc.aio.ServicerContext) -> pb.SendBlocksResponse:
        ae = await self._gate.ready(context)
        if isinstance(request, str):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request)
        return await self._gate.guard(context, self._send_now(ae, request, context))

    async def _send_now(self, ae: AsyncEngine, request: pb.SendBlocksRequest,
                        context: grpc.aio.ServicerContext) -> pb.SendBlocksResponse:
        inp = to_send_blocks_input(request)
        peer = self._peer()
        if peer is None:
            raise PeerTransferOff(f"worker {self.worker_id} has peer transfer off")

        def still_wanted() -> bool:    # the answer must reach the caller before its deadline
            remaining = context.time_remaining()
            return not context.done() and (remaining is None or remaining > _SEND_MARGIN_S)
        num_blocks, num_bytes, reason, unknown = await peer.serve_send(ae, inp, still_wanted)
        return pb.SendBlocksResponse(num_blocks=num_blocks, num_bytes=num_bytes, reason=reason,
                                     generation=peer.me.generation, pair_unknown=unknown)

    async def hot_blocks(self, request: pb.HotBlocksRequest,
                         context: grpc.aio.ServicerContext) -> pb.HotBlocksResponse:
        from worker.engine.commands import HottestBlocks
        from worker.server.scaling import MAX_HOT_BLOCKS
        ae = await self._gate.ready(context)
        hot = await self._gate.guard(context, ae.run(HottestBlocks(max(0, min(request.max_blocks, MAX_HOT_BLOCKS)))))
        peer = self._peer()
        return pb.HotBlocksResponse(block_hashes=[h.to_bytes(16, "big") for h in hot],
                                    generation=peer.me.generation if peer is not None else 0)

    async def pull_blocks(self, request: pb.PullBlocksRequest,
                          context: grpc.aio.ServicerContext) -> pb.PullBlocksResponse:
        ae = await self._gate.ready(context)
        if self._draining():
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_id} is draining")
        peer = self._peer()
        if peer is None:
            await self._gate.fail(context, PeerTransferOff(f"worker {self.worker_id} has peer transfer off"))
        assert peer is not None
        stats = await ae.snapshot(LOAD_WAIT_S)
        return await self._gate.guard(context, self._scaling.serve_pull(
            ae, peer, self._ask, request, handover_room(stats), context.time_remaining()))

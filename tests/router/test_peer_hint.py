"""The router's peer hint: when the picked worker holds fewer leading prompt blocks than
another live worker with a peer plane, the forwarded request names that peer.

`best_peer_hint` is checked as a function; then a real RouterServer forwards to two fake
workers (in-process gRPC servers that answer with the hints they received) over a block
index holding the prompt's leading blocks, so what reaches the worker is what is checked.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from contracts.requests import PeerHint
from contracts.tokenizer import ModelTokenizer
from kvstore.events import Tier
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.config import RouterConfig
from router.index.blocks import BlockIndex
from router.routing.core import Router
from router.routing.pick import best_peer_hint
from router.routing.types import WorkerId
from router.server import RouterServer
from router.workers.registry import WORKER_SERVICE
from tests.support.fake_worker import tiny_tokenizer_files

W0, W1, W2 = WorkerId("w0"), WorkerId("w1"), WorkerId("w2")
PEERS = {W0: "h:1", W1: "h:2", W2: "h:3"}


def test_best_peer_hint_names_the_peer_holding_the_most_blocks() -> None:
    assert best_peer_hint(W0, {W0: 1, W1: 5, W2: 3}, PEERS, 10) == PeerHint("w1", "h:2", 5)
    assert best_peer_hint(W0, {W0: 1, W1: 5, W2: 5}, PEERS, 10) == PeerHint("w1", "h:2", 5)  # tie: lowest id
    assert best_peer_hint(W0, {W0: 1, W1: 9}, PEERS, 4) == PeerHint("w1", "h:2", 4)   # capped to the prompt
    assert best_peer_hint(W1, {W0: 1, W1: 5}, PEERS, 10) is None                       # it holds the most
    assert best_peer_hint(W0, {W0: 4, W1: 9}, PEERS, 4) is None                        # equal once capped
    assert best_peer_hint(W0, {}, PEERS, 10) is None
    # no peer plane on the chosen worker, or on the holder: no hint (or one to the next holder)
    assert best_peer_hint(W0, {W0: 1, W1: 5}, {W1: PEERS[W1]}, 10) is None
    assert best_peer_hint(W0, {W0: 1, W1: 5}, {W0: PEERS[W0]}, 10) is None
    assert best_peer_hint(W0, {W0: 1, W1: 5, W2: 3}, {W0: PEERS[W0], W2: PEERS[W2]}, 10) == PeerHint("w2", "h:3", 3)


class FakeWorker:
    """Serves kvmesh.v1.Worker: GetLoad says whether it has a peer plane; Generate answers with the hints it got
    (as JSON text) and reports `cached_tokens` / `peer_cached_tokens` as a fetching worker would."""

    def __init__(self, worker_id: str, peer_plane: bool, num_cached_blocks: int) -> None:
        self.worker_id, self.peer_plane, self.num_cached_blocks = worker_id, peer_plane, num_cached_blocks
        self.server = grpc.aio.server()
        self.port = 0

    async def start(self) -> str:
        h = health.aio.HealthServicer()
        await h.set(WORKER_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(h, self.server)
        unary = grpc.unary_unary_rpc_method_handler
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(WORKER_SERVICE, {
            "Generate": grpc.unary_stream_rpc_method_handler(self._generate, pb.GenerateRequest.FromString,
                                                             pb.GenerateResponse.SerializeToString),
            "GetLoad": unary(self._load, pb.LoadRequest.FromString, pb.Load.SerializeToString),
            "GetModelInfo": unary(self._info, pb.ModelInfoRequest.FromString, pb.ModelInfo.SerializeToString),
        }),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return f"127.0.0.1:{self.port}"

    async def _generate(self, req: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        hints = [dict(worker_id=h.worker_id, address=h.address, num_blocks=h.num_blocks)
                 for h in req.peer_hints]
        fetched = 4 * hints[0]["num_blocks"] if hints else 0
        yield pb.GenerateResponse(request_id=req.request_id, text=json.dumps(hints), finished=True,
                                  worker_id=self.worker_id, cached_tokens=4 * self.num_cached_blocks + fetched,
                                  peer_cached_tokens=fetched)

    async def _load(self, req: pb.LoadRequest, context: Any) -> pb.Load:
        load = pb.Load(worker_id=self.worker_id, num_free_blocks=100, num_blocks=100)
        if self.peer_plane:
            load.peer.CopyFrom(pb.PeerStats(worker_id=self.worker_id))
        return load

    async def _info(self, req: pb.ModelInfoRequest, context: Any) -> pb.ModelInfo:
        return pb.ModelInfo(model="fake", vocab_size=1000, max_model_len=1000, block_size=4, hash_salt_hex="ab")


async def _route(policy: str, peer_planes: tuple[bool, bool], counts: Mapping[str, int],
                 n: int) -> tuple[list[tuple[str, list[dict[str, Any]]]], Router, list[str]]:
    """Start two fake workers and a router; send `n` requests of a 30-token prompt (7 blocks
    may be cached). Returns (served by, hints received) per request."""
    from contracts.wire import to_generate_input
    fakes = [FakeWorker("w0", peer_planes[0], counts["w0"]), FakeWorker("w1", peer_planes[1], counts["w1"])]
    addresses = [await f.start() for f in fakes]
    server = RouterServer(RouterConfig(worker_addresses=tuple(addresses), http_port=None, routing_policy=policy,
                                       health_interval_s=0.2),
                          tokenizer=ModelTokenizer.from_files(tiny_tokenizer_files()))
    router = server.core
    results = []
    try:
        await server.start()
        await server.wait_ready(10)
        while len(router.live_workers()) < 2:
            await asyncio.sleep(0.02)
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(100, 130))),
                                 sampling=pb.SamplingParams(max_tokens=1))
        hashes = (await router.prepare(to_generate_input(req))).route.block_hashes
        index = server.registry.index = BlockIndex()
        for worker_id, num_blocks in counts.items():
            index.add(WorkerId(worker_id), hashes[:num_blocks], Tier.DEVICE)
        for _ in range(n):
            prepared = await router.prepare(to_generate_input(req))
            async for resp in router.generate(prepared, 10):
                results.append((resp.worker_id, json.loads(resp.text)))
    finally:
        await server.stop(0)
        for f in fakes:
            await f.server.stop(0)
    return results, router, addresses


def test_round_robin_pick_with_fewer_blocks_gets_a_hint_to_the_other() -> None:
    results, router, addresses = asyncio.run(_route("round_robin", (True, True), {"w0": 1, "w1": 5}, 2))
    assert sorted(w for w, _ in results) == ["w0", "w1"]
    for worker, hints in results:
        if worker == "w0":
            assert hints == [dict(worker_id="w1", address=addresses[1], num_blocks=5)]
        else:
            assert hints == []          # w1 holds the most already
    assert router.stats.peer_hints == 1
    # what came from the peer is no index mismatch: w0 reported 4 + 20 cached, 20 of them fetched
    assert router.stats.mismatches == 0 and router.stats.routed_hit_tokens == 4 + 20
    assert router.stats.actual_hit_tokens == 4 + 20


def test_a_hinted_request_queues_only_the_tokens_it_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    """w0 holds 1 block of the 30-token prompt and is hinted to fetch 4 more from w1: the
    router counts 30 − 4 − 16 = 10 tokens queued for prefill there, as for w1's own hit."""
    from router.routing.inflight import InFlightPrefills
    queued: dict[str, int] = {}
    dispatched = InFlightPrefills.dispatched

    def record(self: InFlightPrefills, index: BlockIndex, request_id: str, worker_id: WorkerId, *args: Any,
               **kw: Any) -> None:
        dispatched(self, index, request_id, worker_id, *args, **kw)
        queued[worker_id] = self.queued_tokens(BlockIndex(), [worker_id], args[0])[worker_id]
    monkeypatch.setattr(InFlightPrefills, "dispatched", record)
    results, _, _ = asyncio.run(_route("round_robin", (True, True), {"w0": 1, "w1": 5}, 2))
    assert sorted(w for w, _ in results) == ["w0", "w1"]
    assert queued == {"w0": 10, "w1": 10}


def test_kv_aware_picks_the_holder_and_needs_no_hint() -> None:
    results, router, _ = asyncio.run(_route("kv_aware", (True, True), {"w0": 1, "w1": 5}, 2))
    assert results == [("w1", []), ("w1", [])] and router.stats.peer_hints == 0


@pytest.mark.parametrize("peer_planes", [(True, False), (False, True)])
def test_no_hint_unless_both_workers_have_a_peer_plane(peer_planes: tuple[bool, bool]) -> None:
    results, router, _ = asyncio.run(_route("round_robin", peer_planes, {"w0": 1, "w1": 5}, 2))
    assert [hints for _, hints in results] == [[], []] and router.stats.peer_hints == 0

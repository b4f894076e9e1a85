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
        self.pulls: list[pb.PullBlocksRequest] = []     # PullBlocks calls, as received
        self.pull_gate: asyncio.Event | None = None     # PullBlocks waits for it when set
        self.refuse_pulls = False                       # PullBlocks answers FAILED_PRECONDITION

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
            "PullBlocks": unary(self._pull, pb.PullBlocksRequest.FromString, pb.PullBlocksResponse.SerializeToString),
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

    async def _pull(self, req: pb.PullBlocksRequest, context: Any) -> pb.PullBlocksResponse:
        self.pulls.append(req)
        if self.pull_gate is not None:
            await self.pull_gate.wait()
        if self.refuse_pulls:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"worker {self.worker_id} refuses (test)")
        return pb.PullBlocksResponse(num_blocks=len(req.block_hashes))

    async def _info(self, req: pb.ModelInfoRequest, context: Any) -> pb.ModelInfo:
        return pb.ModelInfo(model="fake", vocab_size=1000, max_model_len=1000, block_size=4, hash_salt_hex="ab")


async def _route(policy: str, peer_planes: tuple[bool, bool], counts: Mapping[str, int], n: int,
                 busy: Mapping[str, int] | None = None, replicate_ahead: bool = True,
                 pulls: Mapping[str, str] | None = None,
                 fakes_out: list[FakeWorker] | None = None) -> tuple[list[tuple[str, list[dict[str, Any]]]],
                                                                     Router, list[str]]:
    """Start two fake workers and a router; send `n` requests of a 30-token prompt (7 blocks
    may be cached), with `busy` requests counted in flight on a worker beside them. `pulls`:
    a worker's PullBlocks "gate"d (never answers) or "refuse"d. Returns (served by, hints
    received) per request; `fakes_out` gets the workers."""
    from contracts.wire import to_generate_input
    fakes = [FakeWorker("w0", peer_planes[0], counts["w0"]), FakeWorker("w1", peer_planes[1], counts["w1"])]
    for fake in fakes:
        mode = (pulls or {}).get(fake.worker_id)
        fake.pull_gate, fake.refuse_pulls = (asyncio.Event() if mode == "gate" else None), mode == "refuse"
    if fakes_out is not None:
        fakes_out[:] = fakes
    addresses = [await f.start() for f in fakes]
    server = RouterServer(RouterConfig(worker_addresses=tuple(addresses), http_port=None, routing_policy=policy,
                                       health_interval_s=0.2, replicate_ahead=replicate_ahead),
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
        for entry in server.registry.live():
            entry.in_flight = (busy or {}).get(entry.worker_id or "", 0)
        for _ in range(n):
            prepared = await router.prepare(to_generate_input(req))
            async for resp in router.generate(prepared, 10):
                results.append((resp.worker_id, json.loads(resp.text)))
        if busy:
            await asyncio.sleep(0.3)     # a background pull's answer
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


def _busy_holder(busy: int = 1, n: int = 1, **kw: Any) -> tuple[list[tuple[str, list[dict[str, Any]]]], Router,
                                                                 list[str], list[FakeWorker]]:
    """kv_aware over w0 (1 block of the prompt) and w1 (5), w1 with `busy` requests in flight
    beside the test's: one in flight makes w0 the pick (its fetch of 4 blocks is cheaper than
    queueing beside w1's request)."""
    fakes: list[FakeWorker] = []
    results, router, addresses = asyncio.run(_route("kv_aware", (True, True), {"w0": 1, "w1": 5}, n, busy={"w1": busy},
                                                    fakes_out=fakes, **kw))
    return results, router, addresses, fakes


def test_replicate_ahead_sends_the_request_to_the_holder_and_pulls_the_prefix_in_the_background() -> None:
    results, router, addresses, fakes = _busy_holder()
    assert results == [("w1", [])]                          # the holder serves it: no fetch on its path
    assert router.stats.peer_hints == 0 and router.stats.mismatches == 0 and router.stats.routed_hit_tokens == 20
    [pull] = fakes[0].pulls                                 # w0 pulls w1's 5 blocks of the prompt
    assert (pull.sender_id, pull.sender_address, len(pull.block_hashes), pull.replica) == ("w1", addresses[1], 5, True)
    assert router.replicas is not None
    assert (router.replicas.counters.redirected, router.replicas.counters.pulls) == (1, 1)
    assert router.replicas.counters.pulled_blocks == 5 and router.replicas.counters.failed_pulls == 0
    assert fakes[1].pulls == []
    from router.observe.metrics import _CoreCollector  # what /metrics exports of them
    exported = {m.name: m.samples[0].value for m in _CoreCollector(router).collect() if "replica" in m.name}
    assert exported == {"kvmesh:router_replica_redirects": 1, "kvmesh:router_replica_pulls": 1,
                        "kvmesh:router_replica_pulled_blocks": 5, "kvmesh:router_replica_pull_failures": 0}


def test_without_replicate_ahead_the_picked_worker_fetches_on_the_request_path() -> None:
    results, router, addresses, fakes = _busy_holder(replicate_ahead=False)
    assert results == [("w0", [dict(worker_id="w1", address=addresses[1], num_blocks=5)])]
    assert router.replicas is None and fakes[0].pulls == [] and router.stats.peer_hints == 1


def test_a_holder_at_its_load_cap_is_not_sent_more_and_the_pick_fetches() -> None:
    # 30 in flight on w1: the cap is ceil(1.25 x 31 / 2) = 20, the holders' 1.5 x 20 = 30
    results, router, addresses, fakes = _busy_holder(busy=30)
    assert results == [("w0", [dict(worker_id="w1", address=addresses[1], num_blocks=5)])]
    assert fakes[0].pulls == [] and router.replicas is not None and router.replicas.counters.redirected == 0


def test_one_pull_per_worker_and_prefix_at_a_time() -> None:
    # w0's pull never answers: still running at the next two requests, which go to the holder too
    # (3 in flight on w1 keep w0 the pick: the cap is ceil(1.25 x 4 / 2) = 3, the holders' 4.5)
    results, router, _, fakes = _busy_holder(busy=3, n=3, pulls={"w0": "gate"})
    assert [w for w, _ in results] == ["w1", "w1", "w1"] and len(fakes[0].pulls) == 1
    assert router.replicas is not None and router.replicas.counters.redirected == 3
    assert router.replicas.counters.pulled_blocks == 0      # cancelled as the router stopped


def test_a_failed_pull_is_counted_and_changes_nothing_else() -> None:
    results, router, _, fakes = _busy_holder(pulls={"w0": "refuse"})
    assert results == [("w1", [])] and len(fakes[0].pulls) == 1      # served by the holder all the same
    assert router.replicas is not None and router.replicas.counters.failed_pulls == 1

"""Peer transfer in the worker (worker/peer.py, the SendBlocks RPC, fetch-or-recompute).

Unit tests run the cost decision, the engine-thread helpers and the fault hook against
oracles (hand-computed costs, the pool's own gather, an engine without any cache). The
two-worker test runs two WorkerServers of the tiny model in this process, each in its own
transfer group rank over gloo on loopback: a hinted request is fetched, a corrupted block
is recomputed, bad SendBlocks input is INVALID_ARGUMENT — and every output equals a
cache-less engine's. The same on SmolLM2 across processes: tests/integration/test_peer.py.
"""
from __future__ import annotations

import time
from typing import Any

import grpc
import pytest
import torch

from kvstore.keys import BlockHash, block_hashes
from kvstore.transfer import MAX_TRANSFER_ID, BlockTransfer
from kvstore.transfer_group import TransferConfig, TransferGroup, free_port
from kvstore.transfer_cost import LinkEstimate
from contracts.requests import PeerHint, SendBlocksInput
from contracts.wire import to_send_blocks_request
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from proto.kvmesh.v1 import kvmesh_pb2_grpc as pb_grpc
from tests.worker.test_server import LoopThread, collect, request
from worker.engine import Engine, EngineConfig
from worker.peer import Decision, FaultPlan, PeerConfig, PeerPlane, PlanView, good_leading_run, plan_fetch
from worker.sampling import SamplingParams
from worker.server import WorkerServer, WorkerServerConfig

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
H = [BlockHash(1000 + i) for i in range(10)]


def _cfg(tiny_model_dir: Any, **kw: Any) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir("llama-gqa")), block_size=4, **({"num_blocks": 128} | kw))


def _view(bandwidth: float = 1e9, latency: float = 1e-3, prefill: float = 1000.0, **kw: Any) -> PlanView:
    base = dict(rank=1, world_size=3, links={0: LinkEstimate(bandwidth, latency), 2: None}, lost={},
                prefill_tokens_per_s=prefill, checksum_bytes_s=float("inf"), bytes_per_block=1_000_000,
                block_size=16)
    return PlanView(**(base | kw))  # type: ignore[arg-type]


def _hint(rank: int, n: int) -> PeerHint:
    return PeerHint(f"w{rank}", f"127.0.0.1:{5000 + rank}", rank, n)


# -- the decision -------------------------------------------------------------------------
def test_plan_fetch_weighs_link_against_prefill() -> None:
    # 8 missing blocks of 1 MB at 1 GB/s + 1 ms = 9 ms; recomputing their 128 tokens at
    # 1,000 tokens/s = 128 ms: fetch them, right after the 2 held here.
    plan = plan_fetch(H, 2, 100, [_hint(0, 10)], _view())
    assert plan.decision is Decision.FETCH and plan.block_hashes == tuple(H[2:10]) and plan.num_local == 2
    assert plan.fetch_s == pytest.approx(0.009) and plan.recompute_s == pytest.approx(0.128)
    # 8 MB at 50 MB/s = 160 ms + 1 ms > 128 ms: recompute
    slow = plan_fetch(H, 2, 100, [_hint(0, 10)], _view(bandwidth=5e7))
    assert slow.decision is Decision.RECOMPUTE and slow.fetch_s == pytest.approx(0.161)
    # the host tier stages at most 3 blocks; the peer's count and the prompt cap it too
    assert plan_fetch(H, 2, 3, [_hint(0, 10)], _view()).block_hashes == tuple(H[2:5])
    assert plan_fetch(H[:6], 2, 100, [_hint(0, 10)], _view()).block_hashes == tuple(H[2:6])
    assert plan_fetch(H, 2, 100, [_hint(0, 4)], _view()).block_hashes == tuple(H[2:4])


def test_plan_fetch_ignores_unusable_hints() -> None:
    for hints, view in (([], _view()), ([_hint(1, 10)], _view()),            # itself
                        ([_hint(3, 10)], _view()), ([_hint(2, 10)], _view()),  # no such rank; unmeasured
                        ([_hint(0, 10)], _view(lost={0: "Connection closed by peer"}))):
        assert plan_fetch(H, 2, 100, hints, view).decision is Decision.NO_PEER, (hints, view.lost)
    assert plan_fetch(H, 6, 100, [_hint(0, 6)], _view()).decision is Decision.LOCAL
    # of several hints, the usable one holding the most blocks
    best = plan_fetch(H, 0, 100, [_hint(0, 4), _hint(2, 10), _hint(0, 7)], _view())
    assert best.hint == _hint(0, 7) and len(best.block_hashes) == 7


def test_good_leading_run_stops_at_the_first_bad_or_unexpected_block() -> None:
    assert good_leading_run(H[:4], [True] * 4, H[:4]) == 4
    assert good_leading_run(H[:4], [True, True, False, True], H[:4]) == 2
    assert good_leading_run([H[0], H[5], H[2]], [True] * 3, H[:3]) == 1
    assert good_leading_run(H[:5], [True] * 5, H[:3]) == 3       # more than asked: the rest is unused


def test_fault_plan_acts_per_send_in_order() -> None:
    plan = FaultPlan(["ok", "corrupt:1", "corrupt:9"])
    blocks = torch.randn(2, 2, 3, 4, 2, 8)                       # [L, 2, n, bs, H, D]
    for expected_changed in ([], [1], [], []):                   # the 4th send has no action: ok
        before = blocks.clone()
        plan(7, blocks)
        changed = [j for j in range(3) if not torch.equal(before[:, :, j], blocks[:, :, j])]
        assert changed == expected_changed
        if changed:
            assert int((before.view(torch.uint8) != blocks.view(torch.uint8)).sum()) == 1
    with pytest.raises(ValueError, match="faults"):
        PeerConfig(transfer=None, faults=("corrupt:x",))         # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefill_probe_tokens"):
        PeerConfig(transfer=None, prefill_probe_tokens=0)        # type: ignore[arg-type]


# -- on the engine -------------------------------------------------------------------------
def test_held_blocks_come_from_the_pool_and_the_host_tier(tiny_model_dir: Any) -> None:
    eng = Engine(_cfg(tiny_model_dir, num_blocks=12, kv_offload_gib=0.001, max_model_len=48))
    prompt = list(range(30, 55))                                # 6 full blocks
    eng.generate(prompt, GREEDY)
    hashes = block_hashes(prompt, 4, eng.salt)
    for i in range(3):                                          # evicts the prompt's tail to host
        eng.generate([100 + 7 * i + j for j in range(25)], GREEDY)
    on_device = [eng.store.pool.get_cached_block(h) is not None for h in hashes]
    in_host = [h in eng.store.host for h in hashes]                   # type: ignore[operator]
    assert not all(on_device) and all(d or h for d, h in zip(on_device, in_host))
    assert eng.store.lookup(hashes).num_blocks == 6
    assert eng.store.lookup(hashes[:3] + [BlockHash(7)] + hashes[4:]).num_blocks == 3
    held = eng.store.read(hashes + [BlockHash(7)], torch.device("cpu"))
    assert held.num_blocks == 6 and held.blocks is not None
    for j, h in enumerate(hashes):                              # oracle: each tier's own copy
        block_id = eng.store.pool.get_cached_block(h)
        want = eng.store.kv.gather_blocks([block_id]) if block_id is not None else eng.store.host.read([h])  # type: ignore[union-attr]
        assert torch.equal(held.blocks[:, :, j:j + 1], want), j
    assert eng.store.read([BlockHash(7)], torch.device("cpu")) == (0, None)


@pytest.mark.parametrize("num_stored", [6, 2])
def test_staged_blocks_are_onloaded_and_output_is_unchanged(tiny_model_dir: Any, num_stored: int) -> None:
    """Blocks another engine computed, stored in a staging tier attached to an engine without
    one: admission onloads them, and the tokens equal a cache-less engine's."""
    owner, puller = Engine(_cfg(tiny_model_dir)), Engine(_cfg(tiny_model_dir))
    oracle = Engine(_cfg(tiny_model_dir, enable_prefix_caching=False))
    prompt = list(range(60, 87))                                # 6 full blocks + 3 tokens
    want = oracle.generate(prompt, GREEDY)[0].token_ids
    assert owner.generate(prompt, GREEDY)[0].token_ids == want
    hashes = block_hashes(prompt, 4, owner.salt)
    held = owner.store.read(hashes[:num_stored], torch.device("cpu"))
    assert puller.store.host is None
    size = puller.layout.blocks_for(puller.max_model_len)
    tier = puller.store.ensure_host_tier(size)
    assert puller.store.host is tier and puller.store.ensure_host_tier(size) is tier
    assert tier.num_blocks == puller.layout.blocks_for(puller.max_model_len)
    assert puller.store.stage(hashes[:num_stored], held.blocks) == num_stored   # type: ignore[arg-type]
    out = puller.generate(prompt, GREEDY)[0]
    assert out.token_ids == want and out.num_cached_tokens == 4 * num_stored
    assert puller.stats().num_onloaded_blocks == num_stored
    puller.check_integrity()


def test_measure_prefill_leaves_no_cached_blocks(tiny_model_dir: Any) -> None:
    eng = Engine(_cfg(tiny_model_dir))
    assert eng.measure_prefill(64) > 0
    assert eng.store.pool.num_cached_blocks == 0 and eng.store.pool.num_used_blocks == 0 and not eng.has_unfinished()


def test_observed_prefills_raise_the_prefill_figure_only(tiny_model_dir: Any) -> None:
    group = TransferGroup.form(TransferConfig(rank=0, world_size=1, master_port=free_port()))
    plane = PeerPlane(Engine(_cfg(tiny_model_dir)), group, BlockTransfer(group), {}, 100.0, 1e9)
    try:
        for tokens, seconds, rate in ((64, 0.5, 128.0), (64, 1.0, 128.0), (16, 0.001, 128.0), (300, 1.0, 300.0)):
            plane.observe_prefill(tokens, seconds)                # 16 tokens: too few to tell
            assert plane.figures().prefill_tokens_per_s == rate
        assert plane.view().prefill_tokens_per_s == 300.0 and plane.view().block_size == 4
    finally:
        plane.close()


# -- two workers, one transfer group -------------------------------------------------------
def _send_blocks(channel: grpc.Channel, req: pb.SendBlocksRequest | bytes) -> pb.SendBlocksResponse:
    call = channel.unary_unary("/kvmesh.v1.Worker/SendBlocks", request_serializer=None,
                               response_deserializer=pb.SendBlocksResponse.FromString)
    return call(req if isinstance(req, bytes) else req.SerializeToString(), timeout=10)


def _wait_for(fn: Any, what: str, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := fn()):
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
    return value


def test_two_workers_fetch_recompute_corrupt_and_bad_input(tiny_model_dir: Any) -> None:
    loop = LoopThread()
    port = free_port()
    group = dict(world_size=2, dist_init_addr=f"127.0.0.1:{port}", transfer_timeout_s=5.0)
    engines = [Engine(_cfg(tiny_model_dir, check_integrity=True)) for _ in range(2)]
    oracle = Engine(_cfg(tiny_model_dir, enable_prefix_caching=False))
    servers = [WorkerServer(engines[0].cfg, WorkerServerConfig(worker_id="w-a", rank=0, **group,
                                                               transfer_faults=("ok", "corrupt:1")), engines[0]),
               WorkerServer(engines[1].cfg, WorkerServerConfig(worker_id="w-b", rank=1, **group), engines[1])]
    try:
        ports = [loop.run(s.start()) for s in servers]
        for s in servers:
            loop.run(s.wait_ready(60))
        with grpc.insecure_channel(f"127.0.0.1:{ports[0]}") as ca, grpc.insecure_channel(f"127.0.0.1:{ports[1]}") as cb:
            a, b = pb_grpc.WorkerStub(ca), pb_grpc.WorkerStub(cb)
            figures = b.GetLoad(pb.LoadRequest()).peer
            assert (figures.rank, figures.world_size, figures.backend) == (1, 2, "gloo")
            assert figures.prefill_tokens_per_s > 0 and figures.checksum_bytes_s > 0
            assert [(link.rank, link.lost) for link in figures.links] == [(0, "")]
            assert figures.links[0].bandwidth_bytes_s > 0 and figures.links[0].latency_s > 0
            hint = pb.PeerHint(worker_id="w-a", address=f"127.0.0.1:{ports[0]}", rank=0, num_blocks=20)

            def run(stub: Any, prompt: list[int], hinted: bool = False) -> tuple[tuple[int, ...], pb.GenerateResponse]:
                req = request(prompt, max_tokens=6, ignore_eos=True)
                if hinted:
                    req.peer_hints.append(hint)
                ids, _, msgs = collect(stub.Generate(req, timeout=60))
                return tuple(ids), msgs[-1]

            # 1. A computes; B, hinted, fetches all 20 leading blocks (the last token is recomputed)
            p1 = [(7 * i) % 200 + 3 for i in range(81)]
            want1 = oracle.generate(p1, GREEDY)[0].token_ids
            assert run(a, p1)[0] == want1
            got, final = run(b, p1, hinted=True)
            assert got == want1
            assert (final.cached_tokens, final.peer_cached_tokens) == (80, 80)
            load = b.GetLoad(pb.LoadRequest())
            assert (load.peer.fetch_decisions, load.peer.blocks_fetched, load.peer.blocks_bad) == (1, 20, 0)
            assert load.peer.last_decision == "fetch" and load.num_onloaded_blocks == 20
            assert load.peer.last_fetch_estimate_s < load.peer.last_recompute_estimate_s
            spec_bytes = engines[0].layout.bytes_per_block
            assert load.peer.bytes_fetched == 20 * spec_bytes
            _wait_for(lambda: a.GetLoad(pb.LoadRequest()).peer.blocks_sent == 20, "A never saw its send complete")

            # 2. A's second send flips a byte of block 1: B keeps block 0, recomputes the rest
            p2 = [(11 * i) % 200 + 3 for i in range(81)]
            want2 = oracle.generate(p2, GREEDY)[0].token_ids
            assert run(a, p2)[0] == want2
            got, final = run(b, p2, hinted=True)
            assert got == want2 and (final.cached_tokens, final.peer_cached_tokens) == (4, 4)
            load = b.GetLoad(pb.LoadRequest())
            assert (load.peer.blocks_fetched, load.peer.blocks_bad, load.peer.fetch_failures) == (21, 1, 0)

            # 3. B already holds p1: nothing to fetch
            assert run(b, p1, hinted=True)[0] == want1
            assert b.GetLoad(pb.LoadRequest()).peer.last_decision == "local"

            # 4. SendBlocks: what A does not hold is not sent; bad input is INVALID_ARGUMENT
            h1 = block_hashes(p1, 4, engines[0].salt)
            assert _send_blocks(ca, to_send_blocks_request([1, 2], 1, 0, 77)).num_blocks == 0
            bad = {"block_hashes": pb.SendBlocksRequest(dst_rank=1, src_rank=0),
                   "a block hash has 16": pb.SendBlocksRequest(block_hashes=[b"\x01" * 15], dst_rank=1),
                   "dst_rank: -1": to_send_blocks_request(h1, -1, 0, 1),
                   "dst_rank: 0": to_send_blocks_request(h1, 0, 0, 1),
                   "dst_rank: 2": to_send_blocks_request(h1, 2, 0, 1),
                   "src_rank: 1": to_send_blocks_request(h1, 1, 1, 1),
                   "transfer_id": to_send_blocks_request(h1, 1, 0, MAX_TRANSFER_ID + 1),
                   "malformed": b"\xff\xff\xff"}
            for expected, req in bad.items():
                with pytest.raises(grpc.RpcError) as err:
                    _send_blocks(ca, req)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (expected, err.value.details())
                assert expected in err.value.details()
            # a caller whose deadline passed while A copied the blocks gets none: nothing is sent
            owner = servers[0]
            sent = a.GetLoad(pb.LoadRequest()).peer.blocks_sent
            late = loop.run(owner._peer.serve_send(owner._ae, SendBlocksInput(tuple(h1), 1, 0, 99),  # type: ignore[union-attr]
                                                   lambda: False))
            assert late[:2] == (0, 0) and "too late" in late[2]
            assert a.GetLoad(pb.LoadRequest()).peer.blocks_sent == sent
            # and A keeps serving, its pair with B intact: B still fetches a third prompt
            p3 = [(13 * i) % 200 + 3 for i in range(41)]
            assert run(a, p3)[0] == oracle.generate(p3, GREEDY)[0].token_ids
            got, final = run(b, p3, hinted=True)
            assert got == oracle.generate(p3, GREEDY)[0].token_ids and final.peer_cached_tokens == 40
            assert b.GetLoad(pb.LoadRequest()).peer.links[0].lost == ""

            # 5. the hinted peer's control plane does not answer: B recomputes, same tokens
            p4 = [(17 * i) % 200 + 3 for i in range(41)]
            hint.address = f"127.0.0.1:{free_port()}"
            got, final = run(b, p4, hinted=True)
            assert got == oracle.generate(p4, GREEDY)[0].token_ids and final.peer_cached_tokens == 0
            assert b.GetLoad(pb.LoadRequest()).peer.fetch_failures == 1
    finally:
        for s in servers:
            loop.run(s.stop(grace=1))
        loop.close()
    for eng in engines:
        eng.check_integrity()
        assert eng.store.pool.num_used_blocks == 0


def test_send_blocks_without_a_transfer_group_is_failed_precondition(tiny_model_dir: Any) -> None:
    loop = LoopThread()
    engine = Engine(_cfg(tiny_model_dir))
    server = WorkerServer(engine.cfg, WorkerServerConfig(worker_id="w-alone"), engine)
    try:
        port = loop.run(server.start())
        loop.run(server.wait_ready(30))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.RpcError) as err:
                _send_blocks(ch, to_send_blocks_request([5], 1, 0, 1))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            # a hint is ignored by a worker outside any group: it just computes
            req = request(list(range(3, 30)), max_tokens=4, ignore_eos=True)
            req.peer_hints.append(pb.PeerHint(worker_id="w-x", address="127.0.0.1:1", rank=0, num_blocks=6))
            ids, _, msgs = collect(pb_grpc.WorkerStub(ch).Generate(req, timeout=30))
            assert len(ids) == 4 and msgs[-1].peer_cached_tokens == 0
            assert not pb_grpc.WorkerStub(ch).GetLoad(pb.LoadRequest()).HasField("peer")
    finally:
        loop.run(server.stop(grace=1))
        loop.close()

"""Peer transfer in the worker (worker/peer/plane.py, the SendBlocks RPC, fetch-or-recompute).

Unit tests run the cost decision, the engine-thread helpers and the fault hook against
oracles (hand-computed costs, the pool's own gather, an engine without any cache). The
two-worker test runs two WorkerServers of the tiny model in this process, each in its own
peer plane, pairs formed on demand over gloo on loopback: a hinted request is fetched, a
corrupted block is recomputed, a rogue SendBlocks (a send nobody receives) breaks one pair
which the next fetch forms anew, bad SendBlocks input is INVALID_ARGUMENT — and every output
equals a cache-less engine's. Across processes (a peer killed and restarted, three workers
with one leaving): tests/integration/test_peer.py.
"""
from __future__ import annotations

import time
from typing import Any

import grpc
import pytest
import torch

from contracts.requests import PeerHint, SendBlocksInput
from contracts.wire import to_send_blocks_request
from kvstore.keys import BlockHash, block_hashes
from kvstore.transfer.blocks import MAX_TRANSFER_ID
from kvstore.transfer.cost import LinkEstimate
from kvstore.transfer.group import free_port
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from tests.support.loop_thread import LoopThread
from tests.worker.test_server import collect, request
from worker.engine.engine import Engine, EngineConfig
from worker.engine.sampling import SamplingParams
from worker.peer.config import PeerConfig
from worker.peer.plan import ASSUMED_LINK, Decision, FaultPlan, PlanView, good_leading_run, plan_fetch
from worker.peer.plane import PeerPlane
from worker.server.service import WorkerServer, WorkerServerConfig

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
H = [BlockHash(1000 + i) for i in range(10)]


def _cfg(tiny_model_dir: Any, **kw: Any) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir("llama-gqa")), block_size=4, **({"num_blocks": 128} | kw))


def _view(bandwidth: float = 1e9, latency: float = 1e-3, prefill: float = 1000.0, **kw: Any) -> PlanView:
    base = dict(worker_id="w1", links={"w0": LinkEstimate(bandwidth, latency)},
                prefill_tokens_per_s=prefill, checksum_bytes_s=float("inf"), bytes_per_block=1_000_000,
                block_size=16)
    return PlanView(**(base | kw))  # type: ignore[arg-type]


def _hint(i: int, n: int) -> PeerHint:
    return PeerHint(f"w{i}", f"127.0.0.1:{5000 + i}", n)


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
    # a hand-off (force): the blocks are fetched even where recomputing looks cheaper
    forced = plan_fetch(H, 2, 100, [_hint(0, 10)], _view(bandwidth=5e7), force=True)
    assert forced.decision is Decision.FETCH and forced.block_hashes == tuple(H[2:10])


def test_plan_fetch_ignores_unusable_hints() -> None:
    for hints in ([], [_hint(1, 10)], [PeerHint("", "127.0.0.1:1", 10)]):   # none, itself, no id
        assert plan_fetch(H, 2, 100, hints, _view()).decision is Decision.NO_PEER, hints
    assert plan_fetch(H, 6, 100, [_hint(0, 6)], _view()).decision is Decision.LOCAL
    # a peer no pair has measured yet: the assumed link (1 GB/s, 1 ms) until one forms
    plan = plan_fetch(H, 2, 100, [_hint(2, 10)], _view())
    assert plan.decision is Decision.FETCH and plan.fetch_s == pytest.approx(
        ASSUMED_LINK.latency_s + 8e6 / ASSUMED_LINK.bandwidth_bytes_s)
    # of several hints, the usable one holding the most blocks
    best = plan_fetch(H, 0, 100, [_hint(0, 4), _hint(2, 9), _hint(0, 7)], _view())
    assert best.hint == _hint(2, 9) and len(best.block_hashes) == 9


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
        PeerConfig("w", faults=("corrupt:x",))
    with pytest.raises(ValueError, match="prefill_probe_tokens"):
        PeerConfig("w", prefill_probe_tokens=0)
    with pytest.raises(ValueError, match="store_port"):
        PeerConfig("w", store_port=70000)


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
    plane = PeerPlane(Engine(_cfg(tiny_model_dir)), PeerConfig("w-solo"), 100.0, 1e9)
    try:
        for tokens, seconds, rate in ((64, 0.5, 128.0), (64, 1.0, 128.0), (16, 0.001, 128.0), (300, 1.0, 300.0)):
            plane.observe_prefill(tokens, seconds)                # 16 tokens: too few to tell
            assert plane.figures().prefill_tokens_per_s == rate
        assert plane.view().prefill_tokens_per_s == 300.0 and plane.view().block_size == 4
    finally:
        plane.close()


# -- two workers, pairs formed on demand ---------------------------------------------------
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


def _pair_fields(key: str, store: str, **kw: Any) -> dict[str, Any]:
    return dict(pair_key=key, store_address=store, receiver_id="w-b", **kw)


TIMEOUT_S = 3.0          # transfers and pair formation in the two-worker test


@pytest.fixture(scope="module")
def two_workers(tiny_model_dir: Any) -> Any:
    """A (sends; its second send corrupts block 1) and B, both with peer transfer on."""
    loop = LoopThread()
    engines = [Engine(_cfg(tiny_model_dir, check_integrity=True)) for _ in range(2)]
    common = dict(peer_transfer=True, transfer_timeout_s=TIMEOUT_S)
    servers = [WorkerServer(engines[0].cfg, WorkerServerConfig(worker_id="w-a", **common,   # type: ignore[arg-type]
                                                               transfer_faults=("ok", "corrupt:1")), engines[0]),
               WorkerServer(engines[1].cfg, WorkerServerConfig(worker_id="w-b", **common), engines[1])]  # type: ignore[arg-type]
    try:
        ports = [loop.run(s.start()) for s in servers]
        for s in servers:
            loop.run(s.wait_ready(60))
        with grpc.insecure_channel(f"127.0.0.1:{ports[0]}") as ca, grpc.insecure_channel(f"127.0.0.1:{ports[1]}") as cb:
            yield loop, servers, engines, ports, ca, cb
    finally:
        for s in servers:
            loop.run(s.stop(grace=1))
        loop.close()
    for eng in engines:
        eng.check_integrity()
        assert eng.store.pool.num_used_blocks == 0


def _runner(stub: Any, hint: pb.PeerHint) -> Any:
    def run(prompt: list[int], hinted: bool = False) -> tuple[tuple[int, ...], pb.GenerateResponse]:
        req = request(prompt, max_tokens=6, ignore_eos=True)
        if hinted:
            req.peer_hints.append(hint)
        ids, _, msgs = collect(stub.Generate(req, timeout=60))
        return tuple(ids), msgs[-1]
    return run


@pytest.mark.server
def test_two_workers_fetch_recompute_corrupt_and_bad_input(tiny_model_dir: Any, two_workers: Any) -> None:
    loop, servers, engines, ports, ca, cb = two_workers
    oracle = Engine(_cfg(tiny_model_dir, enable_prefix_caching=False))
    a, b = pb_grpc.WorkerStub(ca), pb_grpc.WorkerStub(cb)
    figures = b.GetLoad(pb.LoadRequest()).peer
    assert (figures.worker_id, figures.backend, figures.pairs_formed) == ("w-b", "gloo", 0)
    assert figures.generation > 0 and figures.store_address.startswith("127.0.0.1:")
    assert figures.prefill_tokens_per_s > 0 and figures.checksum_bytes_s > 0 and not figures.links
    hint = pb.PeerHint(worker_id="w-a", address=f"127.0.0.1:{ports[0]}", num_blocks=20)
    run_a, run_b = _runner(a, hint), _runner(b, hint)

    # 1. A computes; B, hinted, forms a pair with A and fetches all 20 leading blocks
    p1 = [(7 * i) % 200 + 3 for i in range(81)]
    want1 = oracle.generate(p1, GREEDY)[0].token_ids
    assert run_a(p1)[0] == want1
    got, final = run_b(p1, hinted=True)
    assert got == want1
    assert (final.cached_tokens, final.peer_cached_tokens) == (80, 80)
    load = b.GetLoad(pb.LoadRequest())
    assert (load.peer.fetch_decisions, load.peer.blocks_fetched, load.peer.blocks_bad) == (1, 20, 0)
    assert load.peer.last_decision == "fetch" and load.num_onloaded_blocks == 20 and load.peer.pairs_formed == 1
    assert [(link.worker_id, link.lost) for link in load.peer.links] == [("w-a", "")]
    assert load.peer.links[0].bandwidth_bytes_s > 0 and load.peer.links[0].latency_s > 0
    assert load.peer.bytes_fetched == 20 * engines[0].layout.bytes_per_block
    _wait_for(lambda: a.GetLoad(pb.LoadRequest()).peer.blocks_sent == 20, "A never saw its send complete")

    # 2. A's second send flips a byte of block 1: B keeps block 0, recomputes the rest; same pair
    p2 = [(11 * i) % 200 + 3 for i in range(81)]
    want2 = oracle.generate(p2, GREEDY)[0].token_ids
    assert run_a(p2)[0] == want2
    got, final = run_b(p2, hinted=True)
    assert got == want2 and (final.cached_tokens, final.peer_cached_tokens) == (4, 4)
    load = b.GetLoad(pb.LoadRequest())
    assert (load.peer.blocks_fetched, load.peer.blocks_bad, load.peer.fetch_failures) == (21, 1, 0)
    assert load.peer.pairs_formed == 1

    # 3. B already holds p1: nothing to fetch
    assert run_b(p1, hinted=True)[0] == want1
    assert b.GetLoad(pb.LoadRequest()).peer.last_decision == "local"

    # 4. SendBlocks: what A does not hold is not sent; bad input is INVALID_ARGUMENT
    h1 = block_hashes(p1, 4, engines[0].salt)
    store_b = figures.store_address
    ok = _pair_fields("k1", store_b, new_pair=True)
    assert _send_blocks(ca, to_send_blocks_request([1, 2], 77, **ok)).num_blocks == 0
    unknown = _send_blocks(ca, to_send_blocks_request(h1, 78, **_pair_fields("nope", store_b)))
    assert unknown.pair_unknown and unknown.num_blocks == 0 and "no live pair" in unknown.reason
    assert unknown.generation == a.GetLoad(pb.LoadRequest()).peer.generation
    bad = {"block_hashes": pb.SendBlocksRequest(**ok),
           "a block hash has 16": pb.SendBlocksRequest(block_hashes=[b"\x01" * 15], **ok),
           "pair_key": to_send_blocks_request(h1, 1, **(ok | dict(pair_key=""))),
           "store_address": to_send_blocks_request(h1, 1, **(ok | dict(store_address="nowhere"))),
           "receiver_id: ''": to_send_blocks_request(h1, 1, **(ok | dict(receiver_id=""))),
           "receiver_id: 'w-a' is this worker": to_send_blocks_request(h1, 1, **(ok | dict(receiver_id="w-a"))),
           "sender_id: 'w-z'": to_send_blocks_request(h1, 1, **(ok | dict(sender_id="w-z"))),
           "transfer_id": to_send_blocks_request(h1, MAX_TRANSFER_ID + 1, **ok),
           "malformed": b"\xff\xff\xff"}
    for expected, req in bad.items():
        with pytest.raises(grpc.RpcError) as err:
            _send_blocks(ca, req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (expected, err.value.details())
        assert expected in err.value.details()
    # a caller whose deadline passed while A copied the blocks gets none: nothing is sent
    owner = servers[0]
    sent = a.GetLoad(pb.LoadRequest()).peer.blocks_sent
    late = loop.run(owner._peer.serve_send(owner._ae, SendBlocksInput(tuple(h1), 99, **ok),  # type: ignore[union-attr]
                                           lambda: False))
    assert late[:2] == (0, 0) and "too late" in late[2]
    assert a.GetLoad(pb.LoadRequest()).peer.blocks_sent == sent
    # and A keeps serving, its pair with B intact: B still fetches a third prompt
    p3 = [(13 * i) % 200 + 3 for i in range(41)]
    assert run_a(p3)[0] == oracle.generate(p3, GREEDY)[0].token_ids
    got, final = run_b(p3, hinted=True)
    assert got == oracle.generate(p3, GREEDY)[0].token_ids
    load = b.GetLoad(pb.LoadRequest())
    assert load.peer.pairs_formed == 1 and [(link.worker_id, link.lost) for link in load.peer.links] == [("w-a", "")]
    # 10 tiny-model blocks: with the link now measured, a loaded machine may price the fetch
    # above recomputing 40 tokens (the cost model's call, worker/peer/plan.py); a fetch gets all
    assert load.peer.last_decision in ("fetch", "recompute")
    assert final.peer_cached_tokens == (40 if load.peer.last_decision == "fetch" else 0)
    assert b.GetLoad(pb.LoadRequest()).peer.pairs_broken == 0

    # 5. the hinted peer's control plane does not answer: B recomputes, same tokens. B's prefill
    # figure is set to 1,000 tokens/s first, so its cost model tries the fetch (recomputing 40 tokens:
    # 40 ms, the assumed link 1 ms) rather than recomputing from the start: the tiny model's measured
    # prefill (~40,000 tokens/s on a fast CPU) prices the two about equal
    servers[1]._peer.prefill_tokens_per_s = 1000.0   # type: ignore[union-attr]
    p4 = [(17 * i) % 200 + 3 for i in range(41)]
    gone = pb.PeerHint(worker_id="w-gone", address=f"127.0.0.1:{free_port()}", num_blocks=10)
    got, final = _runner(b, gone)(p4, hinted=True)
    assert got == oracle.generate(p4, GREEDY)[0].token_ids and final.peer_cached_tokens == 0
    assert b.GetLoad(pb.LoadRequest()).peer.fetch_failures == 1


@pytest.mark.server
def test_rogue_send_blocks_breaks_one_pair_and_the_next_fetch_forms_a_new_one(tiny_model_dir: Any,
                                                                              two_workers: Any) -> None:
    """A rogue sender: SendBlocks for 8 blocks A holds with nobody to receive them —
    on B's live pair with A (its key read from B: the worst case), and on a new key at B's
    store that B never joins. A's sends time out; only that pair breaks; B's next hinted
    fetch finds its pair unknown, forms a new one and gets every block."""
    loop, servers, engines, ports, ca, cb = two_workers
    oracle = Engine(_cfg(tiny_model_dir, enable_prefix_caching=False))
    a, b = pb_grpc.WorkerStub(ca), pb_grpc.WorkerStub(cb)
    hint = pb.PeerHint(worker_id="w-a", address=f"127.0.0.1:{ports[0]}", num_blocks=20)
    run_a, run_b = _runner(a, hint), _runner(b, hint)
    p1 = [(19 * i) % 200 + 3 for i in range(41)]
    want = oracle.generate(p1, GREEDY)[0].token_ids
    assert run_a(p1)[0] == want
    if servers[1]._peer.pairs.receiving("w-a") is None:          # (run alone: form the pair first)
        run_b([(23 * i) % 200 + 3 for i in range(41)], hinted=True)
    live = servers[1]._peer.pairs.receiving("w-a")
    assert live is not None and live.ready.done()
    store_b = b.GetLoad(pb.LoadRequest()).peer.store_address
    held = block_hashes(p1, 4, engines[0].salt)[:8]
    before, before_b = a.GetLoad(pb.LoadRequest()).peer, b.GetLoad(pb.LoadRequest()).peer
    for fields in (_pair_fields(live.key, store_b), _pair_fields("rogue-new-key", store_b, new_pair=True)):
        answer = _send_blocks(ca, to_send_blocks_request(held, 4242, **fields))
        assert answer.num_blocks == 8 and not answer.pair_unknown
    after = _wait_for(lambda: (p := a.GetLoad(pb.LoadRequest()).peer).send_failures == before.send_failures + 2
                      and p, "the rogue sends never failed", timeout=4 * TIMEOUT_S)
    assert after.pairs_broken == before.pairs_broken + 1 and after.blocks_sent == before.blocks_sent
    t0 = time.monotonic()
    got, final = run_b(p1, hinted=True)
    assert got == want and final.peer_cached_tokens == 40 and time.monotonic() - t0 < 2 * TIMEOUT_S
    load = b.GetLoad(pb.LoadRequest()).peer    # B learned its pair was gone from A's answer, not a failure
    assert (load.pairs_broken, load.fetch_failures) == (before_b.pairs_broken + 1, before_b.fetch_failures)
    assert load.pairs_formed == before_b.pairs_formed + 1
    assert servers[1]._peer.pairs.receiving("w-a").key != live.key


@pytest.mark.server
def test_send_blocks_without_a_transfer_group_is_failed_precondition(tiny_model_dir: Any) -> None:
    loop = LoopThread()
    engine = Engine(_cfg(tiny_model_dir))
    server = WorkerServer(engine.cfg, WorkerServerConfig(worker_id="w-alone"), engine)
    try:
        port = loop.run(server.start())
        loop.run(server.wait_ready(30))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.RpcError) as err:
                _send_blocks(ch, to_send_blocks_request([5], 1, **_pair_fields("k", "127.0.0.1:1", new_pair=True)))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            # a hint is ignored by a worker outside any group: it just computes
            req = request(list(range(3, 30)), max_tokens=4, ignore_eos=True)
            req.peer_hints.append(pb.PeerHint(worker_id="w-x", address="127.0.0.1:1", num_blocks=6))
            ids, _, msgs = collect(pb_grpc.WorkerStub(ch).Generate(req, timeout=30))
            assert len(ids) == 4 and msgs[-1].peer_cached_tokens == 0
            assert not pb_grpc.WorkerStub(ch).GetLoad(pb.LoadRequest()).HasField("peer")
    finally:
        loop.run(server.stop(grace=1))
        loop.close()

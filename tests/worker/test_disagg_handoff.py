"""The worker's side of disaggregated serving, for every KV cache dtype: a prefill-role
WorkerServer computes a prompt as `prefill_only` (a progress response per chunk, a final one,
no tokens), a decode-role WorkerServer gets the request with a `handoff` hint naming it,
fetches every full prompt block over their pair (gloo on loopback) — after the prefill, and in
rounds while the prefill worker is still computing them — and streams the tokens. The oracle is a
cache-less engine of the same dtype (mixed serving, computed cold): the tokens must be equal.
A hand-off hint to a prefill worker that never answers costs the request its `timeout_s`,
then the decode worker computes the prompt (same tokens). The router's part and real
processes: tests/integration/test_disagg.py."""
from __future__ import annotations

import asyncio
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import torch

from kvstore.keys import block_hashes
from kvstore.transfer.wire import BlockSpec
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from tests.support.loop_thread import LoopThread
from tests.worker.test_server import collect, request
from worker.engine.async_engine import AsyncEngine
from worker.engine.engine import Engine, EngineConfig
from worker.engine.sampling import SamplingParams
from worker.peer.handoff import stage_in_pieces
from worker.server.service import WorkerServer, WorkerServerConfig

pytestmark = pytest.mark.server

BLOCK = 4
PROMPT = [(13 * i) % 200 + 3 for i in range(41)]      # 10 full blocks may be handed off
PROMPT2 = [(7 * i) % 190 + 5 for i in range(41)]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _cfg(tiny_model_dir: Any, dtype: str, **kw: Any) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir("llama-gqa")), block_size=BLOCK, num_blocks=128,
                        kv_cache_dtype=dtype, **kw)


def _generate(stub: Any, req: pb.GenerateRequest) -> tuple[list[int], pb.GenerateResponse]:
    ids, _, msgs = collect(stub.Generate(req, timeout=60))
    return ids, msgs[-1]


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "fp8", "int8", "int4"])
def test_a_handed_off_prompt_decodes_as_a_mixed_worker_would(tiny_model_dir: Any, dtype: str) -> None:
    cold = Engine(_cfg(tiny_model_dir, dtype, enable_prefix_caching=False))
    want, want2 = (out.token_ids for out in cold.generate([PROMPT, PROMPT2], GREEDY))
    loop = LoopThread()
    servers = [WorkerServer(_cfg(tiny_model_dir, dtype, max_num_batched_tokens=8 if role == "prefill" else 2048),
                            WorkerServerConfig(worker_id=f"w-{role}", role=role, peer_transfer=True))
               for role in ("prefill", "decode")]
    try:
        ports = [loop.run(s.start()) for s in servers]
        for s in servers:
            loop.run(s.wait_ready(120))
        with grpc.insecure_channel(f"127.0.0.1:{ports[0]}") as cp, grpc.insecure_channel(f"127.0.0.1:{ports[1]}") as cd:
            p, d = pb_grpc.WorkerStub(cp), pb_grpc.WorkerStub(cd)
            pre = request(PROMPT, request_id="r:prefill", max_tokens=6, ignore_eos=True)
            pre.prefill_only = True
            ids, final = _generate(p, pre)
            assert ids == [] and final.prompt_tokens == len(PROMPT)
            assert p.GetLoad(pb.LoadRequest()).prefill_only_requests == 1
            dec = request(PROMPT, request_id="r", max_tokens=6, ignore_eos=True)
            dec.peer_hints.append(pb.PeerHint(worker_id="w-prefill", address=f"127.0.0.1:{ports[0]}",
                                              num_blocks=10, handoff=True, timeout_s=30.0))
            ids, final = _generate(d, dec)
            assert tuple(ids) == want
            assert (final.cached_tokens, final.peer_cached_tokens) == (40, 40)
            load = d.GetLoad(pb.LoadRequest())
            assert (load.role, load.peer.blocks_fetched, load.peer.blocks_bad) == ("decode", 10, 0)
            _streamed(p, d, f"127.0.0.1:{ports[0]}", want2, _count_asks(servers[1]))
    finally:
        for s in servers:
            loop.run(s.stop(grace=1))
        loop.close()


def _streamed(p: Any, d: Any, prefill_address: str, want: tuple[int, ...], rounds: list[float]) -> None:
    """The decode worker fetches PROMPT2's blocks as the prefill worker stores them: it gets the
    hint while the prefill worker holds the first 5 blocks only, fetches those, waits; the
    prefill worker then computes the rest (chunk by chunk, each chunk reported), and the decode
    worker fetches the other 5 in the rounds after — the tokens are a cold run's."""
    head = request(PROMPT2[:21], request_id="r2-head:prefill", max_tokens=6, ignore_eos=True)
    head.prefill_only = True
    assert _generate(p, head)[0] == []               # 5 leading blocks of PROMPT2 held on the prefill worker
    fetched = d.GetLoad(pb.LoadRequest()).peer.blocks_fetched
    dec = request(PROMPT2, request_id="r2", max_tokens=6, ignore_eos=True)
    dec.peer_hints.append(pb.PeerHint(worker_id="w-prefill", address=prefill_address, num_blocks=10,
                                      handoff=True, timeout_s=60.0))
    with ThreadPoolExecutor(1) as pool:
        decoding = pool.submit(_generate, d, dec)
        deadline = time.monotonic() + 60
        while d.GetLoad(pb.LoadRequest()).peer.blocks_fetched < fetched + 5:
            assert time.monotonic() < deadline and not decoding.done(), "the first round never came"
            time.sleep(0.02)
        asks = len(rounds)
        time.sleep(1.0)                               # later rounds find nothing new: the decode worker waits,
        assert not decoding.done()
        assert len(rounds) - asks <= 12               # longer each time (20, 40, 80, 160 ms ...), not every 20 ms
        pre = request(PROMPT2, request_id="r2:prefill", max_tokens=6, ignore_eos=True)
        pre.prefill_only = True
        _, _, msgs = collect(p.Generate(pre, timeout=60))
        ids, final = decoding.result(timeout=60)
    progress = [m.prefilled_tokens for m in msgs[:-1]]
    assert progress and all(not m.token_ids and not m.finished for m in msgs[:-1])
    assert progress == sorted(progress) and progress[-1] < len(PROMPT2) == msgs[-1].prefilled_tokens
    assert tuple(ids) == want
    assert (final.cached_tokens, final.peer_cached_tokens) == (40, 40)
    assert d.GetLoad(pb.LoadRequest()).peer.blocks_fetched == fetched + 10


def _count_asks(server: WorkerServer) -> list[float]:
    """The times of the decode worker's SendBlocks asks from now on (one per hand-off round)."""
    times: list[float] = []
    ask = server._gen._ask

    async def counted(*args: Any) -> Any:
        times.append(time.monotonic())
        return await ask(*args)
    server._gen._ask = counted
    return times


def test_received_blocks_go_to_the_host_tier_a_few_per_engine_command(tiny_model_dir: Any) -> None:
    engine = Engine(_cfg(tiny_model_dir, "fp32"))
    engine.store.ensure_host_tier(64)
    ae = AsyncEngine(engine)
    sent: list[int] = []
    run = ae.run

    async def spy(command: Any) -> Any:
        sent.append(len(command.block_hashes))
        return await run(command)
    ae.run = spy  # type: ignore[method-assign]
    spec = BlockSpec.of(engine.store.kv.kv)
    blocks = torch.randn(spec.shape(20)).to(spec.dtype)
    hashes = block_hashes(list(range(3, 3 + 20 * BLOCK)), BLOCK, engine.salt)
    try:
        asyncio.run(stage_in_pieces(ae, hashes, blocks, piece_blocks=8))
    finally:
        ae.shutdown()
    assert sent == [8, 8, 4]
    assert engine.store.lookup(hashes).num_host == 20
    assert torch.equal(engine.store.host.read(hashes), blocks)


def test_a_hand_off_from_a_silent_prefill_worker_costs_its_timeout(tiny_model_dir: Any) -> None:
    want = Engine(_cfg(tiny_model_dir, "fp32", enable_prefix_caching=False)).generate(PROMPT, GREEDY)[0].token_ids
    silent = socket.socket()     # accepts connections (the kernel's backlog), never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    loop = LoopThread()
    server = WorkerServer(_cfg(tiny_model_dir, "fp32"), WorkerServerConfig(worker_id="w-decode", role="decode",
                                                                           peer_transfer=True))
    try:
        port = loop.run(server.start())
        loop.run(server.wait_ready(120))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as cd:
            dec = request(PROMPT, max_tokens=6, ignore_eos=True)
            dec.peer_hints.append(pb.PeerHint(worker_id="w-silent", address=f"127.0.0.1:{silent.getsockname()[1]}",
                                              num_blocks=10, handoff=True, timeout_s=1.5))
            t0 = time.monotonic()
            ids, final = _generate(pb_grpc.WorkerStub(cd), dec)
            elapsed = time.monotonic() - t0
        assert tuple(ids) == want and final.peer_cached_tokens == 0
        assert 1.4 < elapsed < 20
    finally:
        loop.run(server.stop(grace=1))
        loop.close()
        silent.close()


def test_hand_off_metrics_carry_the_role_and_the_causes() -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from worker.server.metrics import WorkerMetrics
    m = WorkerMetrics("tiny", "w-d", "fp32", role="decode")
    m.observe_handoff(3 << 20, 0.25)
    m.observe_handoff_failed("timeout")
    m.observe_handoff_failed("timeout")
    m.observe_prefill_only()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(generate_latest(m.registry).decode()) for s in f.samples}
    lv = (("model_name", "tiny"), ("worker_id", "w-d"))
    assert samples[("kvmesh:worker_role_info", tuple(sorted((*lv, ("role", "decode")))))] == 1.0
    assert samples[("kvmesh:handoff_bytes_sum", lv)] == 3 << 20
    assert samples[("kvmesh:handoff_seconds_count", lv)] == 1
    assert samples[("kvmesh:handoff_failures_total", tuple(sorted((*lv, ("cause", "timeout")))))] == 2
    assert samples[("kvmesh:prefill_only_requests_total", lv)] == 1

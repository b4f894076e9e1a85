"""The router over gRPC in front of two real workers (SmolLM2, one Engine each), all on 127.0.0.1:0.

Servers run on an event loop in a background thread; tests talk to them with the sync gRPC
client. The oracle for every generation is the same request sent to a worker directly.
"""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.keys import block_hashes
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.routing.errors import RouterStartError
from router.routing.policy import make_policy
from router.routing.types import RouteRequest, RoutingPolicy, RoutingState, WorkerId, WorkerInfo
from router.server import RouterServer
from tests.support.loop_thread import LoopThread

ROOT = Path(__file__).resolve().parents[2]
NUM_BLOCKS = 256
LONG_PREFIX = ("You are a careful assistant. Answer every question about European geography in one short "
               "sentence, and never add anything else. Countries, capitals, rivers and mountains only. ") * 2


@dataclass
class Cluster:
    lt: LoopThread
    router: RouterServer
    grpc_port: int
    http_port: int | None
    workers: list[Any]         # WorkerServer
    engines: list[Any]         # Engine
    model_dir: Path

    @property
    def worker_addresses(self) -> list[str]:
        return [w.address for w in self.workers]

    def start_worker(self, i: int) -> None:
        """(Re)start worker i on its engine at a new port and tell the router."""
        from worker.server.service import WorkerServer, WorkerServerConfig
        w = WorkerServer(self.engines[i].cfg, WorkerServerConfig(worker_id=f"worker-{i}"), engine=self.engines[i])
        self.lt.run(w.start())
        self.lt.run(w.wait_ready(60))
        self.workers[i] = w

        async def update() -> None:
            self.router.set_workers(self.worker_addresses)
            while len(self.router.core.live_workers()) < len(self.workers):
                await asyncio.sleep(0.05)
        self.lt.run(update(), timeout=30)


def start_cluster(model_dir: Path, num_workers: int, http: bool) -> Cluster:
    from worker.engine.engine import Engine, EngineConfig
    # Loaded one after the other in this thread: transformers' lazy imports race across threads.
    # fp32 weights: these tests hold logprobs and greedy tokens to HF's fp32 forward, the bar for fp32
    # weights; the default (the GGUF's Q4_1) runs int8-input kernels, tested in tests/worker/test_weight_formats*
    engines = [Engine(EngineConfig(model=str(model_dir), num_blocks=NUM_BLOCKS, weight_dtype="fp32"))
               for _ in range(num_workers)]
    lt = LoopThread()
    cluster = Cluster(lt, None, 0, None, [None] * num_workers, engines, model_dir)  # type: ignore[arg-type]
    for i in range(num_workers):
        from worker.server.service import WorkerServer, WorkerServerConfig
        cluster.workers[i] = WorkerServer(engines[i].cfg, WorkerServerConfig(worker_id=f"worker-{i}"),
                                          engine=engines[i])
        lt.run(cluster.workers[i].start())
    for w in cluster.workers:
        lt.run(w.wait_ready(60))
    cfg = RouterConfig(worker_addresses=tuple(cluster.worker_addresses), model=str(model_dir),
                       served_model_name="smollm2", http_port=0 if http else None, health_interval_s=0.2)

    async def start() -> tuple[RouterServer, int, int | None]:
        router = RouterServer(cfg)
        g, h = await router.start()
        await router.wait_ready(10)
        return router, g, h
    cluster.router, cluster.grpc_port, cluster.http_port = lt.run(start())
    return cluster


def stop_cluster(c: Cluster) -> None:
    try:
        c.lt.run(c.router.stop(1))
        for w in c.workers:
            c.lt.run(w.stop(1))
    finally:
        c.lt.close()


@pytest.fixture(scope="module")
def cluster(smollm2_dir: Path) -> Iterator[Cluster]:
    c = start_cluster(smollm2_dir, 2, http=False)
    try:
        yield c
    finally:
        stop_cluster(c)


@pytest.fixture
def router_channel(cluster: Cluster) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as ch:
        yield ch


def run_generate(channel: grpc.Channel, req: pb.GenerateRequest, service: str = "Router",
                 timeout: float = 60) -> list[pb.GenerateResponse]:
    stub = pb_grpc.RouterStub(channel) if service == "Router" else pb_grpc.WorkerStub(channel)
    return list(stub.Generate(req, timeout=timeout))


def greedy(max_tokens: int = 12, **kw: Any) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def summary(responses: list[pb.GenerateResponse]) -> tuple[list[int], str, pb.GenerateResponse]:
    assert responses and responses[-1].finished and all(not r.finished for r in responses[:-1])
    return [t for r in responses for t in r.token_ids], "".join(r.text for r in responses), responses[-1]


# -- the policy, pure --------------------------------------------------------------------
def test_prefix_hash_policy_is_stable_and_minimal_on_removal() -> None:
    salt, base = b"salt", make_policy(RoutingPolicy.PREFIX_HASH)

    class _Idle:  # every worker idle: the ring alone decides
        @staticmethod
        def pick(workers, route, exclude=()):  # type: ignore[no-untyped-def]
            return base.pick(workers, route, RoutingState(), exclude)
    policy = _Idle
    workers = [WorkerInfo(WorkerId(f"w{i}"), f"127.0.0.1:{7000 + i}") for i in range(4)]
    routes = []
    for n in range(200):
        ids = tuple(range(n, n + 80))
        routes.append(RouteRequest(ids, tuple(block_hashes(ids, 16, salt))))
    first = [policy.pick(workers, r) for r in routes]
    assert first == [policy.pick(list(reversed(workers)), r) for r in routes]  # order-free
    assert len({w.worker_id for w in first if w}) == 4                          # spreads
    # Same first 4 blocks, different tail → same worker.
    ids = routes[0].token_ids[:64] + (9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9)
    assert policy.pick(workers, RouteRequest(ids, tuple(block_hashes(ids, 16, salt)))) == first[0]
    # Removing a worker moves only its own keys.
    gone = workers[1]
    after = [policy.pick([w for w in workers if w != gone], r) for r in routes]
    for before, now in zip(first, after):
        assert now == before or before == gone
    # Short prompts hash their token ids; exclude works; nothing left → None.
    short = RouteRequest((1, 2, 3), ())
    assert policy.pick(workers, short) == policy.pick(workers, short)
    assert policy.pick(workers, short, exclude={w.worker_id for w in workers}) is None


# -- generation ---------------------------------------------------------------------------
@pytest.mark.server
@pytest.mark.parametrize("kind", ["text", "token_ids", "chat"])
def test_greedy_through_router_equals_worker_direct(cluster: Cluster, router_channel: grpc.Channel,
                                                    kind: str) -> None:
    engine = cluster.engines[0]
    prompt = "The three largest cities in France are"
    messages = [{"role": "user", "content": "Name one river in Germany. ¿Y en España?"}]
    if kind == "text":
        req = pb.GenerateRequest(text=prompt, sampling=greedy())
    elif kind == "token_ids":
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=engine.encode(prompt)), sampling=greedy())
    else:
        req = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages]),
                                 sampling=greedy())
    ids, text, last = summary(run_generate(router_channel, req))
    with grpc.insecure_channel(cluster.worker_addresses[1]) as ch:
        want_ids, want_text, want_last = summary(run_generate(ch, req, service="Worker"))
    assert (ids, text) == (want_ids, want_text)
    assert last.prompt_tokens == want_last.prompt_tokens and last.completion_tokens == 12
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.worker_id in ("worker-0", "worker-1")


@pytest.mark.server
def test_same_prefix_same_worker_and_cached(cluster: Cluster, router_channel: grpc.Channel) -> None:
    info = cluster.router.core.model_info
    assert info is not None
    lasts = []
    for question in ("What is the capital of Austria?", "Which river flows through Budapest?"):
        req = pb.GenerateRequest(text=LONG_PREFIX + question, sampling=greedy(4))
        lasts.append(summary(run_generate(router_channel, req))[2])
    assert lasts[0].worker_id == lasts[1].worker_id
    assert lasts[1].cached_tokens >= 4 * info.block_size
    # The worker chosen is the policy's pick over the live workers (oracle: the policy itself).
    ids = cluster.router.core.tokenizer.encode(LONG_PREFIX + "x")  # type: ignore[union-attr]
    route = RouteRequest(tuple(ids), tuple(block_hashes(ids, info.block_size, bytes.fromhex(info.hash_salt_hex))))
    state = cluster.router.core.routing_state(route)
    chosen = cluster.router.core.policy.pick(cluster.router.core.live_workers(), route, state)
    assert chosen.worker_id == lasts[0].worker_id


@pytest.mark.server
def test_32_concurrent_streams_complete(cluster: Cluster) -> None:
    async def one(stub: pb_grpc.RouterStub, i: int) -> pb.GenerateResponse:
        req = pb.GenerateRequest(text=f"Story {i}: once upon a time", sampling=greedy(6, ignore_eos=True))
        responses = [r async for r in stub.Generate(req, timeout=120)]
        return responses[-1]

    async def many() -> list[pb.GenerateResponse]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as ch:
            stub = pb_grpc.RouterStub(ch)
            return await asyncio.gather(*(one(stub, i) for i in range(32)))
    lasts = cluster.lt.run(many(), timeout=180)
    assert all(r.finished and r.completion_tokens == 6 for r in lasts)
    assert {r.worker_id for r in lasts} == {"worker-0", "worker-1"}


def used_blocks(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        load = pb_grpc.WorkerStub(ch).GetLoad(pb.LoadRequest(), timeout=10)
    return load.num_used_blocks + load.num_running + load.num_waiting


def wait_until(predicate: Any, timeout: float = 10) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.server
def test_cancelled_stream_frees_blocks_on_the_worker(cluster: Cluster, router_channel: grpc.Channel) -> None:
    req = pb.GenerateRequest(text="Count slowly: one, two,", sampling=greedy(500, ignore_eos=True))
    call = pb_grpc.RouterStub(router_channel).Generate(req, timeout=60)
    first = next(call)
    address = cluster.worker_addresses[int(first.worker_id.rsplit("-", 1)[1])]
    assert used_blocks(address) > 0
    call.cancel()
    assert wait_until(lambda: used_blocks(address) == 0), "the cancelled request still holds blocks"


@pytest.mark.server
def test_abort_goes_to_the_worker_holding_the_request(cluster: Cluster, router_channel: grpc.Channel) -> None:
    stub = pb_grpc.RouterStub(router_channel)
    req = pb.GenerateRequest(request_id="abort-me", text="Tell me a long story.",
                             sampling=greedy(500, ignore_eos=True))
    call = stub.Generate(req, timeout=60)
    next(call)
    assert stub.Abort(pb.AbortRequest(request_id="abort-me"), timeout=10).found
    last = list(call)[-1]
    assert last.finished and last.finish_reason == pb.FINISH_REASON_ABORT
    assert not stub.Abort(pb.AbortRequest(request_id="abort-me"), timeout=10).found


@pytest.mark.server
def test_model_info_health_and_reflection(cluster: Cluster, router_channel: grpc.Channel) -> None:
    info = pb_grpc.RouterStub(router_channel).GetModelInfo(pb.ModelInfoRequest(), timeout=10)
    with grpc.insecure_channel(cluster.worker_addresses[0]) as ch:
        assert info == pb_grpc.WorkerStub(ch).GetModelInfo(pb.ModelInfoRequest(), timeout=10)
    health = health_pb2_grpc.HealthStub(router_channel)
    for service in ("", "kvmesh.v1.Router"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    refl = reflection_pb2_grpc.ServerReflectionStub(router_channel)
    replies = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                             timeout=10))
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"kvmesh.v1.Router", "grpc.health.v1.Health"} <= names


# -- failures of workers ------------------------------------------------------------------
@pytest.mark.server
def test_killed_worker_requests_go_to_the_other(cluster: Cluster, router_channel: grpc.Channel) -> None:
    req = pb.GenerateRequest(text=LONG_PREFIX + "Where is Lyon?", sampling=greedy(4))
    owner = summary(run_generate(router_channel, req))[2].worker_id
    i = int(owner.rsplit("-", 1)[1])
    # A second router that does not probe on its own: its first request after the kill must
    # take the retry path (UNAVAILABLE before any token → once more on the other worker).
    blind_cfg = RouterConfig(worker_addresses=tuple(cluster.worker_addresses), model=str(cluster.model_dir),
                             http_port=None, health_interval_s=3600)
    blind = RouterServer(blind_cfg, tokenizer=cluster.router.core.tokenizer)
    blind_port, _ = cluster.lt.run(blind.start())
    try:
        assert len(blind.core.live_workers()) == 2
        cluster.lt.run(cluster.workers[i].stop(1))
        with grpc.insecure_channel(f"127.0.0.1:{blind_port}") as ch:
            assert summary(run_generate(ch, req))[2].worker_id == f"worker-{1 - i}"
        assert [w.worker_id for w in blind.core.live_workers()] == [f"worker-{1 - i}"]
        for _ in range(3):  # the main router: before and after its probes notice
            assert summary(run_generate(router_channel, req))[2].worker_id == f"worker-{1 - i}"
    finally:
        cluster.lt.run(blind.stop(0))
        cluster.start_worker(i)
    assert summary(run_generate(router_channel, req))[2].worker_id == owner


@pytest.mark.server
def test_mismatched_workers_refuse_to_start(cluster: Cluster, tiny_model_dir: Any) -> None:
    from worker.engine.engine import EngineConfig
    from worker.server.service import WorkerServer, WorkerServerConfig
    tiny = WorkerServer(EngineConfig(model=str(tiny_model_dir("llama-gqa")), num_blocks=16),
                        WorkerServerConfig(worker_id="tiny"))
    cluster.lt.run(tiny.start())
    try:
        cluster.lt.run(tiny.wait_ready(60))
        cfg = RouterConfig(worker_addresses=(cluster.worker_addresses[0], tiny.address),
                           model=str(cluster.model_dir), http_port=None)
        with pytest.raises(RouterStartError, match="hash_salt_hex"):
            cluster.lt.run(RouterServer(cfg).start())
    finally:
        cluster.lt.run(tiny.stop(1))


@pytest.mark.server
def test_no_worker_ready_is_unavailable(cluster: Cluster) -> None:
    async def check() -> grpc.StatusCode:
        router = RouterServer(RouterConfig(worker_addresses=("127.0.0.1:1",), model=str(cluster.model_dir),
                                           http_port=None))
        port, _ = await router.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
                try:
                    [r async for r in pb_grpc.RouterStub(ch).Generate(pb.GenerateRequest(text="hi"), timeout=5)]
                except grpc.aio.AioRpcError as e:
                    return e.code()
                raise AssertionError("Generate succeeded without a worker")
        finally:
            await router.stop(0)
    assert cluster.lt.run(check()) == grpc.StatusCode.UNAVAILABLE


# -- the CLI ------------------------------------------------------------------------------
@pytest.mark.server
def test_client_cli_router_and_worker_fallback(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    from kvmesh.cli import main
    prompt = "The capital of Italy is"
    results = []
    for target in (f"127.0.0.1:{cluster.grpc_port}", cluster.worker_addresses[0]):
        assert main(["client", "generate", "--target", target, "--max-tokens", "5", "--json", prompt]) == 0
        out, err = capsys.readouterr()
        results.append(json.loads(out))
        assert "5 tokens" in err
    assert results[0]["token_ids"] == results[1]["token_ids"] and results[0]["worker_id"]
    assert main(["client", "generate", "--target", "127.0.0.1:1", "hi"]) == 1
    assert "--target 127.0.0.1:1" in capsys.readouterr().err


@pytest.mark.multiproc
@pytest.mark.server
def test_router_cli_serves_until_sigterm(cluster: Cluster) -> None:
    cmd = [sys.executable, "-m", "kvmesh.cli", "router", "--grpc-port", "0", "--http-port", "0",
           "--model", str(cluster.model_dir)] + [a for w in cluster.worker_addresses for a in ("--worker", w)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("kvmesh router serving grpc on 127.0.0.1:"), (line, proc.stderr.read())  # type: ignore[union-attr]
        port = int(line.split()[5].rsplit(":", 1)[1])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            grpc.channel_ready_future(ch).result(timeout=10)
            health = health_pb2_grpc.HealthStub(ch)
            assert wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                              == health_pb2.HealthCheckResponse.SERVING)
            assert summary(run_generate(ch, pb.GenerateRequest(text="Hi", sampling=greedy(2))))[2].finished
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

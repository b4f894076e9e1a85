"""WorkerServer over real gRPC on 127.0.0.1:0: greedy equality with Engine.generate, health,
drain, cancellation, bad input, and `kvmesh worker` as a process.

The servers run on an event loop in a background thread; tests use plain synchronous clients.
"""
from __future__ import annotations

import concurrent.futures
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from tests.support.loop_thread import LoopThread
from worker.engine.engine import Engine, EngineConfig
from worker.engine.sampling import SamplingParams
from worker.server.service import WORKER_SERVICE, WorkerServer, WorkerServerConfig

ROOT = Path(__file__).resolve().parents[2]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LONG = dict(max_tokens=506, ignore_eos=True)   # to max_model_len 512 from a 6-token prompt unless stopped
STEP_PACE_S = 0.01                               # with pace(): a LONG stream lasts >= 5 s on any CPU


def pace(monkeypatch: pytest.MonkeyPatch, engine: Engine, seconds: float = STEP_PACE_S) -> None:
    """Every engine step takes at least STEP_PACE_S, so a stream a test means to cut is still running when
    it cuts it: a fast CPU runs the 506 tiny-model tokens inside the 0.3-0.5 s a cut waits."""
    step = engine.step

    def paced_step() -> Any:
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(engine, "step", paced_step)


def tiny_cfg(tiny_model_dir: Any, **overrides: Any) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir("llama-gqa")), block_size=4, num_blocks=256, **overrides)


@contextmanager
def serving(loop: LoopThread, engine_cfg: EngineConfig, engine: Engine | None = None,
            **cfg: Any) -> Iterator[tuple[WorkerServer, grpc.Channel]]:
    server = WorkerServer(engine_cfg, WorkerServerConfig(**cfg), engine=engine)
    try:
        port = loop.run(server.start())
        loop.run(server.wait_ready(60))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield server, channel
    finally:
        loop.run(server.stop(grace=5))


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir: Any) -> Engine:
    return Engine(tiny_cfg(tiny_model_dir, check_integrity=True))


@pytest.fixture(scope="module")
def channel(loop: LoopThread, tiny_engine: Engine) -> Iterator[grpc.Channel]:
    """The shared worker "w-test" serving the tiny model; every test leaves it idle."""
    with serving(loop, tiny_engine.cfg, tiny_engine, worker_id="w-test") as (_, ch):
        yield ch


def request(ids: list[int], request_id: str = "", **sampling: Any) -> pb.GenerateRequest:
    sp = dict(temperature=0.0, max_tokens=8) | sampling
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=ids),
                              sampling=pb.SamplingParams(**sp))


def collect(stream: Any) -> tuple[list[int], str, list[pb.GenerateResponse]]:
    """Concatenated new token ids and text of a stream, and its messages (the last is final)."""
    msgs = list(stream)
    assert msgs and msgs[-1].finished and not any(m.finished for m in msgs[:-1])
    return [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs), msgs


def wait_idle(channel: grpc.Channel, timeout: float = 5.0) -> pb.Load:
    """GetLoad until nothing runs or waits and every block is free again."""
    stub = pb_grpc.WorkerStub(channel)
    deadline = time.monotonic() + timeout
    while True:
        load = stub.GetLoad(pb.LoadRequest())
        if load.num_running == load.num_waiting == load.num_used_blocks == 0:
            return load
        assert time.monotonic() < deadline, f"worker not idle after {timeout} s: {load}"
        time.sleep(0.02)


def health_status(channel: grpc.Channel, service: str = "") -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service)).status


def assert_serves(channel: grpc.Channel) -> None:
    ids, _, msgs = collect(pb_grpc.WorkerStub(channel).Generate(request([9, 8, 7], max_tokens=2, ignore_eos=True)))
    assert len(ids) == 2 and msgs[-1].completion_tokens == 2


# -- generation -----------------------------------------------------------------------------
@pytest.mark.server
def test_generate_equals_engine_generate_and_reports_cache(channel, tiny_model_dir):
    # The oracle replays the same requests in the same order with the same config, so both
    # engines take the same cache path (cold, then a cached prefix).
    oracle = Engine(tiny_cfg(tiny_model_dir))
    stub = pb_grpc.WorkerStub(channel)
    before = stub.GetLoad(pb.LoadRequest())
    p1 = [11, 200, 37, 64, 5, 190, 23, 77, 140, 3]
    p2 = p1 + [45, 46, 47]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want1 = oracle.generate(p1, greedy)[0]
    ids1, _, msgs1 = collect(stub.Generate(request(p1, "r1", max_tokens=12, ignore_eos=True)))
    assert tuple(ids1) == want1.token_ids and len(msgs1) == 12
    final = msgs1[-1]
    assert (final.request_id, final.worker_id, final.finish_reason) == ("r1", "w-test", pb.FINISH_REASON_LENGTH)
    assert (final.prompt_tokens, final.completion_tokens, final.cached_tokens) == (len(p1), 12, 0)
    assert all(m.worker_id == "w-test" and m.request_id == "r1" for m in msgs1)

    # Same prefix: served from the cache (two full blocks of 4), same greedy tokens.
    want2 = oracle.generate(p2, greedy)[0]
    ids2, _, msgs2 = collect(stub.Generate(request(p2, max_tokens=12, ignore_eos=True)))
    assert tuple(ids2) == want2.token_ids
    assert msgs2[-1].cached_tokens == want2.num_cached_tokens and msgs2[-1].cached_tokens >= 8
    assert re.fullmatch(r"[0-9a-f]{32}", msgs2[-1].request_id)    # uuid4 hex when left empty

    # A stop token: finish_reason STOP at the first occurrence, as in the engine.
    stop_at = want1.token_ids[4]
    want3 = oracle.generate(p1, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_at]))[0]
    ids3, _, msgs3 = collect(stub.Generate(request(p1, max_tokens=12, stop_token_ids=[stop_at])))
    assert tuple(ids3) == want3.token_ids and ids3[-1] == stop_at
    assert msgs3[-1].finish_reason == pb.FINISH_REASON_STOP and want3.finish_reason == "stop"

    after = wait_idle(channel)
    finals = [msgs1[-1], msgs2[-1], msgs3[-1]]
    assert after.prompt_tokens - before.prompt_tokens == sum(m.prompt_tokens for m in finals)
    assert after.cached_prompt_tokens - before.cached_prompt_tokens == sum(m.cached_tokens for m in finals)
    assert after.prefix_hit_blocks > before.prefix_hit_blocks and after.num_blocks == 256


@pytest.mark.server
def test_model_info(channel, tiny_engine):
    info = pb_grpc.WorkerStub(channel).GetModelInfo(pb.ModelInfoRequest())
    assert info.model == tiny_engine.model_config.name and info.vocab_size == 256
    assert (info.max_model_len, info.block_size, info.kv_cache_dtype) == (512, 4, tiny_engine.layout.kv_cache_dtype)
    assert list(info.eos_token_ids) == [2] and info.hash_salt_hex == tiny_engine.salt.hex()
    assert info.attention_backend == tiny_engine.runner.attention_backend.value  # native or torch on CPU


@pytest.mark.server
def test_health_and_reflection(channel):
    assert health_status(channel) == SERVING and health_status(channel, WORKER_SERVICE) == SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert {"kvmesh.v1.Worker", "grpc.health.v1.Health"} <= names


@pytest.mark.server
def test_loading_then_text_and_chat_on_smollm2(loop, smollm2_dir):
    server = WorkerServer(EngineConfig(model=str(smollm2_dir), num_blocks=64),
                          WorkerServerConfig(worker_id="w-smol"))
    text = "The capital of France is"
    chat = [pb.ChatMessage(role="user", content="Name three primary colors.")]
    sp = dict(temperature=0.0, max_tokens=8)
    try:
        port = loop.run(server.start())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            # Loading SmolLM2 takes seconds: the server already answers, and says it is not ready.
            assert health_status(ch) == NOT_SERVING and health_status(ch, WORKER_SERVICE) == NOT_SERVING
            stub = pb_grpc.WorkerStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(pb.GenerateRequest(text=text)))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in err.value.details()
            loop.run(server.wait_ready(60))
            assert health_status(ch) == SERVING and health_status(ch, WORKER_SERVICE) == SERVING
            text_ids, text_out, _ = collect(stub.Generate(pb.GenerateRequest(
                text=text, sampling=pb.SamplingParams(**sp))))
            chat_ids, chat_out, chat_msgs = collect(stub.Generate(pb.GenerateRequest(
                chat=pb.ChatMessages(messages=chat), sampling=pb.SamplingParams(**sp))))
    finally:
        loop.run(server.stop(grace=5))
    engine = server.engine            # idle now: the oracle runs on the same weights
    assert engine is not None
    greedy = SamplingParams(**sp)
    want = engine.generate(engine.encode(text), greedy)[0]
    assert (tuple(text_ids), text_out) == (want.token_ids, want.text) and text_out
    prompt = engine.apply_chat_template([{"role": "user", "content": "Name three primary colors."}])
    want = engine.generate(prompt, greedy)[0]
    assert (tuple(chat_ids), chat_out) == (want.token_ids, want.text) and chat_out
    assert chat_msgs[-1].prompt_tokens == len(prompt)


# -- draining -------------------------------------------------------------------------------
@pytest.mark.server
def test_drain_finishes_inflight_and_refuses_new(loop, tiny_model_dir, monkeypatch):
    engine = Engine(tiny_cfg(tiny_model_dir))
    pace(monkeypatch, engine, 0.002)                 # still streaming when the drain starts, ~1 s to the end
    server = WorkerServer(engine.cfg, WorkerServerConfig(worker_id="w-drain"), engine=engine)
    port = loop.run(server.start())
    stopping: concurrent.futures.Future[None] | None = None
    try:
        loop.run(server.wait_ready(10))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.WorkerStub(ch)
            stream = stub.Generate(request([4, 5, 6, 7, 8], **LONG))   # 506 tokens, seconds
            first = next(stream)
            stopping = loop.submit(server.stop(grace=30))
            deadline = time.monotonic() + 5
            while health_status(ch) != NOT_SERVING:
                assert time.monotonic() < deadline, "health still SERVING while draining"
                time.sleep(0.01)
            assert health_status(ch, WORKER_SERVICE) == NOT_SERVING
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request([1, 2, 3])))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
            rest = list(stream)                          # the in-flight stream runs to the end
            assert rest[-1].finished and rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == rest[-1].completion_tokens == 506
            stopping.result(10)                          # and then stop returns, well before grace
    finally:
        loop.run(server.stop(grace=0))
    assert engine.store.pool.num_used_blocks == 0 and not engine.has_unfinished()


@pytest.mark.server
def test_drain_timeout_cancels_streams_and_frees_blocks(loop, tiny_model_dir, monkeypatch):
    engine = Engine(tiny_cfg(tiny_model_dir))
    pace(monkeypatch, engine)
    server = WorkerServer(engine.cfg, WorkerServerConfig(worker_id="w-cut"), engine=engine)
    port = loop.run(server.start())
    try:
        loop.run(server.wait_ready(10))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stream = pb_grpc.WorkerStub(ch).Generate(request([4, 5, 6, 7, 8], **LONG))
            next(stream)
            t0 = time.monotonic()
            loop.run(server.stop(grace=0.3), timeout=10)
            assert time.monotonic() - t0 < 3
            with pytest.raises(grpc.RpcError) as err:
                list(stream)
            assert err.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    finally:
        loop.run(server.stop(grace=0))
    assert engine.store.pool.num_used_blocks == 0 and not engine.has_unfinished()
    engine.check_integrity()


# -- cancellation ---------------------------------------------------------------------------
@pytest.mark.server
def test_client_cancel_aborts_and_frees_blocks(channel, tiny_engine, monkeypatch):
    pace(monkeypatch, tiny_engine)
    stub = pb_grpc.WorkerStub(channel)
    stream = stub.Generate(request([30, 31, 32, 33, 34, 35], **LONG))
    next(stream)
    load = stub.GetLoad(pb.LoadRequest())
    assert load.num_running == 1 and load.num_used_blocks > 0
    stream.cancel()
    wait_idle(channel, timeout=3)
    assert_serves(channel)


@pytest.mark.server
def test_deadline_exceeded_aborts_and_frees_blocks(channel, tiny_engine, monkeypatch):
    pace(monkeypatch, tiny_engine)
    stub = pb_grpc.WorkerStub(channel)
    got: list[pb.GenerateResponse] = []
    with pytest.raises(grpc.RpcError) as err:
        for msg in stub.Generate(request([40, 41, 42, 43, 44], **LONG), timeout=0.5):
            got.append(msg)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert got and not any(m.finished for m in got)      # it was cut mid-stream
    wait_idle(channel, timeout=3)
    assert_serves(channel)


@pytest.mark.server
def test_abort_rpc_ends_stream_with_abort(channel, tiny_engine, monkeypatch):
    pace(monkeypatch, tiny_engine)
    stub = pb_grpc.WorkerStub(channel)
    stream = stub.Generate(request([50, 51, 52, 53], "abort-me", **LONG))
    next(stream)
    with pytest.raises(grpc.RpcError) as err:                # the id is taken while it runs
        list(stub.Generate(request([1, 2, 3], "abort-me")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "already running" in err.value.details()
    assert stub.Abort(pb.AbortRequest(request_id="abort-me")).found
    rest = list(stream)
    assert rest[-1].finished and rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert not stub.Abort(pb.AbortRequest(request_id="abort-me")).found
    wait_idle(channel)


# -- bad input ------------------------------------------------------------------------------
def _ser(**fields: Any) -> bytes:
    return pb.GenerateRequest(**fields).SerializeToString()


BAD_INPUT = {
    "no input": (_ser(), "set one of text, token_ids, chat"),
    "empty text": (_ser(text=""), "text: the prompt is empty"),
    "empty token_ids": (_ser(token_ids=pb.TokenIds()), "token_ids: the prompt is empty"),
    "text and token_ids": (_ser(text="hi") + _ser(token_ids=pb.TokenIds(ids=[1, 2])),
                           "set exactly one of text, token_ids, chat (got text and token_ids)"),
    "id over vocab": (request([5, 256]).SerializeToString(), "prompt token ids must be in [0, 256)"),
    "negative id": (request([-1, 5]).SerializeToString(), "prompt token ids must be in [0, 256)"),
    "prompt too long": (request([7] * 512).SerializeToString(), "prompt has 512 tokens"),
    "max_tokens 0": (request([5], max_tokens=0).SerializeToString(), "max_tokens must be an integer >= 1"),
    "max_tokens < 0": (request([5], max_tokens=-3).SerializeToString(), "max_tokens must be an integer >= 1"),
    "NaN temperature": (request([5], temperature=float("nan")).SerializeToString(),
                        "sampling.temperature: must be finite"),
    "negative temperature": (request([5], temperature=-0.5).SerializeToString(), "temperature must be"),
    "top_p 0": (request([5], top_p=0.0).SerializeToString(), "top_p must be in (0, 1]"),
    "unknown field": (request([5]).SerializeToString() + b"\x98\x06\x01", "unknown fields [99]"),
    "invalid UTF-8": (b"\x12\x02\xff\xfe", "bad UTF-8"),
    "text without tokenizer": (_ser(text="hello"), "no tokenizer"),
    "priority out of range": (_ser(token_ids=pb.TokenIds(ids=[5]), priority=1001),
                              "priority must be an integer in [-1000, 1000], got 1001"),
    "bad chat role": (_ser(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="robot", content="x")])),
                      "chat.role: 'robot'"),
    "hint without port": (_ser(token_ids=pb.TokenIds(ids=[5]), peer_hints=[pb.PeerHint(address="w1")]),
                          "peer_hints[0].address: 'w1' is not HOST:PORT"),
    "hint negative blocks": (_ser(token_ids=pb.TokenIds(ids=[5]),
                                  peer_hints=[pb.PeerHint(address="h:1", num_blocks=-2)]),
                             "peer_hints[0].num_blocks: -2 must be >= 0"),
    "negative shared prefix": (_ser(token_ids=pb.TokenIds(ids=[5]), shared_prefix_blocks=-4),
                               "shared_prefix_blocks: -4 must be >= 0"),
}


@pytest.mark.server
@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_invalid_argument_and_server_keeps_serving(channel, case):
    raw, expected = BAD_INPUT[case]
    generate = channel.unary_stream("/kvmesh.v1.Worker/Generate", request_serializer=None,
                                    response_deserializer=pb.GenerateResponse.FromString)
    with pytest.raises(grpc.RpcError) as err:
        list(generate(raw, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert expected in err.value.details()
    assert_serves(channel)


@pytest.mark.server
def test_oversized_message_is_resource_exhausted(channel):
    with pytest.raises(grpc.RpcError) as err:
        list(pb_grpc.WorkerStub(channel).Generate(pb.GenerateRequest(text="a" * 10_000_000), timeout=10))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_serves(channel)


@pytest.mark.server
def test_queue_full_is_resource_exhausted(loop, tiny_model_dir, monkeypatch):
    # One running slot and one waiting slot: a third request cannot be queued.
    engine = Engine(tiny_cfg(tiny_model_dir, max_queue_len=1, max_num_seqs=1))
    pace(monkeypatch, engine)
    with serving(loop, engine.cfg, engine, worker_id="w-full") as (_, ch):
        stub = pb_grpc.WorkerStub(ch)
        running = stub.Generate(request([60, 61, 62], **LONG))
        next(running)
        waiting = stub.Generate(request([63, 64, 65], **LONG))
        deadline = time.monotonic() + 5
        while stub.GetLoad(pb.LoadRequest()).num_waiting != 1:
            assert time.monotonic() < deadline, "second request never queued"
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request([66, 67, 68])))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queue_len" in err.value.details()
        running.cancel()
        waiting.cancel()
        wait_idle(ch)
        assert_serves(ch)


@pytest.mark.server
def test_config_validation():
    for bad in (dict(port=70000), dict(worker_id=""), dict(advertise_address="nohost"),
                dict(advertise_address="h:0"), dict(drain_timeout_s=-1.0), dict(max_message_bytes=0),
                dict(cluster_name="")):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=name):
            WorkerServerConfig(**bad)
    cfg = EngineConfig()
    assert WorkerServer(cfg, WorkerServerConfig(advertise_address="10.0.0.5:7000")).address == "10.0.0.5:7000"


# -- the process ----------------------------------------------------------------------------
@pytest.mark.multiproc
def test_kvmesh_worker_process_serves_and_exits_on_sigterm(tiny_model_dir, tmp_path):
    stderr = (tmp_path / "worker.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli", "worker", "--model", str(tiny_model_dir("llama-gqa")),
         "--port", "0", "--num-blocks", "64", "--block-size", "4", "--worker-id", "w-proc"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
        try:
            line = lines.get(timeout=90)
        except queue.Empty:
            pytest.fail(f"no serving line; log:\n{(tmp_path / 'worker.log').read_text()}")
        m = re.fullmatch(r"kvmesh worker w-proc serving on 127\.0\.0\.1:(\d+)\n", line)
        assert m, f"unexpected line {line!r}; log:\n{(tmp_path / 'worker.log').read_text()}"
        with grpc.insecure_channel(f"127.0.0.1:{m.group(1)}") as ch:
            assert health_status(ch) == SERVING
            ids, _, msgs = collect(pb_grpc.WorkerStub(ch).Generate(request([3, 4, 5], max_tokens=4, ignore_eos=True)))
            assert len(ids) == 4 and msgs[-1].worker_id == "w-proc"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert time.monotonic() - t0 < 5
        assert proc.stdout.read() == ""          # exactly one line on stdout
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stderr.close()

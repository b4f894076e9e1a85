"""Tenant isolation of the prefix cache, Abort ownership and bounded requests, met the way clients
meet them: the `openai` SDK on HTTP, grpcio on gRPC.

One real worker (SmolLM2, its gRPC idle timeout short) behind two routers on one loop: one
with a keys file of four tenants (c and d configured with the same `salt=`), one open with
`--max-tokens-limit`. The oracle for isolation is the worker's own cache: `cached_tokens` in
the usage, and which of the router's block hashes the worker holds (CountHeld).
"""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contracts.grpc_options import grpc_server_options
from contracts.requests import BadRequest, ChatMessage, GenerateInput
from contracts.sampling import SamplingParams
from contracts.wire import to_generate_input
from kvstore.keys import block_hashes, cache_salt_root
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.security.auth import ANONYMOUS, ApiKey, TenantId, parse_keys_file
from router.security.tenancy import TenantActivity, TenantSalts, bound_max_tokens
from router.server import RouterServer
from tests.router.test_router import NUM_BLOCKS
from tests.support.loop_thread import LoopThread

KEYS = {"a": "sk-tenant-a-0001", "b": "sk-tenant-b-0002", "c": "sk-tenant-c-0003", "d": "sk-tenant-d-0004"}
SYSTEM = ("You are the private assistant of the Lighthouse Keepers' Guild. Never reveal the guild's "
          "signal codes, the rota of the northern lights or the names of its members. ") * 2
LIMIT = 6


@dataclass
class Tenancy:
    lt: LoopThread
    worker: Any              # WorkerServer
    keyed: RouterServer
    keyed_grpc: int
    keyed_http: int
    limited_grpc: int
    limited_http: int


@pytest.fixture(scope="module")
def ten(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenancy]:
    from worker.engine.engine import Engine, EngineConfig
    from worker.server.service import WorkerServer, WorkerServerConfig
    keys_file = tmp_path_factory.mktemp("keys") / "keys"
    keys_file.write_text(f"{KEYS['a']} team-a\n{KEYS['b']} team-b\n"
                         f"{KEYS['c']} team-c salt=shared-c-d\n{KEYS['d']} team-d priority salt=shared-c-d\n")
    engine = Engine(EngineConfig(model=str(smollm2_dir), num_blocks=NUM_BLOCKS))
    lt = LoopThread()
    worker = WorkerServer(engine.cfg, WorkerServerConfig(worker_id="worker-0"), engine=engine)
    lt.run(worker.start())
    lt.run(worker.wait_ready(60))
    common = dict(worker_addresses=(worker.address,), model=str(smollm2_dir), served_model_name="smollm2",
                  http_port=0, health_interval_s=0.2)

    async def start(cfg: RouterConfig) -> tuple[RouterServer, int, int]:
        router = RouterServer(cfg)
        g, h = await router.start()
        await router.wait_ready(10)
        assert h is not None
        return router, g, h
    keyed, kg, kh = lt.run(start(RouterConfig(**common, api_keys=parse_keys_file(keys_file))))  # type: ignore[arg-type]
    limited, lg, lh = lt.run(start(RouterConfig(**common, max_tokens_limit=LIMIT,  # type: ignore[arg-type]
                                                grpc_idle_timeout_s=1.0)))
    try:
        yield Tenancy(lt, worker, keyed, kg, kh, lg, lh)
    finally:
        try:
            for r in (keyed, limited):
                lt.run(r.stop(1))
            lt.run(worker.stop(1))
        finally:
            lt.close()


def sdk(port: int, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60)


def chat(ten: Tenancy, tenant: str, question: str, **extra: Any) -> int:
    """One chat completion as `tenant`; returns its cached_tokens."""
    r = sdk(ten.keyed_http, KEYS[tenant]).chat.completions.create(
        model="smollm2", max_tokens=1, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        extra_body=extra or None)
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return int(r.usage.prompt_tokens_details.cached_tokens or 0)


def held(ten: Tenancy, hashes: tuple[int, ...]) -> int:
    """How many leading `hashes` the worker's cache holds (the worker's own lookup)."""
    from worker.engine.commands import CountHeld
    return ten.lt.run(ten.worker._ae.run(CountHeld(hashes)))


def prepared_hashes(ten: Tenancy, caller: ApiKey, question: str, cache_salt: str = "") -> tuple[int, ...]:
    """The router's block hashes of the chat `chat()` sends."""
    messages = (ChatMessage("system", SYSTEM), ChatMessage("user", question))
    inp = GenerateInput("", None, None, messages, SamplingParams(max_tokens=1), cache_salt=cache_salt)
    return ten.lt.run(ten.keyed.core.prepare(inp, caller)).route.block_hashes


def key_of(ten: Tenancy, tenant: str) -> ApiKey:
    return next(k for k in ten.keyed.cfg.api_keys if k.key == KEYS[tenant])


@pytest.mark.server
def test_tenants_do_not_see_each_others_prefix(ten: Tenancy) -> None:
    assert chat(ten, "a", "What is the signal code for fog?") == 0
    assert chat(ten, "a", "Who keeps the rota?") > 32           # A's own prefix hits
    assert chat(ten, "b", "What is the signal code for fog?") == 0   # B cannot observe it ...
    assert chat(ten, "b", "Who keeps the rota?") > 32           # ... but has its own
    q = "Who keeps the rota?"
    a, b = prepared_hashes(ten, key_of(ten, "a"), q), prepared_hashes(ten, key_of(ten, "b"), q)
    assert len(a) >= 4 and not set(a) & set(b)
    # Hash agreement: the worker holds exactly the chains the router computed for each tenant,
    # and none of the unsalted chain (the open router's, tenant-less, keys).
    assert held(ten, a) == len(a) and held(ten, b) == len(b)
    assert held(ten, prepared_hashes(ten, ANONYMOUS, q)) == 0
    # gRPC is the same tenant as HTTP for the same key: A's prefix hits there too.
    with grpc.insecure_channel(f"127.0.0.1:{ten.keyed_grpc}") as ch:
        messages = [pb.ChatMessage(role="system", content=SYSTEM), pb.ChatMessage(role="user", content="Hi")]
        req = pb.GenerateRequest(chat=pb.ChatMessages(messages=messages),
                                 sampling=pb.SamplingParams(max_tokens=1, temperature=0))
        out = list(pb_grpc.RouterStub(ch).Generate(req, timeout=60,
                                                   metadata=(("authorization", f"Bearer {KEYS['a']}"),)))
        assert out[-1].finished and out[-1].cached_tokens > 32


@pytest.mark.server
def test_equal_explicit_salt_shares_across_tenants(ten: Tenancy) -> None:
    assert chat(ten, "a", "Which lamp is brightest?", cache_salt="guild-shared") == 0
    assert chat(ten, "b", "Which tower is oldest?", cache_salt="guild-shared") > 32
    assert chat(ten, "b", "Which tower is oldest?", cache_salt="another") == 0
    # Tenants c and d are configured with the same salt= in the keys file: they share.
    assert chat(ten, "c", "Name the rocks.") == 0
    assert chat(ten, "d", "Name the shoals.") > 32
    c = prepared_hashes(ten, key_of(ten, "c"), "Name the rocks.")
    assert c == prepared_hashes(ten, key_of(ten, "d"), "Name the rocks.")
    assert c == prepared_hashes(ten, key_of(ten, "a"), "Name the rocks.", "shared-c-d")
    assert held(ten, c) == len(c)


def test_salt_derivation_and_keys_file_grammar(tmp_path: Path) -> None:
    keys = (ApiKey("k1", TenantId("x")), ApiKey("k2", TenantId("y")), ApiKey("k3", TenantId("z"), salt="s"))
    salts = TenantSalts(keys)
    x, y = salts.default_for(keys[0]), salts.default_for(keys[1])
    assert x and y and x != y and salts.default_for(keys[2]) == "s"
    assert salts.default_for(ANONYMOUS) == "" and salts.salt_for(keys[0], "mine") == "mine"
    assert TenantSalts(keys[:2]).default_for(keys[0]) != x        # another key set: another secret
    assert TenantSalts(reversed(keys)).default_for(keys[0]) == x  # the same set in any order
    assert cache_salt_root("") is None and cache_salt_root("a") != cache_salt_root("b")
    tokens = list(range(64))
    plain = block_hashes(tokens, 16, b"m")
    salted = block_hashes(tokens, 16, b"m", cache_salt_root("t"))
    assert len(salted) == 4 and not set(plain) & set(salted)
    f = tmp_path / "keys"
    f.write_text("k1 x salt=abc priority\nk2 x salt=abc\n")
    assert [(k.salt, k.priority) for k in parse_keys_file(f)] == [("abc", True), ("abc", False)]
    assert "abc" not in repr(parse_keys_file(f)[0])
    for bad in ("k1 x salt=\n", "k1 x salt=a salt=b\n", "k1 x pri\n", "k1 x salt=a\nk2 x salt=b\n"):
        f.write_text(bad)
        with pytest.raises(ValueError, match="api_keys_file"):
            parse_keys_file(f)


def test_salted_request_chain_in_the_engine_request() -> None:
    """The worker's Request (and every sequence forked from it for n > 1) hashes with the
    salt's root, exactly as the router's prepare does."""
    import torch

    from worker.engine.fork import _sequence
    from worker.engine.request import Request
    root = cache_salt_root("team-x")
    req = Request("r", list(range(40)), SamplingParams(max_tokens=4, n=2), 44, None, 0, root)
    req.update_block_hashes(16, b"m")
    assert req.block_hashes == block_hashes(list(range(40)), 16, b"m", root)
    child = _sequence(req, 1, torch.device("cpu"))
    child.update_block_hashes(16, b"m")
    assert child.hash_root == root and child.block_hashes == req.block_hashes


def test_max_tokens_limit_flag() -> None:
    import argparse

    from kvmesh.serve.cli import add_serve_arguments, config_from_args
    from router.flags import add_router_arguments, routing_argv
    for add in (add_router_arguments, add_serve_arguments):
        p = argparse.ArgumentParser()
        add(p)
        assert p.parse_args([]).max_tokens_limit is None and routing_argv(p.parse_args([])) == ()
        args = p.parse_args(["--max-tokens-limit", "7"])
        assert routing_argv(args) == ("--max-tokens-limit", "7")
    assert config_from_args(args).router_argv == ("--max-tokens-limit", "7")   # serve → its router
    with pytest.raises(ValueError, match="max_tokens_limit"):
        RouterConfig(max_tokens_limit=0)


@pytest.mark.server
def test_abort_only_own_tenant(ten: Tenancy) -> None:
    auth = {t: (("authorization", f"Bearer {k}"),) for t, k in KEYS.items()}
    req = pb.GenerateRequest(request_id="tenancy-abort-1", text="Count to a thousand:",
                             sampling=pb.SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0))
    with grpc.insecure_channel(f"127.0.0.1:{ten.keyed_grpc}") as ch:
        stub = pb_grpc.RouterStub(ch)
        stream = stub.Generate(req, timeout=120, metadata=auth["a"])
        next(stream)   # running now
        abort = pb.AbortRequest(request_id="tenancy-abort-1")
        assert stub.Abort(abort, timeout=10, metadata=auth["b"]).found is False   # not B's: looks absent
        assert stub.Abort(pb.AbortRequest(request_id="no-such"), timeout=10, metadata=auth["b"]).found is False
        assert stub.Abort(abort, timeout=10, metadata=auth["a"]).found is True
        last = list(stream)[-1]
        assert last.finished and last.finish_reason == pb.FINISH_REASON_ABORT and last.completion_tokens < 2000


def test_busy_tenants_are_those_in_flight_or_ended_within_the_window() -> None:
    now = [0.0]
    act = TenantActivity(window_s=5.0, clock=lambda: now[0])
    assert act.busy_with("a") == 1
    act.arrive("a")
    act.arrive("a")
    assert (act.busy_with("b"), act.busy_with("a")) == (2, 1)
    act.leave("a")
    now[0] = 100.0
    assert act.busy_with("b") == 2          # one of a's requests is still in flight
    act.leave("a")
    now[0] = 104.0
    assert act.busy_with("b") == 2          # a's last one ended 4 s ago
    now[0] = 105.5
    assert act.busy_with("b") == 1
    with pytest.raises(ValueError, match="window_s"):
        TenantActivity(window_s=-1.0)


@pytest.mark.server
def test_each_request_tells_the_worker_how_many_tenants_are_busy_on_the_router(ten: Tenancy) -> None:
    core = ten.keyed.core
    now = [0.0]
    saved, core.tenants = core.tenants, TenantActivity(window_s=5.0, clock=lambda: now[0])

    def busy(caller: ApiKey) -> int:
        """`busy_tenants` of a request of `caller`, as the worker reads it off the wire."""
        inp = GenerateInput("", "Hi", None, None, SamplingParams(max_tokens=1))
        msg = ten.lt.run(core.prepare(inp, caller)).request
        return to_generate_input(pb.GenerateRequest.FromString(msg.SerializeToString())).tenant.busy_tenants
    try:
        assert busy(key_of(ten, "b")) == 1
        chat(ten, "a", "Say hi.")           # through the router's generate: a is busy, then recent
        assert (busy(key_of(ten, "b")), busy(key_of(ten, "a"))) == (2, 1)
        now[0] = 5.5
        assert busy(key_of(ten, "b")) == 1   # a's request ended more than the window ago
        assert busy(ANONYMOUS) == 0
    finally:
        core.tenants = saved


@pytest.mark.server
def test_max_tokens_beyond_context(ten: Tenancy) -> None:
    info = ten.keyed.core.model_info
    assert info is not None
    too_many = info.max_model_len
    with pytest.raises(openai.BadRequestError) as e:
        sdk(ten.keyed_http, KEYS["a"]).completions.create(model="smollm2", prompt="Hello", max_tokens=too_many)
    err = e.value.response.json()["error"]
    assert err["param"] == "max_tokens" and "maximum context length is" in err["message"]
    req = pb.GenerateRequest(text="Hello", sampling=pb.SamplingParams(max_tokens=too_many))
    metadata = (("authorization", f"Bearer {KEYS['a']}"),)
    for port in (ten.keyed_grpc, int(ten.worker.address.rsplit(":", 1)[1])):   # router, then worker
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.RouterStub(ch) if port == ten.keyed_grpc else pb_grpc.WorkerStub(ch)
            with pytest.raises(grpc.RpcError) as g:
                list(stub.Generate(req, timeout=60, metadata=metadata))
            assert g.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "max_tokens" in (g.value.details() or "") and "maximum context length" in (g.value.details() or "")


@pytest.mark.server
def test_max_tokens_limit_default_and_cap(ten: Tenancy) -> None:
    client = sdk(ten.limited_http)
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Tell a long story."}],
                                       extra_body={"ignore_eos": True})   # no max_tokens: the limit
    assert r.usage is not None and r.usage.completion_tokens == LIMIT and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt="Hello", max_tokens=LIMIT + 1)
    err = e.value.response.json()["error"]
    assert err["param"] == "max_tokens" and "--max-tokens-limit" in err["message"]
    ok = client.completions.create(model="smollm2", prompt="Hello", max_tokens=LIMIT, extra_body={"ignore_eos": True})
    assert ok.usage is not None and ok.usage.completion_tokens == LIMIT
    with pytest.raises(openai.BadRequestError) as e:     # min_tokens above the default the limit gives: a 400
        client.completions.create(model="smollm2", prompt="Hello", extra_body={"min_tokens": LIMIT + 1})
    err = e.value.response.json()["error"]
    assert err["param"] == "min_tokens" and "--max-tokens-limit" in err["message"]
    inp = GenerateInput("", "x", None, None, SamplingParams(max_tokens=100), max_tokens_given=False)
    assert bound_max_tokens(inp, 10, 50, None).max_tokens == 40      # a default fits the context
    with pytest.raises(BadRequest, match="max_tokens"):
        bound_max_tokens(GenerateInput("", "x", None, None, SamplingParams(max_tokens=41)), 10, 50, None)
    short = GenerateInput("", "x", None, None, SamplingParams(max_tokens=100, min_tokens=45), max_tokens_given=False)
    with pytest.raises(BadRequest, match="^min_tokens: 45 exceeds the 40 token"):
        bound_max_tokens(short, 10, 50, None)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (reading what it sends meanwhile:
    its SETTINGS, then GOAWAY)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if sock.recv(1 << 16) == b"":
                return True
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
    return False


@pytest.fixture
def idle_worker(tmp_path: Path) -> Iterator[int]:
    """A worker server whose gRPC idle timeout is 1 s (its model fails to load: only its
    server is needed, and health answers NOT_SERVING)."""
    from worker.engine.engine import EngineConfig
    from worker.server.service import WorkerServer, WorkerServerConfig
    lt = LoopThread()
    worker = WorkerServer(EngineConfig(model=str(tmp_path)), WorkerServerConfig(grpc_idle_timeout_s=1.0))
    try:
        yield lt.run(worker.start())
    finally:
        try:
            lt.run(worker.stop(0))
        finally:
            lt.close()


def _goes_idle_and_reconnects(port: int, call: Callable[[grpc.Channel], object]) -> None:
    """A TCP client that never speaks HTTP/2 is dropped (handshake timeout = the 1 s idle
    timeout here); a gRPC client that makes one call and idles gets GOAWAY (its channel goes
    IDLE), and its next call reconnects and is answered."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        assert _closed_within(raw, 8)
    states: list[grpc.ChannelConnectivity] = []
    went_idle = threading.Event()

    def watch(state: grpc.ChannelConnectivity) -> None:
        states.append(state)
        if state == grpc.ChannelConnectivity.IDLE and grpc.ChannelConnectivity.READY in states:
            went_idle.set()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        ch.subscribe(watch, try_to_connect=False)
        call(ch)
        assert went_idle.wait(8), states
        call(ch)


@pytest.mark.server
def test_grpc_idle_connections_are_closed(ten: Tenancy, idle_worker: int) -> None:
    metadata = (("authorization", f"Bearer {KEYS['a']}"),)
    _goes_idle_and_reconnects(ten.limited_grpc, lambda ch: pb_grpc.RouterStub(ch).GetModelInfo(
        pb.ModelInfoRequest(), timeout=10, metadata=metadata))
    _goes_idle_and_reconnects(idle_worker, lambda ch: health_pb2_grpc.HealthStub(ch).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=10))
    assert ("grpc.max_connection_idle_ms", 1000) in grpc_server_options(1 << 20, 1.0)

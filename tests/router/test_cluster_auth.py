"""Cluster authentication, met the way clients and attackers meet it.

One real worker (SmolLM2) serving mutual TLS with a cluster token, registered in a Redis that
requires a password, and one router finding it there, serving HTTPS and gRPC over TLS.
Certificates come from `trustme`. Clients are real: the `openai` SDK over HTTPS, grpcio over
TLS, grpcio without a client certificate (the worker's handshake fails), and the fake-worker
attack done exactly: with Redis write access, SADD/HSET/SET a fake worker pointing at a
gRPC server of ours (holding a certificate from the cluster's CA, but not the token, relaying
the router's nonce to the real worker); it gets 0 requests and the router logs it as rejected.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import redis
import trustme
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from contracts.cluster_token import TOKEN_METADATA, attestation_mac, masked, token_from, verify_attestation
from contracts.tls import TlsConfig
from kvmesh.serve.processes import start_redis, terminate
from kvstore.metadata.registry import RedisConfig
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.security.attest import Admitter, Verdict
from router.server import RouterServer
from tests.router.test_router import NUM_BLOCKS
from tests.support.fake_worker import WORKER, worker_handlers
from tests.support.loop_thread import LoopThread
from tests.support.redis_server import RedisServer

TOKEN = "test-cluster-token-0123456789abcdef"
REDIS_PASSWORD = "test-redis-password-0123456789"
CLUSTER = "authtest"
# The Redis ACL user per role that README "Security" documents (keys ~kvmesh:<cluster-name>:*);
# the default user is off. The attacker below holds the worker's credentials (write access).
ACL = {"kvmesh-router": "+ping +info +multi +exec +smembers +srem +hgetall +get +set +xread +xrevrange",
       "kvmesh-worker": "+ping +info +multi +exec +get +set +getdel +del +incrby +hset +hgetall +sadd +srem +smembers "
                        "+pexpire +xadd +eval"}
PROMPT = "The capital of France is"


@dataclass
class Certs:
    ca: Path
    cert: Path       # 127.0.0.1 / localhost, usable as server and client certificate
    key: Path

    @property
    def tls(self) -> TlsConfig:
        return TlsConfig(cert=self.cert, key=self.key, ca=self.ca)

    def client_credentials(self, with_cert: bool) -> grpc.ChannelCredentials:
        if not with_cert:
            return grpc.ssl_channel_credentials(root_certificates=self.ca.read_bytes())
        return self.tls.channel_credentials()


def make_certs(directory: Path) -> Certs:
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    paths = Certs(directory / "ca.pem", directory / "cert.pem", directory / "key.pem")
    ca.cert_pem.write_to_path(str(paths.ca))
    leaf.cert_chain_pems[0].write_to_path(str(paths.cert))
    leaf.private_key_pem.write_to_path(str(paths.key))
    return paths


@dataclass
class FakeWorker:
    """A gRPC server posing as a worker: counts what it is asked; Attest relays the nonce to
    the real worker (it holds a CA certificate, so the relay gets through the real worker's TLS)."""

    relay_to: str
    certs: Certs
    model_info: pb.ModelInfo
    calls: dict[str, int] = field(default_factory=dict)
    tokens_seen: list[str] = field(default_factory=list)
    server: grpc.aio.Server | None = None
    port: int = 0

    def _count(self, name: str, context: grpc.aio.ServicerContext) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.tokens_seen += [v for k, v in context.invocation_metadata() or () if k == TOKEN_METADATA]

    async def start(self) -> int:
        async def generate(req: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> Any:
            self._count("Generate", context)
            yield pb.GenerateResponse(text="EVIL", token_ids=[1], finished=True, worker_id="evil",
                                      finish_reason=pb.FINISH_REASON_LENGTH)

        async def get_load(req: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.Load:
            self._count("GetLoad", context)
            return pb.Load(worker_id="evil", num_blocks=NUM_BLOCKS, num_free_blocks=NUM_BLOCKS)

        async def get_model_info(req: pb.ModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
            self._count("GetModelInfo", context)
            return self.model_info

        async def attest(req: pb.AttestRequest, context: grpc.aio.ServicerContext) -> pb.AttestResponse:
            self._count("Attest", context)
            async with grpc.aio.secure_channel(self.relay_to, self.certs.client_credentials(True)) as ch:
                return await pb_grpc.WorkerStub(ch).Attest(req, timeout=5)

        handlers = worker_handlers(generate, {
            "GetLoad": (get_load, pb.LoadRequest, pb.Load),
            "GetModelInfo": (get_model_info, pb.ModelInfoRequest, pb.ModelInfo),
            "Attest": (attest, pb.AttestRequest, pb.AttestResponse)})
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((handlers,))
        health_servicer = health.aio.HealthServicer()
        for service in ("", WORKER):
            await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.server)
        self.port = self.certs.tls.add_port(self.server, "127.0.0.1:0", require_client_cert=False)
        await self.server.start()
        return self.port


@dataclass
class Secured:
    lt: LoopThread
    certs: Certs
    redis: RedisServer
    worker: Any            # WorkerServer
    router: RouterServer
    grpc_port: int
    http_port: int


@pytest.fixture(scope="module")
def secured(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    from worker.engine.engine import Engine, EngineConfig
    from worker.server.service import WorkerServer, WorkerServerConfig
    tmp = tmp_path_factory.mktemp("auth")
    certs = make_certs(tmp)
    server = RedisServer(tmp, ["--user", "default", "off", *(a for user, commands in ACL.items() for a in (
        "--user", user, "on", f">{REDIS_PASSWORD}", f"~kvmesh:{CLUSTER}:*", *commands.split()))])
    server.start()
    engine = Engine(EngineConfig(model=str(smollm2_dir), num_blocks=NUM_BLOCKS))
    lt = LoopThread()
    worker = WorkerServer(engine.cfg, WorkerServerConfig(worker_id="worker-0", redis_url=_url(server, "kvmesh-worker"),
                                                         cluster_name=CLUSTER, cluster_token=TOKEN, tls=certs.tls),
                          engine=engine)
    lt.run(worker.start())
    lt.run(worker.wait_ready(60))
    cfg = RouterConfig(model=str(smollm2_dir), served_model_name="smollm2", http_port=0, health_interval_s=0.2,
                       redis_url=_url(server, "kvmesh-router"), cluster_name=CLUSTER, cluster_token=TOKEN,
                       tls=certs.tls)

    async def start() -> tuple[RouterServer, int, int | None]:
        router = RouterServer(cfg)
        g, h = await router.start()
        await router.wait_ready(30)
        return router, g, h
    router, g, h = lt.run(start())
    assert h is not None
    try:
        yield Secured(lt, certs, server, worker, router, g, h)
    finally:
        lt.run(router.stop(1))
        lt.run(worker.stop(1))
        lt.close()
        server.stop()


def _url(server: RedisServer, user: str) -> str:
    return f"redis://{user}:{REDIS_PASSWORD}@127.0.0.1:{server.port}/0"


def _router_channel(s: Secured) -> grpc.Channel:
    return grpc.secure_channel(f"127.0.0.1:{s.grpc_port}", s.certs.client_credentials(False))


def _generate(channel: grpc.Channel, prompt: str = PROMPT, **kw: Any) -> tuple[str, pb.GenerateResponse]:
    req = pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(temperature=0.0, max_tokens=8), **kw)
    text, last = [], None
    for r in pb_grpc.RouterStub(channel).Generate(req, timeout=60):
        text.append(r.text)
        last = r
    assert last is not None and last.finished
    return "".join(text), last


@pytest.mark.redis
def test_grpc_over_tls_and_openai_sdk_over_https(secured: Secured) -> None:
    with _router_channel(secured) as ch:
        grpc_text, last = _generate(ch)
    assert last.worker_id == "worker-0" and grpc_text
    ctx = ssl.create_default_context(cafile=str(secured.certs.ca))
    with openai.DefaultHttpxClient(verify=ctx) as http:    # the SDK's own HTTP client, trusting our CA
        client = openai.OpenAI(base_url=f"https://127.0.0.1:{secured.http_port}/v1", api_key="unused",
                               http_client=http, max_retries=0, timeout=60)
        done = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0)
    assert done.choices[0].text == grpc_text      # both fronts, one greedy answer
    cli = subprocess.run([sys.executable, "-m", "kvmesh.cli", "client", "generate", "--target",
                          f"127.0.0.1:{secured.grpc_port}", "--tls-ca", str(secured.certs.ca), "--json",
                          "--max-tokens", "8", PROMPT], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and json.loads(cli.stdout)["text"] == grpc_text, cli.stderr
    # plaintext clients of the TLS ports get nowhere
    with grpc.insecure_channel(f"127.0.0.1:{secured.grpc_port}") as ch, pytest.raises(grpc.RpcError) as e:
        _generate(ch)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{secured.http_port}/health", timeout=5)


@pytest.mark.redis
def test_worker_needs_a_client_certificate_then_the_token(secured: Secured) -> None:
    address = secured.worker.address
    with grpc.secure_channel(address, secured.certs.client_credentials(False)) as ch:
        with pytest.raises(grpc.RpcError) as e:       # no client certificate: the handshake fails
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(address, secured.certs.client_credentials(True)) as ch:
        stub = pb_grpc.WorkerStub(ch)
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
        hinted = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=2),
                                    peer_hints=[pb.PeerHint(address="10.0.0.9:1234")])
        rogue = pb.SendBlocksRequest(block_hashes=[bytes([i]) * 16 for i in range(8)])
        for call in (lambda: list(stub.Generate(hinted, timeout=10)), lambda: stub.SendBlocks(rogue, timeout=10),
                     lambda: stub.GetLoad(pb.LoadRequest(), timeout=10),
                     lambda: stub.GetLoad(pb.LoadRequest(), timeout=10,
                                          metadata=((TOKEN_METADATA, TOKEN[:-1] + "x"),))):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value.details()
        load = stub.GetLoad(pb.LoadRequest(), timeout=10, metadata=((TOKEN_METADATA, TOKEN),))
        assert load.worker_id == "worker-0"


@pytest.mark.redis
def test_fake_worker_registered_in_redis_gets_nothing(secured: Secured, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    with grpc.secure_channel(secured.worker.address, secured.certs.client_credentials(True)) as ch:
        info = pb_grpc.WorkerStub(ch).GetModelInfo(pb.ModelInfoRequest(), timeout=10,
                                                   metadata=((TOKEN_METADATA, TOKEN),))
    fake = FakeWorker(secured.worker.address, secured.certs, info)
    port = secured.lt.run(fake.start())
    evil = f"127.0.0.1:{port}"
    attacker = _url(secured.redis, "kvmesh-worker")
    keys = RedisConfig(url=attacker, cluster_name=CLUSTER).keys
    with redis.Redis.from_url(attacker) as r:     # the attacker holds a worker's Redis credentials
        r.sadd(keys.workers, "evil")
        r.hset(keys.record("evil"), mapping={"worker_id": "evil", "address": evil, "model": info.model,
                                             "block_size": str(info.block_size), "num_blocks": str(NUM_BLOCKS),
                                             "hash_salt_hex": info.hash_salt_hex, "epoch": "1"})
        r.set(keys.alive("evil"), "1", ex=120)
    try:
        deadline = time.monotonic() + 30
        while not any(f"REJECTED worker at {evil}" in m for m in caplog.messages):
            assert time.monotonic() < deadline, (fake.calls, caplog.messages)
            time.sleep(0.1)
        with _router_channel(secured) as ch:
            served = {_generate(ch, f"Request {i}: hello")[1].worker_id for i in range(4)}
        assert served == {"worker-0"}
        assert fake.calls.get("Attest", 0) >= 1          # it was asked to prove itself ...
        assert "Generate" not in fake.calls and fake.tokens_seen == []   # ... and got no prompt, no token
        assert [w.info.worker_id for w in secured.router.registry.live()] == ["worker-0"]
        consumer = secured.router.registry.consumer      # the ACL users suffice: registry and events flow
        assert consumer is not None
        stats = consumer.stats()
        assert not stats.degraded and stats.failures == 0 and stats.entries > 0, stats
        assert not [m for m in caplog.messages if "no permissions" in m], caplog.messages
    finally:
        with redis.Redis.from_url(attacker) as r:
            r.srem(keys.workers, "evil")
            r.delete(keys.record("evil"), keys.alive("evil"))
        assert fake.server is not None
        secured.lt.run(fake.server.stop(None))


# -- the pieces, without a cluster -------------------------------------------------------------
def test_attestation_binds_nonce_worker_and_address() -> None:
    mac = attestation_mac(TOKEN, b"n" * 32, "worker-0", "10.0.0.1:50061")
    assert verify_attestation(TOKEN, b"n" * 32, "worker-0", "10.0.0.1:50061", mac)
    for nonce, wid, address, token in ((b"m" * 32, "worker-0", "10.0.0.1:50061", TOKEN),
                                       (b"n" * 32, "worker-1", "10.0.0.1:50061", TOKEN),
                                       (b"n" * 32, "worker-0", "10.0.0.2:50061", TOKEN),
                                       (b"n" * 32, "worker-0", "10.0.0.1:50061", TOKEN + "x")):
        assert not verify_attestation(token, nonce, wid, address, mac)
    assert TOKEN not in masked(TOKEN) and masked(TOKEN).startswith(TOKEN[:4])
    assert token_from(None, {"KVMESH_CLUSTER_TOKEN": TOKEN}) == TOKEN and token_from(None, {}) is None
    with pytest.raises(ValueError, match="^cluster_token:"):
        token_from("short", {})


def test_no_token_admits_all_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    admitter = Admitter(RouterConfig())
    caplog.set_level(logging.WARNING, logger="kvmesh.router")
    verdicts = [asyncio.run(admitter.admit("127.0.0.1:1", None, 1.0)).verdict for _ in range(3)]  # type: ignore[arg-type]
    assert verdicts == [Verdict.ADMITTED] * 3
    assert sum("no --cluster-token" in m for m in caplog.messages) == 1


@pytest.mark.multiproc
def test_embedded_redis_has_a_password_kept_across_restarts(tmp_path: Path) -> None:
    url, child = start_redis(tmp_path, password=REDIS_PASSWORD)
    try:
        assert url.startswith(f"redis://:{REDIS_PASSWORD}@127.0.0.1:")
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as anonymous:   # redis-cli PING, no AUTH
            anonymous.sendall(b"PING\r\n")
            assert anonymous.recv(100).startswith(b"-NOAUTH")
        assert REDIS_PASSWORD not in " ".join(child.proc.args)     # not in ps: a 0600 config file
        terminate([child], 5)
        again, child = start_redis(tmp_path, port=port, password=REDIS_PASSWORD)   # as the supervisor restarts it
        assert again == url
        with redis.Redis.from_url(url, socket_timeout=2) as client:
            assert client.ping()
    finally:
        terminate([child], 5)


@pytest.mark.server
def test_peer_channel_carries_certificate_and_token(tmp_path: Path) -> None:
    """worker -> worker SendBlocks (worker/cluster_auth.peer_channel) against a server demanding
    both mutual TLS and the token, as a worker does."""
    from contracts.grpc_auth import ClusterTokenGuard
    from worker.server.cluster_auth import peer_channel
    from worker.server.config import WorkerServerConfig
    certs = make_certs(tmp_path)

    async def send_blocks(req: pb.SendBlocksRequest, context: grpc.aio.ServicerContext) -> pb.SendBlocksResponse:
        return pb.SendBlocksResponse(num_blocks=len(req.block_hashes))

    async def run() -> list[object]:
        server = grpc.aio.server(interceptors=[ClusterTokenGuard(TOKEN, WORKER)])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(WORKER, {
            "SendBlocks": grpc.unary_unary_rpc_method_handler(
                send_blocks, request_deserializer=pb.SendBlocksRequest.FromString,
                response_serializer=pb.SendBlocksResponse.SerializeToString)}),))
        port = certs.tls.add_port(server, "127.0.0.1:0", require_client_cert=True)
        await server.start()
        results: list[object] = []
        try:
            for token in (TOKEN, None):
                channel = peer_channel(WorkerServerConfig(cluster_token=token, tls=certs.tls), f"127.0.0.1:{port}")
                try:
                    reply = await pb_grpc.WorkerStub(channel).SendBlocks(
                        pb.SendBlocksRequest(block_hashes=[b"\0" * 16] * 3), timeout=10)
                    results.append(reply.num_blocks)
                except grpc.aio.AioRpcError as e:
                    results.append(e.code())
                finally:
                    await channel.close()
        finally:
            await server.stop(None)
        return results
    assert asyncio.run(run()) == [3, grpc.StatusCode.UNAUTHENTICATED]


def test_serve_passes_tls_flags_and_secrets_to_its_children(tmp_path: Path) -> None:
    """`kvmesh serve --tls-cert --tls-key --tls-ca`: the flags reach the router's and every
    worker's command line (parsed back with the real `kvmesh` parser); the token and the Redis URL
    go by environment only."""
    from kvmesh.cli import build_parser
    from kvmesh.serve.cli import config_from_args
    from kvmesh.serve.local import LocalCluster, _worker_argv
    certs = make_certs(tmp_path)
    args = build_parser().parse_args(["serve", "--tls-cert", str(certs.cert), "--tls-key", str(certs.key),
                                      "--tls-ca", str(certs.ca)])
    cfg = config_from_args(args)
    url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:1/0"
    worker = _worker_argv(cfg, "worker-0", 0, 1, [])
    router = LocalCluster(cfg)._router_argv(0, 0)
    for argv in (worker, router):
        ns = build_parser().parse_args(argv[3:])          # after `python -m kvmesh.cli`
        assert (ns.tls_cert, ns.tls_key, ns.tls_ca) == (certs.cert, certs.key, certs.ca)
        assert ns.cluster_token is None and ns.redis_url is None
        assert cfg.cluster_token not in " ".join(argv) and REDIS_PASSWORD not in " ".join(argv)
    assert cfg.child_env(url) == {"KVMESH_REDIS_URL": url, "KVMESH_CLUSTER_TOKEN": cfg.cluster_token}
    only_router = config_from_args(build_parser().parse_args(
        ["serve", "--tls-cert", str(certs.cert), "--tls-key", str(certs.key)]))
    assert "--tls-cert" not in _worker_argv(only_router, "worker-0", 0, 1, [])   # no CA: workers stay plaintext


def test_local_workers_split_the_cores_unless_threads_is_set() -> None:
    """`kvmesh serve --workers N`: each local worker gets `--threads` = its share of the cores
    this process may use (N workers of every-core threads would take turns on the same
    cores); a `--threads` the user gives reaches every worker instead."""
    import os

    from kvmesh.cli import build_parser
    from kvmesh.serve.cli import config_from_args
    from kvmesh.serve.local import _worker_argv
    cores = len(os.sched_getaffinity(0))
    for workers in (1, 2, 64):
        cfg = config_from_args(build_parser().parse_args(["serve", "--workers", str(workers)]))
        ns = build_parser().parse_args(_worker_argv(cfg, "worker-0", 0, 1, [])[3:])
        assert ns.threads == max(1, cores // workers)
    cfg = config_from_args(build_parser().parse_args(["serve", "--workers", "2", "--threads", "3"]))
    argv = _worker_argv(cfg, "worker-0", 0, 1, [])
    assert argv.count("--threads") == 1 and build_parser().parse_args(argv[3:]).threads == 3

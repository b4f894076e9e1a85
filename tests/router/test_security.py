"""Client authentication on the router, met the way a client meets it: the
official `openai` SDK and raw HTTP for 401/200, grpcio for UNAUTHENTICATED.

One real worker (SmolLM2) behind two routers on one loop: an open one (the loopback default)
and one with keys (`--api-key` style and a keys file with a tenant).
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import logging
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.security.auth import (
    ApiKey,
    Authenticator,
    add_auth_arguments,
    keys_from_args,
    parse_keys_file,
    warn_if_open,
)
from router.server import RouterServer
from tests.router.test_router import Cluster, greedy, start_cluster, stop_cluster

KEY = "sk-plain-0123456789"
TENANT_KEY = "sk-tenant-a-abcdef"
PROMPT = "The capital of France is"


@dataclass
class Keyed:
    open: Cluster
    grpc_port: int
    http_port: int


@pytest.fixture(scope="module")
def keyed(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Keyed]:
    keys_file = tmp_path_factory.mktemp("keys") / "keys"
    keys_file.write_text(f"# key tenant [priority]\n{TENANT_KEY} tenant-a priority\n")
    keys = (ApiKey(KEY), *parse_keys_file(keys_file))
    c = start_cluster(smollm2_dir, 1, http=True)
    cfg = RouterConfig(worker_addresses=tuple(c.worker_addresses), model=str(smollm2_dir),
                       served_model_name="smollm2", http_port=0, health_interval_s=0.2, api_keys=keys,
                       http_read_timeout_s=2.0, http_idle_timeout_s=2.0, max_concurrent_per_tenant=1)

    async def start() -> tuple[RouterServer, int, int | None]:
        router = RouterServer(cfg)
        g, h = await router.start()
        await router.wait_ready(10)
        return router, g, h
    router, g, h = c.lt.run(start())
    assert h is not None
    try:
        yield Keyed(c, g, h)
    finally:
        c.lt.run(router.stop(1))
        stop_cluster(c)


def sdk(port: int, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.mark.server
def test_http_keys_with_openai_sdk(keyed: Keyed) -> None:
    with pytest.raises(openai.AuthenticationError) as bad:
        sdk(keyed.http_port, "sk-wrong").completions.create(model="smollm2", prompt=PROMPT, max_tokens=2)
    assert bad.value.status_code == 401
    body = bad.value.response.json()
    assert body["error"]["code"] == "invalid_api_key" and body["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError):
        sdk(keyed.http_port, "sk-wrong").models.list()
    for key in (KEY, TENANT_KEY):
        r = sdk(keyed.http_port, key).completions.create(model="smollm2", prompt=PROMPT, max_tokens=3, temperature=0)
        assert r.usage is not None and r.usage.completion_tokens == 3
    # The open (loopback, no keys) router takes any key.
    r = sdk(keyed.open.http_port or 0, "anything").completions.create(model="smollm2", prompt=PROMPT, max_tokens=2)
    assert r.usage is not None and r.usage.completion_tokens == 2


@pytest.mark.server
def test_back_to_back_requests_fit_a_one_request_tenant_limit(keyed: Keyed) -> None:
    """--max-concurrent-per-tenant 1 (the fixture): a client that starts its next request the moment
    the last one ends — a stream read to its end, a stream left at its finished chunk, a refused
    gRPC call — is never refused for the slot the ended request held."""
    client = sdk(keyed.http_port, KEY)
    md = (("authorization", f"Bearer {KEY}"),)
    with grpc.insecure_channel(f"127.0.0.1:{keyed.grpc_port}") as ch:
        stub = pb_grpc.RouterStub(ch)
        for _ in range(4):
            chunks = list(client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2, stream=True))
            assert chunks[-1].choices[0].finish_reason == "length"
            stream = client.chat.completions.create(model="smollm2", max_tokens=2, stream=True,
                                                    messages=[{"role": "user", "content": PROMPT}])
            for chunk in stream:                  # stop reading at the finish chunk, before [DONE]
                if chunk.choices and chunk.choices[0].finish_reason:
                    break
            stream.close()
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(pb.GenerateRequest(text="", sampling=greedy(2)), timeout=30, metadata=md))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            out = list(stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=greedy(2)), timeout=60, metadata=md))
            assert out[-1].finished
            r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2)
            assert r.usage is not None and r.usage.completion_tokens == 2


@pytest.mark.server
def test_http_missing_or_malformed_header_is_401_and_health_open(keyed: Keyed) -> None:
    base = f"http://127.0.0.1:{keyed.http_port}"
    for headers in ({}, {"Authorization": KEY}, {"Authorization": "Basic " + KEY}, {"Authorization": "Bearer "}):
        req = urllib.request.Request(base + "/v1/models", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 401 and json.loads(e.value.read())["error"]["code"] == "invalid_api_key"
    with urllib.request.urlopen(base + "/health", timeout=10) as r:
        assert r.status == 200
    req = urllib.request.Request(base + "/v1/models", headers={"Authorization": f"bearer {TENANT_KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert json.loads(r.read())["data"][0]["id"] == "smollm2"


@pytest.mark.server
def test_metrics_open_by_default_keyed_with_metrics_require_key(keyed: Keyed) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{keyed.http_port}/metrics", timeout=10) as r:
        assert r.status == 200 and b"kvmesh:router_" in r.read()      # a keyed router, no key sent

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="m 1\n")

    async def scrape(require: bool, headers: dict[str, str]) -> int:
        app = web.Application(middlewares=[Authenticator([ApiKey(KEY)], metrics_require_key=require).http_middleware()])
        app.add_routes([web.get("/metrics", metrics)])
        async with TestClient(TestServer(app)) as client:
            return (await client.get("/metrics", headers=headers)).status
    assert asyncio.run(scrape(False, {})) == 200
    assert asyncio.run(scrape(True, {})) == 401
    assert asyncio.run(scrape(True, {"Authorization": f"Bearer {KEY}"})) == 200


@pytest.mark.server
def test_grpc_unauthenticated_without_key(keyed: Keyed) -> None:
    req = pb.GenerateRequest(text=PROMPT, sampling=greedy(2))
    with grpc.insecure_channel(f"127.0.0.1:{keyed.grpc_port}") as ch:
        stub = pb_grpc.RouterStub(ch)
        for md in ((), (("authorization", "Bearer sk-wrong"),), (("authorization", KEY),)):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, timeout=30, metadata=md))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:
                stub.GetModelInfo(pb.ModelInfoRequest(), timeout=30, metadata=md)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:
                stub.Abort(pb.AbortRequest(request_id="x"), timeout=30, metadata=md)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Garbage bytes without a key: rejected before parsing.
        raw = ch.unary_stream("/kvmesh.v1.Router/Generate", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as e:
            list(raw(b"\xff\xfe garbage", timeout=30))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Health stays open; the right key generates.
        check = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        out = list(stub.Generate(req, timeout=60, metadata=(("authorization", f"Bearer {TENANT_KEY}"),)))
        assert out[-1].finished and sum(len(r.token_ids) for r in out) == 2


def test_keys_file_parsing_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "keys"
    f.write_text("k1 alpha\n\n  # comment\nk2 beta priority  # trailing comment\n")
    assert [(k.key, k.tenant, k.priority) for k in parse_keys_file(f)] == [
        ("k1", "alpha", False), ("k2", "beta", True)]
    assert "k1" not in repr(parse_keys_file(f)[0])
    for bad in ("k1\n", "k1 alpha root\n", "", "a b c d\n"):  # admin is a flag now
        f.write_text(bad)
        with pytest.raises(ValueError, match="api_keys_file"):
            parse_keys_file(f)
    f.write_text("k3 gamma\n")
    p = argparse.ArgumentParser()
    add_auth_arguments(p)
    monkeypatch.setenv("KVMESH_API_KEYS_FILE", str(f))
    keys = keys_from_args(p.parse_args(["--api-key", "k0"]))
    assert [(k.key, k.tenant) for k in keys] == [("k0", "default"), ("k3", "gamma")]
    auth = Authenticator(keys)
    assert auth.check("Bearer k3") is keys[1] and auth.check("Bearer k") is None and auth.check(None) is None
    with pytest.raises(ValueError):
        ApiKey("has space")


def test_warns_when_binding_non_loopback_without_keys(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvmesh.router.auth"):
        assert warn_if_open("0.0.0.0", ()) is True
        assert "WITHOUT client authentication" in caplog.text
        assert warn_if_open("127.0.0.1", ()) is False and warn_if_open("::1", ()) is False
        assert warn_if_open("0.0.0.0", (ApiKey("k"),)) is False


# -- hostile input: 4xx with an OpenAI-style body, then the next request served --
AUTH = {"Authorization": f"Bearer {KEY}"}


def post(port: int, path: str, body: bytes, headers: dict[str, str] | None = None,
         method: str = "POST") -> tuple[int, dict[str, object]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **AUTH, **(headers or {})})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"null")
    finally:
        conn.close()


def assert_served(port: int) -> None:
    status, body = post(port, "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode())
    assert status == 200, body


def assert_4xx(status: int, body: object, want: int | None = None) -> None:
    assert 400 <= status < 500 and (want is None or status == want), (status, body)
    assert isinstance(body, dict) and isinstance(body["error"], dict) and body["error"]["message"], body


@pytest.mark.server
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_hostile_json_bodies_are_4xx(keyed: Keyed, path: str) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    bodies = [
        deep,
        b'{"prompt": ' + deep + b', "messages": ' + deep + b"}",
        b'{"prompt": "a\\ud800b", "max_tokens": 2}',
        b'{"messages": [{"role": "user", "content": "x\\udfffy"}], "max_tokens": 2}',
        b"\xff\xfe\x00garbage",
        b"",
        b"null",
        b'{"prompt": 1e999999}',
    ]
    for body in bodies:
        status, parsed = post(keyed.http_port, path, body)
        assert_4xx(status, parsed)
    for ctype in ("text/plain", "multipart/form-data; boundary=x", "application/x-www-form-urlencoded"):
        status, parsed = post(keyed.http_port, path, b"a=b&c=d", {"Content-Type": ctype})
        assert_4xx(status, parsed)
    assert_served(keyed.http_port)


@pytest.mark.server
def test_wrong_methods_and_paths_are_openai_json(keyed: Keyed) -> None:
    for method, path in (("GET", "/v1/completions"), ("PUT", "/v1/chat/completions"), ("DELETE", "/v1/models")):
        status, body = post(keyed.http_port, path, b"", method=method)
        assert_4xx(status, body, 405)
        assert body["error"]["code"] == "method_not_allowed"  # type: ignore[index]
    status, body = post(keyed.http_port, "/v1/nope", b"{}")
    assert_4xx(status, body, 404)
    assert_served(keyed.http_port)


@pytest.mark.server
def test_body_shorter_than_content_length_times_out(keyed: Keyed) -> None:
    with socket.create_connection(("127.0.0.1", keyed.http_port), timeout=20) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: 500\r\n\r\n".encode() + b'{"prompt": "hi"')
        t0 = time.monotonic()
        head = s.recv(4096)
        assert head.startswith(b"HTTP/1.1 408"), head[:200]
        assert time.monotonic() - t0 < 15
    assert_served(keyed.http_port)


@pytest.mark.server
def test_idle_keepalive_connection_is_closed(keyed: Keyed) -> None:
    with socket.create_connection(("127.0.0.1", keyed.http_port), timeout=20) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        assert s.recv(4096) == b""          # closed by the server after http_idle_timeout_s (2 s)
        assert time.monotonic() - t0 < 15


@pytest.mark.server
def test_zero_token_prompt_is_rejected(keyed: Keyed) -> None:
    status, body = post(keyed.http_port, "/v1/completions", b'{"prompt": "", "max_tokens": 2}')
    assert_4xx(status, body, 400)
    status, body = post(keyed.http_port, "/v1/completions", b'{"prompt": [], "max_tokens": 2}')
    assert_4xx(status, body, 400)
    with grpc.insecure_channel(f"127.0.0.1:{keyed.grpc_port}") as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.RouterStub(ch).Generate(pb.GenerateRequest(text="", sampling=greedy(2)), timeout=30,
                                                 metadata=(("authorization", f"Bearer {KEY}"),)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_served(keyed.http_port)


@pytest.mark.server
def test_grpc_garbage_bytes_on_every_router_method(keyed: Keyed) -> None:
    md = (("authorization", f"Bearer {KEY}"),)
    with grpc.insecure_channel(f"127.0.0.1:{keyed.grpc_port}") as ch:
        for method, streaming in (("Generate", True), ("Abort", False), ("GetModelInfo", False)):
            path = f"/kvmesh.v1.Router/{method}"
            call = ch.unary_stream(path) if streaming else ch.unary_unary(path)
            with pytest.raises(grpc.RpcError) as e:
                out = call(b"\xff\xff\xff\xff garbage", timeout=30, metadata=md)
                if streaming:
                    list(out)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value)
        out = list(pb_grpc.RouterStub(ch).Generate(pb.GenerateRequest(text=PROMPT, sampling=greedy(2)),
                                                   timeout=60, metadata=md))
        assert out[-1].finished


@pytest.mark.server
def test_grpc_garbage_bytes_on_every_worker_method(keyed: Keyed, caplog: pytest.LogCaptureFixture) -> None:
    with grpc.insecure_channel(keyed.open.worker_addresses[0]) as ch, caplog.at_level(logging.ERROR):
        for method, streaming in (("Generate", True), ("Abort", False), ("GetModelInfo", False),
                                  ("GetLoad", False), ("SendBlocks", False), ("Attest", False)):
            path = f"/kvmesh.v1.Worker/{method}"
            call = ch.unary_stream(path) if streaming else ch.unary_unary(path)
            with pytest.raises(grpc.RpcError) as e:
                out = call(b"\xff\xff\xff\xff garbage", timeout=30)
                if streaming:
                    list(out)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value)
        assert not [r for r in caplog.records if "Traceback" in r.getMessage() or r.exc_info], caplog.text
        info = pb_grpc.WorkerStub(ch).GetModelInfo(pb.ModelInfoRequest(), timeout=30)
        assert info.model


@pytest.mark.server
def test_max_concurrent_per_tenant(keyed: Keyed) -> None:
    """Limit 1: while tenant-a streams, its next request (HTTP or gRPC) is refused; the other
    tenant is served; after the stream ends tenant-a is served again."""
    a, other = sdk(keyed.http_port, TENANT_KEY), sdk(keyed.http_port, KEY)
    stream = a.completions.create(model="smollm2", prompt=PROMPT, max_tokens=200, stream=True, temperature=0)
    first = next(iter(stream))
    assert first.choices
    with pytest.raises(openai.RateLimitError) as e:
        a.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 429 and e.value.response.json()["error"]["code"] == "too_many_requests"
    with grpc.insecure_channel(f"127.0.0.1:{keyed.grpc_port}") as ch:
        with pytest.raises(grpc.RpcError) as g:
            list(pb_grpc.RouterStub(ch).Generate(pb.GenerateRequest(text=PROMPT, sampling=greedy(2)), timeout=30,
                                                 metadata=(("authorization", f"Bearer {TENANT_KEY}"),)))
        assert g.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    r = other.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2)
    assert r.usage is not None and r.usage.completion_tokens == 2
    stream.close()
    deadline = time.monotonic() + 20
    while True:   # the server notices the closed stream and releases the slot
        try:
            r = a.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert r.usage is not None and r.usage.completion_tokens == 2


def test_config_rejects_bad_limits() -> None:
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="max_concurrent_per_tenant"):
            RouterConfig(max_concurrent_per_tenant=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="http_read_timeout_s"):
        RouterConfig(http_read_timeout_s=0)


@pytest.mark.server
def test_priority_only_for_flagged_tenants(keyed: Keyed) -> None:
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2, "priority": 1}).encode()
    status, parsed = post(keyed.http_port, "/v1/completions", body)          # KEY: tenant 'default', not flagged
    assert_4xx(status, parsed, 403)
    assert parsed["error"]["param"] == "priority"  # type: ignore[index]
    status, parsed = post(keyed.http_port, "/v1/completions", body, {"Authorization": f"Bearer {TENANT_KEY}"})
    assert status == 200, parsed
    status, parsed = post(keyed.open.http_port or 0, "/v1/completions", body)   # no keys: loopback trust
    assert status == 200, parsed
    req = pb.GenerateRequest(text=PROMPT, sampling=greedy(2), priority=1)
    with grpc.insecure_channel(f"127.0.0.1:{keyed.grpc_port}") as ch:
        stub = pb_grpc.RouterStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=30, metadata=(("authorization", f"Bearer {KEY}"),)))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        out = list(stub.Generate(req, timeout=60, metadata=(("authorization", f"Bearer {TENANT_KEY}"),)))
        assert out[-1].finished

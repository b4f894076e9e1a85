"""Client authentication on the router (issue #17 item 1), met the way a client meets it: the
official `openai` SDK and raw HTTP for 401/200, grpcio for UNAUTHENTICATED.

One real worker (SmolLM2) behind two routers on one loop: an open one (the loopback default)
and one with keys (`--api-key` style and a keys file with a tenant).
"""
from __future__ import annotations

import argparse
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from router.auth import ApiKey, Authenticator, add_auth_arguments, keys_from_args, parse_keys_file, warn_if_open
from router.config import RouterConfig
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
                       served_model_name="smollm2", http_port=0, health_interval_s=0.2, api_keys=keys)

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
    # The open (loopback, no keys) router takes any key, as before.
    r = sdk(keyed.open.http_port or 0, "anything").completions.create(model="smollm2", prompt=PROMPT, max_tokens=2)
    assert r.usage is not None and r.usage.completion_tokens == 2


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
    for bad in ("k1\n", "k1 alpha admin\n", "", "a b c d\n"):
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

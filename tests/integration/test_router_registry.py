"""A router without model storage, as real processes: redis-server, one `kvmesh
worker --redis-url` (SmolLM2) and `kvmesh router` with NO --worker and `--tokenizer-source
worker`, its KVMESH_CACHE_DIR in tmp. The router is started first: /health answers 503 (and
/livez 200) until the worker registers and the router has its tokenizer, then 200. The oracle:
a second router with `--tokenizer-source local` (today's path, reading the converted model)
gives the same chat completion through the `openai` SDK. The cache holds the worker's files
under the digest the worker reports.

Needs a worker that serves Worker.GetTokenizer; skipped (saying so) against one that does not.
"""
from __future__ import annotations

import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from contracts.tokenizer import tokenizer_files_digest
from kvmesh.serve.processes import Child, spawn, terminate
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.multiproc, pytest.mark.redis]

ROOT = Path(__file__).resolve().parents[2]
WORKER_LINE = re.compile(r"^kvmesh worker (\S+) serving on (\S+):(\d+)$", re.M)
ROUTER_LINE = re.compile(r"kvmesh router serving grpc on (\S+):(\d+) http on (\S+):(\d+)")
START_S = 180.0
CLI = [sys.executable, "-m", "kvmesh.cli"]


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def _router(tmp_path: Path, name: str, redis_url: str, source: str, env: dict[str, str]) -> tuple[Child, str]:
    child = spawn(tmp_path, name, [*CLI, "router", "--redis-url", redis_url, "--grpc-port", "0", "--http-port", "0",
                                   "--model", "smollm2", "--tokenizer-source", source], env=env)
    m = child.wait_line(ROUTER_LINE, time.monotonic() + START_S, START_S)
    return child, f"http://{m.group(3)}:{m.group(4)}"


def _chat(base: str) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    return client.chat.completions.create(model="smollm2", max_tokens=12, temperature=0.0, messages=[
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"}])


@pytest.fixture
def children() -> Iterator[list[Child]]:
    out: list[Child] = []
    try:
        yield out
    finally:
        terminate(out, 30)


def test_router_without_model_storage_gets_the_tokenizer_from_a_registered_worker(
        redis_server: RedisServer, tmp_path: Path, children: list[Child]) -> None:  # noqa: F811
    cache = tmp_path / "router-cache"
    router, base = _router(tmp_path, "router-worker-tok", redis_server.url, "worker", {"KVMESH_CACHE_DIR": str(cache)})
    children.append(router)
    assert (_status(base + "/health"), _status(base + "/readyz"), _status(base + "/livez")) == (503, 503, 200)

    worker = spawn(tmp_path, "worker-0", [*CLI, "worker", "--port", "0", "--worker-id", "worker-0", "--model",
                                          "smollm2", "--num-blocks", "64", "--redis-url", redis_server.url])
    children.append(worker)
    m = worker.wait_line(WORKER_LINE, time.monotonic() + START_S, START_S)
    with grpc.insecure_channel(f"{m.group(2)}:{m.group(3)}") as ch:
        stub = pb_grpc.WorkerStub(ch)
        try:
            files = stub.GetTokenizer(pb.TokenizerRequest(), timeout=30)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:   # type: ignore[attr-defined]
                pytest.skip("this worker does not serve GetTokenizer yet")
            raise
        info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=30)
    assert info.tokenizer_sha256 == files.sha256 == tokenizer_files_digest(dict(files.files))

    deadline = time.monotonic() + 60
    while _status(base + "/health") != 200:
        assert time.monotonic() < deadline and router.proc.poll() is None, router.tail()
        time.sleep(0.2)
    assert _status(base + "/v1/models") == 200
    got = _chat(base)

    local, local_base = _router(tmp_path, "router-local-tok", redis_server.url, "local", {})
    children.append(local)
    deadline = time.monotonic() + 60
    while _status(local_base + "/health") != 200:
        assert time.monotonic() < deadline and local.proc.poll() is None, local.tail()
        time.sleep(0.2)
    want = _chat(local_base)
    assert got.choices[0].message.content and got.choices[0].message.content == want.choices[0].message.content
    assert got.usage is not None and want.usage is not None
    assert got.usage.prompt_tokens == want.usage.prompt_tokens     # the same prompt ids

    cached = cache / "tokenizers" / info.tokenizer_sha256
    assert {p.name: p.read_bytes() for p in cached.iterdir()} == dict(files.files)
    assert "tokenizer.json" in dict(files.files)

"""The router's tokenizer from a worker and its
readiness / liveness split, against in-process fake workers (tests/support/fake_worker.py).

Oracles: the digest is `contracts.tokenizer.tokenizer_files_digest` (the worker's, pinned in
tests/contracts/test_tokenizer_files.py); the prompt ids a worker receives equal
`ModelTokenizer.from_model_dir` over the same files written by the test (what a
local-tokenizer router computes).
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contracts.health import LIVENESS_SERVICE
from contracts.tokenizer import ModelTokenizer, tokenizer_files_digest
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.config import RouterConfig, TokenizerSource
from router.flags import add_router_arguments
from router.routing.errors import RouterStartError
from router.server import RouterServer
from router.workers.tokenizer import (
    TokenizerMismatch,
    cache_dir,
    check_files,
    load_cached,
    resolve_tokenizer_source,
    store,
)
from tests.support.fake_worker import FakeWorker, tiny_tokenizer_files

ROUTER = "kvmesh.v1.Router"
MESSAGES = [{"role": "user", "content": "the capital of france is"}]


@pytest.fixture(autouse=True)
def cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    yield tmp_path / "cache"


# -- the pieces ----------------------------------------------------------------------------------
def _reply(files: dict[str, bytes], **kw: Any) -> pb.TokenizerFiles:
    return pb.TokenizerFiles(model="tiny", hash_salt_hex=kw.get("salt", "ab"), files=files,
                             sha256=kw.get("sha", tokenizer_files_digest(files)))


def test_check_files_refuses_each_kind_of_bad_reply() -> None:
    files = tiny_tokenizer_files()
    good = tokenizer_files_digest(files)
    info = pb.ModelInfo(hash_salt_hex="ab", tokenizer_sha256=good)
    assert check_files(_reply(files), info) == files
    cases = {
        "not plain file names": _reply(files | {"../evil": b"x"}),
        "lack tokenizer.json": _reply({"tokenizer_config.json": files["tokenizer_config.json"]}),
        "not the sha256": _reply(files, sha="0" * 64),
        "not the workers' tokenizer_sha256": _reply(files | {"extra.txt": b"1"}),
        "hash_salt_hex": _reply(files, salt="cd"),
    }
    for why, reply in cases.items():
        with pytest.raises(TokenizerMismatch, match=why):
            check_files(reply, info)
    with pytest.raises(TokenizerMismatch, match="not a sha256"):
        check_files(_reply(files), pb.ModelInfo(hash_salt_hex="ab"))


def test_cache_is_atomic_and_checked_on_reuse(cache_in_tmp: Path) -> None:
    files = tiny_tokenizer_files()
    sha = tokenizer_files_digest(files)
    path = store(files, sha)
    assert path == cache_in_tmp / "tokenizers" / sha == cache_dir(sha)
    assert sorted(p.name for p in path.parent.iterdir()) == [sha]    # no temp dir left behind
    assert {p.name: p.read_bytes() for p in path.iterdir()} == files
    loaded = load_cached(sha)
    assert loaded is not None and loaded.tokenizer.encode("hello world") == [2, 3]
    assert store(files, sha) == path                                 # a second store keeps the copy
    (path / "tokenizer.json").write_bytes(b"{}")                     # altered on disk
    assert load_cached(sha) is None
    assert store(files, sha) == path and load_cached(sha) is not None   # replaced
    assert sorted(p.name for p in path.parent.iterdir()) == [sha]
    with pytest.raises(ValueError, match="64 lowercase hex"):
        cache_dir("../../etc")


def test_the_default_temperature_travels_with_the_tokenizer(cache_in_tmp: Path) -> None:
    """generation_config.json is among the files a worker sends (contracts TOKENIZER_FILES), so
    a worker-tokenizer router defaults `temperature` as a local one does (vLLM's rule)."""
    files = tiny_tokenizer_files()
    sha = tokenizer_files_digest(files)
    store(files, sha)
    loaded = load_cached(sha)
    assert loaded is not None and loaded.default_temperature == 1.0     # none sent: vLLM's 1.0
    files["generation_config.json"] = json.dumps({"temperature": 0.6}).encode()
    check_files(_reply(files), pb.ModelInfo(hash_salt_hex="ab", tokenizer_sha256=tokenizer_files_digest(files)))
    sha = tokenizer_files_digest(files)
    store(files, sha)
    loaded = load_cached(sha)
    assert loaded is not None and loaded.default_temperature == 0.6


def test_auto_is_local_only_for_a_local_model_with_a_tokenizer(tmp_path: Path) -> None:
    auto = TokenizerSource.AUTO
    assert resolve_tokenizer_source(auto, "HuggingFaceTB/SmolLM2-135M-Instruct") is TokenizerSource.WORKER
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    assert resolve_tokenizer_source(auto, str(model)) is TokenizerSource.WORKER
    for name, data in tiny_tokenizer_files().items():
        (model / name).write_bytes(data)
    assert resolve_tokenizer_source(auto, str(model)) is TokenizerSource.LOCAL
    assert resolve_tokenizer_source(TokenizerSource.WORKER, str(model)) is TokenizerSource.WORKER
    assert resolve_tokenizer_source(TokenizerSource.LOCAL, "org/name") is TokenizerSource.LOCAL


def test_flag_spelling() -> None:
    import argparse
    p = argparse.ArgumentParser()
    add_router_arguments(p)
    assert p.parse_args([]).tokenizer_source == "auto"
    assert p.parse_args(["--tokenizer-source", "worker"]).tokenizer_source == "worker"
    assert RouterConfig(tokenizer_source="worker").tokenizer_source is TokenizerSource.WORKER
    with pytest.raises(ValueError, match="tokenizer_source='disk'; accepted: auto, local, worker"):
        RouterConfig(tokenizer_source="disk")


# -- a router with no model storage ---------------------------------------------------------------
def _cfg(*workers: FakeWorker, **kw: Any) -> RouterConfig:
    return RouterConfig(**{"worker_addresses": tuple(w.address for w in workers), "model": "org/tiny-chat",
                           "tokenizer_source": "worker", "http_port": 0, "health_interval_s": 0.05} | kw)


async def _health(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return int(reply.status)


async def _until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.mark.server
def test_not_ready_until_a_worker_sent_its_tokenizer_then_serves(cache_in_tmp: Path) -> None:
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

    async def run() -> None:
        worker = FakeWorker("w0", tokenizer_gate=asyncio.Event())
        await worker.start(serving=False)
        router = RouterServer(_cfg(worker))
        grpc_port, http_port = await router.start()
        base = f"http://127.0.0.1:{http_port}"
        chat = {"model": "org/tiny-chat", "messages": MESSAGES, "max_tokens": 4}
        try:
            async with aiohttp.ClientSession() as http:
                async def get(path: str) -> int:
                    async with http.get(base + path) as r:
                        return r.status

                async def post_chat() -> tuple[int, Any]:
                    async with http.post(base + "/v1/chat/completions", json=chat) as r:
                        return r.status, await r.json()
                # no worker ready: not ready, but live; /v1/models answers
                assert [await get(p) for p in ("/health", "/readyz", "/live", "/livez", "/v1/models")] == \
                       [503, 503, 200, 200, 200]
                assert await _health(grpc_port, ROUTER) == not_serving
                assert await _health(grpc_port, LIVENESS_SERVICE) == serving
                status, body = await post_chat()
                assert (status, body["error"]["code"]) == (503, "no_worker")
                # the worker is ready, its GetTokenizer is held: still not ready, a clear 503
                await worker.set_serving(True)
                await _until(lambda: worker.calls.get("GetTokenizer", 0) == 1)
                assert router.registry.ready and router.core.tokenizer is None
                assert await get("/readyz") == 503 and await _health(grpc_port, ROUTER) == not_serving
                status, body = await post_chat()
                assert (status, body["error"]["code"], body["error"]["type"]) == \
                       (503, "tokenizer_not_loaded", "service_unavailable")
                assert "tokenizer" in body["error"]["message"]
                # the files arrive: ready
                worker.tokenizer_gate.set()
                await router.wait_ready(10)
                assert [await get(p) for p in ("/health", "/readyz", "/livez")] == [200, 200, 200]
                assert await _health(grpc_port, ROUTER) == serving
                status, body = await post_chat()
                assert status == 200, body
                assert body["choices"][0]["message"]["content"] == "paris"
                async with http.get(base + "/v1/models") as r:
                    assert (await r.json())["data"][0]["id"] == "org/tiny-chat"
        finally:
            await router.stop(0)
            await worker.stop()
        path = cache_in_tmp / "tokenizers" / worker.digest
        assert {p.name: p.read_bytes() for p in path.iterdir()} == worker.files
        # the oracle: a local-tokenizer router over the same files sends the same prompt ids
        assert worker.prompts == [ModelTokenizer.from_model_dir(path).apply_chat_template(MESSAGES)]
    asyncio.run(run())


@pytest.mark.server
def test_cached_files_are_reused_after_their_digest_is_checked(cache_in_tmp: Path) -> None:
    async def start_and_stop(worker: FakeWorker) -> None:
        router = RouterServer(_cfg(worker, http_port=None))
        await router.start()
        try:
            await router.wait_ready(10)
            assert router.core.tokenizer is not None and router.core.tokenizer.encode("hello") == [2]
        finally:
            await router.stop(0)

    async def run() -> None:
        worker = FakeWorker("w0")
        await worker.start()
        try:
            await start_and_stop(worker)
            assert worker.calls["GetTokenizer"] == 1
            await start_and_stop(worker)                 # a restarted router: from the cache
            assert worker.calls["GetTokenizer"] == 1
            (cache_in_tmp / "tokenizers" / worker.digest / "tokenizer_config.json").write_text("{}")
            await start_and_stop(worker)                 # an altered cache: fetched again
            assert worker.calls["GetTokenizer"] == 2
        finally:
            await worker.stop()
    asyncio.run(run())


@pytest.mark.server
def test_workers_with_bad_files_or_another_tokenizer_are_refused(caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        files = tiny_tokenizer_files()
        liar = FakeWorker("liar", sent_files=files | {"tokenizer_config.json": b"{}"})    # sends other files
        other = FakeWorker("other", files=files | {"special_tokens_map.json": json.dumps({}).encode()})
        honest = FakeWorker("honest")
        for w in (liar, other, honest):
            await w.start()
        router = RouterServer(_cfg(liar, honest, http_port=None))    # the liar is asked first
        try:
            await router.start()
            await router.wait_ready(10)
            router.set_workers([liar.address, honest.address, other.address])
            await _until(lambda: router.registry.entry(other.address).refused is not None)
            assert [w.info.worker_id for w in router.registry.live() if w.info] == ["honest"]
            assert liar.calls["GetTokenizer"] == 1 and "Generate" not in liar.calls
            assert "GetTokenizer" not in other.calls        # refused on its ModelInfo already
            refused = {w.address: w.refused for w in (router.registry.entry(a.address) for a in (liar, other))}
            assert "is not the sha256" in (refused[liar.address] or "")
            assert "tokenizer_sha256" in (refused[other.address] or "")
            assert honest.calls["GetTokenizer"] == 1
        finally:
            await router.stop(0)
            for w in (liar, other, honest):
                await w.stop()
    asyncio.run(run())


@pytest.mark.server
def test_a_worker_without_the_digest_is_refused_when_the_router_needs_it() -> None:
    async def run() -> None:
        old = FakeWorker("old", sha256="")
        await old.start()
        try:   # named by --worker: refused at start, as for a hash salt that disagrees
            with pytest.raises(RouterStartError, match="predates GetTokenizer"):
                await RouterServer(_cfg(old, http_port=None)).start()
            assert "GetTokenizer" not in old.calls
        finally:
            await old.stop()
    asyncio.run(run())


@pytest.mark.server
def test_an_unwritable_cache_keeps_the_router_not_ready_and_says_why(
        cache_in_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache_in_tmp.parent.mkdir(parents=True, exist_ok=True)
    cache_in_tmp.write_text("a file where the cache dir should be")

    async def run() -> None:
        worker = FakeWorker("w0")
        await worker.start()
        router = RouterServer(_cfg(worker, http_port=None))
        try:
            await router.start()
            await _until(lambda: worker.calls.get("GetTokenizer", 0) >= 2)    # retried
            assert not router.core.serving and router.registry.ready
            assert any("cannot cache the tokenizer" in m for m in caplog.messages)
            cache_in_tmp.unlink()                                         # fixed: it loads on the next try
            await router.wait_ready(10)
        finally:
            await router.stop(0)
            await worker.stop()
    asyncio.run(run())


@pytest.mark.server
def test_probes_need_no_api_key_and_are_in_the_openapi_document() -> None:
    from router.security.auth import ApiKey

    async def run() -> None:
        router = RouterServer(_cfg(api_keys=(ApiKey("sk-test-key-0123456789"),)))
        _, http_port = await router.start()
        base = f"http://127.0.0.1:{http_port}"
        try:
            async with aiohttp.ClientSession() as http:
                got = {}
                for path in ("/health", "/readyz", "/live", "/livez", "/v1/models", "/openapi.json"):
                    async with http.get(base + path) as r:
                        got[path] = r.status
                assert got == {"/health": 503, "/readyz": 503, "/live": 200, "/livez": 200, "/v1/models": 401,
                               "/openapi.json": 401}
                async with http.get(base + "/openapi.json",
                                    headers={"Authorization": "Bearer sk-test-key-0123456789"}) as r:
                    paths = (await r.json())["paths"]
                assert {"/health", "/readyz", "/live", "/livez"} <= set(paths)
        finally:
            await router.stop(0)
    asyncio.run(run())


@pytest.mark.server
def test_a_roll_to_another_model_completes_once_no_old_worker_is_ready(cache_in_tmp: Path) -> None:
    """The router has no model of its own: when the last worker of the old model stops being
    ready, the next ready worker sets the model (and the tokenizer) again; workers refused for
    disagreeing with the old model are probed again."""
    async def run() -> None:
        old = FakeWorker("old")
        new = FakeWorker("new", hash_salt_hex="cd",
                         files=tiny_tokenizer_files() | {"generation_config.json": b'{"temperature": 0.5}'})
        for w in (old, new):
            await w.start()
        router = RouterServer(_cfg(old, http_port=None))
        try:
            await router.start()
            await router.wait_ready(10)
            old_tokenizer = router.core.tokenizer
            router.set_workers([old.address, new.address])
            await _until(lambda: router.registry.entry(new.address).refused is not None)   # mid-roll
            await old.set_serving(False)                                # the last old worker drains
            await _until(lambda: [w.info.worker_id for w in router.registry.live() if w.info] == ["new"])
            await router.wait_ready(10)
            info = router.core.model_info
            assert info is not None and (info.hash_salt_hex, info.tokenizer_sha256) == ("cd", new.digest)
            assert router.core.tokenizer is not None and router.core.tokenizer is not old_tokenizer
            assert router.core.default_temperature == 0.5 and new.calls["GetTokenizer"] == 1
            await old.set_serving(True)                                 # an old worker back: refused now
            await _until(lambda: router.registry.entry(old.address).refused is not None)
            assert "hash_salt_hex" in (router.registry.entry(old.address).refused or "")
        finally:
            await router.stop(0)
            for w in (old, new):
                await w.stop()
    asyncio.run(run())


@pytest.mark.server
def test_a_stream_cut_on_the_only_worker_resumes_after_the_model_was_forgotten() -> None:
    """Its only worker lost mid-stream, the router forgets the model (no worker is ready); the
    request still moves on, with the model it was prepared for, once the worker is back."""
    async def run() -> None:
        worker = FakeWorker("w0", cut_streams=1)
        await worker.start()
        router = RouterServer(_cfg(worker, http_port=None))
        try:
            await router.start()
            await router.wait_ready(10)
            from contracts.wire import to_generate_input
            req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=4, temperature=0.0))
            req.chat.messages.add(role="user", content="the capital of france is")
            prepared = await router.core.prepare(to_generate_input(req))
            out = [r async for r in router.core.generate(prepared, 20)]
            assert out[-1].finished and out[-1].migrations == 1 and worker.calls["Generate"] == 2
        finally:
            await router.stop(0)
            await worker.stop()
    asyncio.run(run())

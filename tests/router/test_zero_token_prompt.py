"""A prompt that tokenizes to zero tokens is a clear error on every path:
`Engine.generate`, `kvmesh generate` (its `main`, in process), the worker's gRPC, the router's gRPC
and HTTP; the servers keep serving.

The model is the tiny random Llama of tests/conftest.py with a word-level tokenizer whose
normalizer deletes '§', so the non-empty prompt "§ §" has no tokens at all.
"""
from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.server import RouterServer
from tests.support.loop_thread import LoopThread

NOTHING = "§ §"          # deleted by the tokenizer's normalizer: zero tokens
WORDS = ["<unk>", "a", "b", "c", "hello", "world"]


def _with_tokenizer(model_dir: Path, dest: Path) -> Path:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    shutil.copytree(model_dir, dest)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace("§", "")
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({"unk_token": "<unk>"}))
    return dest


@dataclass
class Served:
    lt: LoopThread
    model_dir: Path
    engine: Any
    worker_port: int
    grpc_port: int
    http_port: int


@pytest.fixture(scope="module")
def served(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from worker.engine.engine import Engine, EngineConfig
    from worker.server.service import WorkerServer, WorkerServerConfig
    model_dir = _with_tokenizer(tiny_model_dir("llama-mha"), tmp_path_factory.mktemp("zero") / "model")
    engine = Engine(EngineConfig(model=str(model_dir), num_blocks=64))
    lt = LoopThread()
    worker = WorkerServer(engine.cfg, WorkerServerConfig(), engine=engine)
    lt.run(worker.start())
    lt.run(worker.wait_ready(60))
    cfg = RouterConfig(worker_addresses=(worker.address,), model=str(model_dir), http_port=0, health_interval_s=0.2)

    async def start() -> tuple[RouterServer, int, int | None]:
        router = RouterServer(cfg)
        g, h = await router.start()
        await router.wait_ready(10)
        return router, g, h
    router, g, h = lt.run(start())
    assert h is not None
    try:
        yield Served(lt, model_dir, engine, int(worker.address.rsplit(":", 1)[1]), g, h)
    finally:
        try:
            lt.run(router.stop(1))
            lt.run(worker.stop(1))
        finally:
            lt.close()


@pytest.mark.server
def test_engine_generate_rejects_zero_tokens(served: Served) -> None:
    from worker.engine.engine import InvalidRequest
    from worker.engine.sampling import SamplingParams
    assert served.engine.encode(NOTHING) == []
    for prompt in (NOTHING, served.engine.encode(NOTHING)):
        with pytest.raises(InvalidRequest, match="empty"):
            served.engine.generate(prompt, SamplingParams(max_tokens=2))


@pytest.mark.server
def test_cli_generate_rejects_zero_tokens(served: Served, capsys: pytest.CaptureFixture[str]) -> None:
    from kvmesh.cli import main
    for extra in (["--json"], []):
        assert main(["generate", "--model", str(served.model_dir), "--prompt", NOTHING, "--max-tokens", "2",
                     "--num-blocks", "16", *extra]) == 2
        err = capsys.readouterr().err
        assert "--prompt" in err and "empty" in err


@pytest.mark.server
def test_grpc_and_http_reject_zero_tokens(served: Served) -> None:
    req = pb.GenerateRequest(text=NOTHING, sampling=pb.SamplingParams(max_tokens=2))
    for port, stub_cls in ((served.worker_port, pb_grpc.WorkerStub), (served.grpc_port, pb_grpc.RouterStub)):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.RpcError) as e:
                list(stub_cls(ch).Generate(req, timeout=60))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty" in (e.value.details() or "")
            ok = list(stub_cls(ch).Generate(pb.GenerateRequest(text="hello a", sampling=req.sampling), timeout=60))
            assert ok[-1].finished
    url = f"http://127.0.0.1:{served.http_port}/v1/completions"
    body = json.dumps({"prompt": NOTHING, "max_tokens": 2}).encode()
    with pytest.raises(urllib.error.HTTPError) as h:
        urllib.request.urlopen(urllib.request.Request(url, body, {"Content-Type": "application/json"}), timeout=60)
    error = json.loads(h.value.read())["error"]
    assert h.value.code == 400 and error["param"] == "prompt" and "empty" in error["message"]
    body = json.dumps({"prompt": "hello b", "max_tokens": 2}).encode()
    with urllib.request.urlopen(urllib.request.Request(url, body, {"Content-Type": "application/json"}),
                                timeout=60) as r:
        assert json.loads(r.read())["usage"]["completion_tokens"] >= 1

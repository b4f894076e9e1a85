"""Worker.GetTokenizer over real gRPC: a router without model storage gets the
tokenizer files from a worker. Round trip against the model dir (the oracle is the tokenizer
loaded from the dir itself), the digest in ModelInfo, the cluster token on every Worker RPC,
the 32 MiB bound, and a model without a tokenizer."""
from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import grpc
import pytest

import worker.server.load
from contracts.cluster_token import TOKEN_METADATA
from contracts.tokenizer import (
    MAX_TOKENIZER_MESSAGE_BYTES,
    ModelTokenizer,
    read_tokenizer_files,
    tokenizer_files_digest,
)
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from tests.worker.test_server import serving
from worker.engine.engine import Engine, EngineConfig

TOKEN = "tokenizer-test-cluster-token-0123456789"
AUTH = ((TOKEN_METADATA, TOKEN),)
PADDING = 5 * 2**20     # tokenizer_config.json grows past grpc's 4 MiB default message size
TEXTS = ("The capital of France is", "émoji 🚀 and 中文\n\ttabs")
CHATS = ([{"role": "user", "content": "Name three primary colors."}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])


@pytest.fixture(scope="module")
def tok_model_dir(tiny_model_dir: Any, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with SmolLM2's tokenizer files, tokenizer_config.json padded to > 5 MiB."""
    path = tmp_path_factory.mktemp("tiny-with-tokenizer")
    shutil.copytree(tiny_model_dir("llama-gqa"), path, dirs_exist_ok=True)
    for name in ("tokenizer.json", "chat_template.jinja", "special_tokens_map.json"):
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, path / name)
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    config["kvmesh_test_padding"] = "x" * PADDING
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tok_engine(tok_model_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(tok_model_dir), block_size=4, num_blocks=64))


def big_channel(port: int) -> grpc.Channel:
    """What a router's channel needs to receive TokenizerFiles."""
    return grpc.insecure_channel(f"127.0.0.1:{port}",
                                 options=[("grpc.max_receive_message_length", MAX_TOKENIZER_MESSAGE_BYTES)])


@pytest.mark.server
def test_get_tokenizer_round_trip(loop, tok_engine: Engine, tok_model_dir: Path) -> None:
    with serving(loop, tok_engine.cfg, tok_engine, worker_id="w-tok", cluster_token=TOKEN) as (server, _), \
            big_channel(server.port) as ch:
        stub = pb_grpc.WorkerStub(ch)
        info = stub.GetModelInfo(pb.ModelInfoRequest(), metadata=AUTH, timeout=10)
        sent = stub.GetTokenizer(pb.TokenizerRequest(), metadata=AUTH, timeout=30)
    files = dict(sent.files)
    assert files == read_tokenizer_files(tok_model_dir)
    assert sum(map(len, files.values())) > PADDING
    assert sent.sha256 == tokenizer_files_digest(files) == info.tokenizer_sha256 and len(sent.sha256) == 64
    assert (sent.model, sent.hash_salt_hex) == (info.model, info.hash_salt_hex) and sent.hash_salt_hex
    loaded, local = ModelTokenizer.from_files(files), ModelTokenizer.from_model_dir(tok_model_dir)
    assert loaded.chat_template == local.chat_template and loaded.special_tokens == local.special_tokens
    for text in TEXTS:
        assert loaded.encode(text) == local.encode(text) == tok_engine.encode(text)
    for chat in CHATS:
        want = tok_engine.apply_chat_template(chat)
        assert loaded.apply_chat_template(chat) == local.apply_chat_template(chat) == want


@pytest.mark.server
def test_every_worker_rpc_but_attest_needs_the_token(loop, tok_engine: Engine) -> None:
    """Listed from the service descriptor, so a new RPC is covered the day it is added."""
    methods = pb.DESCRIPTOR.services_by_name["Worker"].methods
    assert "GetTokenizer" in [m.name for m in methods]
    with serving(loop, tok_engine.cfg, tok_engine, worker_id="w-auth", cluster_token=TOKEN) as (server, _), \
            big_channel(server.port) as ch:
        for method in methods:
            path = f"/kvmesh.v1.Worker/{method.name}"
            for metadata in ((), ((TOKEN_METADATA, TOKEN[:-1] + "x"),)):
                call = ch.unary_stream(path) if method.server_streaming else ch.unary_unary(path)
                with pytest.raises(grpc.RpcError) as err:
                    out = call(b"", timeout=10, metadata=metadata)
                    if method.server_streaming:
                        list(out)
                if method.name == "Attest":     # open: it answers (here: the empty nonce is refused)
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
                else:
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method.name, err.value)
        assert pb_grpc.WorkerStub(ch).GetTokenizer(pb.TokenizerRequest(), metadata=AUTH, timeout=30).sha256


@pytest.mark.server
def test_too_large_tokenizer_is_refused(loop, tok_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker.server.load, "read_tokenizer_files",
                        functools.partial(read_tokenizer_files, max_bytes=PADDING))
    with serving(loop, tok_engine.cfg, tok_engine, worker_id="w-big") as (_, ch):
        stub = pb_grpc.WorkerStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.GetTokenizer(pb.TokenizerRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"more than the {PADDING} a worker sends" in err.value.details()
        assert stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10).tokenizer_sha256 == ""


@pytest.mark.server
def test_model_without_tokenizer(loop, tiny_model_dir: Any) -> None:
    engine = Engine(EngineConfig(model=str(tiny_model_dir("llama-gqa")), block_size=4, num_blocks=64))
    with serving(loop, engine.cfg, engine, worker_id="w-notok") as (_, ch):
        stub = pb_grpc.WorkerStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.GetTokenizer(pb.TokenizerRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no tokenizer" in err.value.details()
        info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10)
        assert info.model and info.tokenizer_sha256 == ""

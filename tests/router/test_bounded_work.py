"""Bounded work before the checks (router/security/bounds.py), met by a client: a prompt too long
for the context by its characters is refused before a token is computed, the HTTP body bound
follows the model, and a real `kvmesh router` process gives its memory back after a flood of
oversize prompts (its VmRSS from /proc).

One real worker (SmolLM2) in this process; the router is a child process with a keys file.
"""
from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from contracts.requests import BadRequest, ChatMessage, GenerateInput
from contracts.sampling import SamplingParams
from contracts.tokenizer import ModelTokenizer
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from router.security.bounds import body_limit, check_prompt_chars, max_token_bytes
from tests.router.test_router import NUM_BLOCKS
from tests.support.loop_thread import LoopThread

KEY = "sk-alpha-flood-0001"
OVERSIZE_CHARS = 4_000_000        # the prompts
FLOOD = 8


@dataclass
class Child:
    proc: subprocess.Popen[str]
    http: int
    grpc: int
    max_model_len: int

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def child(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    from worker.engine.engine import Engine, EngineConfig
    from worker.server.service import WorkerServer, WorkerServerConfig
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"{KEY} alpha\n")
    engine = Engine(EngineConfig(model=str(smollm2_dir), num_blocks=NUM_BLOCKS))
    lt = LoopThread()
    worker = WorkerServer(engine.cfg, WorkerServerConfig(worker_id="worker-0"), engine=engine)
    lt.run(worker.start())
    lt.run(worker.wait_ready(60))
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh.cli", "router", "--worker", worker.address,
                             "--model", str(smollm2_dir), "--served-model-name", "smollm2", "--grpc-port", "0",
                             "--http-port", "0", "--api-keys-file", str(keys)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()     # "kvmesh router serving grpc on H:P http on H:P"
        words = line.split()
        assert "serving" in words, line
        g, h = int(words[words.index("grpc") + 2].rsplit(":", 1)[1]), int(words[-1].rsplit(":", 1)[1])
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{h}/health", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, "the router did not get ready"
                time.sleep(0.2)
        req = urllib.request.Request(f"http://127.0.0.1:{h}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            max_model_len = json.loads(resp.read())["data"][0]["max_model_len"]
        yield Child(proc, h, g, max_model_len)
    finally:
        proc.terminate()
        proc.wait(30)
        lt.run(worker.stop(1))
        lt.close()


def post(port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json",
                                                      "Authorization": f"Bearer {KEY}", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def completion(port: int, prompt: str, max_tokens: int = 2) -> tuple[int, Any]:
    return post(port, "/v1/completions", json.dumps({"model": "smollm2", "prompt": prompt,
                                                     "max_tokens": max_tokens, "temperature": 0}).encode())


def test_max_token_bytes_bounds_every_token(smollm2_dir: Path) -> None:
    tok = ModelTokenizer.from_model_dir(smollm2_dir)
    bound = max_token_bytes(tok)
    text = ("Grüße aus Köln — 東京 🚄 " * 50) + " " * 200 + "\n\n\t\t" + "x" * 300
    pieces = [tok.decode([i], skip_special_tokens=False) for i in tok.encode(text, False)]
    assert max(len(p.encode()) for p in pieces) < bound
    assert len(text.encode()) <= len(pieces) * bound     # the bound the character check relies on
    params = SamplingParams(max_tokens=1)
    check_prompt_chars(GenerateInput("", "a" * (100 * bound), None, None, params), 100, bound)
    with pytest.raises(BadRequest, match="^text: the prompt has"):
        check_prompt_chars(GenerateInput("", "a" * (100 * bound + 1), None, None, params), 100, bound)
    with pytest.raises(BadRequest, match="^chat: "):
        check_prompt_chars(GenerateInput("", None, None, (ChatMessage("user", "a" * 100 * bound),), params),
                           100, bound)
    with pytest.raises(BadRequest, match="^token_ids: "):
        check_prompt_chars(GenerateInput("", None, tuple(range(100)), None, params), 100, bound)
    assert body_limit(8192, bound, 2**40) == 8192 * bound * 6 + 64 * 1024 and body_limit(8192, bound, 1000) == 1000


@pytest.mark.multiproc
@pytest.mark.server
def test_prompt_over_the_bound_is_400_before_tokenizing_and_body_over_it_413(child: Child) -> None:
    tok_bytes = max_token_bytes(ModelTokenizer.from_model_dir(Path(_model_dir(child))))
    max_chars = child.max_model_len * tok_bytes
    status, body = completion(child.http, "a" * (max_chars + 1))
    assert status == 400 and body["error"]["param"] == "prompt" and "characters" in body["error"]["message"]
    status, body = post(child.http, "/tokenize", json.dumps({"prompt": "a" * (max_chars + 1)}).encode())
    assert status == 400 and "characters" in body["error"]["message"]
    chat = {"model": "smollm2", "max_tokens": 1, "messages": [{"role": "user", "content": "b" * (max_chars + 1)}]}
    status, body = post(child.http, "/v1/chat/completions", json.dumps(chat).encode())
    assert status == 400 and body["error"]["param"] == "messages"
    # a body longer than the bound: 413 by its Content-Length, unread
    limit = body_limit(child.max_model_len, tok_bytes, 4 * 2**20)
    status, body = post(child.http, "/v1/completions", b"{" + b" " * limit + b"}")
    assert status == 413 and body["error"]["code"] == "request_too_large"
    # gRPC: INVALID_ARGUMENT
    with grpc.insecure_channel(f"127.0.0.1:{child.grpc}", options=[("grpc.max_send_message_length", 2**23)]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.RouterStub(ch).Generate(pb.GenerateRequest(text="a" * (max_chars + 1)), timeout=60,
                                                 metadata=(("authorization", f"Bearer {KEY}"),)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "characters" in (e.value.details() or "")
    assert completion(child.http, "The capital of France is")[0] == 200


def _model_dir(child: Child) -> str:
    argv = child.proc.args
    assert isinstance(argv, list)
    return str(argv[argv.index("--model") + 1])


@pytest.mark.multiproc
@pytest.mark.server
def test_router_memory_returns_to_baseline_after_oversize_prompts(child: Child) -> None:
    for _ in range(3):
        assert completion(child.http, "Warm up: the capital of Italy is")[0] == 200
    before = child.rss_kib()
    results: list[int] = []         # HTTP: 413 (body over the bound) or 400 (characters); gRPC: 400
    prompt = "The quick brown fox jumps over the lazy dog. " * (OVERSIZE_CHARS // 45)

    def http_one() -> None:
        results.append(completion(child.http, prompt)[0])

    def grpc_one() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{child.grpc}",
                                   options=[("grpc.max_send_message_length", 2**23)]) as ch:
            try:
                list(pb_grpc.RouterStub(ch).Generate(pb.GenerateRequest(text=prompt), timeout=120,
                                                     metadata=(("authorization", f"Bearer {KEY}"),)))
                results.append(200)
            except grpc.RpcError as e:
                results.append(-400 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 500)
    t0 = time.monotonic()
    for fn in (http_one, grpc_one):
        threads = [threading.Thread(target=fn) for _ in range(FLOOD)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    took = time.monotonic() - t0
    time.sleep(2.0)          # the router gives freed memory back 0.5 s after the last refusal
    after = child.rss_kib()
    print(f"router VmRSS: {before} KiB before, {after} KiB after {2 * FLOOD} oversize prompts "
          f"({OVERSIZE_CHARS} characters each) in {took:.1f} s")
    assert after <= 1.2 * before, f"VmRSS {before} -> {after} KiB"
    assert len(results) == 2 * FLOOD and set(results) <= {400, 413, -400} and results.count(-400) == FLOOD, results
    assert completion(child.http, "The capital of Spain is")[0] == 200

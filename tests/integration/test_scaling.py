"""Scaling that keeps the cache, with real processes: `kvmesh worker --peer-transfer` on SmolLM2
(CPU) registered in a real Redis.

Worker A computes three prompts and is hit for them; a client keeps streaming to B all along.
A gets SIGTERM while a stream of its own runs: it drains, hands its hottest blocks to B (B pulls
them over the peer plane into its host tier) and exits. Then B serves A's prompts from its cache
with the tokens A produced, and the router's index (the real EventConsumer feeding the real
BlockIndex) has B holding every one of their blocks. Worker C starts next and warms from B's
hottest in the background: it serves those prompts from its cache too, and the index has C
holding them. No request fails: not the one running on A when it drained, not the ones to B.
"""
from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest

from kvstore.events import WorkerId
from kvstore.keys import BlockHash, block_hashes
from kvstore.metadata.registry import RedisConfig
from kvstore.metadata.streams import EventConsumer
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from router.index.blocks import BlockIndex
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.multiproc, pytest.mark.redis]

ROOT = Path(__file__).resolve().parents[2]
WORKER_LINE = re.compile(r"^kvmesh worker (\S+) serving on (\S+):(\d+)$", re.M)
BLOCK = 16
PROMPT_TOKENS = 97           # 6 full blocks that a cache may serve (the last token is always computed)
CLUSTER = "scaling"


class Worker(NamedTuple):
    proc: subprocess.Popen[bytes]
    address: str
    log: Path


def _start(tmp: Path, worker_id: str, redis_url: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "kvmesh.cli", "worker", "--port", "0", "--worker-id", worker_id,
            "--model", "smollm2", "--peer-transfer", "--cluster-name", CLUSTER, "--metrics-port", "-1",
            "--kv-offload-gib", "0.05", "--drain-timeout-s", "30", "--threads", "1"]
    with open(tmp / f"{worker_id}.out", "wb") as fo, open(tmp / f"{worker_id}.log", "ab") as fe:
        return subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                                env=os.environ | {"PYTHONUNBUFFERED": "1", "KVMESH_REDIS_URL": redis_url})


def _serving(tmp: Path, worker_id: str, proc: subprocess.Popen[bytes], timeout: float = 600.0) -> Worker:
    out, log = tmp / f"{worker_id}.out", tmp / f"{worker_id}.log"
    deadline = time.monotonic() + timeout
    while (m := WORKER_LINE.search(out.read_text(errors="replace"))) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{worker_id} did not start (rc {proc.poll()}):\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return Worker(proc, f"{m.group(2)}:{m.group(3)}", log)


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 20000) for _ in range(PROMPT_TOKENS)]


def _run(address: str, prompt: list[int], max_tokens: int = 4) -> tuple[list[int], pb.GenerateResponse]:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                             sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    with grpc.insecure_channel(address) as ch:
        msgs = list(pb_grpc.WorkerStub(ch).Generate(req, timeout=180))
    assert msgs and msgs[-1].finished
    return [t for m in msgs for t in m.token_ids], msgs[-1]


def _load(address: str) -> pb.Load:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.WorkerStub(ch).GetLoad(pb.LoadRequest(), timeout=30)


def _salt(address: str) -> bytes:
    with grpc.insecure_channel(address) as ch:
        return bytes.fromhex(pb_grpc.WorkerStub(ch).GetModelInfo(pb.ModelInfoRequest(), timeout=30).hash_salt_hex)


def _index_holds(redis_url: str, worker_id: str, hashes: list[BlockHash], timeout_s: float = 30.0) -> bool:
    """Whether the router's index, fed from the event streams, shows `worker_id` holding every hash."""
    async def main() -> bool:
        index = BlockIndex()
        consumer = EventConsumer(RedisConfig(redis_url, CLUSTER), index, block_ms=20)
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                await consumer.poll()
                if all(WorkerId(worker_id) in index.locate(h) for h in hashes):
                    return True
            return False
        finally:
            await consumer.aclose()
    return asyncio.run(main())


class Traffic:
    """A client streaming to `address` in a loop (a few prompts again and again) until stopped."""

    def __init__(self, address: str) -> None:
        self.address, self.errors, self.done = address, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            try:
                _run(self.address, _prompt(100 + i % 2), max_tokens=2)
                self.done += 1
            except Exception as e:  # noqa: BLE001 - every failure is reported by the test
                self.errors.append(repr(e))
            i += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=300)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def test_drain_hands_over_and_a_new_worker_warms_under_traffic(tmp_path: Path, redis_url: str) -> None:
    procs = {w: _start(tmp_path, w, redis_url) for w in ("w-a", "w-b")}
    try:
        a, b = (_serving(tmp_path, w, p) for w, p in procs.items())
        salt = _salt(a.address)
        prompts = [_prompt(s) for s in (1, 2, 3)]
        want = {}
        for p in prompts:                                   # computed, then hit: A's hottest
            want[tuple(p)], _ = _run(a.address, p)
            again, last = _run(a.address, p)
            assert again == want[tuple(p)] and last.cached_tokens >= 96
        hashes = [h for p in prompts for h in block_hashes(p[:96], BLOCK, salt)]
        traffic = Traffic(b.address)
        running: list[object] = []
        on_a = threading.Thread(target=lambda: running.append(_run(a.address, _prompt(7), max_tokens=24)))
        on_a.start()
        time.sleep(1.0)
        a.proc.send_signal(signal.SIGTERM)                  # drain: hand over, let the stream finish
        on_a.join(timeout=120)
        assert a.proc.wait(timeout=120) == 0
        assert running, "the stream running on A when it drained failed"
        log_a = a.log.read_text()
        m = re.search(r"handed over (\d+) of its (\d+) hottest block\(s\) to w-b", log_a)
        assert m and int(m.group(1)) >= len(hashes), log_a[-2000:]
        assert _index_holds(redis_url, "w-b", hashes)
        for p in prompts:                                   # B serves A's prompts from its cache
            tokens, last = _run(b.address, p)
            assert tokens == want[tuple(p)] and last.cached_tokens >= 96

        procs["w-c"] = _start(tmp_path, "w-c", redis_url)
        c = _serving(tmp_path, "w-c", procs["w-c"])
        deadline = time.monotonic() + 120
        while _load(c.address).blocks_warmed < len(hashes):
            assert time.monotonic() < deadline, c.log.read_text()[-2000:]
            time.sleep(0.5)
        assert _index_holds(redis_url, "w-c", hashes)
        for p in prompts:                                   # C's first requests hit
            tokens, last = _run(c.address, p)
            assert tokens == want[tuple(p)] and last.cached_tokens >= 96
        traffic.stop()
        assert traffic.errors == [] and traffic.done > 0
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()

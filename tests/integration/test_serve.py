"""`kvmesh serve` / `LocalCluster` end to end: real redis-server, worker and router processes on
127.0.0.1. The oracle for generations is `Engine.generate` on the same model in this process.

The `kvmesh serve` subprocess tests run first, before the module's cluster starts, so the two
never compete for this machine's cores.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import pytest

from kvmesh.serve.local import LocalCluster, ServeConfig
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[2]
KV_GIB = "0.25"
MAX_TOKENS = 16
PROMPTS = ("The capital of France is", "A paged KV cache splits memory into")
# `kvmesh serve` makes a random cluster token and Redis password per start; these tests choose
# theirs (by environment, as an operator may) to reach the workers and Redis directly.
TOKEN = "serve-test-cluster-token-0123456789"
REDIS_PASSWORD = "serve-test-redis-password-0123"
SECRETS_ENV = {"KVMESH_CLUSTER_TOKEN": TOKEN, "KVMESH_REDIS_PASSWORD": REDIS_PASSWORD}
CHAT = ({"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "What is the tallest mountain on Earth?"})


# -- helpers ------------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    """Running (a zombie counts as gone: it has exited, only its parent has not reaped it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _pids_with(marker: str) -> list[int]:
    """Live processes whose command line contains `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and _alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def _wait_gone(pids: list[int], marker: str, timeout: float) -> list[int]:
    """Poll until none of `pids` (nor anything with `marker` in its cmdline) runs; returns survivors."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if _alive(p)] + _pids_with(marker)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


class Launched(NamedTuple):
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path
    grpc_target: str
    child_pids: list[int]


def _launch_serve(tmp_path: Path, cluster_name: str, *flags: str, workers: int = 1) -> Launched:
    """`kvmesh serve --workers N` on free ports (plus `flags`); waits for its ready banner."""
    out, err = tmp_path / f"{cluster_name}.out", tmp_path / f"{cluster_name}.err"
    argv = [sys.executable, "-m", "kvmesh.cli", "serve", "--workers", str(workers), "--grpc-port", "0",
            "--http-port", "0", "--cluster-name", cluster_name, "--log-dir", str(tmp_path / f"{cluster_name}-logs"),
            "--kv-cache-memory-gib", KV_GIB, *flags]
    with open(out, "wb") as fo, open(err, "wb") as fe:
        proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                                env=os.environ | SECRETS_ENV)
    deadline = time.monotonic() + 120
    while "Ctrl-C stops everything" not in out.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            pytest.fail(f"kvmesh serve did not come up (rc {proc.returncode}):\n{out.read_text()}\n{err.read_text()}")
        time.sleep(0.2)
    text = out.read_text()
    target = re.search(r"^\s+gRPC\s+(\S+)$", text, re.M)
    pids = re.search(r"^\s+pids\s+(.+)$", text, re.M)
    assert target and pids, text
    child_pids = [int(p.split("=")[1]) for p in pids.group(1).split()]
    assert len(child_pids) == 2 + workers, text     # redis, worker-0.., router
    return Launched(proc, out, err, target.group(1), child_pids)


def _chat_request(messages: tuple[dict[str, str], ...], **sampling: Any) -> pb.GenerateRequest:
    req = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling))
    for m in messages:
        req.chat.messages.add(role=m["role"], content=m["content"])
    return req


def _collect(responses: Iterator[pb.GenerateResponse]) -> tuple[list[int], pb.GenerateResponse]:
    ids: list[int] = []
    last = None
    for r in responses:
        ids.extend(r.token_ids)
        last = r
    assert last is not None and last.finished
    return ids, last


# -- fast failures: before any child starts -----------------------------------------------------
def _serve_fails(*flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvmesh.cli", "serve", *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=30, env=env)


def test_serve_port_in_use_names_the_flag() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _serve_fails("--grpc-port", "0", "--http-port", str(port))
    assert r.returncode == 2
    assert r.stderr.strip() == (f"kvmesh serve: --http-port: 127.0.0.1:{port} is already in use "
                                "(pick another port, or 0 for a free one)")


def test_serve_without_redis_server_says_what_to_do(tmp_path: Path) -> None:
    r = _serve_fails("--grpc-port", "0", "--http-port", "0", "--log-dir", str(tmp_path),
                     env=os.environ | {"PATH": str(tmp_path)})
    assert r.returncode == 2
    assert "redis-server not found" in r.stderr and "--redis-url" in r.stderr and "apt-get install" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_redis_that_dies_is_reported_with_its_log(tmp_path: Path) -> None:
    fake = tmp_path / "bin" / "redis-server"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'fatal: cannot start (fake redis)'\nexit 1\n")
    fake.chmod(0o755)
    r = _serve_fails("--grpc-port", "0", "--http-port", "0", "--log-dir", str(tmp_path / "logs"),
                     env=os.environ | {"PATH": f"{fake.parent}:{os.environ['PATH']}"})
    assert r.returncode == 2
    assert "redis-server did not answer PING" in r.stderr and "fatal: cannot start (fake redis)" in r.stderr


def test_serve_flags_become_config() -> None:
    from kvmesh.cli import build_parser
    from kvmesh.serve.cli import config_from_args
    args = build_parser().parse_args(["serve", "--workers", "3", "--model", "/m", "--kv-cache-memory-gib", "0.5",
                                      "--no-enable-prefix-caching", "--grpc-port", "0", "--cluster-name", "c1"])
    cfg = config_from_args(args)
    assert (cfg.workers, cfg.model, cfg.grpc_port, cfg.http_port, cfg.cluster_name) == (3, "/m", 0, 8000, "c1")
    assert cfg.engine_argv == ("--kv-cache-memory-gib", "0.5", "--no-enable-prefix-caching")
    assert cfg.cluster_token and cfg.cluster_token != config_from_args(args).cluster_token   # fresh per start
    assert cfg.cluster_token not in repr(cfg)
    for bad in (dict(workers=0), dict(grpc_port=70000), dict(redis_url="localhost:6379"),
                dict(engine_argv=("--port", "1")), dict(cluster_name="a b")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServeConfig(**bad)  # type: ignore[arg-type]


# -- `kvmesh serve` as a real subprocess ----------------------------------------------------------
def test_serve_subprocess_sigterm_leaves_nothing(tmp_path: Path) -> None:
    name = f"kvmesh-test-{uuid.uuid4().hex[:8]}"
    launched = _launch_serve(tmp_path, name)
    try:
        client = subprocess.run([sys.executable, "-m", "kvmesh.cli", "client", "generate", "--target",
                                 launched.grpc_target, "--json", "--max-tokens", "8", "Hello, my name is"],
                                cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert client.returncode == 0, client.stderr
        _secrets_kept_out_of_sight(launched)
        result = json.loads(client.stdout)
        assert result["completion_tokens"] >= 1 and result["worker_id"] == "worker-0"
        assert all(_alive(p) for p in launched.child_pids)
        # the launcher, its worker and its router carry the name (redis-server's title does not)
        assert set(_pids_with(f"--cluster-name {name}")) == {launched.proc.pid, *launched.child_pids[1:]}
        launched.proc.send_signal(signal.SIGTERM)
        assert launched.proc.wait(timeout=20) == 0, launched.err.read_text()
    finally:
        if launched.proc.poll() is None:
            launched.proc.kill()
            launched.proc.wait()
    assert _wait_gone(launched.child_pids, f"--cluster-name {name}", 1.0) == []


def _secrets_kept_out_of_sight(launched: Launched) -> None:
    """The token and the Redis password reach the children by environment only: not in any
    command line (ps), not in the banner (masked); Redis refuses a client without the password."""
    banner = launched.out.read_text()
    assert TOKEN not in banner and REDIS_PASSWORD not in banner and f"cluster token {TOKEN[:4]}" in banner
    m = re.search(r"^\s+redis\s+redis://:\*\*\*@127\.0\.0\.1:(\d+)/0", banner, re.M)
    assert m, banner
    for pid in launched.child_pids:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert TOKEN.encode() not in cmdline and REDIS_PASSWORD.encode() not in cmdline
    router_env = Path(f"/proc/{launched.child_pids[-1]}/environ").read_bytes()
    assert f"KVMESH_CLUSTER_TOKEN={TOKEN}".encode() in router_env
    with socket.create_connection(("127.0.0.1", int(m.group(1))), timeout=5) as anonymous:
        anonymous.sendall(b"PING\r\n")
        assert anonymous.recv(100).startswith(b"-NOAUTH")


def test_serve_subprocess_sigkill_children_follow(tmp_path: Path) -> None:
    name = f"kvmesh-test-{uuid.uuid4().hex[:8]}"
    launched = _launch_serve(tmp_path, name)
    launched.proc.kill()             # no chance to clean up: PR_SET_PDEATHSIG must do it
    launched.proc.wait()
    survivors = _wait_gone(launched.child_pids, f"--cluster-name {name}", 15.0)
    for pid in survivors:            # do not leak them into the rest of the run
        os.kill(pid, signal.SIGKILL)
    assert survivors == []


def test_serve_restart_policy_never_exits_1_when_a_worker_dies(tmp_path: Path) -> None:
    """Under --restart-policy never a child's exit names the child and ends the run (1), stopping
    the rest (the default, on-failure, restarts it: tests/integration/test_faults.py)."""
    name = f"kvmesh-test-{uuid.uuid4().hex[:8]}"
    launched = _launch_serve(tmp_path, name, "--restart-policy", "never")
    redis_pid, worker_pid, router_pid = launched.child_pids
    try:
        os.kill(worker_pid, signal.SIGKILL)
        assert launched.proc.wait(timeout=30) == 1, launched.err.read_text()
    finally:
        if launched.proc.poll() is None:
            launched.proc.kill()
            launched.proc.wait()
    err = launched.err.read_text()
    assert f"kvmesh serve: worker-0 (pid {worker_pid}) exited with code -9" in err, err
    assert _wait_gone([redis_pid, router_pid], f"--cluster-name {name}", 5.0) == []


# -- one LocalCluster for the rest --------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    cfg = ServeConfig(workers=2, grpc_port=0, http_port=0, cluster_name=f"kvmesh-test-{uuid.uuid4().hex[:8]}",
                      engine_argv=("--kv-cache-memory-gib", KV_GIB))
    c = LocalCluster(cfg)
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path) -> Any:
    from worker.engine.engine import Engine, EngineConfig
    return Engine(EngineConfig(model=str(smollm2_dir), kv_cache_memory_gib=float(KV_GIB)))


@pytest.fixture(scope="module")
def channel(cluster: LocalCluster) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(cluster.grpc_target) as ch:
        yield ch


def _greedy(engine: Any, ids: list[int]) -> Any:   # -> RequestOutput
    from worker.engine.sampling import SamplingParams
    return engine.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]


def test_cluster_addresses(cluster: LocalCluster) -> None:
    assert re.fullmatch(r"127\.0\.0\.1:\d+", cluster.grpc_target)
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", cluster.http_base_url)
    assert len(cluster.worker_addresses) == 2 and re.match(r"redis://:[^@]+@127\.0\.0\.1:", cluster.redis_url)
    assert cluster.poll() is None


@pytest.mark.parametrize("prompt", PROMPTS)
def test_text_greedy_matches_engine(cluster: LocalCluster, channel: grpc.Channel, engine: Any, prompt: str) -> None:
    req = pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    ids, last = _collect(pb_grpc.RouterStub(channel).Generate(req, timeout=120))
    assert ids == list(_greedy(engine, engine.encode(prompt)).token_ids)
    assert last.worker_id in ("worker-0", "worker-1")


def test_chat_greedy_matches_engine(cluster: LocalCluster, channel: grpc.Channel, engine: Any) -> None:
    req = _chat_request(CHAT, max_tokens=MAX_TOKENS, temperature=0.0)
    ids, last = _collect(pb_grpc.RouterStub(channel).Generate(req, timeout=120))
    expected_prompt = engine.apply_chat_template(list(CHAT))
    assert last.prompt_tokens == len(expected_prompt)
    assert ids == list(_greedy(engine, expected_prompt).token_ids)


def test_openai_chat_over_http(cluster: LocalCluster, engine: Any) -> None:
    from openai import OpenAI
    client = OpenAI(base_url=cluster.http_base_url, api_key="test", max_retries=0, timeout=120)
    resp = client.chat.completions.create(model=cluster.cfg.model, messages=list(CHAT),  # type: ignore[arg-type]
                                          max_tokens=MAX_TOKENS, temperature=0.0)
    expected = _greedy(engine, engine.apply_chat_template(list(CHAT)))
    assert resp.choices[0].message.content == expected.text
    assert resp.usage is not None and resp.usage.completion_tokens == len(expected.token_ids)


def test_32_concurrent_streams_complete(cluster: LocalCluster) -> None:
    async def one(stub: pb_grpc.RouterStub, i: int) -> pb.GenerateResponse:
        req = pb.GenerateRequest(text=f"Question {i}: name a prime number larger than {i * 7}.",
                                 sampling=pb.SamplingParams(max_tokens=8, temperature=0.0))
        last = None
        async for r in stub.Generate(req, timeout=150):
            last = r
        assert last is not None
        return last

    async def main() -> list[pb.GenerateResponse]:
        async with grpc.aio.insecure_channel(cluster.grpc_target) as ch:
            stub = pb_grpc.RouterStub(ch)
            return await asyncio.gather(*(one(stub, i) for i in range(32)))

    finals = asyncio.run(main())
    assert len(finals) == 32
    assert all(f.finished and 1 <= f.completion_tokens <= 8 for f in finals)


def _used_blocks(cluster: LocalCluster) -> int:
    total = 0
    for address in cluster.worker_addresses:
        with grpc.insecure_channel(address) as ch:
            total += pb_grpc.WorkerStub(ch).GetLoad(pb.LoadRequest(), timeout=10).num_used_blocks
    return total


def test_cancelled_stream_frees_worker_blocks(cluster: LocalCluster) -> None:
    async def main() -> tuple[int, str]:
        async with grpc.aio.insecure_channel(cluster.grpc_target) as ch:
            req = pb.GenerateRequest(text="Write a very long story about a lighthouse keeper.",
                                     sampling=pb.SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True))
            call = pb_grpc.RouterStub(ch).Generate(req, timeout=120)
            worker_id = ""
            for _ in range(3):
                r = await call.read()
                assert r is not grpc.aio.EOF and not r.finished
                worker_id = r.worker_id
            used = await asyncio.to_thread(_used_blocks, cluster)
            call.cancel()
            return used, worker_id

    used_while_streaming, worker_id = asyncio.run(main())
    assert used_while_streaming > 0 and worker_id
    deadline = time.monotonic() + 10
    while (used := _used_blocks(cluster)) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert used == 0

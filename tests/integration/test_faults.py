"""Faults a user meets on `kvmesh serve --workers 2` (real processes on 127.0.0.1): `kill -9`
of a worker or of the embedded Redis. The supervisor restarts the dead child on its port while
the cluster keeps serving. One `kvmesh serve` for the whole file, with
`--migration-limit 0`: a stream cut by a dead worker must end with an error, never silently
(tests/integration/test_chaos.py has migration on, the default).
"""
from __future__ import annotations

import os
import re
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from tests.integration.test_serve import REDIS_PASSWORD, TOKEN, Launched, _alive, _launch_serve

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launched]:
    launched = _launch_serve(tmp_path_factory.mktemp("faults"), f"kvmesh-test-{uuid.uuid4().hex[:8]}",
                             "--routing-policy", "round_robin", "--migration-limit", "0", workers=2)
    try:
        yield launched
    finally:
        launched.proc.send_signal(signal.SIGTERM)
        try:
            launched.proc.wait(timeout=30)
        except Exception:
            launched.proc.kill()
            launched.proc.wait()
            raise


def _generate(target: str, i: int) -> pb.GenerateResponse:
    """One greedy request through the router; its last (finished) response."""
    req = pb.GenerateRequest(text=f"Request {i}: the number after {i} is",
                             sampling=pb.SamplingParams(max_tokens=4, temperature=0.0))
    with grpc.insecure_channel(target) as ch:
        last = None
        for r in pb_grpc.RouterStub(ch).Generate(req, timeout=60):
            last = r
    assert last is not None and last.finished
    return last


def _wait_for_line(launched: Launched, pattern: str, timeout: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while (m := re.search(pattern, launched.err.read_text(), re.M)) is None:
        assert launched.proc.poll() is None, launched.err.read_text()
        assert time.monotonic() < deadline, launched.err.read_text()
        time.sleep(0.2)
    return m


def _wait_both_routed(served: Launched, first_id: int) -> None:
    """Until round robin has reached both workers (a restarted one is back in routing)."""
    deadline = time.monotonic() + 120
    seen: set[str] = set()
    i = first_id
    while seen != {"worker-0", "worker-1"}:
        assert time.monotonic() < deadline, f"not both workers in routing; served by {seen}"
        try:
            seen.add(_generate(served.grpc_target, i).worker_id)
        except grpc.RpcError as e:    # the only live worker may be restarting too
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
        i += 1
        time.sleep(0.2)


def test_killed_worker_is_restarted_and_serves_again(served: Launched) -> None:
    worker_pid = served.child_pids[1]
    os.kill(worker_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    # meanwhile the router sends every request to the healthy worker
    assert all(_generate(served.grpc_target, i).worker_id == "worker-1" for i in range(3))
    m = _wait_for_line(served, r"^kvmesh serve: restarted worker-0 \(pid (\d+)\)$", 30)
    assert f"worker-0 (pid {worker_pid}) exited with code -9" in served.err.read_text()
    assert "restarting worker-0 in 0.5 s (exit status -9" in served.err.read_text()
    new_pid = int(m.group(1))
    assert new_pid != worker_pid and _alive(new_pid)
    _wait_both_routed(served, 100)
    print(f"worker-0 back in routing {time.monotonic() - killed_at:.1f} s after kill -9")
    assert served.proc.poll() is None and _alive(served.child_pids[0]) and _alive(served.child_pids[3])


def test_killed_redis_is_restarted_on_its_port_and_requests_keep_succeeding(served: Launched) -> None:
    banner = (served.out.read_text())
    redis_url = re.search(r"^\s+redis\s+(\S+)", banner, re.M)
    assert redis_url, banner
    os.kill(served.child_pids[0], signal.SIGKILL)
    for i in range(200, 204):        # the router routes without Redis
        assert _generate(served.grpc_target, i).finished
    _wait_for_line(served, r"^kvmesh serve: restarted redis \(pid \d+\)$", 30)
    with redis.Redis.from_url(redis_url.group(1).replace("***", REDIS_PASSWORD), socket_timeout=2.0) as client:
        assert client.ping()
    for i in range(300, 304):
        assert _generate(served.grpc_target, i).finished
    assert served.proc.poll() is None


def _busy_worker(served: Launched) -> int:
    """The index (0, 1) of the worker that holds KV blocks now, from each worker's GetLoad."""
    addresses = re.search(r"^\s+workers\s+(.+)$", served.out.read_text(), re.M)
    assert addresses, served.out.read_text()
    for i, address in enumerate(addresses.group(1).split()):
        with grpc.insecure_channel(address) as ch:
            load = pb_grpc.WorkerStub(ch).GetLoad(pb.LoadRequest(), timeout=10,
                                                  metadata=(("x-kvmesh-cluster-token", TOKEN),))
            if load.num_used_blocks > 0:
                return i
    raise AssertionError("no worker holds the stream's blocks")


def test_http_stream_cut_by_a_dead_worker_ends_with_an_error_chunk_and_done(served: Launched) -> None:
    """No silent truncation: the worker under a streaming completion is killed -9; the client's
    stream still ends with an OpenAI-style error chunk and `data: [DONE]`."""
    import http.client
    import json
    _wait_for_line(served, r"^kvmesh serve: restarted worker-0", 5)   # the first test's restart is done
    http_port = re.search(r"^\s+HTTP\s+http://127\.0\.0\.1:(\d+)/v1$", served.out.read_text(), re.M)
    assert http_port, served.out.read_text()
    conn = http.client.HTTPConnection("127.0.0.1", int(http_port.group(1)), timeout=60)
    body = {"model": "smollm2", "prompt": "Write a very long story about a lighthouse keeper.", "max_tokens": 2000,
            "temperature": 0, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = []
    while len(events) < 3:
        line = resp.readline().decode().strip()
        if line:
            events.append(line)
    os.kill(served.child_pids[1 + _busy_worker(served)], signal.SIGKILL)
    while (line := resp.readline().decode()) != "":
        if line.strip():
            events.append(line.strip())
    conn.close()
    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2].removeprefix("data: "))
    assert error["error"]["type"] == "server_error" and "unavailable" in error["error"]["message"], error
    assert served.proc.poll() is None


def test_sigterm_to_a_worker_drains_its_stream_then_it_stays_down(served: Launched) -> None:
    """Graceful drain: SIGTERM to the worker under a gRPC stream; the stream finishes normally
    (finish reason, all its tokens), the worker exits 0 and, under on-failure, is not restarted
    while the router keeps serving on the other worker."""
    _wait_both_routed(served, 500)
    req = pb.GenerateRequest(text="Count slowly from one to one hundred:",
                             sampling=pb.SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    with grpc.insecure_channel(served.grpc_target) as ch:
        stream = pb_grpc.RouterStub(ch).Generate(req, timeout=120)
        first = next(stream)
        busy = int(first.worker_id.split("-")[1])
        pids = [int(p.split("=")[1]) for p in re.findall(r"worker-\d=\d+", served.out.read_text())]
        restarted = re.findall(rf"restarted worker-{busy} \(pid (\d+)\)", served.err.read_text())
        pid = int(restarted[-1]) if restarted else pids[busy]
        os.kill(pid, signal.SIGTERM)
        rest = list(stream)
    tokens = len(first.token_ids) + sum(len(r.token_ids) for r in rest)
    assert rest[-1].finished and tokens == 48
    _wait_for_line(served, rf"^kvmesh serve: worker-{busy} exited cleanly; not restarted", 30)
    for i in range(400, 403):
        assert _generate(served.grpc_target, i).worker_id == f"worker-{1 - busy}"


def test_sigterm_still_stops_everything(served: Launched, tmp_path: Path) -> None:
    """Only SIGINT/SIGTERM ends a supervised run, with status 0 (runs last: it ends the cluster)."""
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(timeout=30) == 0, served.err.read_text()
    assert "restarting" not in served.err.read_text().split("SIGTERM received")[-1]


def test_router_is_live_but_not_ready_without_a_ready_worker(tmp_path: Path) -> None:
    """Readiness is not liveness: a `kvmesh router` whose only worker is unreachable answers
    /live 200, /health 503 and gRPC health NOT_SERVING (load balancers send it nothing)."""
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.integration.test_serve import ROOT
    out = tmp_path / "router.out"
    with open(out, "wb") as fo:
        proc = subprocess.Popen([sys.executable, "-m", "kvmesh.cli", "router", "--worker", "127.0.0.1:1",
                                 "--grpc-port", "0", "--http-port", "0"], cwd=ROOT, stdout=fo,
                                stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while (m := re.search(r"serving grpc on \S+:(\d+) http on \S+:(\d+)", out.read_text())) is None:
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.1)
        grpc_port, http_port = m.groups()
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/live", timeout=10) as r:
            assert r.status == 200
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10)
        assert err.value.code == 503
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        proc.terminate()
        proc.wait(timeout=30)

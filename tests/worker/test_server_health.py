"""Liveness apart from readiness on a real WorkerServer: gRPC health services and
/livez, /readyz on the metrics port, while loading, serving, draining, with a stalled engine
(the KVMESH_TEST_STALL_FILE hook), with steps that keep raising, and idle past the timeout."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

import worker.engine.engine
from contracts.health import LIVENESS_SERVICE
from kvstore.metadata.registry import RedisConfig, WorkerRegistry
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from tests.support.redis_server import RedisServer, free_port
from tests.worker.test_server import (
    LONG,
    NOT_SERVING,
    ROOT,
    SERVING,
    assert_serves,
    health_status,
    request,
    serving,
    tiny_cfg,
)
from worker.engine.engine import Engine
from worker.server.health import WORKER_SERVICE
from worker.server.service import WorkerServer, WorkerServerConfig


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir: Any) -> Engine:
    """One engine, served by one server after another (each leaves it idle)."""
    return Engine(tiny_cfg(tiny_model_dir))


def probe(port: int | None, path: str) -> tuple[int, str]:
    assert port
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def checks(ch: grpc.Channel) -> tuple[int, int, int]:
    """(liveness, readiness "", readiness kvmesh.v1.Worker)"""
    return health_status(ch, LIVENESS_SERVICE), health_status(ch, ""), health_status(ch, WORKER_SERVICE)


def wait_for(pred: Callable[[], bool], timeout: float) -> float:
    """Poll `pred` every 50 ms; the seconds it took."""
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, f"not true after {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - t0


def assert_idle(engine: Engine) -> None:
    assert not engine.has_unfinished() and engine.store.pool.num_used_blocks == 0
    engine.check_integrity()


@pytest.mark.redis
def test_stalled_engine_turns_not_live_and_leaves_the_registry(loop, tiny_engine, redis_server: RedisServer,
                                                               tmp_path: Path) -> None:
    stall = tmp_path / "stall"
    registry = WorkerRegistry(RedisConfig(redis_server.url, cluster_name="live"))
    with serving(loop, tiny_engine.cfg, tiny_engine, worker_id="w-stall", redis_url=redis_server.url,
                 cluster_name="live", metrics_port=0, liveness_timeout_s=2.0, stall_file=str(stall)) as (server, ch):
        stub = pb_grpc.WorkerStub(ch)
        assert [r.worker_id for r in registry.live_workers()] == ["w-stall"]
        assert checks(ch) == (SERVING, SERVING, SERVING)
        assert probe(server.metrics_port, "/livez") == (200, "ok\n")
        assert probe(server.metrics_port, "/readyz") == (200, "ok\n")
        inflight = stub.Generate(request([50, 51, 52, 53], **LONG), timeout=60)
        next(inflight)

        stall.touch()                 # the engine thread hangs like a device would
        t0 = time.monotonic()
        wait_for(lambda: health_status(ch, LIVENESS_SERVICE) == NOT_SERVING, timeout=15)
        assert time.monotonic() - t0 >= 1.5         # not before the timeout (2 s from the last beat)
        assert checks(ch) == (NOT_SERVING, NOT_SERVING, NOT_SERVING)
        status, body = probe(server.metrics_port, "/livez")
        assert status == 503 and "not made progress" in body and "--liveness-timeout-s 2" in body
        status, body = probe(server.metrics_port, "/readyz")
        assert status == 503 and body.startswith("not live: ")
        wait_for(lambda: registry.live_workers() == [], timeout=10)     # the router drops it
        with pytest.raises(grpc.RpcError) as err:                        # running streams end ...
            list(inflight)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "not live" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:                        # ... and new ones are refused
            list(stub.Generate(request([1, 2, 3], max_tokens=2), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "not live" in err.value.details()
        assert stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10).model    # no engine needed

        stall.unlink()               # the engine thread resumes; the verdict stays
        time.sleep(1.5)              # > the registry's heartbeat interval (1 s)
        assert checks(ch) == (NOT_SERVING, NOT_SERVING, NOT_SERVING)
        assert probe(server.metrics_port, "/livez")[0] == 503
        assert registry.live_workers() == []
    registry.close()
    assert_idle(tiny_engine)


@pytest.mark.server
def test_repeated_step_failures_turn_not_live(loop, tiny_engine, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_step() -> Any:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(tiny_engine, "step", broken_step)
    with serving(loop, tiny_engine.cfg, tiny_engine, worker_id="w-fail", metrics_port=0,
                 max_step_failures=2) as (server, ch):
        stub = pb_grpc.WorkerStub(ch)
        for i in range(2):             # each failed step fails its request; the worker carries on
            assert checks(ch) == (SERVING, SERVING, SERVING)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request([7, 8, 9 + i], max_tokens=2), timeout=10))
            assert err.value.code() == grpc.StatusCode.INTERNAL and "illegal memory access" in err.value.details()
        wait_for(lambda: health_status(ch, LIVENESS_SERVICE) == NOT_SERVING, timeout=5)   # watched every 1 s
        assert checks(ch) == (NOT_SERVING, NOT_SERVING, NOT_SERVING)
        status, body = probe(server.metrics_port, "/livez")
        assert status == 503 and "2 engine steps in a row raised" in body and "illegal memory access" in body
        with pytest.raises(grpc.RpcError) as err:
            stub.GetLoad(pb.LoadRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    monkeypatch.undo()
    assert_idle(tiny_engine)


@pytest.mark.server
def test_idle_engine_stays_live_past_the_timeout(loop, tiny_engine) -> None:
    with serving(loop, tiny_engine.cfg, tiny_engine, worker_id="w-idle", metrics_port=0,
                 liveness_timeout_s=2.0) as (server, ch):
        time.sleep(5.0)              # idle ticks beat every 0.5 s
        assert checks(ch) == (SERVING, SERVING, SERVING)
        assert probe(server.metrics_port, "/livez") == (200, "ok\n")
        assert probe(server.metrics_port, "/readyz") == (200, "ok\n")
        assert_serves(ch)
        assert b"kvmesh:num_requests_running" in urllib.request.urlopen(      # /metrics beside the probes
            f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read()


@pytest.mark.server
def test_loading_and_draining_are_live_but_not_ready(loop, tiny_engine, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = threading.Event()

    def slow_load(cfg: Any) -> Engine:   # the load thread waits for the test
        assert loaded.wait(30)
        return tiny_engine
    monkeypatch.setattr(worker.engine.engine, "Engine", slow_load)
    server = WorkerServer(tiny_engine.cfg, WorkerServerConfig(worker_id="w-life", metrics_port=0))
    port = loop.run(server.start())
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert checks(ch) == (SERVING, NOT_SERVING, NOT_SERVING)
            assert probe(server.metrics_port, "/livez") == (200, "ok\n")
            assert probe(server.metrics_port, "/readyz") == (503, "loading the model\n")
            loaded.set()
            loop.run(server.wait_ready(30))
            assert checks(ch) == (SERVING, SERVING, SERVING)
            assert probe(server.metrics_port, "/readyz") == (200, "ok\n")

            stream = pb_grpc.WorkerStub(ch).Generate(request([60, 61, 62], **LONG))
            next(stream)
            stopping = loop.submit(server.stop(grace=20))    # SIGTERM: drain
            wait_for(lambda: health_status(ch) == NOT_SERVING, timeout=10)
            assert checks(ch) == (SERVING, NOT_SERVING, NOT_SERVING)
            assert probe(server.metrics_port, "/livez") == (200, "ok\n")
            assert probe(server.metrics_port, "/readyz") == (503, "draining\n")
            stream.cancel()
            stopping.result(30)
    finally:
        loop.run(server.stop(grace=0))
    assert_idle(tiny_engine)


@pytest.mark.multiproc
def test_kvmesh_worker_process_stall_hook_and_flags(tiny_model_dir: Any, tmp_path: Path) -> None:
    """`kvmesh worker` as the chart runs it: KVMESH_TEST_STALL_FILE from the env and
    --liveness-timeout-s reach the server; /livez on --metrics-port turns 503; SIGTERM still stops
    a worker whose engine thread hangs."""
    stall, log_path = tmp_path / "stall", tmp_path / "worker.log"
    metrics_port = free_port()
    with log_path.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.cli", "worker", "--model", str(tiny_model_dir("llama-gqa")),
             "--port", "0", "--num-blocks", "64", "--block-size", "4", "--worker-id", "w-hook",
             "--metrics-port", str(metrics_port), "--liveness-timeout-s", "2", "--max-step-failures", "5"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True,
            env=os.environ | {"KVMESH_TEST_STALL_FILE": str(stall)})
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()          # the serving line (the pytest timeout bounds it)
            assert "serving on" in line, log_path.read_text()
            assert probe(metrics_port, "/livez") == (200, "ok\n")
            assert probe(metrics_port, "/readyz") == (200, "ok\n")
            stall.touch()
            wait_for(lambda: probe(metrics_port, "/livez")[0] == 503, timeout=20)
            assert probe(metrics_port, "/readyz")[0] == 503
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)       # the stall file is still there
            assert proc.wait(timeout=30) == 0
            assert time.monotonic() - t0 < 10
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    log = log_path.read_text()
    assert log.count("IS NOT LIVE") == 1 and "--liveness-timeout-s 2" in log, log

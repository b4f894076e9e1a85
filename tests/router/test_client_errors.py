"""Failures a client causes are counted, not dumped, met with raw sockets: cancellations
mid-stream count as `abort` on the router (`kvmesh:router_requests_total{outcome="abort"}`)
and the worker (`kvmesh:request_success_total{finished_reason="abort"}`) with one INFO line
each naming the request id; malformed framing and clients gone mid-response are one
rate-limited WARNING without a traceback and `kvmesh:router_client_errors_total{kind}`.

One real worker (SmolLM2, its /metrics on) behind a router with HTTP, no keys.
"""
from __future__ import annotations

import json
import logging
import socket
import struct
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.client_exceptions import ClientConnectionResetError

from router.config import RouterConfig
from router.fronts.openai.client_errors import WARN_EVERY_S, ClientErrorKind, ClientErrors
from router.observe.metrics import sample_sum, scrape
from router.server import RouterServer
from tests.router.test_router import NUM_BLOCKS
from tests.support.loop_thread import LoopThread

CANCELS = 20


@dataclass
class Site:
    lt: LoopThread
    worker: Any             # WorkerServer
    router: RouterServer
    http: int

    def router_metric(self, name: str, **labels: str) -> float:
        return sample_sum(scrape(f"http://127.0.0.1:{self.http}/metrics"), name, **labels)

    def worker_metric(self, name: str, **labels: str) -> float:
        return sample_sum(scrape(f"http://127.0.0.1:{self.worker.metrics_port}/metrics"), name, **labels)


@pytest.fixture(scope="module")
def site(smollm2_dir: Path) -> Iterator[Site]:
    from worker.engine.engine import Engine, EngineConfig
    from worker.server.service import WorkerServer, WorkerServerConfig
    engine = Engine(EngineConfig(model=str(smollm2_dir), num_blocks=NUM_BLOCKS))
    lt = LoopThread()
    worker = WorkerServer(engine.cfg, WorkerServerConfig(worker_id="worker-0", metrics_port=0), engine=engine)
    lt.run(worker.start())
    lt.run(worker.wait_ready(60))

    async def start() -> tuple[RouterServer, int]:
        router = RouterServer(RouterConfig(worker_addresses=(worker.address,), model=str(smollm2_dir),
                                           served_model_name="smollm2", http_port=0, health_interval_s=0.2))
        _, h = await router.start()
        await router.wait_ready(10)
        assert h is not None
        return router, h
    router, h = lt.run(start())
    try:
        yield Site(lt, worker, router, h)
    finally:
        try:
            lt.run(router.stop(1))
            lt.run(worker.stop(1))
        finally:
            lt.close()


def raw(port: int, data: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(data)
    return s


def reset(s: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0), as a killed client does."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def stream_request(request_id: str, max_tokens: int) -> bytes:
    body = json.dumps({"model": "smollm2", "prompt": "Count slowly from one to a thousand:", "stream": True,
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"x-request-id: {request_id}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)


def read_until(s: socket.socket, marker: bytes) -> bytes:
    got = b""
    while marker not in got:
        chunk = s.recv(65536)
        assert chunk, f"closed before {marker!r}: {got[-200:]!r}"
        got += chunk
    return got


def wait_until(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def no_tracebacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [f"{r.name} {r.levelname} {r.getMessage()[:120]}" for r in caplog.records
            if r.exc_info or r.levelno >= logging.ERROR]


@pytest.mark.server
def test_cancellations_mid_stream_are_counted_with_one_line_each(site: Site,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    router0 = site.router_metric("kvmesh:router_requests_total", outcome="abort")
    worker0 = site.worker_metric("kvmesh:request_success_total", finished_reason="abort")
    for i in range(CANCELS):
        s = raw(site.http, stream_request(f"cancel-{i}", 400))
        read_until(s, b"data: ")            # streaming: the request runs on the worker
        reset(s)
    wait_until("20 aborts on the router", lambda: site.router_metric(
        "kvmesh:router_requests_total", outcome="abort") == router0 + CANCELS)
    wait_until("20 aborts on the worker", lambda: site.worker_metric(
        "kvmesh:request_success_total", finished_reason="abort") == worker0 + CANCELS)
    for logger in ("kvmesh.router", "kvmesh.worker"):
        lines = [r.getMessage() for r in caplog.records if r.name == logger and " aborted on " in r.getMessage()]
        for i in range(CANCELS):
            assert sum(line.startswith(f"request cancel-{i} aborted on ") for line in lines) == 1, (logger, i, lines)
    assert not no_tracebacks(caplog), no_tracebacks(caplog)
    # a request that finishes is no abort
    s = raw(site.http, stream_request("finishes-0", 2))
    read_until(s, b"data: [DONE]")
    s.close()
    time.sleep(0.5)
    assert site.router_metric("kvmesh:router_requests_total", outcome="abort") == router0 + CANCELS


@pytest.mark.server
@pytest.mark.parametrize("kind, request_bytes", [
    ("bad_framing", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n"),
    ("line_too_long", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 20000 + b"\r\n\r\n"),
    ("bad_framing", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
])
def test_malformed_framing_is_one_warning_without_traceback(site: Site, caplog: pytest.LogCaptureFixture,
                                                            kind: str, request_bytes: bytes) -> None:
    caplog.set_level(logging.DEBUG)
    before = site.router_metric("kvmesh:router_client_errors_total", kind=kind)
    for _ in range(10):
        s = raw(site.http, request_bytes)
        status_line = read_until(s, b"\r\n").split(b"\r\n")[0]
        assert status_line.split()[1] == b"400", status_line
        s.close()
    assert not no_tracebacks(caplog), no_tracebacks(caplog)     # logged before the 400 is written
    wait_until("10 counted", lambda: site.router_metric("kvmesh:router_client_errors_total", kind=kind)
               == before + 10)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "client error" in r.getMessage()]
    assert len(warnings) <= 1, [r.getMessage() for r in warnings]      # rate-limited (one per kind per 10 s)
    with urllib.request.urlopen(f"http://127.0.0.1:{site.http}/health", timeout=10) as resp:
        assert resp.status == 200     # the router still serves


@pytest.mark.server
def test_client_closing_at_the_end_of_a_stream_logs_no_traceback(site: Site,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    for i in range(10):
        s = raw(site.http, stream_request(f"done-{i}", 1))
        read_until(s, b'"finish_reason": "length"')
        reset(s)                            # while the router writes [DONE]
    time.sleep(1.0)
    assert not no_tracebacks(caplog), no_tracebacks(caplog)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "client error" in r.getMessage()]
    assert len(warnings) <= 1


def test_client_errors_logger_counts_rate_limits_and_keeps_server_tracebacks(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    errors = ClientErrors(clock=lambda: now[0])
    caplog.set_level(logging.DEBUG)
    for _ in range(5):
        errors.exception("Error handling request from %s", "127.0.0.1",
                         exc_info=ClientConnectionResetError("Cannot write to closing transport"))
    now[0] += WARN_EVERY_S
    errors.exception("Error handling request from %s", "127.0.0.1", exc_info=ConnectionResetError("gone"))
    assert errors.counts[ClientErrorKind.DISCONNECT.value] == 6
    warnings = [r for r in caplog.records if r.name == "kvmesh.router.http"]
    assert [r.levelname for r in warnings] == ["WARNING", "WARNING"] and not any(r.exc_info for r in warnings)
    assert "(+4 more of this kind since the last line)" in warnings[1].getMessage()
    caplog.clear()
    try:
        raise RuntimeError("a bug of ours")
    except RuntimeError as e:
        errors.exception("Error handling request", exc_info=e)
    assert [(r.name, r.levelname, bool(r.exc_info)) for r in caplog.records] == [("aiohttp.server", "ERROR", True)]

"""kvmesh.serve.processes.spawn: a child starts even while this process has gRPC traffic in flight,
is told to exit when the thread that started it ends, and keeps its pid through the shim."""
from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from kvmesh.serve.processes import Child, spawn, terminate


@pytest.fixture
def grpc_traffic() -> Iterator[None]:
    """An in-process gRPC server and two threads calling it without pause (as the launcher's
    router or a test's client does while a worker is started or restarted)."""
    server = grpc.server(futures.ThreadPoolExecutor(4))
    echo_handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {"Echo": echo_handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    echo = channel.unary_unary("/t.T/Echo")
    echo(b"warm", timeout=10)
    stop = threading.Event()

    def call() -> None:
        while not stop.is_set():
            echo(b"x", timeout=10)

    callers = [threading.Thread(target=call, daemon=True) for _ in range(2)]
    for t in callers:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in callers:
            t.join(10)
        channel.close()
        server.stop(None)


@pytest.mark.server
def test_children_start_while_grpc_calls_are_in_flight(tmp_path: Path, grpc_traffic: None) -> None:
    """With a plain fork (a preexec_fn), gRPC's fork handler restarted its poller in the child and
    close_fds closed the poller's epoll fd: now and then a child aborted before exec (SIGABRT, -6),
    failing cluster starts and restarts (grpc/grpc#43055). 150 starts must all run their program."""
    codes = []
    for i in range(150):
        child = spawn(tmp_path, f"c{i}", ["true"])
        codes.append(child.proc.wait(timeout=30))
    failed = {i: (c, (tmp_path / f"c{i}.log").read_text()[-300:]) for i, c in enumerate(codes) if c != 0}
    assert failed == {}


def _exec_done(child: Child, argv: list[str]) -> None:
    """Wait until the shim has exec'd `argv` (its PR_SET_PDEATHSIG is set by then): the
    child's pid shows the command line as given."""
    deadline = time.monotonic() + 10
    cmdline = Path(f"/proc/{child.proc.pid}/cmdline")
    while cmdline.read_bytes() != b"".join(os.fsencode(a) + b"\0" for a in argv):
        assert time.monotonic() < deadline, cmdline.read_bytes()
        time.sleep(0.01)


def test_a_child_keeps_its_pid_and_exits_when_the_thread_that_started_it_ends(tmp_path: Path) -> None:
    started: list[Child] = []

    def start() -> None:
        child = spawn(tmp_path, "sleeper", ["sleep", "60"])
        _exec_done(child, ["sleep", "60"])
        started.append(child)

    t = threading.Thread(target=start)
    t.start()
    t.join()
    try:
        assert started[0].proc.wait(timeout=10) == -signal.SIGTERM
    finally:
        terminate(started, 5.0)


def test_a_program_that_is_not_there_raises_in_the_caller(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no-such-kvmesh-program"):
        spawn(tmp_path, "missing", ["no-such-kvmesh-program", "--flag"])

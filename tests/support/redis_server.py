"""A real `redis-server` for tests: a child process on a free 127.0.0.1 port, in a temp dir,
without persistence, so a restart on the same port comes back empty (like a crashed Redis).

Its fixtures (`redis_server`, `redis_server_factory`) are registered for every test by tests/conftest.py.
Tests that need it are skipped when no redis-server binary is installed.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import redis

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One redis-server child. `extra_args` are appended to its command line (e.g.
    `["--requirepass", "pw"]`, `["--user", "alice", "on", ">pw", "~*", "+@all"]`)."""

    def __init__(self, workdir: Path, extra_args: Sequence[str] = (), port: int | None = None,
                 tls: bool = False) -> None:
        self.workdir = workdir
        self.extra_args = list(extra_args)
        self.port = port if port is not None else free_port()
        self.tls = tls
        self.password: str | None = None
        if "--requirepass" in self.extra_args:
            self.password = self.extra_args[self.extra_args.index("--requirepass") + 1]
        self._proc: subprocess.Popen[bytes] | None = None
        self.num_starts = 0

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"{'rediss' if self.tls else 'redis'}://{auth}127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> None:
        assert not self.running, "redis-server is already running"
        port_args = ["--port", "0", "--tls-port", str(self.port)] if self.tls \
            else ["--port", str(self.port)]
        cmd = [REDIS_SERVER, *port_args, "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", str(self.workdir), "--daemonize", "no",
               "--logfile", str(self.workdir / f"redis-{self.port}.log"), *self.extra_args]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.num_starts += 1
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode() if self._proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}: {err}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.01)
        self.stop()
        raise RuntimeError(f"redis-server did not listen on port {self.port} in {timeout_s} s")

    def stop(self) -> None:
        """Kill it at once (SIGKILL: a crash, nothing saved)."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait(timeout=10)
        if self._proc.stderr is not None:
            self._proc.stderr.close()
        self._proc = None

    def restart(self) -> None:
        """Stop and start again on the same port: an empty Redis with a new run_id."""
        self.stop()
        self.start()

    def client(self) -> redis.Redis:
        """A plain admin client (only for servers without TLS)."""
        return redis.Redis.from_url(self.url, decode_responses=True)


def _require_binary() -> None:
    if not Path(REDIS_SERVER).exists():
        pytest.skip("redis-server is not installed")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server for one test (starting one takes ~20 ms)."""
    _require_binary()
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """`make(extra_args=(), tls=False) -> RedisServer`, started; all stopped after the test."""
    _require_binary()
    servers: list[RedisServer] = []

    def make(extra_args: Sequence[str] = (), tls: bool = False) -> RedisServer:
        workdir = tmp_path / f"redis-{len(servers)}"
        workdir.mkdir()
        server = RedisServer(workdir, extra_args, tls=tls)
        servers.append(server)
        server.start()
        return server

    try:
        yield make
    finally:
        for server in servers:
            server.stop()

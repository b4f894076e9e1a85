"""A TCP balancer for tests: one address in front of several backends (router replicas), as a
Kubernetes Service is in front of its ready pods.

Each accepted connection goes to the next ready backend in turn (round robin per connection,
as kube-proxy's IPVS mode does) and its bytes are copied both ways until either side closes.
A backend is taken out of the rotation when a health check (a TCP connect every `check_s`)
fails or a connection to it is refused, and put back when a check succeeds again — the
Service's endpoints following the pods' readiness. A connection whose backend dies mid-stream
is cut (the client sees its stream reset and retries, through the balancer, on another
backend); nothing is replayed here. Runs its own asyncio loop in a daemon thread; `close()`
stops it. Counts per backend the connections it sent there (`connections`).
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence

from tests.support.loop_thread import LoopThread

__all__ = ["TcpBalancer"]


class TcpBalancer:
    """Listen on 127.0.0.1:`port` (0: a free one; `address` says which) and spread connections
    over `backends` ("HOST:PORT")."""

    def __init__(self, backends: Sequence[str], port: int = 0, check_s: float = 0.2,
                 connect_timeout_s: float = 2.0) -> None:
        self.backends = list(backends)
        self.ready = dict.fromkeys(self.backends, True)
        self.connections = dict.fromkeys(self.backends, 0)
        self.refused = 0                    # connections no backend would take
        self.check_s, self.connect_timeout_s = check_s, connect_timeout_s
        self._next = 0
        self._thread = LoopThread()
        self._server: asyncio.Server | None = None
        self._checks: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self.port = self._thread.run(self._start(port), timeout=10)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _start(self, port: int) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", port)
        self._checks = asyncio.create_task(self._check_loop())
        return int(self._server.sockets[0].getsockname()[1])

    async def _open(self, backend: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        host, port = backend.rsplit(":", 1)
        try:
            return await asyncio.wait_for(asyncio.open_connection(host, int(port)), self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError):
            return None

    async def _check_loop(self) -> None:
        while True:
            for b in self.backends:
                opened = await self._open(b)
                self.ready[b] = opened is not None
                if opened is not None:
                    opened[1].close()
            await asyncio.sleep(self.check_s)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            upstream = None
            for _ in range(len(self.backends)):
                ready = [b for b in self.backends if self.ready[b]]
                if not ready:
                    break
                backend = ready[self._next % len(ready)]
                self._next += 1
                upstream = await self._open(backend)
                if upstream is not None:
                    self.connections[backend] += 1
                    break
                self.ready[backend] = False     # refused: out of the rotation until a check passes
            if upstream is None:
                self.refused += 1
                return
            up_reader, up_writer = upstream
            pipes = [asyncio.ensure_future(_pipe(reader, up_writer)), asyncio.ensure_future(_pipe(up_reader, writer))]
            try:
                await asyncio.wait(pipes)
            finally:
                for p in pipes:
                    p.cancel()
        finally:
            writer.close()
            self._conns.discard(task)

    def close(self) -> None:
        async def stop() -> None:
            if self._checks is not None:
                self._checks.cancel()
            if self._server is not None:
                self._server.close()
            for t in list(self._conns):
                t.cancel()
            await asyncio.gather(*self._conns, return_exceptions=True)
        self._thread.run(stop(), timeout=10)
        self._thread.close()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """Copy until EOF or an error on either side; then close `dst` (cutting the other half too)."""
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass    # a side reset: the connection is cut, as a dead pod's would be
    finally:
        dst.close()

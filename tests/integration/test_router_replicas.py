"""Router replicas behind one address: two `kvmesh router --share-pending` processes on one
redis-server and the same two (fake, in-process) workers, behind tests/support/balancer.py's TCP
balancer as behind a Kubernetes Service. Clients keep one gRPC channel each (one connection,
pinned to one router) and send requests back to back; one router is SIGKILLed under load.

What a client sees: its requests in flight on the killed router end with UNAVAILABLE ("Stream
removed (Socket closed)": the balancer cuts the connection); it retries, its channel
reconnects through the balancer, which has taken the dead router out, and the survivor serves
the request. No request is lost: every one completes within a few retries."""
from __future__ import annotations

import re
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from kvmesh.serve.processes import Child, spawn, terminate
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from tests.support.balancer import TcpBalancer
from tests.support.fake_worker import FakeWorker
from tests.support.loop_thread import LoopThread
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.multiproc, pytest.mark.redis]

ROUTER_LINE = re.compile(r"kvmesh router serving grpc on (\S+):(\d+) http on (\S+):(\d+)")
CLIENTS = 4
RETRIES = 20


def _ready(http: str) -> bool:
    try:
        with urllib.request.urlopen(f"{http}/readyz", timeout=2) as r:
            return int(r.status) == 200
    except (urllib.error.URLError, OSError):
        return False


class _Client(threading.Thread):
    """Requests back to back on one channel through the balancer, each retried on UNAVAILABLE."""

    def __init__(self, n: int, target: str, stop: threading.Event) -> None:
        super().__init__(name=f"client-{n}", daemon=True)
        self.n, self.target, self.stop = n, target, stop
        self.done: list[float] = []          # when each request completed
        self.errors: list[tuple[grpc.StatusCode, str]] = []
        self.lost = 0                        # requests that ran out of retries

    def run(self) -> None:
        # its own connection (channels of one process share them by default)
        with grpc.insecure_channel(self.target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            stub = pb_grpc.RouterStub(channel)
            i = 0
            while not self.stop.is_set():
                i += 1
                req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[2 + (self.n + i + k) % 12 for k in range(12)]),
                                         sampling=pb.SamplingParams(temperature=0.0, max_tokens=1))
                for _ in range(RETRIES):
                    try:
                        msgs = list(stub.Generate(req, timeout=10))
                        assert msgs and msgs[-1].finished
                        self.done.append(time.monotonic())
                        break
                    except grpc.RpcError as e:
                        self.errors.append((e.code(), e.details() or ""))
                        time.sleep(0.1)
                else:
                    self.lost += 1


def test_a_router_killed_under_load_costs_no_request(redis_server: RedisServer, tmp_path: Path) -> None:
    loop = LoopThread()
    workers = [FakeWorker(f"w{i}", delay_s=0.2) for i in range(2)]
    routers: list[Child] = []
    balancer = None
    try:
        for w in workers:
            loop.run(w.start())
        for i in range(2):
            routers.append(spawn(tmp_path, f"router-{i}", [
                sys.executable, "-m", "kvmesh.cli", "router", "--redis-url", redis_server.url,
                "--cluster-name", "rep", "--grpc-port", "0", "--http-port", "0", "--model", "tiny",
                "--tokenizer-source", "worker", "--share-pending",
                *[a for w in workers for a in ("--worker", w.address)]],
                env={"KVMESH_CACHE_DIR": str(tmp_path / "cache")}))
        ends = [r.wait_line(ROUTER_LINE, time.monotonic() + 120, 120) for r in routers]
        deadline = time.monotonic() + 60
        while not all(_ready(f"http://{m.group(3)}:{m.group(4)}") for m in ends):
            assert time.monotonic() < deadline, "the routers did not become ready"
            time.sleep(0.2)
        backends = [f"{m.group(1)}:{m.group(2)}" for m in ends]
        balancer = TcpBalancer(backends)

        stop = threading.Event()
        clients = [_Client(n, balancer.address, stop) for n in range(CLIENTS)]
        for c in clients:
            c.start()
        time.sleep(1.5)
        assert all(balancer.connections[b] >= 1 for b in backends), balancer.connections
        routers[0].proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        time.sleep(2.5)
        stop.set()
        for c in clients:
            c.join(timeout=30)
            assert not c.is_alive(), f"{c.name} hangs"

        print("what the clients saw:", [e for c in clients for e in c.errors])
        assert sum(c.lost for c in clients) == 0, [c.errors for c in clients]
        after = sum(1 for c in clients for t in c.done if t > killed_at + 0.5)
        assert after >= CLIENTS, f"only {after} requests completed after the kill"
        codes = {code for c in clients for code, _ in c.errors}
        assert codes <= {grpc.StatusCode.UNAVAILABLE}, [c.errors for c in clients]
        assert codes, "no request was in flight on the killed router (the kill tested nothing)"
        assert not balancer.ready[backends[0]] and balancer.ready[backends[1]]
    finally:
        if balancer is not None:
            balancer.close()
        terminate(routers, 20)
        for w in workers:
            loop.run(w.stop())
        loop.close()

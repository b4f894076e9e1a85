"""Real `kvmesh worker` processes (SmolLM2) and a `kvmesh router` process on a Redis Cluster (3
primaries on loopback, the first with a replica) and on a Sentinel-managed primary (a primary, a
replica, 3 sentinels). Workers and router each get the URL of a different cluster node (any node
works: cluster mode is detected), or the one Sentinel URL.

Each test: the router routes a repeated prompt to the worker that cached it (cached tokens > 0);
then, with chat requests running back to back, the Redis primary holding a worker's keys is
SIGKILLed and its replica promoted. No request fails (the routing decision reads only the router's
memory), workers and router reconnect to the promoted replica, and the router's block index ends
exact: per worker, the blocks it indexes equal the blocks the worker reports (GET /v1/cluster:
both sides in one answer), events lost in the failover healed by inventories.
"""
from __future__ import annotations

import json
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvmesh.serve.config import ServeConfig
from kvmesh.serve.local import LocalCluster
from kvmesh.serve.processes import Child, spawn, terminate
from kvstore.metadata.registry import RedisConfig, WorkerRegistry
from tests.kvstore.test_metadata_topologies import worker_ids_on
from tests.support.redis_topologies import RedisClusterNodes, RedisSentinelGroup

pytestmark = [pytest.mark.multiproc, pytest.mark.redis]

WORKER_LINE = re.compile(r"^kvmesh worker (\S+) serving on (\S+):(\d+)$", re.M)
ROUTER_LINE = re.compile(r"kvmesh router serving grpc on (\S+):(\d+) http on (\S+):(\d+)")
START_S = 240.0
CLI = [sys.executable, "-m", "kvmesh.cli"]
SYSTEM = "You are a terse assistant for a shipping company. Answer in one short sentence, no lists. " * 3


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), ""


def _until(what: str, ok: Callable[[], bool], timeout_s: float, children: list[Child]) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        dead = [c for c in children if c.proc.poll() is not None]
        assert not dead, f"{what}: {dead[0].name} exited: {dead[0].tail()}"
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.2)


@pytest.fixture
def children() -> Iterator[list[Child]]:
    out: list[Child] = []
    try:
        yield out
    finally:
        terminate(out, 30)


def _start(tmp_path: Path, children: list[Child], worker_urls: dict[str, str], router_url: str) -> str:
    """Start one worker per (id -> its --redis-url) and the router; returns the router's HTTP base
    once it routes to every worker."""
    for wid, url in worker_urls.items():
        children.append(spawn(tmp_path, wid, [*CLI, "worker", "--port", "0", "--worker-id", wid, "--model",
                                              "smollm2", "--num-blocks", "96", "--redis-url", url]))
    for c in children:
        c.wait_line(WORKER_LINE, time.monotonic() + START_S, START_S)
    router = spawn(tmp_path, "router", [*CLI, "router", "--redis-url", router_url, "--grpc-port", "0",
                                        "--http-port", "0", "--model", "smollm2"])
    children.append(router)
    m = router.wait_line(ROUTER_LINE, time.monotonic() + START_S, START_S)
    base = f"http://{m.group(3)}:{m.group(4)}"
    _until("the router routes to every worker",
           lambda: {w["worker_id"] for w in _cluster(base)["workers"] if w.get("up")} == set(worker_urls),
           60, children)
    return base


def _cluster(base: str) -> dict[str, Any]:
    status, body = _get(base + "/v1/cluster")
    return dict(json.loads(body)) if status == 200 else {"workers": []}


def _chat(base: str, question: str) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.create(model="smollm2", max_tokens=3, temperature=0.0, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])


def _cached(done: openai.types.chat.ChatCompletion) -> int:
    details = done.usage.prompt_tokens_details if done.usage is not None else None
    return int(details.cached_tokens or 0) if details is not None else 0


def _worker(done: openai.types.chat.ChatCompletion) -> str:
    extra = done.model_extra or {}
    return str(extra.get("kvmesh", {}).get("worker_id"))


def _repeat_hits(base: str, question: str) -> None:
    """Asked twice, a question goes to the same worker the second time, which has it cached
    beyond the shared system prompt."""
    first, again = _chat(base, question), _chat(base, question)
    assert _worker(first) == _worker(again) and _cached(again) > _cached(first), (first, again)


def _index_exact(base: str) -> bool:
    """Every worker idle, and the router indexes as many blocks of it, per tier, as it holds."""
    workers = _cluster(base)["workers"]
    return bool(workers) and all(
        w.get("up") and w["num_running"] == 0 and w["num_waiting"] == 0
        and w["index_blocks"] == {"device": w["blocks"]["device_cached"], "host": w["blocks"]["host"]}
        for w in workers)


class _Load(threading.Thread):
    """Chat requests back to back, each a new question after the shared system prompt."""

    def __init__(self, base: str, n: int) -> None:
        super().__init__(name=f"load-{n}", daemon=True)
        self.base, self.n = base, n
        self.stop = threading.Event()
        self.done = 0
        self.errors: list[str] = []

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            try:
                _chat(self.base, f"Client {self.n}, order {i}: where is parcel {1000 * self.n + i}?")
                self.done += 1
            except openai.OpenAIError as e:
                self.errors.append(f"{type(e).__name__}: {e}")


def _routes_and_survives_failover(base: str, kill: Callable[[], None], children: list[Child]) -> None:
    _repeat_hits(base, "What does a tracking number look like?")
    _until("the index matches the workers before the failover", lambda: _index_exact(base), 30, children)

    loads = [_Load(base, n) for n in range(2)]
    for load in loads:
        load.start()
    time.sleep(1.0)
    before = sum(load.done for load in loads)
    kill()
    time.sleep(2.0)
    for load in loads:
        load.stop.set()
    for load in loads:
        load.join(timeout=180)
        assert not load.is_alive(), f"{load.name} hangs"
    assert [e for load in loads for e in load.errors] == []
    assert sum(load.done for load in loads) > before, "no request completed across the failover"
    print(f"{sum(load.done for load in loads)} requests, {before} before the kill, none failed")

    _until("the index is exact after the failover", lambda: _index_exact(base), 60, children)
    restarts = re.search(r"^kvmesh[:_]router_redis_restarts_total (\S+)$", _get(base + "/metrics")[1], re.M)
    assert restarts and float(restarts.group(1)) >= 1, "the router did not notice the failover"
    _repeat_hits(base, "Can a parcel be redirected after dispatch?")
    _until("the index is exact at the end", lambda: _index_exact(base), 30, children)


def test_workers_and_router_on_a_redis_cluster_survive_a_primary_failover(
        redis_cluster_factory: Callable[..., RedisClusterNodes], tmp_path: Path, children: list[Child]) -> None:
    cluster = redis_cluster_factory(3, replicas=1)
    keys = RedisConfig(cluster.url, "kvmesh")
    on_first = worker_ids_on(cluster, keys, 0, 1)[0]          # its keys live on the primary killed below
    on_other = worker_ids_on(cluster, keys, 1, 1)[0]
    base = _start(tmp_path, children, {on_first: cluster.nodes[1].url, on_other: cluster.nodes[2].url},
                  router_url=cluster.nodes[0].url)
    _routes_and_survives_failover(base, lambda: cluster.kill_primary(0), children)


def test_workers_and_router_through_sentinel_survive_a_failover(
        redis_sentinel: RedisSentinelGroup, tmp_path: Path, children: list[Child]) -> None:
    base = _start(tmp_path, children, {"w-a": redis_sentinel.url, "w-b": redis_sentinel.url},
                  router_url=redis_sentinel.url)
    _routes_and_survives_failover(base, redis_sentinel.kill_primary, children)


def test_kvmesh_serve_on_a_redis_cluster(redis_cluster: RedisClusterNodes) -> None:
    """`kvmesh serve --redis-url <a cluster node>` (LocalCluster, what the command runs): no embedded
    redis-server; both workers register on the cluster, their keys on the primaries of their hash
    tags; the router routes a repeated question to the worker that cached it."""
    name = "serve-on-cluster"
    cfg = ServeConfig(workers=2, grpc_port=0, http_port=0, cluster_name=name, redis_url=redis_cluster.nodes[1].url,
                      engine_argv=("--num-blocks", "96"))
    with LocalCluster(cfg) as served:
        assert "redis" not in served.pids and served.redis_url == redis_cluster.nodes[1].url
        base = served.http_base_url.removesuffix("/v1")
        registry = WorkerRegistry(RedisConfig(redis_cluster.nodes[2].url, name))
        try:
            assert {r.worker_id for r in registry.live_workers()} == {"worker-0", "worker-1"}
        finally:
            registry.close()
        _until("the router routes to both workers",
               lambda: len([w for w in _cluster(base)["workers"] if w.get("up")]) == 2, 60, [])
        _repeat_hits(base, "How long does customs clearance take?")
        _until("the index matches the workers", lambda: _index_exact(base), 30, [])

"""Client calls into a `tests.support.podnet.PodCluster` from the test process: a worker's Generate
(with a peer hint) and GetLoad with the cluster token, a greedy request through the router,
the router's /v1/cluster and /metrics, and a prompt of random token ids.
"""
from __future__ import annotations

import contextlib
import json
import random
import re
import urllib.request
from collections.abc import Iterator
from typing import Any, NamedTuple

import grpc

from kvmesh.bench.chaos_harness import wait_until
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from tests.support.podnet import PodCluster

BLOCK = 16
PROMPT_TOKENS = 97           # 6 full blocks may come from a cache (the last token never does)
FULL = (PROMPT_TOKENS - 1) // BLOCK * BLOCK
_UP = re.compile(r'^kvmesh:router_worker_up\{worker_id="([^"]+)"\} (\S+)$', re.M)


class Reply(NamedTuple):
    tokens: list[int]
    final: pb.GenerateResponse


def prompt(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 20000) for _ in range(n)]


def request(ids: list[int], max_tokens: int = 6) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                              sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def worker_address(cl: PodCluster, pod: str) -> str:
    """The address peers and the router dial: the worker's --advertise-address."""
    return next(a.split("=", 1)[1] for a in cl.pods[pod].run.argv if a.startswith("--advertise-address="))


def on_worker(cl: PodCluster, pod: str, ids: list[int], hint: str | None = None, timeout_s: float = 120,
              max_tokens: int = 6) -> Reply:
    """A greedy Generate straight to worker `pod`, hinted (if `hint`) that worker `hint` holds
    the prompt's full blocks."""
    req = request(ids, max_tokens)
    if hint is not None:
        req.peer_hints.append(pb.PeerHint(worker_id=hint, address=worker_address(cl, hint),
                                          num_blocks=len(ids) // BLOCK))
    with grpc.insecure_channel(cl.addr(pod, "grpc")) as ch:
        msgs = list(pb_grpc.WorkerStub(ch).Generate(req, timeout=timeout_s, metadata=cl.metadata))
    assert msgs and msgs[-1].finished, msgs[-1:]
    return Reply([t for m in msgs for t in m.token_ids], msgs[-1])


def via_router(cl: PodCluster, ids: list[int], timeout_s: float = 120, max_tokens: int = 6) -> Reply:
    with grpc.insecure_channel(cl.addr(cl.router, "grpc")) as ch:
        msgs = list(pb_grpc.RouterStub(ch).Generate(request(ids, max_tokens), timeout=timeout_s))
    assert msgs and msgs[-1].finished, msgs[-1:]
    return Reply([t for m in msgs for t in m.token_ids], msgs[-1])


def load(cl: PodCluster, pod: str) -> pb.Load:
    with grpc.insecure_channel(cl.addr(pod, "grpc")) as ch:
        return pb_grpc.WorkerStub(ch).GetLoad(pb.LoadRequest(), timeout=30, metadata=cl.metadata)


def _get(url: str) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=10) as r:
        return str(r.read().decode())


def cluster_doc(cl: PodCluster) -> dict[str, Any]:
    """The router's GET /v1/cluster."""
    return dict(json.loads(_get(cl.url(cl.router, "http", "/v1/cluster"))))


def workers_up(cl: PodCluster) -> dict[str, bool]:
    """worker id -> in the router's routing now (`kvmesh:router_worker_up`)."""
    body = _get(cl.url(cl.router, "http", "/metrics"))
    return {m.group(1): float(m.group(2)) == 1.0 for m in _UP.finditer(body)}


def index_matches_worker(cl: PodCluster, pod: str) -> tuple[bool, dict[str, Any]]:
    """The router's block index holds, per tier, as many blocks of `pod` as `pod` says it holds
    (both read in one /v1/cluster answer: the index side from the router's memory, the worker
    side from the worker's GetLoad). Returns (equal, the worker's entry); (False, {}) while the
    router does not list `pod` (e.g. its registry record expired)."""
    entry = next((w for w in cluster_doc(cl)["workers"] if w["worker_id"] == pod), None)
    if entry is None:
        return False, {}
    held = entry.get("blocks") or {}
    index = entry.get("index_blocks") or {}
    equal = entry.get("up", False) and index == {"device": held.get("device_cached"), "host": held.get("host")}
    return bool(equal), entry


@contextlib.contextmanager
def running(cluster: PodCluster, workers: int = 2) -> Iterator[PodCluster]:
    """Redis, `workers` workers (loading side by side) and the router, as the chart starts them,
    until every worker is in the router's routing; the pods' log tails are printed if the
    bring-up fails, and everything is torn down at the end."""
    try:
        cluster.start_redis()
        for i in range(workers):
            cluster.start_worker(i, wait=False)
        for i in range(workers):
            cluster.wait_ready(cluster.worker(i), 420)
        cluster.start_router()
        assert wait_until(lambda: all(workers_up(cluster).get(cluster.worker(i)) for i in range(workers)), 60) \
            is not None, "the workers never entered routing"
        yield cluster
    except BaseException:
        print(cluster.log_tails())
        raise
    finally:
        cluster.close()

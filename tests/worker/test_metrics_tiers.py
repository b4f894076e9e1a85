"""Worker /metrics after a known sequence on a 12-block device pool with a host tier: a shared
prefix pushed out by unrelated prompts (device LRU evictions offloaded to the host tier), the
prefix again (onloaded: exactly its 6 blocks, 24 cached tokens), then three concurrent requests
that do not fit (preemptions). Counters are compared with what the engine and the clients saw;
the request id of gRPC metadata names the worker's JSON log lines; a real Prometheus reads the
same names and values."""
from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from contracts.logs import JsonFormatter
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from tests.support.json_logs import json_logs
from tests.support.loop_thread import LoopThread
from tests.support.prometheus_server import Prometheus, needs_prometheus
from tests.worker.test_metrics import scrape
from tests.worker.test_server import collect, request, serving, wait_idle
from worker.engine.engine import Engine, EngineConfig
from worker.server.service import WorkerServer

WORKER = "w-tiers"


@pytest.fixture(scope="module")
def tiered(tiny_model_dir: Any) -> Iterator[tuple[WorkerServer, grpc.Channel, Engine]]:
    lt = LoopThread()
    engine = Engine(EngineConfig(model=str(tiny_model_dir("llama-gqa")), block_size=4, num_blocks=12,
                                 kv_offload_gib=0.001, max_model_len=64))
    try:
        with serving(lt, engine.cfg, engine=engine, worker_id=WORKER, metrics_port=0) as (server, channel):
            yield server, channel, engine
    finally:
        lt.close()


def value(samples: Any, name: str, **labels: str) -> float:
    want = {"worker_id": WORKER} | labels
    found = [v for (n, ls), v in samples.items() if n == name and all(dict(ls).get(k) == w for k, w in want.items())]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


def settled(server: WorkerServer, channel: grpc.Channel) -> Any:
    """A scrape taken after the engine went idle (the snapshot is refreshed every 0.5 s)."""
    wait_idle(channel, 10)
    time.sleep(0.7)
    return scrape(server.metrics_port)


@pytest.mark.server
def test_offload_onload_eviction_and_preemption_counters(tiered):
    server, channel, engine = tiered
    stub = pb_grpc.WorkerStub(channel)
    rng = random.Random(0)
    shared = [rng.randrange(3, 200) for _ in range(24)]                # 6 full blocks
    collect(stub.Generate(request(shared + [7, 8], max_tokens=2, ignore_eos=True)))
    for _ in range(3):     # unrelated traffic pushes the shared prefix out of the device pool
        collect(stub.Generate(request([rng.randrange(3, 200) for _ in range(30)], max_tokens=2, ignore_eos=True)))
    before = settled(server, channel)
    assert value(before, "kvmesh:kv_blocks_onloaded_total") == 0
    offloaded = value(before, "kvmesh:kv_blocks_offloaded_total")
    lru_tokens = value(before, "kvmesh:kv_evicted_tokens_total", policy="lru")
    assert offloaded > 0 and lru_tokens >= 4 * offloaded, "evicted blocks were not offloaded"
    host = engine.store.host
    assert host is not None and offloaded == host.stats().offloaded
    assert lru_tokens == 4 * engine.store.pool.stats().evictions
    _, _, again = collect(stub.Generate(request(shared + [7, 8], max_tokens=2, ignore_eos=True)))
    assert again[-1].cached_tokens == 24
    after = settled(server, channel)
    assert value(after, "kvmesh:kv_blocks_onloaded_total") == 6
    assert value(after, "kvmesh:prefix_cache_hits_total") - value(before, "kvmesh:prefix_cache_hits_total") == 24
    assert value(after, "kvmesh:host_tier_usage_perc") > 0
    assert value(before, "kvmesh:num_preemptions_total") == 0

    def one(i: int) -> pb.GenerateResponse:      # 3 x (16 + 24 tokens) = 30 blocks on a 12-block pool
        prompt = [rng.randrange(3, 200) for _ in range(16)]
        return collect(pb_grpc.WorkerStub(channel).Generate(request(prompt, max_tokens=24, ignore_eos=True)))[2][-1]
    with ThreadPoolExecutor(3) as pool:
        finals = list(pool.map(one, range(3)))
    assert all(f.completion_tokens == 24 for f in finals)
    s = settled(server, channel)
    load = stub.GetLoad(pb.LoadRequest())
    assert value(s, "kvmesh:num_preemptions_total") == load.num_preemptions > 0
    assert value(s, "kvmesh:kv_blocks_offloaded_total") == host.stats().offloaded
    assert value(s, "kvmesh:generation_tokens_total") == 2 * 5 + 24 * 3
    assert value(s, "kvmesh:inter_token_latency_seconds_count") == 1 * 5 + 23 * 3


@pytest.mark.server
def test_metadata_request_id_on_every_worker_json_line(tiered):
    _, channel, _ = tiered
    with json_logs() as logs:
        collect(pb_grpc.WorkerStub(channel).Generate(request([5, 6, 7, 8, 9], request_id="engine-id-1", max_tokens=2),
                                                     metadata=(("x-request-id", "trace-meta-7"),)))
    lines = logs.lines
    mine = [d for d in lines if d.get("request_id") == "trace-meta-7"]
    assert any(d["msg"].startswith("request engine-id-1 finished on w-tiers:") for d in mine), lines
    for d in mine:
        assert set(d) >= {"ts", "level", "logger", "msg"} and d["logger"].startswith("kvmesh.")
    assert not [d for d in lines if "engine-id-1" in d["msg"] and d.get("request_id") != "trace-meta-7"]
    assert isinstance(logs.handler.formatter, JsonFormatter)


@pytest.mark.multiproc
@pytest.mark.server
@needs_prometheus
def test_real_prometheus_sees_the_vllm_style_names(tiered, tmp_path):
    """Debian's prometheus (which asks for OpenMetrics first) scrapes the worker and finds the
    `kvmesh:` names with the values /metrics shows, and the cluster hit rate via PromQL."""
    server, channel, _ = tiered
    s = settled(server, channel)
    prom = Prometheus(tmp_path, [f"http://127.0.0.1:{server.metrics_port}/metrics"])
    try:
        prom.wait(prom.targets_up, "the worker target up")
        hits, queries = (value(s, f"kvmesh:prefix_cache_{k}_total") for k in ("hits", "queries"))
        rate = "sum(kvmesh:prefix_cache_hits_total) / sum(kvmesh:prefix_cache_queries_total)"
        assert prom.wait(lambda: prom.scalar(rate), "the hit rate in PromQL") == hits / queries
        assert prom.scalar("sum(kvmesh:kv_blocks_onloaded_total)") == value(s, "kvmesh:kv_blocks_onloaded_total")
        assert not prom.query('{__name__=~"kvmesh_.*"}'), "names lost their colon"
    finally:
        prom.stop()

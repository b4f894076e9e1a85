"""Worker /metrics (worker/server/metrics.py) scraped over real HTTP from a real WorkerServer: after a
known sequence of gRPC requests (one with a shared prefix, one stopped by a stop token) the
counters equal what the client was told, and the histograms counted every request."""
from __future__ import annotations

import logging
import re
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from tests.support.loop_thread import LoopThread
from tests.worker.test_server import collect, request, serving, tiny_cfg
from worker.server.cli import metrics_port_for
from worker.server.service import WorkerServer, WorkerServerConfig

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def worker(loop: LoopThread, tiny_model_dir: Any) -> Iterator[tuple[WorkerServer, grpc.Channel]]:
    with serving(loop, tiny_cfg(tiny_model_dir), worker_id="w-metrics", metrics_port=0) as served:
        yield served


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    """The one sample `name` of worker w-metrics with `labels` (model_name: any, but present)."""
    want = {"worker_id": "w-metrics"} | labels
    found = [v for (n, ls), v in samples.items()
             if n == name and "model_name" in dict(ls) and all(dict(ls).get(k) == w for k, w in want.items())]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


@pytest.mark.server
def test_counters_equal_what_the_clients_were_told(worker):
    server, channel = worker
    assert server.metrics_port
    stub = pb_grpc.WorkerStub(channel)
    prefix = [11, 200, 37, 64, 5, 190, 23, 77, 140, 3, 99, 98]          # three full blocks of 4
    first_ids, _, m1 = collect(stub.Generate(request(prefix, max_tokens=6, ignore_eos=True)))
    _, _, m2 = collect(stub.Generate(request(prefix + [45, 46, 47, 48], max_tokens=4, ignore_eos=True)))
    _, _, m3 = collect(stub.Generate(request([7, 6, 5], max_tokens=20, stop_token_ids=[first_ids[1]])))
    finals = [m1[-1], m2[-1], m3[-1]]
    assert m2[-1].cached_tokens >= len(prefix), "the shared prefix was not served from the cache"
    s = scrape(server.metrics_port)
    assert value(s, "kvmesh:prompt_tokens_total") == sum(f.prompt_tokens for f in finals) == 12 + 16 + 3
    assert value(s, "kvmesh:prefix_cache_queries_total") == 12 + 16 + 3
    assert value(s, "kvmesh:prefix_cache_hits_total") == sum(f.cached_tokens for f in finals)
    assert value(s, "kvmesh:generation_tokens_total") == sum(f.completion_tokens for f in finals)
    reasons = [pb.FinishReason.Name(f.finish_reason).removeprefix("FINISH_REASON_").lower() for f in finals]
    for reason in set(reasons):
        assert value(s, "kvmesh:request_success_total", finished_reason=reason) == reasons.count(reason)
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert value(s, f"kvmesh:{hist}_count") == 3, hist
        assert value(s, f"kvmesh:{hist}_bucket", le="+Inf") == 3, hist
        assert 0 <= value(s, f"kvmesh:{hist}_sum") < 60, hist
    # one inter-token observation per token gap; the gaps of a request add up to its decode time
    assert value(s, "kvmesh:inter_token_latency_seconds_count") == sum(f.completion_tokens - 1 for f in finals)
    assert value(s, "kvmesh:inter_token_latency_seconds_sum") == pytest.approx(
        value(s, "kvmesh:request_decode_time_seconds_sum"), abs=1e-6)
    assert [v for (n, _), v in s.items() if n == "kvmesh:kv_cache_dtype_info"] == [1.0]


@pytest.mark.server
def test_gauges_follow_the_engine_snapshot(worker):
    server, channel = worker
    load = pb_grpc.WorkerStub(channel).GetLoad(pb.LoadRequest())
    deadline = time.monotonic() + 10
    while True:      # the snapshot is refreshed every 0.5 s: wait for one taken with the worker idle
        s = scrape(server.metrics_port)
        if any(n == "kvmesh:num_requests_running" for n, _ in s) and value(s, "kvmesh:num_requests_running") == 0:
            break
        assert time.monotonic() < deadline, "no idle engine snapshot in /metrics after 10 s"
        time.sleep(0.1)
    assert value(s, "kvmesh:num_requests_running") == 0
    assert value(s, "kvmesh:num_requests_waiting") == 0
    assert value(s, "kvmesh:num_preemptions_total") == load.num_preemptions
    assert value(s, "kvmesh:room_waits_total") == 0      # a roomy pool: no admission waited to keep a prefix
    usage = value(s, "kvmesh:kv_cache_usage_perc")
    assert 0.0 <= usage <= 1.0
    assert value(s, "kvmesh:host_tier_usage_perc") == 0.0
    # idle: the pool's reuse counters reach /metrics as GetLoad reports them (the router's input)
    stub = pb_grpc.WorkerStub(channel)
    shared = list(range(100, 140))                       # 40 tokens (the tiny vocabulary: 256 ids)
    for tail in ([1, 2], [3, 4]):
        collect(stub.Generate(request(shared + tail, max_tokens=2, ignore_eos=True)))
    idle = stub.GetLoad(pb.LoadRequest())
    assert idle.num_reused_blocks > 0, "the second request reused the first one's prefix"
    while (value(s, "kvmesh:kv_reused_blocks"), value(s, "kvmesh:kv_protected_blocks")) \
            != (idle.num_reused_blocks, idle.num_protected_blocks):
        assert time.monotonic() < deadline + 10, "the reuse gauges never matched GetLoad"
        time.sleep(0.1)
        s = scrape(server.metrics_port)
    assert idle.num_protected_blocks <= idle.num_free_blocks
    # the protection window starts at one pool turnover (kvstore/fade.py) and stays there without mistakes
    assert value(s, "kvmesh:kv_protect_window_blocks") == idle.num_blocks


def test_metrics_port_flag_default():
    assert metrics_port_for(50051, None) == 51051
    assert metrics_port_for(0, None) == 0
    assert metrics_port_for(65000, None) == 0
    assert metrics_port_for(50051, 9100) == 9100
    assert metrics_port_for(50051, -1) is None
    with pytest.raises(ValueError, match="metrics_port"):
        WorkerServerConfig(metrics_port=70000)


@pytest.mark.server
def test_one_access_log_line_per_finished_request(worker, caplog):
    _, channel = worker
    with caplog.at_level(logging.INFO, logger="kvmesh.worker"):
        _, _, msgs = collect(pb_grpc.WorkerStub(channel).Generate(
            request([1, 2, 3, 4, 5], request_id="trace-me-1", max_tokens=3, ignore_eos=True)))
    lines = [r.getMessage() for r in caplog.records if "trace-me-1" in r.getMessage()]
    f = msgs[-1]
    assert lines == [f"request trace-me-1 finished on w-metrics: prompt_tokens=5 cached_tokens={f.cached_tokens} "
                     f"completion_tokens=3 " + lines[0].split("completion_tokens=3 ", 1)[1]]
    assert re.search(r"ttft_s=\d+\.\d{4} e2e_s=\d+\.\d{4} finish_reason=length$", lines[0])

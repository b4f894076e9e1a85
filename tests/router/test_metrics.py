"""The router's /metrics (router/observe/metrics.py) on its HTTP port, scraped over real HTTP from a
real router over one real SmolLM2 worker: after a known sequence of gRPC requests (two with a
shared prefix) the counters equal what the clients were told."""
from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proto.kvmesh.v1 import kvmesh_pb2 as pb
from tests.router.test_router import LONG_PREFIX, Cluster, greedy, run_generate, summary
from tests.support.json_logs import json_logs
from tests.support.prometheus_server import Prometheus, needs_prometheus

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int | None) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    found = [v for (n, ls), v in samples.items() if n == name and dict(ls) == labels]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples in {sorted(n for n, _ in samples)}"
    return found[0]


@pytest.mark.server
def test_router_counters_equal_what_the_clients_were_told(web: Cluster) -> None:
    prompts = [LONG_PREFIX + "What is the capital of France?", LONG_PREFIX + "Which river flows through Vienna?",
               "Hi"]
    finals: list[pb.GenerateResponse] = []
    with grpc.insecure_channel(f"127.0.0.1:{web.grpc_port}") as ch:
        for text in prompts:
            finals.append(summary(run_generate(ch, pb.GenerateRequest(text=text, sampling=greedy(3))))[2])
    served = [f.cached_tokens - f.peer_cached_tokens for f in finals]
    assert served[1] > 0, "the shared prefix was not served from the worker's cache"
    worker_id = finals[0].worker_id
    policy = web.router.cfg.routing_policy.value
    s = scrape(web.http_port)
    reasons = [pb.FinishReason.Name(f.finish_reason).removeprefix("FINISH_REASON_").lower() for f in finals]
    for reason in set(reasons):
        assert value(s, "kvmesh:router_requests_total", worker_id=worker_id, policy=policy,
                     outcome=reason) == reasons.count(reason)
    assert value(s, "kvmesh:router_served_hit_tokens_total") == sum(served)
    # No Redis here, so no block index: the router predicts no hit, and every served hit is a mismatch.
    assert value(s, "kvmesh:router_predicted_hit_tokens_total") == 0
    assert value(s, "kvmesh:router_hit_mismatches_total") == sum(n != 0 for n in served)
    assert value(s, "kvmesh:router_routing_decision_seconds_count") == 3
    assert value(s, "kvmesh:router_routing_decision_seconds_bucket", le="+Inf") == 3
    assert 0 <= value(s, "kvmesh:router_routing_decision_seconds_sum") < 1
    assert value(s, "kvmesh:router_time_to_first_token_seconds_count", worker_id=worker_id) == 3
    assert value(s, "kvmesh:router_worker_up", worker_id=worker_id) == 1


def cluster_doc(port: int | None) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/cluster", timeout=10) as resp:
        return json.loads(resp.read())


@pytest.mark.server
def test_cluster_json_moves_by_what_one_request_did(web: Cluster) -> None:
    before = cluster_doc(web.http_port)
    with grpc.insecure_channel(f"127.0.0.1:{web.grpc_port}") as ch:
        final = summary(run_generate(ch, pb.GenerateRequest(text=LONG_PREFIX + "Name a Swiss river.",
                                                            sampling=greedy(2))))[2]
    after = cluster_doc(web.http_port)
    assert [w["worker_id"] for w in after["workers"]] == [final.worker_id]
    w0, w1 = before["workers"][0], after["workers"][0]
    assert w1["up"] and w1["num_running"] == w1["num_waiting"] == 0
    assert w1["prompt_tokens"] - w0["prompt_tokens"] == final.prompt_tokens
    assert w1["cached_prompt_tokens"] - w0["cached_prompt_tokens"] == final.cached_tokens > 0
    assert w1["hit_rate"] == w1["cached_prompt_tokens"] / w1["prompt_tokens"]
    assert 0 <= w1["kv_cache_usage"] <= 1
    r0, r1 = before["router"], after["router"]
    assert r1["served_hit_tokens"] - r0["served_hit_tokens"] == final.cached_tokens - final.peer_cached_tokens
    assert sum(r["count"] for r in r1["requests"]) - sum(r["count"] for r in r0["requests"]) == 1
    assert after["policy"] == web.router.cfg.routing_policy.value


@pytest.mark.server
def test_x_request_id_names_the_request_in_router_and_worker_logs(web: Cluster, caplog: Any) -> None:
    body = json.dumps({"model": "smollm2", "prompt": "Hello", "max_tokens": 2}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{web.http_port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json", "x-request-id": "trace-abc-42"})
    with caplog.at_level(logging.INFO):
        with urllib.request.urlopen(req, timeout=60) as resp:
            answer = json.loads(resp.read())
    assert answer["id"] == "trace-abc-42"
    lines = {r.name: r.getMessage() for r in caplog.records if "trace-abc-42" in r.getMessage()}
    usage = answer["usage"]
    for logger, worker_id in (("kvmesh.router", "worker-0"), ("kvmesh.worker", "worker-0")):
        assert lines[logger].startswith(f"request trace-abc-42 finished on {worker_id}: "
                                        f"prompt_tokens={usage['prompt_tokens']} "), lines
        assert f"completion_tokens={usage['completion_tokens']} " in lines[logger]
    bad = urllib.request.Request(f"http://127.0.0.1:{web.http_port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json", "x-request-id": "has space"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(bad, timeout=60)
    assert e.value.code == 400


@pytest.mark.server
def test_tenant_counts_and_cluster_json_agree(web: Cluster) -> None:
    """Without API keys every client is the tenant `default`: each generating request, HTTP or
    gRPC, counts once in /metrics and in /v1/cluster."""
    def admitted() -> float:
        return scrape(web.http_port).get(("kvmesh:router_tenant_requests_total",
                                          frozenset({("tenant", "default"), ("outcome", "admitted")})), 0.0)
    before = admitted()
    with grpc.insecure_channel(f"127.0.0.1:{web.grpc_port}") as ch:
        summary(run_generate(ch, pb.GenerateRequest(text="One", sampling=greedy(1))))
    body = json.dumps({"model": "smollm2", "prompt": "Two", "max_tokens": 1}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{web.http_port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60):
        pass
    assert admitted() == before + 2
    tenants = cluster_doc(web.http_port)["router"]["tenants"]
    assert tenants == [{"tenant": "default", "admitted": before + 2, "rejected": 0}]


@pytest.mark.server
def test_request_id_on_every_router_and_worker_json_line(web: Cluster) -> None:
    """With the JSON log format, every line logged while serving a request carries its id (a
    contextvar), in the router and, through gRPC metadata, in the worker."""
    with json_logs() as logs:
        body = json.dumps({"model": "smollm2", "prompt": "Hello", "max_tokens": 2, "no_such_field": 1}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{web.http_port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json", "x-request-id": "json-trace-9"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert json.loads(resp.read())["id"] == "json-trace-9"
    lines = logs.lines
    traced = {d["logger"] for d in lines if d.get("request_id") == "json-trace-9"}
    assert {"kvmesh.router", "kvmesh.worker"} <= traced, lines
    assert all(d.get("request_id") == "json-trace-9" for d in lines if "json-trace-9" in d["msg"])
    unknown = [d for d in lines if "no_such_field" in d["msg"]]      # logged before routing, by the front
    assert unknown and all(d.get("request_id") == "json-trace-9" for d in unknown), lines


@pytest.mark.multiproc
@pytest.mark.server
@needs_prometheus
def test_real_prometheus_scrapes_the_router_and_promql_gives_the_hit_rate(web: Cluster, tmp_path: Path) -> None:
    """Debian's prometheus scrapes the router's /metrics every second (generated config); a PromQL
    query over its HTTP API returns the hit rate the clients were told: served cached tokens over
    prompt tokens."""
    prom = Prometheus(tmp_path, [f"http://127.0.0.1:{web.http_port}/metrics"])
    try:
        prom.wait(prom.targets_up, "the router target up")
        with grpc.insecure_channel(f"127.0.0.1:{web.grpc_port}") as ch:
            for q in ("Name a lake in Italy.", "Name a lake in Austria."):
                summary(run_generate(ch, pb.GenerateRequest(text=LONG_PREFIX + q, sampling=greedy(1))))
        s = scrape(web.http_port)          # everything this module's requests did, as the router counts it
        served = sum(v for (n, _), v in s.items() if n == "kvmesh:router_served_hit_tokens_total")
        prompt = sum(v for (n, _), v in s.items() if n == "kvmesh:router_prompt_tokens_total")
        assert served > 0 and prompt > served
        hit_rate = "sum(kvmesh:router_served_hit_tokens_total) / sum(kvmesh:router_prompt_tokens_total)"
        got = prom.wait(lambda: prom.scalar(hit_rate) == served / prompt or None, "the expected hit rate")
        assert got is True
        assert prom.scalar('kvmesh:router_worker_up{worker_id="worker-0"}') == 1.0
    finally:
        prom.stop()

"""`kvmesh serve --log-format json` (one real cluster: redis, a worker and a router as real
processes): the banner prints the dashboard URL and the router's and each worker's /metrics
URL; both answer with counters that equal what a client was told; a real Prometheus scraping
them returns the expected prefix-cache hit rate through PromQL; the router's block-index event
metrics move; every child logs JSON lines, and one request's id names its lines in the router's
and the worker's log."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_serve import ROOT, _launch_serve
from tests.support.prometheus_server import Prometheus, needs_prometheus

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]
PREFIX = ("You are a careful assistant. Answer every question about European geography in one short "
          "sentence, and never add anything else. ") * 2


def _samples(url: str) -> dict[str, float]:
    """name{labels} without model_name/worker_id -> value, summed over those labels."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            rest = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "worker_id"))
            key = f"{s.name}{{{rest}}}"
            out[key] = out.get(key, 0.0) + s.value
    return out


def _client(target: str, prompt: str, request_id: str) -> dict[str, Any]:
    client = subprocess.run([sys.executable, "-m", "kvmesh.cli", "client", "generate", "--target", target, "--json",
                             "--max-tokens", "4", "--request-id", request_id, prompt],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert client.returncode == 0, client.stderr
    return dict(json.loads(client.stdout))


def _json_lines(path: Path) -> list[dict[str, Any]]:
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    parsed = []
    for line in lines:
        if line.startswith("{"):
            parsed.append(json.loads(line))
    return parsed


@needs_prometheus
def test_serve_metrics_prometheus_and_json_logs(tmp_path: Path) -> None:
    name = f"kvmesh-test-{uuid.uuid4().hex[:8]}"
    launched = _launch_serve(tmp_path, name, "--log-format", "json")
    prom = None
    try:
        text = launched.out.read_text()
        router_url = re.search(r"^\s+metrics\s+(http://\S+/metrics) \(router\)$", text, re.M)
        worker_url = re.search(r"^\s+(http://\S+/metrics) \(worker-0\)$", text, re.M)
        dashboard = re.search(r"^\s+dashboard\s+(http://\S+/dashboard)$", text, re.M)
        assert router_url and worker_url and dashboard, text
        with urllib.request.urlopen(dashboard.group(1), timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith("text/html")
        prom = Prometheus(tmp_path, [router_url.group(1), worker_url.group(1)])
        results = [_client(launched.grpc_target, PREFIX + q, f"serve-trace-{i}")
                   for i, q in enumerate(("Name a river in France.", "Name a river in Spain."))]
        assert results[1]["num_cached_tokens"] > 0, results
        worker = _samples(worker_url.group(1))
        assert worker["kvmesh:prompt_tokens_total{}"] == sum(r["prompt_tokens"] for r in results)
        assert worker["kvmesh:prefix_cache_hits_total{}"] == sum(r["num_cached_tokens"] for r in results)
        router = _samples(router_url.group(1))
        assert sum(v for k, v in router.items() if k.startswith("kvmesh:router_requests_total{")) == 2
        expected = sum(r["num_cached_tokens"] for r in results) / sum(r["prompt_tokens"] for r in results)
        hit_rate = "sum(kvmesh:prefix_cache_hits_total) / sum(kvmesh:prefix_cache_queries_total)"
        # 0 (or no data) until a scrape after the second request, which is the only one with hits
        assert prom.wait(lambda: prom.scalar(hit_rate), "a non-zero PromQL hit rate", 60) == expected
        prom.wait(lambda: prom.scalar('kvmesh:router_worker_up{worker_id="worker-0"}') == 1.0, "worker up")
        # Redis-fed block index: the worker's events were applied, it was asked for an inventory
        # once (a new worker), and once idle the index is not behind its stream.
        prom.wait(lambda: (prom.scalar("sum(kvmesh:router_kv_events_total)") or 0) > 0, "kv events applied")
        assert (prom.scalar("sum(kvmesh:router_kv_event_resyncs_total)") or 0) >= 1
        prom.wait(lambda: prom.scalar('kvmesh:router_kv_event_lag_seconds{worker_id="worker-0"}') == 0.0, "no lag")
        launched.proc.send_signal(signal.SIGTERM)
        assert launched.proc.wait(timeout=20) == 0, launched.err.read_text()
        logs = tmp_path / f"{name}-logs"
        for part in ("router", "worker-0"):
            lines = _json_lines(logs / f"{part}.log")
            assert lines and all({"ts", "level", "logger", "msg"} <= set(d) for d in lines), part
            mine = [d for d in lines if d.get("request_id") == "serve-trace-1"]
            assert any(d["msg"].startswith("request serve-trace-1 finished on worker-0") for d in mine), (part, lines)
    finally:
        if prom is not None:
            prom.stop()
        if launched.proc.poll() is None:
            launched.proc.kill()
            launched.proc.wait()

"""`kvmesh serve` prints the router's and each worker's /metrics URL in its banner, and both
answer with counters that equal what a client was told (one real cluster, real processes)."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_serve import ROOT, _launch_serve

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


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


def test_serve_banner_metrics_urls_answer(tmp_path: Path) -> None:
    launched = _launch_serve(tmp_path, f"kvmesh-test-{uuid.uuid4().hex[:8]}")
    try:
        text = launched.out.read_text()
        router_url = re.search(r"^\s+metrics\s+(http://\S+/metrics) \(router\)$", text, re.M)
        worker_url = re.search(r"^\s+(http://\S+/metrics) \(worker-0\)$", text, re.M)
        assert router_url and worker_url, text
        client = subprocess.run([sys.executable, "-m", "router.cli", "client", "generate", "--target",
                                 launched.grpc_target, "--json", "--max-tokens", "4", "Hello, my name is"],
                                cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert client.returncode == 0, client.stderr
        result = json.loads(client.stdout)
        worker = _samples(worker_url.group(1))
        assert worker["kvmesh:prompt_tokens_total{}"] == result["prompt_tokens"]
        assert worker["kvmesh:generation_tokens_total{}"] == result["completion_tokens"]
        router = _samples(router_url.group(1))
        assert sum(v for k, v in router.items() if k.startswith("kvmesh:router_requests_total{")) == 1
        deadline = time.monotonic() + 10
        while _samples(router_url.group(1)).get("kvmesh:router_worker_up{}") != 1.0:
            assert time.monotonic() < deadline, "router_worker_up never 1"
            time.sleep(0.2)
        launched.proc.send_signal(signal.SIGTERM)
        assert launched.proc.wait(timeout=20) == 0, launched.err.read_text()
    finally:
        if launched.proc.poll() is None:
            launched.proc.kill()
            launched.proc.wait()

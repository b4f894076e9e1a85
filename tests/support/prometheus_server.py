"""A real Prometheus (Debian's `prometheus` package, /usr/bin/prometheus) for tests: a child
process on a free 127.0.0.1 port with a generated config that scrapes the given /metrics URLs
every second, its TSDB in a temp dir. `query` runs PromQL over its HTTP API.

Tests that need it are skipped when the binary is missing (`make setup` installs it).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.support.redis_server import free_port

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
needs_prometheus = pytest.mark.skipif(not Path(PROMETHEUS).exists(),
                                      reason="needs Debian's prometheus (make setup installs it)")


class Prometheus:
    """`prometheus` scraping `targets` (http://host:port/metrics URLs, one job each) every
    `interval_s` (also the scrape timeout: a loaded 2-core machine answers slowly)."""

    def __init__(self, workdir: Path, targets: Sequence[str], interval_s: int = 2) -> None:
        self.workdir, self.port = workdir, free_port()
        jobs = []
        for i, url in enumerate(targets):
            parsed = urllib.parse.urlparse(url)
            jobs.append({"job_name": f"kvmesh-{i}", "scrape_interval": f"{interval_s}s",
                         "scrape_timeout": f"{interval_s}s",
                         "metrics_path": parsed.path, "static_configs": [{"targets": [parsed.netloc]}]})
        self.config = workdir / "prometheus.yml"
        self.config.write_text(json.dumps({"scrape_configs": jobs}))  # JSON is YAML
        self.log = workdir / "prometheus.log"
        with open(self.log, "wb") as log:
            self._proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={self.config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        self.wait(lambda: self._get("/-/ready") is not None, "ready", 30)

    def _get(self, path: str) -> Any:
        if self._proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self._proc.returncode}: {self.log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as resp:
                body = resp.read()
        except OSError:
            return None
        return json.loads(body) if path.startswith("/api/") else body

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's result vector (each: metric labels and [ts, "value"])."""
        doc = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        assert doc is not None and doc["status"] == "success", doc
        return list(doc["data"]["result"])

    def scalar(self, promql: str) -> float | None:
        """The value of a one-element result (None: empty)."""
        result = self.query(promql)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None

    def targets_up(self) -> bool:
        doc = self._get("/api/v1/targets")
        active = doc["data"]["activeTargets"] if doc else []
        return bool(active) and all(t["health"] == "up" for t in active)

    def wait(self, check: Callable[[], Any], what: str, timeout_s: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            got = check()
            if got:
                return got
            if time.monotonic() > deadline:
                doc = self._get("/api/v1/targets")
                health = ([(t["scrapeUrl"], t["health"], t["lastError"]) for t in doc["data"]["activeTargets"]]
                          if doc else [])
                raise AssertionError(f"prometheus: {what} within {timeout_s} s (last: {got!r}); targets {health}; "
                                     f"log:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

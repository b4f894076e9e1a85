"""helm/kvmesh monitoring: the workers' PodMonitor next to the router's
ServiceMonitor (same switch, only with the Prometheus Operator API), the Grafana dashboard
ConfigMap (label grafana_dashboard: "1"), and every metric its queries name is one kvmesh
exports (names taken from real `WorkerMetrics` / `RouterMetrics` registries)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvstore.metadata.streams import ConsumerStats
from router.config import RouterConfig
from router.observe.metrics import RouterMetrics
from router.routing.core import Router
from router.workers.registry import WorkerRegistry
from tests.helm.manifests import CHART, NAMESPACE, container, matches, one, pod_labels, render, run_helm, validate_all
from worker.engine.config import EngineStats
from worker.server.metrics import PeerTotals, WorkerMetrics

MONITORING = ("monitoring.coreos.com/v1",)


@pytest.mark.multiproc
def test_pod_monitor_scrapes_the_workers_metrics_port(helm: Path, tmp_path: Path) -> None:
    on = {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}
    r = render(helm, tmp_path / "on", on, api_versions=MONITORING)   # (PodMonitor: a CRD, no schema here)
    pm, worker = one(r.docs, "PodMonitor"), one(r.docs, "StatefulSet", "worker")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1" and pm["metadata"]["labels"]["release"] == "prom"
    assert matches(pm["spec"]["selector"]["matchLabels"], pod_labels(worker))
    assert pm["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    ports = {p["name"]: p["containerPort"] for p in container(worker)["ports"]}
    assert endpoint["port"] == "metrics" and ports["metrics"] == 9061 and endpoint["path"] == "/metrics"
    policy = next(d for d in r.docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("worker"))
    assert {"ports": [{"port": "metrics", "protocol": "TCP"}]} in policy["spec"]["ingress"]
    assert not [d for d in render(helm, tmp_path / "no-crd", on).docs if d["kind"] == "PodMonitor"]
    off = render(helm, tmp_path / "off", {"serviceMonitor": {"enabled": True}, "worker": {"metricsPort": -1}},
                 api_versions=MONITORING)
    assert not [d for d in off.docs if d["kind"] == "PodMonitor"] and one(off.docs, "ServiceMonitor")
    notes = run_helm(helm, "install", "kvm", str(CHART), "--dry-run=client", "--set", "serviceMonitor.enabled=true")
    assert "no ServiceMonitor was created (nor the workers' PodMonitor)" in notes.stdout


def exported_names() -> set[str]:
    """Every family name a worker (with a host tier, peers and token eviction) and a router
    (with a Redis consumer) export."""
    w = WorkerMetrics("m", "w0", "auto", eviction_policy="h2o")
    w.update_stats(EngineStats(1, 0, 3, 5, 8, 1, 1, 0), PeerTotals(1, 0, 0, 0, 10))
    cfg = RouterConfig(worker_addresses=("127.0.0.1:1",))

    async def no_op(ready: bool) -> None:
        return None
    registry = WorkerRegistry(cfg, no_op)
    router = Router(cfg, registry)

    class Consumer:     # what the collector reads of an EventConsumer
        def stats(self) -> ConsumerStats:
            return ConsumerStats(False, 1, 2, 0, 0, 0, 1, 0, 0)
    registry.consumer = Consumer()  # type: ignore[assignment]
    rm = RouterMetrics(router)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {fam.name + suffix for reg in (w.registry, rm.registry, rm.tenant_registry(None)) for fam in reg.collect()
            for suffix in suffixes[fam.type]}


@pytest.mark.multiproc
def test_grafana_dashboard_configmap_queries_exported_metrics(helm: Path, tmp_path: Path) -> None:
    r = render(helm, tmp_path, {"grafanaDashboard": {"enabled": True, "namespace": "monitoring"}})
    validate_all(r)
    (cm,) = [d for d in r.docs if d["kind"] == "ConfigMap" and d["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert cm["metadata"]["namespace"] == "monitoring"
    dash = json.loads(cm["data"]["kvmesh.json"])
    assert dash["title"] == "kvmesh" and len(dash["panels"]) >= 10
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"kvmesh:[a-z0-9_]+", e)}
    missing = used - exported_names()
    assert not missing, f"the dashboard queries metrics nobody exports: {sorted(missing)}"
    assert {"kvmesh:prefix_cache_hits_total", "kvmesh:kv_cache_usage_perc", "kvmesh:router_worker_up",
            "kvmesh:time_to_first_token_seconds_bucket"} <= used
    default = render(helm, tmp_path / "default")
    assert not [d for d in default.docs if d["metadata"].get("labels", {}).get("grafana_dashboard")]

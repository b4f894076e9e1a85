"""helm/kvmesh values and the command line: prove with the real CLI parser that every
engine/worker/router value reaches the containers' command lines, and that values.yaml has a
value for every `kvmesh worker`/`kvmesh router` option.

Needs .tools/bin/helm (scripts/install-helm.sh; `make setup` runs it).
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.manifests import (
    CHART,
    NAMESPACE,
    RELEASE,
    Doc,
    container,
    env_value,
    kvmesh_parser,
    one,
    parse_cli,
    render,
    snake,
)

# Every engine/worker/router value set to something other than both the chart's and the CLI's
# defaults, so a value that never reaches the command line cannot pass by coincidence.
ALL_VALUES: Doc = {
    "clusterName": "cluster-x",
    "engine": {"model": "/models/llama-3-8b", "device": "cuda:1", "dtype": "bf16", "blockSize": 32,
               "kvCacheDtype": "int8", "kvCacheMemoryGib": 7.5, "numBlocks": 12345, "memoryGib": 20.5,
               "enablePrefixCaching": False,
               "maxNumSeqs": 17, "maxNumBatchedTokens": 1048576, "maxModelLen": 4096, "kvOffloadGib": 3,
               "fairShare": "off", "fairStepTokens": 64, "prefillChunkTokens": 128, "decodeStepPrefillTokens": 24,
               "tenantMaxCachedFrac": 0.25, "roomWaitSteps": 5,
               "kvDiskGib": 7, "kvDiskWriteThrough": False, "weightDtype": "q8_0",
               "kvDisk": {"mountPath": "/data/kv", "volume": "pvc", "hostPath": "/mnt/kv",
                          "storageClassName": "fast", "size": "20Gi"},
               "kvEviction": "h2o", "kvBudget": 1024, "attentionSinks": 8,
               "h2oDecay": 0.9, "attentionBackend": "triton", "enforceEager": True,
               "threads": 3},
    "worker": {"replicas": 3, "port": 50099, "distPort": 29999, "drainTimeoutS": 12.5,
               "terminationGracePeriodSeconds": 40, "metricsPort": 9999, "logFormat": "json", "preStopSleepS": 3,
               "liveness": {"timeoutS": 45.5, "maxStepFailures": 7}, "drainHandover": False, "warmStartMbS": 64.5},
    "router": {"replicas": 1, "grpcPort": 50111, "httpPort": 8111, "routingPolicy": "least_loaded", "loadFactor": 1.5,
               "servedModelName": "llama-3-8b-instruct",
               "maxConcurrentPerTenant": 7, "metricsTenantNames": True, "maxTokensLimit": 512, "logFormat": "json",
               "migrationLimit": 5, "drainTimeoutS": 17.5,
               "preStopSleepS": 2, "terminationGracePeriodSeconds": 33, "tokenizerSource": "local",
               "disaggMinPromptTokens": 300, "disaggTransferTimeoutS": 7.5, "sharePending": True,
               "pickLog": "/var/cache/kvmesh/picks.jsonl"},
}
# Values whose flag is spelled differently from the camelCase rule.
FLAG_OF = {("worker", "port"): "port", ("worker", "drainTimeoutS"): "drain_timeout_s",
           ("router", "drainTimeoutS"): "drain_timeout_s", ("worker", "liveness.timeoutS"): "liveness_timeout_s",
           ("worker", "liveness.maxStepFailures"): "max_step_failures", ("engine", "kvDisk.mountPath"): "kv_disk_path"}
NOT_FLAGS = {("worker", "replicas"), ("worker", "distPort"), ("worker", "terminationGracePeriodSeconds"),
             ("router", "replicas"), ("worker", "preStopSleepS"), ("router", "preStopSleepS"),
             ("router", "terminationGracePeriodSeconds"), ("engine", "kvDisk.volume"), ("engine", "kvDisk.hostPath"),
             ("engine", "kvDisk.storageClassName"), ("engine", "kvDisk.size")}


# -- every value reaches the command line ------------------------------------------------

def expected_flags(section: str) -> Iterator[tuple[str, str, Any]]:
    """(value name, Namespace attribute, value) for every rendered value of a section."""
    flat = {f"{key}.{k}" if isinstance(value, dict) else key: v
            for key, value in ALL_VALUES[section].items()
            for k, v in (value.items() if isinstance(value, dict) else [(key, value)])}
    for key, value in flat.items():
        if (section, key) in NOT_FLAGS:
            continue
        yield key, FLAG_OF.get((section, key), snake(key)), value


@pytest.mark.multiproc
def test_every_value_reaches_the_command_line(helm: Path, tmp_path: Path) -> None:
    r = render(helm, tmp_path, ALL_VALUES)
    worker_ns = parse_cli(container(one(r.docs, "StatefulSet", "worker")))
    router_ns = parse_cli(container(one(r.docs, "Deployment", "router")))
    defaults = {"worker": kvmesh_parser().parse_args(["worker"]), "router": kvmesh_parser().parse_args(["router"])}
    assert (worker_ns.command, router_ns.command) == ("worker", "router")

    checks = [("worker", worker_ns, k, attr, v) for k, attr, v in expected_flags("engine")]
    checks += [("worker", worker_ns, k, attr, v) for k, attr, v in expected_flags("worker")]
    checks += [("router", router_ns, k, attr, v) for k, attr, v in expected_flags("router")]
    checks += [(cmd, ns, "clusterName", "cluster_name", ALL_VALUES["clusterName"])
               for cmd, ns in (("worker", worker_ns), ("router", router_ns))]
    checks.append(("router", router_ns, "engine.model", "model", ALL_VALUES["engine"]["model"]))
    for cmd, ns, key, attr, value in checks:
        assert getattr(defaults[cmd], attr) != value, f"{key}: pick a non-default test value"
        assert getattr(ns, attr) == value, f"kvmesh {cmd}: {key}={value!r} rendered as {attr}={getattr(ns, attr)!r}"

    w = ALL_VALUES["worker"]
    assert worker_ns.host == router_ns.host == "0.0.0.0"
    assert worker_ns.worker_id == "$(POD_NAME)"
    assert worker_ns.advertise_address == (
        f"$(POD_NAME).{RELEASE}-kvmesh-worker-headless.{NAMESPACE}.svc.cluster.local:{w['port']}")
    assert router_ns.worker == []       # the router admits the workers registered in Redis
    redis = f"redis://:$(KVMESH_REDIS_PASSWORD)@{RELEASE}-kvmesh-redis.{NAMESPACE}.svc.cluster.local:6379/0"
    assert worker_ns.redis_url is router_ns.redis_url is None      # in the environment: no password in ps
    for kind, component in (("StatefulSet", "worker"), ("Deployment", "router")):
        assert env_value(container(one(r.docs, kind, component)), "KVMESH_REDIS_URL") == redis


# Options the chart sets itself (addresses, identity) or leaves at the CLI default on purpose.
CHART_OWNED = {"command", "run", "host", "worker_id", "advertise_address", "redis_url", "worker",
               "no_http",  # router: the chart always serves HTTP (Service port, HPA, ServiceMonitor)
               "peer_transfer", "transfer_port",  # worker: set through KVMESH_* env (configmap)
               "api_key", "api_keys_file", "cluster_token", "metrics_require_key",  # `security`: Secrets, env
               "tls_cert", "tls_key", "tls_ca", "tls_server_name",  # (tests/helm/test_chart_security.py)
               "role",  # worker: each pool's own (tests/helm/test_chart_pools.py)
               "cpu_affinity"}  # worker: in Kubernetes the kubelet's CPU manager pins a pod's CPUs


def test_values_cover_every_cli_option() -> None:
    """values.yaml has an engine value for every engine flag, and the test sets each of them; a new
    `kvmesh worker`/`kvmesh router` option fails here until the chart has a value for it."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values["engine"]) == set(ALL_VALUES["engine"]), "ALL_VALUES must set every engine value"
    for cmd in ("worker", "router"):
        covered = {attr for section in (("engine", "worker") if cmd == "worker" else ("router",))
                   for _, attr, _ in expected_flags(section)} | {"cluster_name", "model"}
        options = set(vars(kvmesh_parser().parse_args([cmd])))
        assert options - covered - CHART_OWNED == set(), f"kvmesh {cmd} options without a chart value"


@pytest.mark.multiproc
def test_enable_prefix_caching_both_ways(helm: Path, tmp_path: Path) -> None:
    for on in (True, False):
        r = render(helm, tmp_path / str(on), {"engine": {"enablePrefixCaching": on}})
        assert parse_cli(container(one(r.docs, "StatefulSet", "worker"))).enable_prefix_caching is on

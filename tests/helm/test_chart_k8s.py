"""helm/kvmesh for real GPU pools: no static worker list and no worker count the
other manifests depend on, a router without model storage, liveness apart from readiness,
placement (soft spread, runtime class, scheduler, priority), image digests, and worker
autoscaling (KEDA ScaledObject only where its API exists, or an HPA on prometheus-adapter's
metric). Every rendered set goes through `kubernetes-validate --strict` (the ScaledObject, a CRD
without a schema there, is checked by check_scaled_object).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from contracts.health import LIVENESS_SERVICE
from tests.helm.manifests import (
    AUTOSCALING_EXAMPLE,
    CHART,
    GPU_EXAMPLE,
    KEDA,
    NAMESPACE,
    RELEASE,
    Doc,
    check_references,
    container,
    kvmesh_parser,
    matches,
    one,
    parse_cli,
    pod_labels,
    probe_spec,
    render,
    run_helm,
    subcommands,
    validate_all,
)
from tests.helm.test_monitoring import exported_names

WORKER_STS = f"{RELEASE}-kvmesh-worker"
DIGEST = "sha256:" + "ab12" * 16


def _pod_spec(w: Doc) -> Doc:
    spec: Doc = w["spec"]["template"]["spec"] if "template" in w["spec"] else w["spec"]
    return spec


def _fails(helm: Path, *args: str) -> str:
    proc = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)
    assert proc.returncode != 0, f"rendered: {args}"
    return proc.stderr


def test_issue24_flags_are_in_the_cli() -> None:
    """The chart renders --liveness-timeout-s, --max-step-failures (worker) and --tokenizer-source (router)."""
    subs = subcommands(kvmesh_parser())
    assert {"--liveness-timeout-s", "--max-step-failures"} <= set(subs["worker"]._option_string_actions)
    assert "--tokenizer-source" in subs["router"]._option_string_actions


# -- 1. membership: the registry, not a list --------------------------------------------

@pytest.mark.multiproc
def test_router_gets_no_worker_list_and_nothing_depends_on_the_count(helm: Path, tmp_path: Path) -> None:
    renders = {n: render(helm, tmp_path / str(n), {"worker": {"replicas": n}}) for n in (1, 2, 5)}
    router = container(one(renders[2].docs, "Deployment", "router"))
    assert parse_cli(router).worker == [] and not any("--worker=" in a for a in router["args"])
    assert "--redis-url" not in " ".join(router["args"]) and any(e["name"] == "KVMESH_REDIS_URL" for e in router["env"])
    cm = one(renders[2].docs, "ConfigMap")["data"]
    assert not {k for k in cm if "RANK" in k or "WORLD" in k or "DIST_INIT" in k}
    assert not any("RANK" in e["name"] or "WORLD" in e["name"]
                   for e in container(one(renders[2].docs, "StatefulSet", "worker"))["env"])

    assert one(renders[5].docs, "StatefulSet", "worker")["spec"]["replicas"] == 5

    def without_count(docs: list[Doc]) -> list[Doc]:
        for d in docs:
            if d["kind"] == "StatefulSet" and d["metadata"]["name"] == WORKER_STS:
                d["spec"].pop("replicas")
            if d["kind"] == "Secret":       # generated tokens differ per render
                d.pop("data")
        return docs
    one_worker = without_count(renders[1].docs)
    for n in (2, 5):      # router, PDBs, NetworkPolicies, Services, ConfigMap: the same for any count
        assert without_count(renders[n].docs) == one_worker, f"a manifest depends on worker.replicas={n}"


@pytest.mark.multiproc
def test_router_needs_redis(helm: Path) -> None:
    # The schema says it first; without the schema, the template says it in words.
    assert "at '/redis/external/url'" in _fails(helm, "--set", "redis.enabled=false")
    err = _fails(helm, "--skip-schema-validation", "--set", "redis.enabled=false")
    assert "the router learns its workers from the Redis worker registry" in err


# -- 2. a router without model storage -------------------------------------------------

@pytest.mark.multiproc
def test_router_mounts_no_model_volume(helm: Path, tmp_path: Path) -> None:
    values: Doc = {"modelCache": {"type": "pvc", "existingClaim": "llm-models"},
                   "worker": {"nodeSelector": {"gpu": "h100"}},
                   "router": {"nodeSelector": {"pool": "cpu"}, "tolerations": []}}
    r = render(helm, tmp_path, values)
    validate_all(r)
    check_references(r.docs)
    router = one(r.docs, "Deployment", "router")
    spec, c = _pod_spec(router), container(router)
    assert parse_cli(c).tokenizer_source == "worker"
    assert "models" not in {v["name"] for v in spec["volumes"]} | {m["name"] for m in c["volumeMounts"]}
    assert "llm-models" not in yaml.safe_dump(router)
    cache = next(v for v in spec["volumes"] if v["name"] == "cache")
    assert "emptyDir" in cache
    cm = one(r.docs, "ConfigMap")["data"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "cache"]
    assert not mount.get("readOnly") and mount["mountPath"] == "/var/cache/kvmesh"
    assert cm["HOME"] == mount["mountPath"] and cm["KVMESH_CACHE_DIR"].startswith(mount["mountPath"] + "/")
    assert {"configMapRef": {"name": f"{RELEASE}-kvmesh-env"}} in c["envFrom"]
    assert spec["nodeSelector"] == {"pool": "cpu"} and "tolerations" not in spec   # its own, not the GPU ones
    worker = _pod_spec(one(r.docs, "StatefulSet", "worker"))
    models = next(v for v in worker["volumes"] if v["name"] == "models")
    assert models["persistentVolumeClaim"]["claimName"] == "llm-models"
    local = render(helm, tmp_path / "local", {**values, "router": {"tokenizerSource": "local"}})
    router = one(local.docs, "Deployment", "router")
    assert parse_cli(container(router)).tokenizer_source == "local"
    assert "models" in {v["name"] for v in _pod_spec(router)["volumes"]}
    check_references(local.docs)


# -- 3. liveness apart from readiness --------------------------------------------------

@pytest.mark.multiproc
def test_worker_liveness_is_the_engine_and_readiness_the_service(helm: Path, tmp_path: Path) -> None:
    assert (CHART / "templates" / "_helpers.tpl").read_text().count(LIVENESS_SERVICE) == 1
    r = render(helm, tmp_path, {"worker": {"liveness": {"timeoutS": 20, "maxStepFailures": 2}}})
    c = container(one(r.docs, "StatefulSet", "worker"))
    ns = parse_cli(c)
    assert (ns.liveness_timeout_s, ns.max_step_failures) == (20, 2)
    assert probe_spec(c, "livenessProbe") == {"grpc": {"port": ns.port, "service": LIVENESS_SERVICE}}
    for probe in ("startupProbe", "readinessProbe"):
        assert probe_spec(c, probe) == {"grpc": {"port": ns.port, "service": "kvmesh.v1.Worker"}}
    router = container(one(r.docs, "Deployment", "router"))
    port = parse_cli(router).grpc_port
    assert probe_spec(router, "livenessProbe") == {"grpc": {"port": port, "service": LIVENESS_SERVICE}}
    assert probe_spec(router, "readinessProbe") == {"grpc": {"port": port, "service": "kvmesh.v1.Router"}}


@pytest.mark.multiproc
def test_tls_probes_use_the_plain_http_metrics_port(helm: Path, tmp_path: Path) -> None:
    tls: Doc = {"security": {"tls": {"enabled": True, "existingSecret": "kv-tls"}}, "worker": {"metricsPort": 9555}}
    r = render(helm, tmp_path, tls)
    validate_all(r)
    check_references(r.docs)
    c = container(one(r.docs, "StatefulSet", "worker"))
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"] == parse_cli(c).metrics_port == 9555
    assert probe_spec(c, "livenessProbe") == {"httpGet": {"path": "/livez", "port": "metrics"}}
    assert probe_spec(c, "readinessProbe") == {"httpGet": {"path": "/readyz", "port": "metrics"}}
    router = container(one(r.docs, "Deployment", "router"))
    assert probe_spec(router, "livenessProbe") == {"httpGet": {"path": "/livez", "port": "http", "scheme": "HTTPS"}}
    # No metrics port under TLS: only "the port is open", and NOTES says what that loses.
    off = render(helm, tmp_path / "off", {**tls, "worker": {"metricsPort": -1}})
    c = container(one(off.docs, "StatefulSet", "worker"))
    assert all(probe_spec(c, p) == {"tcpSocket": {"port": "grpc"}} for p in ("livenessProbe", "readinessProbe"))
    notes = run_helm(helm, "install", RELEASE, str(CHART), "--dry-run=client", "--set", "security.tls.enabled=true",
                     "--set", "security.tls.existingSecret=kv-tls", "--set", "worker.metricsPort=-1")
    assert notes.returncode == 0, notes.stderr
    assert "a stuck engine is not restarted" in notes.stdout


@pytest.mark.multiproc
@pytest.mark.parametrize("values,message", [
    ({"worker": {"liveness": {"timeoutS": 0, "maxStepFailures": 3}}}, "/worker/liveness/timeoutS"),
    ({"worker": {"liveness": {"timeoutS": 60, "maxStepFailures": 0}}}, "/worker/liveness/maxStepFailures"),
    ({"router": {"tokenizerSource": "remote"}}, "/router/tokenizerSource"),
])
def test_schema_rejects_bad_liveness_and_tokenizer_values(helm: Path, tmp_path: Path, values: Doc,
                                                          message: str) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(values))
    assert message in _fails(helm, "-f", str(f))


# -- 4. placement and images ------------------------------------------------------------

@pytest.mark.multiproc
def test_workers_spread_softly_by_default(helm: Path, tmp_path: Path) -> None:
    r = render(helm, tmp_path)
    sts = one(r.docs, "StatefulSet", "worker")
    spec = _pod_spec(sts)
    assert "affinity" not in spec, "no anti-affinity by default: several workers may share a node"
    (spread,) = spec["topologySpreadConstraints"]
    assert {k: spread[k] for k in ("maxSkew", "topologyKey", "whenUnsatisfiable")} == {
        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}
    assert matches(spread["labelSelector"]["matchLabels"], pod_labels(sts))
    other = {**pod_labels(sts), "app.kubernetes.io/component": "x"}
    assert matches(spread["labelSelector"]["matchLabels"], other) is False
    none = _pod_spec(one(render(helm, tmp_path / "none", {"worker": {"topologySpread": "none"}}).docs,
                         "StatefulSet", "worker"))
    assert "topologySpreadConstraints" not in none
    own = [{"maxSkew": 2, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {"a": "b"}}}]
    custom = _pod_spec(one(render(helm, tmp_path / "own", {"worker": {"topologySpreadConstraints": own}}).docs,
                           "StatefulSet", "worker"))
    assert custom["topologySpreadConstraints"] == own
    hard = _pod_spec(one(render(helm, tmp_path / "hard", {"worker": {"podAntiAffinity": "hard"}}).docs,
                         "StatefulSet", "worker"))
    assert hard["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]


@pytest.mark.multiproc
def test_runtime_class_scheduler_and_priority(helm: Path, tmp_path: Path) -> None:
    fields = ("runtimeClassName", "schedulerName", "priorityClassName")
    values: Doc = {"worker": {"runtimeClassName": "nvidia", "schedulerName": "volcano",
                              "priorityClassName": "gpu-high"},
                   "router": {"runtimeClassName": "runc", "schedulerName": "default-scheduler",
                              "priorityClassName": "serving"}}
    r = render(helm, tmp_path, values)
    validate_all(r)
    for kind, part in (("StatefulSet", "worker"), ("Deployment", "router")):
        spec = _pod_spec(one(r.docs, kind, part))
        assert {f: spec[f] for f in fields} == values[part], part
        default = _pod_spec(one(render(helm, tmp_path / "default").docs, kind, part))
        assert not set(fields) & set(default), f"{part}: empty values must not render"


@pytest.mark.multiproc
def test_image_digest_renders_repo_at_digest(helm: Path, tmp_path: Path) -> None:
    r = render(helm, tmp_path, {"image": {"workerDigest": DIGEST, "routerDigest": DIGEST.replace("ab12", "cd34"),
                                          "workerTag": "ignored"}})
    validate_all(r)
    worker = container(one(r.docs, "StatefulSet", "worker"))["image"]
    assert worker == f"ghcr.io/kvmesh/kvmesh@{DIGEST}"
    router_image = f"ghcr.io/kvmesh/kvmesh@{DIGEST.replace('ab12', 'cd34')}"
    assert container(one(r.docs, "Deployment", "router"))["image"] == router_image
    assert container(one(r.docs, "Pod", "test"))["image"] == router_image
    assert ":sha256:" not in (tmp_path / "rendered.yaml").read_text().replace("@sha256:", "@")
    tagged = render(helm, tmp_path / "tag", {"image": {"workerTag": "0.2.0-cuda"}})
    assert container(one(tagged.docs, "StatefulSet", "worker"))["image"] == "ghcr.io/kvmesh/kvmesh:0.2.0-cuda"


@pytest.mark.multiproc
@pytest.mark.parametrize("values,message", [
    ({"image": {"workerTag": DIGEST}}, "/image/workerTag"),           # a digest in the tag: repo:sha256:… is invalid
    ({"image": {"routerTag": f"0.1@{DIGEST}"}}, "/image/routerTag"),
    ({"image": {"workerDigest": "ab12"}}, "/image/workerDigest"),
    ({"image": {"repository": f"ghcr.io/kvmesh/kvmesh@{DIGEST}"}}, "/image/repository"),
    ({"image": {"repository": "ghcr.io/kvmesh/kvmesh:0.1.0"}}, "/image/repository"),
])
def test_schema_rejects_digests_in_the_wrong_place(helm: Path, tmp_path: Path, values: Doc, message: str) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(values))
    assert message in _fails(helm, "-f", str(f))


@pytest.mark.multiproc
def test_registry_with_a_port_is_a_repository(helm: Path, tmp_path: Path) -> None:
    r = render(helm, tmp_path, {"image": {"repository": "registry.local:5000/ml/kvmesh", "workerDigest": DIGEST}})
    assert container(one(r.docs, "StatefulSet", "worker"))["image"] == f"registry.local:5000/ml/kvmesh@{DIGEST}"


# -- 5. autoscaling -----------------------------------------------------------------------

def check_scaled_object(docs: list[Doc]) -> Doc:
    """KEDA's ScaledObject (keda.sh/v1alpha1) as its CRD defines the fields we use."""
    so = one(docs, "ScaledObject")
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    spec = so["spec"]
    assert set(spec) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod",
                         "advanced", "triggers", "idleReplicaCount", "fallback"}
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": WORKER_STS}
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert all(isinstance(spec[k], int)
               for k in ("minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod"))
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert isinstance(behavior["scaleDown"]["stabilizationWindowSeconds"], int)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] in ("AverageValue", "Value")
    meta = trigger["metadata"]
    assert all(isinstance(v, str) for v in meta.values()), "KEDA trigger metadata is a map of strings"
    assert meta["serverAddress"].startswith(("http://", "https://"))
    float(meta["threshold"])
    used = {n for n in exported_names() if f"{n}{{" in meta["query"]}
    assert used, f"the query names no metric a worker exports: {meta['query']}"
    assert "replicas" not in one(docs, "StatefulSet", "worker")["spec"], "KEDA and a fixed replica count"
    return so


@pytest.mark.multiproc
def test_keda_scaled_object_only_with_its_api(helm: Path, tmp_path: Path) -> None:
    on: Doc = {"worker": {"replicas": 3, "autoscaling": {"minReplicas": 2, "maxReplicas": 6, "target": 5,
                                                         "keda": {"enabled": True, "cooldownPeriod": 120}}}}
    r = render(helm, tmp_path / "keda", on, api_versions=(KEDA,))
    validate_all(r)
    check_references(r.docs)
    so = check_scaled_object(r.docs)
    (trigger,) = so["spec"]["triggers"]
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"], so["spec"]["cooldownPeriod"]) == (2, 6, 120)
    assert trigger["metricType"] == "AverageValue" and trigger["metadata"]["threshold"] == "5"
    assert trigger["metadata"]["query"] == (
        f'sum(kvmesh:num_requests_waiting{{namespace="{NAMESPACE}",worker_id=~"{WORKER_STS}-[0-9]+"}})')
    # the worker ids the query matches are the pods' names (--worker-id=$(POD_NAME))
    assert parse_cli(container(one(r.docs, "StatefulSet", "worker"))).worker_id == "$(POD_NAME)"
    without = render(helm, tmp_path / "no-api", on)
    assert not [d for d in without.docs if d["kind"] == "ScaledObject"]
    assert one(without.docs, "StatefulSet", "worker")["spec"]["replicas"] == 3
    notes = run_helm(helm, "install", RELEASE, str(CHART), "--dry-run=client",
                     "--set", "worker.autoscaling.keda.enabled=true")
    assert "no ScaledObject was created" in notes.stdout
    kv = render(helm, tmp_path / "kv", {"worker": {"autoscaling": {"metric": "kv_cache_usage_perc", "target": 0.75,
                                                                  "keda": {"enabled": True}}}}, api_versions=(KEDA,))
    (trigger,) = check_scaled_object(kv.docs)["spec"]["triggers"]
    assert trigger["metricType"] == "Value" and trigger["metadata"]["threshold"] == "0.75"
    assert trigger["metadata"]["query"].startswith("avg(kvmesh:kv_cache_usage_perc{")


@pytest.mark.multiproc
def test_hpa_alternative_on_a_pods_metric(helm: Path, tmp_path: Path) -> None:
    r = render(helm, tmp_path, {"worker": {"autoscaling": {"hpa": {"enabled": True}, "maxReplicas": 12}}})
    validate_all(r)
    check_references(r.docs)
    hpa = one(r.docs, "HorizontalPodAutoscaler", "worker")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": WORKER_STS}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 12)
    (metric,) = hpa["spec"]["metrics"]
    assert metric == {"type": "Pods", "pods": {"metric": {"name": "kvmesh_num_requests_waiting"},
                                               "target": {"type": "AverageValue", "averageValue": "4"}}}
    assert "kvmesh:num_requests_waiting" in exported_names()     # the series prometheus-adapter renames
    assert "replicas" not in one(r.docs, "StatefulSet", "worker")["spec"]
    assert not [d for d in r.docs if d["kind"] == "ScaledObject"]
    notes = run_helm(helm, "install", RELEASE, str(CHART), "--dry-run=client",
                     "--set", "worker.autoscaling.hpa.enabled=true")
    assert "no custom.metrics.k8s.io" in notes.stdout


@pytest.mark.multiproc
def test_keda_and_hpa_together_fail(helm: Path) -> None:
    err = _fails(helm, "--api-versions", KEDA, "--set", "worker.autoscaling.keda.enabled=true",
                 "--set", "worker.autoscaling.hpa.enabled=true")
    assert "enable keda or hpa, not both" in err


@pytest.mark.multiproc
def test_kv_usage_target_is_a_fraction_and_min_at_most_max(helm: Path) -> None:
    err = _fails(helm, "--set", "worker.autoscaling.metric=kv_cache_usage_perc", "--set", "worker.autoscaling.target=4")
    assert "/worker/autoscaling/target" in err
    err = _fails(helm, "--set", "worker.autoscaling.minReplicas=5", "--set", "worker.autoscaling.maxReplicas=4")
    assert "worker.autoscaling.minReplicas (5) exceeds worker.autoscaling.maxReplicas (4)" in err


# -- 6. the examples ----------------------------------------------------------------------

@pytest.mark.multiproc
@pytest.mark.parametrize("files", [(AUTOSCALING_EXAMPLE,), (GPU_EXAMPLE, AUTOSCALING_EXAMPLE)],
                         ids=["autoscaling", "gpu-pool+autoscaling"])
def test_autoscaling_example(helm: Path, tmp_path: Path, files: tuple[Path, ...]) -> None:
    r = render(helm, tmp_path, None, *files, api_versions=(KEDA, "monitoring.coreos.com/v1"))
    validate_all(r)
    check_references(r.docs)
    so = check_scaled_object(r.docs)
    example = yaml.safe_load(AUTOSCALING_EXAMPLE.read_text())["worker"]
    assert so["spec"]["minReplicaCount"] == example["autoscaling"]["minReplicas"]
    assert so["spec"]["maxReplicaCount"] == example["autoscaling"]["maxReplicas"]
    # Prometheus scrapes what KEDA asks about: the workers' metrics port, through the PodMonitor.
    pm, worker = one(r.docs, "PodMonitor"), one(r.docs, "StatefulSet", "worker")
    assert matches(pm["spec"]["selector"]["matchLabels"], pod_labels(worker))
    # Scale-down: the grace period covers the preStop sleep and the drain.
    spec, c = _pod_spec(worker), container(worker)
    sleep = float(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert spec["terminationGracePeriodSeconds"] >= sleep + parse_cli(c).drain_timeout_s + 5


# -- the values table ------------------------------------------------------------------

def test_readme_values_table_names_every_value() -> None:
    """helm/kvmesh/README.md's table names every value of values.yaml (or a `prefix.*` over it)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    table = [line for line in (CHART / "README.md").read_text().splitlines() if line.startswith("| `")]
    named = {n for line in table for n in line.split("|")[1].replace("`", "").replace(" ", "").split(",")}
    whole = ("resources", "Probe", "nodeSelector", "affinity", "ontext", "annotations", "Labels")

    def leaves(d: Doc, prefix: str = "") -> list[str]:
        return [p for k, v in d.items() for p in (
            leaves(v, f"{prefix}{k}.") if isinstance(v, dict) and v and not k.endswith(whole) else [f"{prefix}{k}"])]
    missing = [p for p in leaves(values) if p not in named and not any(
        n.endswith(".*") and p.startswith(n[:-1]) for n in named)]
    assert not missing, f"values without a row in helm/kvmesh/README.md: {missing}"

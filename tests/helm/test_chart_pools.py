"""helm/kvmesh worker pools: the default one mixed pool, and with disaggregation.enabled a prefill
and a decode pool, each a StatefulSet running `kvmesh worker --role` with its own replicas,
resources, autoscaling (HPA or KEDA) and PDB, behind the one headless Service. Rendered, validated
against the Kubernetes schemas, command lines read by the real `kvmesh` parser.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.helm.manifests import (
    CHART,
    GPU_EXAMPLE,
    KEDA,
    NAMESPACE,
    RELEASE,
    Doc,
    check_references,
    container,
    matches,
    parse_cli,
    pod_labels,
    render,
    run_helm,
    validate_all,
)

POOLS: Doc = {"disaggregation": {
    "enabled": True,
    "prefill": {"replicas": 2, "resources": {"requests": {"cpu": "8", "memory": "16Gi"}, "limits": {"memory": "32Gi"}},
                "autoscaling": {"hpa": {"enabled": True}, "maxReplicas": 6}},
    "decode": {"replicas": 5, "autoscaling": {"keda": {"enabled": True}, "metric": "kv_cache_usage_perc",
                                               "target": 0.8, "minReplicas": 2}}}}


def _by_name(docs: list[Doc], kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _worker_sets(docs: list[Doc]) -> dict[str, Doc]:
    return {n: d for n, d in _by_name(docs, "StatefulSet").items() if not n.endswith("-redis")}


@pytest.mark.multiproc
def test_default_is_one_mixed_pool(helm: Path, tmp_path: Path) -> None:
    r = render(helm, tmp_path, None)
    (sts,) = _worker_sets(r.docs).values()
    assert sts["metadata"]["name"] == f"{RELEASE}-kvmesh-worker" and sts["spec"]["replicas"] == 2
    assert parse_cli(container(sts)).role == "mixed"
    assert pod_labels(sts)["kvmesh.io/role"] == "mixed"
    assert "kvmesh.io/role" not in sts["spec"]["selector"]["matchLabels"]   # a StatefulSet's selector is immutable


@pytest.mark.multiproc
@pytest.mark.parametrize("api_versions", [(), (KEDA,)], ids=["no-keda", "keda"])
def test_prefill_and_decode_pools_render_and_validate(helm: Path, tmp_path: Path,
                                                      api_versions: tuple[str, ...]) -> None:
    r = render(helm, tmp_path, POOLS, api_versions=api_versions)
    validate_all(r)
    check_references(r.docs)
    sets = _worker_sets(r.docs)
    prefill, decode = sets[f"{RELEASE}-kvmesh-worker-prefill"], sets[f"{RELEASE}-kvmesh-worker-decode"]
    assert len(sets) == 2, sorted(sets)            # no mixed pool beside them
    for sts, role in ((prefill, "prefill"), (decode, "decode")):
        ns = parse_cli(container(sts))
        assert (ns.command, ns.role) == ("worker", role)
        assert pod_labels(sts)["kvmesh.io/role"] == role
        assert sts["spec"]["selector"]["matchLabels"]["kvmesh.io/role"] == role
        assert ns.advertise_address.startswith(f"$(POD_NAME).{RELEASE}-kvmesh-worker-headless.{NAMESPACE}.svc")
    # Own replicas: the prefill pool's HPA owns its count, the decode pool has its own (KEDA only
    # owns it where the cluster has the ScaledObject API).
    assert "replicas" not in prefill["spec"]
    assert decode["spec"].get("replicas") == (None if api_versions else 5)
    # Own resources: the prefill pool's, the decode pool's from worker.resources, each with its GPU.
    pr, dr = container(prefill)["resources"], container(decode)["resources"]
    assert (pr["requests"]["cpu"], pr["limits"]["memory"], pr["limits"]["nvidia.com/gpu"]) == ("8", "32Gi", 1)
    assert (dr["requests"]["cpu"], dr["limits"]["memory"], dr["limits"]["nvidia.com/gpu"]) == ("4", "64Gi", 1)
    # Own autoscaling.
    (hpa,) = _by_name(r.docs, "HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"]["name"] == prefill["metadata"]["name"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 6)
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "kvmesh_num_requests_waiting"
    scaled = _by_name(r.docs, "ScaledObject")
    if api_versions:
        (so,) = scaled.values()
        assert so["spec"]["scaleTargetRef"]["name"] == decode["metadata"]["name"]
        assert so["spec"]["minReplicaCount"] == 2
        (trigger,) = so["spec"]["triggers"]
        assert trigger["metadata"]["query"] == (f'avg(kvmesh:kv_cache_usage_perc{{namespace="{NAMESPACE}",'
                                                f'worker_id=~"{RELEASE}-kvmesh-worker-decode-[0-9]+"}})')
        assert trigger["metricType"] == "Value" and trigger["metadata"]["threshold"] == "0.8"
    else:
        assert not scaled
    # One PDB per pool, each selecting only its own pool's pods.
    pdbs = _by_name(r.docs, "PodDisruptionBudget")
    for sts in (prefill, decode):
        pdb = pdbs[sts["metadata"]["name"]]
        assert matches(pdb["spec"]["selector"]["matchLabels"], pod_labels(sts))
    # The headless Service gives every pod of both pools its DNS name.
    headless = _by_name(r.docs, "Service")[f"{RELEASE}-kvmesh-worker-headless"]
    assert all(matches(headless["spec"]["selector"], pod_labels(s)) for s in (prefill, decode))


@pytest.mark.multiproc
def test_router_gets_the_disaggregation_flags(helm: Path, tmp_path: Path) -> None:
    values = POOLS | {"router": {"disaggMinPromptTokens": 0, "disaggTransferTimeoutS": 2.5}}
    r = render(helm, tmp_path, values)
    (router,) = _by_name(r.docs, "Deployment").values()
    ns = parse_cli(container(router))
    assert (ns.disagg_min_prompt_tokens, ns.disagg_transfer_timeout_s) == (0, 2.5)   # 0: every prompt takes the hop
    unset = parse_cli(container(next(iter(_by_name(render(helm, tmp_path / "d", POOLS).docs,
                                                     "Deployment").values()))))
    defaults = parse_cli({"command": ["kvmesh"], "args": ["router"]})
    assert unset.disagg_min_prompt_tokens == defaults.disagg_min_prompt_tokens


@pytest.mark.multiproc
def test_lint_and_notes_name_both_pools(helm: Path) -> None:
    args = [a for k, v in (("disaggregation.enabled", "true"), ("disaggregation.decode.autoscaling.keda.enabled",
                                                                 "true")) for a in ("--set", f"{k}={v}")]
    lint = run_helm(helm, "lint", "--strict", str(CHART), *args)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    notes = run_helm(helm, "install", RELEASE, str(CHART), "--dry-run=client", *args)
    assert notes.returncode == 0, notes.stderr
    assert "Prefill workers (--role prefill) (1 pods, " in notes.stdout
    assert f"scale statefulset {RELEASE}-kvmesh-worker-decode" in notes.stdout
    assert "disaggregation.decode.autoscaling.keda.enabled is true but this cluster has no" in notes.stdout


@pytest.mark.multiproc
@pytest.mark.parametrize("pool, why", [
    ({"autoscaling": {"hpa": {"enabled": True}, "keda": {"enabled": True}}}, "enable keda or hpa, not both"),
    ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "minReplicas (5) exceeds"),
    ({"autoscaling": {"metric": "kv_cache_usage_perc", "target": 4}}, "a KV usage fraction"),
], ids=["two-autoscalers", "min-over-max", "usage-over-1"])
def test_bad_pool_values_fail_naming_the_pool(helm: Path, tmp_path: Path, pool: Doc, why: str) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"disaggregation": {"enabled": True, "decode": {"replicas": 1, **pool}}}))
    out = run_helm(helm, "template", RELEASE, str(CHART), "-f", str(path))
    assert out.returncode != 0 and "disaggregation.decode.autoscaling" in out.stderr and why in out.stderr, \
        out.stderr


@pytest.mark.multiproc
def test_schema_rejects_an_unknown_pool_value(helm: Path) -> None:
    out = run_helm(helm, "template", RELEASE, str(CHART), "--set", "disaggregation.prefill.replica=2")
    assert out.returncode != 0 and "replica" in out.stderr


@pytest.mark.multiproc
def test_disaggregated_example_over_the_gpu_pool(helm: Path, tmp_path: Path) -> None:
    example = CHART / "examples" / "disaggregated.yaml"
    r = render(helm, tmp_path, None, GPU_EXAMPLE, example, api_versions=(KEDA,))
    validate_all(r)
    check_references(r.docs)
    sets = _worker_sets(r.docs)
    assert sorted(sets) == [f"{RELEASE}-kvmesh-worker-decode", f"{RELEASE}-kvmesh-worker-prefill"]
    assert {d["spec"]["scaleTargetRef"]["name"] for d in r.docs if d["kind"] == "HorizontalPodAutoscaler"
            and d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"} == {
        f"{RELEASE}-kvmesh-worker-prefill"}
    assert {d["spec"]["scaleTargetRef"]["name"] for d in r.docs if d["kind"] == "ScaledObject"} == {
        f"{RELEASE}-kvmesh-worker-decode"}
    lint = run_helm(helm, "lint", "--strict", str(CHART), "-f", str(GPU_EXAMPLE), "-f", str(example))
    assert lint.returncode == 0, lint.stdout + lint.stderr

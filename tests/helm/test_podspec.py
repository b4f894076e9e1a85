"""tests/support/podspec.py: Kubernetes' `$(VAR)` expansion and env resolution, applied to the rendered
chart as the pod-network tests run it (no namespaces needed here)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helm.manifests import HELM
from tests.support.podspec import expand, render_chart


@pytest.mark.parametrize(("text", "want"), [
    ("$(A)", "1"), ("x$(A)y$(B)", "x1y2"), ("$$(A)", "$(A)"), ("$$$(A)", "$1"), ("$(MISSING)", "$(MISSING)"),
    ("$A", "$A"), ("a$", "a$"), ("$(A", "$(A"), ("$()", "$()"), ("$(A)$(A)", "11"), ("$(A $$", "$(A $"),
    ("100$$", "100$"),
])
def test_expand_follows_kubernetes(text: str, want: str) -> None:
    assert expand(text, {"A": "1", "B": "2"}) == want


@pytest.mark.multiproc
def test_worker_and_redis_commands_resolve_secrets_fields_and_references(tmp_path: Path) -> None:
    if not HELM.is_file():
        pytest.skip("helm missing (make setup)")
    specs = render_chart(tmp_path, {"engine": {"device": "cpu"}, "worker": {"gpu": {"count": 0}, "extraEnv": [
        {"name": "STALL", "value": "/x/stall-$(POD_NAME)"}, {"name": "LATER", "value": "$(NOT_YET)"},
        {"name": "NOT_YET", "value": "v"}]}})
    pod = specs.pod_name("worker", 1)
    run = specs.run("worker", pod, "10.0.0.7")
    password = next(v["redis-password"] for v in specs.secrets.values() if "redis-password" in v)
    token = next(v["token"] for v in specs.secrets.values() if "token" in v)
    assert pod == "kvm-kvmesh-worker-1"
    assert run.env["POD_NAME"] == pod and run.env["POD_NAMESPACE"] == "llm"
    assert run.env["KVMESH_REDIS_URL"] == f"redis://:{password}@kvm-kvmesh-redis.llm.svc.cluster.local:6379/0"
    assert run.env["KVMESH_CLUSTER_TOKEN"] == token and len(token) >= 32
    assert run.env["KVMESH_PEER_TRANSFER"] == "1"                    # from the ConfigMap (envFrom)
    assert run.env["STALL"] == f"/x/stall-{pod}"
    assert run.env["LATER"] == "$(NOT_YET)"                           # defined after it: kept as written
    assert f"--worker-id={pod}" in run.argv and run.argv[:2] == ("kvmesh", "worker")
    assert not any("$(" in a for a in run.argv), run.argv
    redis = specs.run("redis", specs.pod_name("redis"), "10.0.0.2")
    assert redis.argv[0] == "redis-server" and redis.argv[redis.argv.index("--requirepass") + 1] == password
    assert run.port("grpc") == 50061

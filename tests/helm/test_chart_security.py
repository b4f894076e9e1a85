"""helm/kvmesh `security` values: the cluster token and the Redis password as
generated (or existing) Secrets reaching the pods by environment, client API keys from a Secret,
TLS from an existing Secret or a cert-manager Certificate, and the router's NetworkPolicy
admitting a named label by default. Command lines are read back with the real `kvmesh` parser.
"""
from __future__ import annotations

import base64
from pathlib import Path

import pytest
import yaml

from router.security.auth import parse_keys_file
from tests.helm.manifests import (
    CHART,
    NAMESPACE,
    RELEASE,
    Doc,
    check_references,
    container,
    env_value,
    one,
    parse_cli,
    probe_spec,
    render,
    run_helm,
    validate_all,
)

TLS_SECRET: Doc = {"security": {"tls": {"enabled": True, "existingSecret": "kv-tls"},
                                 "apiKeys": {"existingSecret": "kv-keys"}}}
CERT_MANAGER: Doc = {"security": {"tls": {"enabled": True, "certManager": {"issuerRef": {"name": "kv-ca"}}}}}


def _env(c: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in c.get("env", [])}


def _secrets(docs: list[Doc]) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}


@pytest.mark.multiproc
def test_default_generates_token_and_redis_password(helm: Path, tmp_path: Path) -> None:
    r = render(helm, tmp_path)
    secrets = _secrets(r.docs)
    token = secrets[f"{RELEASE}-kvmesh-cluster-token"]["data"]["token"]
    password = secrets[f"{RELEASE}-kvmesh-redis-auth"]["data"]["redis-password"]
    assert len(base64.b64decode(token)) >= 32 and base64.b64decode(password).decode().isalnum()
    for kind, component in (("StatefulSet", "worker"), ("Deployment", "router")):
        c = container(one(r.docs, kind, component))
        env = _env(c)
        assert env["KVMESH_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": f"{RELEASE}-kvmesh-cluster-token", "key": "token"}
        assert env["KVMESH_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == f"{RELEASE}-kvmesh-redis-auth"
        assert "KVMESH_REDIS_URL" in env and not any("redis://" in a for a in c["args"])
        ns = parse_cli(c)
        assert ns.cluster_token is None and ns.tls_cert is None    # the token by env; TLS off by default
    redis = container(one(r.docs, "StatefulSet", "redis"))
    assert "--protected-mode" not in redis["args"] and "--requirepass" in redis["args"]
    assert _env(redis)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == f"{RELEASE}-kvmesh-redis-auth"


@pytest.mark.multiproc
def test_existing_secrets_are_used_and_none_generated(helm: Path, tmp_path: Path) -> None:
    values: Doc = {"security": {"clusterToken": {"existingSecret": "kv-token", "existingSecretKey": "t"}},
                   "redis": {"auth": {"existingSecret": "kv-redis"}}}
    r = render(helm, tmp_path, values)     # (the default's generated Secrets: test_chart's schema validation)
    assert _secrets(r.docs) == {}
    env = _env(container(one(r.docs, "StatefulSet", "worker")))
    assert env["KVMESH_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "kv-token", "key": "t"}
    assert env["KVMESH_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "kv-redis"
    off = render(helm, tmp_path / "off", {"security": {"clusterToken": {"enabled": False}},
                                          "redis": {"auth": {"enabled": False}}})
    assert _secrets(off.docs) == {}
    assert "KVMESH_CLUSTER_TOKEN" not in _env(container(one(off.docs, "Deployment", "router")))
    assert "--protected-mode" in container(one(off.docs, "StatefulSet", "redis"))["args"]


@pytest.mark.multiproc
def test_api_keys_secret_is_the_routers_keys_file(helm: Path, tmp_path: Path) -> None:
    r = render(helm, tmp_path, {"security": {"apiKeys": {"existingSecret": "kv-keys"}, "metricsRequireKey": True}})
    check_references(r.docs)         # schema validation of this volume: test_tls_from_an_existing_secret
    router = one(r.docs, "Deployment", "router")
    c = container(router)
    path = Path(env_value(c, "KVMESH_API_KEYS_FILE") or "")
    mount = next(m for m in c["volumeMounts"] if m["name"] == "api-keys")
    volume = next(v for v in router["spec"]["template"]["spec"]["volumes"] if v["name"] == "api-keys")
    assert volume["secret"]["secretName"] == "kv-keys" and path == Path(mount["mountPath"]) / "api-keys"
    assert parse_cli(c).metrics_require_key is True
    # what the Secret must hold: the router's keys-file format
    keys = tmp_path / "api-keys"
    keys.write_text("sk-a team-a\nsk-ops ops priority\n")
    assert [k.tenant for k in parse_keys_file(keys)] == ["team-a", "ops"]


def _check_tls_pods(docs: list[Doc], secret: str) -> None:
    for kind, component in (("StatefulSet", "worker"), ("Deployment", "router"), ("Pod", "test")):
        w = one(docs, kind, component)
        spec = w["spec"]["template"]["spec"] if "template" in w["spec"] else w["spec"]
        c = container(w)
        ns = parse_cli(c)
        mount = next(m for m in c["volumeMounts"] if m["name"] == "tls")
        assert next(v for v in spec["volumes"] if v["name"] == "tls")["secret"]["secretName"] == secret
        assert str(ns.tls_ca) == f"{mount['mountPath']}/ca.crt"
        if kind != "Pod":
            assert (str(ns.tls_cert), str(ns.tls_key)) == (f"{mount['mountPath']}/tls.crt",
                                                           f"{mount['mountPath']}/tls.key")
    # The kubelet's gRPC probes speak no TLS: the workers' plain-HTTP metrics port answers them.
    worker, router = container(one(docs, "StatefulSet", "worker")), container(one(docs, "Deployment", "router"))
    assert {p: probe_spec(worker, p) for p in ("startupProbe", "livenessProbe", "readinessProbe")} == {
        "startupProbe": {"httpGet": {"path": "/readyz", "port": "metrics"}},
        "livenessProbe": {"httpGet": {"path": "/livez", "port": "metrics"}},
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "metrics"}}}
    assert router["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"}
    assert router["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http", "scheme": "HTTPS"}


@pytest.mark.multiproc
def test_tls_from_an_existing_secret(helm: Path, tmp_path: Path) -> None:
    r = render(helm, tmp_path, TLS_SECRET)
    validate_all(r)
    check_references(r.docs)
    _check_tls_pods(r.docs, "kv-tls")
    assert not [d for d in r.docs if d["kind"] == "Certificate"]


@pytest.mark.multiproc
def test_tls_from_cert_manager_only_with_its_api(helm: Path, tmp_path: Path) -> None:
    proc = run_helm(helm, "template", RELEASE, str(CHART),
                    "--namespace", NAMESPACE, "--set", "security.tls.enabled=true",
                    "--set", "security.tls.certManager.issuerRef.name=kv-ca")
    assert proc.returncode != 0 and "security.tls.enabled" in proc.stderr and "cert-manager" in proc.stderr
    r = render(helm, tmp_path, CERT_MANAGER, api_versions=("cert-manager.io/v1",))
    cert = one(r.docs, "Certificate")
    secret = f"{RELEASE}-kvmesh-tls"
    assert cert["apiVersion"] == "cert-manager.io/v1" and cert["spec"]["secretName"] == secret
    assert cert["spec"]["issuerRef"] == {"name": "kv-ca", "kind": "Issuer"}
    assert {"server auth", "client auth"} <= set(cert["spec"]["usages"])
    names = cert["spec"]["dnsNames"]
    worker = container(one(r.docs, "StatefulSet", "worker"))
    advertised = parse_cli(worker).advertise_address.replace("$(POD_NAME)",
                                                             f"{RELEASE}-kvmesh-worker-0").rsplit(":", 1)[0]
    assert any(n.startswith("*.") and advertised.endswith(n[1:]) for n in names)   # what the router dials
    assert f"{RELEASE}-kvmesh-router.{NAMESPACE}.svc.cluster.local" in names       # what clients dial
    _check_tls_pods(r.docs, secret)


@pytest.mark.multiproc
def test_router_ingress_defaults_to_a_named_label(helm: Path, tmp_path: Path) -> None:
    r = render(helm, tmp_path)
    policy = next(d for d in r.docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-router"))
    peers = policy["spec"]["ingress"][0]["from"]
    assert {"namespaceSelector": {"matchLabels": {"kvmesh.io/client": "true"}},
            "podSelector": {"matchLabels": {"kvmesh.io/client": "true"}}} in peers
    assert all(p for p in peers), "an empty peer would admit everyone"


@pytest.mark.multiproc
@pytest.mark.parametrize("values,message", [
    ({"security": {"tls": {"certManager": {"issuerRef": {"kind": "Cluster"}}}}},
     "/security/tls/certManager/issuerRef/kind"),
    ({"security": {"clusterToken": {"existingSecretKey": ""}}}, "/security/clusterToken/existingSecretKey"),
    ({"security": {"apiKey": {}}}, "additional properties 'apiKey' not allowed"),
])
def test_schema_rejects_bad_security_values(helm: Path, tmp_path: Path, values: Doc, message: str) -> None:
    f = tmp_path / "values.yaml"
    f.write_text(yaml.safe_dump(values))
    proc = run_helm(helm, "template", RELEASE, str(CHART), "-f", str(f))
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr

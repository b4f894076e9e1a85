"""Render helm/kvmesh and look at the result: helm runs, manifest lookups, the real `kvmesh`
parser applied to container command lines, Kubernetes schema validation, and the references
between manifests that no schema checks (selectors, ports, volumes, $(VAR) in args).
"""
from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path
from typing import Any, NamedTuple

import kubernetes_validate
import yaml

from kvmesh.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
HELM = ROOT / ".tools" / "bin" / "helm"
CHART = ROOT / "helm" / "kvmesh"
GPU_EXAMPLE = CHART / "examples" / "gpu-pool.yaml"
AUTOSCALING_EXAMPLE = CHART / "examples" / "autoscaling.yaml"
KEDA = "keda.sh/v1alpha1/ScaledObject"     # --api-versions of a cluster with KEDA
# The chart's kubeVersion floor (pod-index label) and the Kubernetes of helm's client.
K8S_VERSIONS = ("1.28.0", "1.35.0")
RELEASE, NAMESPACE = "kvm", "llm"
# No built-in schema: checked by check_service_monitor, tests/helm/test_monitoring.py and
# check_scaled_object (tests/helm/test_chart_k8s.py).
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "ScaledObject"}

Doc = dict[str, Any]


class Render(NamedTuple):
    docs: list[Doc]
    path: Path  # the rendered YAML, kept in the test's tmp dir


def snake(camel: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", camel).lower()


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=60, check=False)


def render(helm: Path, out_dir: Path, values: Doc | None = None, *files: Path,
           api_versions: tuple[str, ...] = ()) -> Render:
    """`helm template` into out_dir; fails the test with helm's stderr if rendering fails."""
    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for f in files:
        args += ["-f", str(f)]
    if values:
        vfile = out_dir / "values.yaml"
        vfile.write_text(yaml.safe_dump(values))
        args += ["-f", str(vfile)]
    for api in api_versions:
        args += ["--api-versions", api]
    proc = run_helm(helm, *args)
    assert proc.returncode == 0, f"helm template failed:\n{proc.stderr}"
    path = out_dir / "rendered.yaml"
    path.write_text(proc.stdout)
    return Render([d for d in yaml.safe_load_all(proc.stdout) if d], path)


def one(docs: list[Doc], kind: str, component: str | None = None) -> Doc:
    found = [d for d in docs if d["kind"] == kind and (
        component is None or d["metadata"]["labels"].get("app.kubernetes.io/component") == component)]
    assert len(found) == 1, f"expected one {kind} {component or ''}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def container(workload: Doc) -> Doc:
    spec = workload["spec"]["template"]["spec"] if "template" in workload["spec"] else workload["spec"]
    (c,) = spec["containers"]
    return c


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of the parser and of its subcommands, recursively."""
    found = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= option_strings(sub)
    return found


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def kvmesh_parser() -> argparse.ArgumentParser:
    """The real `kvmesh` parser."""
    return build_parser()


def parse_cli(c: Doc) -> argparse.Namespace:
    """The container's command line through the real `kvmesh` parser (argparse exits on an unknown
    flag; an abbreviated one, which argparse would accept, fails here too)."""
    argv = [*c["command"], *c["args"]]
    assert argv[0] == "kvmesh", argv
    parser = kvmesh_parser()
    rest = argv[1:argv.index("--")] if "--" in argv else argv[1:]
    unknown = {a.split("=", 1)[0] for a in rest if a.startswith("-")} - option_strings(parser)
    assert not unknown, f"flags not spelled as the CLI spells them: {sorted(unknown)}"
    try:
        return parser.parse_args(argv[1:])
    except SystemExit as e:
        raise AssertionError(f"`kvmesh` rejects the rendered command line {argv}") from e


def env_value(c: Doc, name: str) -> str | None:
    """The literal value of env var `name` of container `c` (None: absent or from a Secret)."""
    return next((e.get("value") for e in c.get("env", []) if e["name"] == name), None)


def pod_labels(workload: Doc) -> dict[str, str]:
    if "template" in workload["spec"]:
        return workload["spec"]["template"]["metadata"]["labels"]
    return workload["metadata"]["labels"]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def check_references(docs: list[Doc]) -> None:
    """Cross-manifest invariants the API server cannot check for us."""
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    by_kind_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    for w in workloads:
        assert matches(w["spec"]["selector"]["matchLabels"], pod_labels(w)), w["metadata"]["name"]
        others = [o for o in workloads if o is not w and matches(w["spec"]["selector"]["matchLabels"], pod_labels(o))]
        assert not others, f"{w['metadata']['name']} selects the pods of {[o['metadata']['name'] for o in others]}"
        if w["kind"] == "StatefulSet":
            svc = by_kind_name.get(("Service", w["spec"]["serviceName"]))
            assert svc is not None, f"{w['metadata']['name']}: serviceName {w['spec']['serviceName']} not rendered"
    for d in docs:
        if d["kind"] == "Service":
            targets = [w for w in workloads if matches(d["spec"]["selector"], pod_labels(w))]
            # one workload, or the worker pools (prefill + decode) behind the headless Service
            assert len(targets) == 1 or {pod_labels(w)["app.kubernetes.io/component"] for w in targets} == {
                "worker"}, f"Service {d['metadata']['name']} selects {len(targets)} workloads"
            for target in targets:
                ports = {p["name"] for p in container(target)["ports"]}
                assert {p["targetPort"] for p in d["spec"]["ports"]} <= ports, d["metadata"]["name"]
        if d["kind"] == "PodDisruptionBudget":
            assert sum(matches(d["spec"]["selector"]["matchLabels"], pod_labels(w)) for w in workloads) == 1
        if d["kind"] == "NetworkPolicy":
            assert any(matches(d["spec"]["podSelector"]["matchLabels"], pod_labels(w)) for w in workloads)
        if d["kind"] in ("HorizontalPodAutoscaler", "ScaledObject"):
            ref = d["spec"]["scaleTargetRef"]
            assert (ref["kind"], ref["name"]) in by_kind_name
            assert "replicas" not in by_kind_name[(ref["kind"], ref["name"])]["spec"], \
                "an autoscaler and a fixed replica count"
    for w in [*workloads, *[d for d in docs if d["kind"] == "Pod"]]:
        spec = w["spec"]["template"]["spec"] if "template" in w["spec"] else w["spec"]
        c = container(w)
        volumes = {v["name"] for v in spec.get("volumes", [])} | {
            t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes, w["metadata"]["name"]
        env = {e["name"] for e in c.get("env", [])}
        for src in c.get("envFrom", []):
            env |= set(configmaps[src["configMapRef"]["name"]]["data"])
        for ref in re.findall(r"\$\(([A-Z_][A-Z0-9_]*)\)", " ".join(c.get("args", []))):
            assert ref in env, f"{w['metadata']['name']}: args use $({ref}) but the container has no such env"
        defined: set[str] = set()   # an env value may use $(VAR) of a VAR defined before it
        for e in c.get("env", []):
            for ref in re.findall(r"\$\(([A-Z_][A-Z0-9_]*)\)", e.get("value", "")):
                assert ref in defined, f"{w['metadata']['name']}: env {e['name']} uses $({ref}) not defined before it"
            defined.add(e["name"])
        port_names = {p["name"] for p in c.get("ports", [])}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            for how in ("tcpSocket", "httpGet"):
                port = c.get(probe, {}).get(how, {}).get("port")
                assert port is None or port in port_names or isinstance(port, int), (w["metadata"]["name"], probe)


def check_service_monitor(docs: list[Doc]) -> None:
    sm = one(docs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    svc = one(docs, "Service", "router")
    assert matches(sm["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    assert sm["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}


def validate_all(r: Render) -> None:
    errors = []
    for d in r.docs:
        if d["kind"] in CRD_KINDS:
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(d, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                where = "/".join(map(str, e.path))
                errors.append(f"{d['kind']}/{d['metadata']['name']} (k8s {version}) at {where}: {e.message}")
    assert not errors, f"{r.path}:\n" + "\n".join(errors)


def host(i: int) -> str:
    return f"{RELEASE}-kvmesh-worker-{i}.{RELEASE}-kvmesh-worker-headless.{NAMESPACE}.svc.cluster.local"


def probe_spec(c: Doc, probe: str) -> Doc:
    """The probe's handler (grpc / httpGet / tcpSocket), without its timings."""
    return {k: v for k, v in c[probe].items() if k in ("grpc", "httpGet", "tcpSocket", "exec")}

"""The rendered chart's containers as local command lines: what a kubelet would run.

`render_chart` runs `helm template` (tests/helm/manifests.py); `PodSpecs` reads the Secrets,
ConfigMaps and workloads out of the result and gives, for one pod of one workload, its argv and
environment with Kubernetes' rules applied faithfully:
- env is `envFrom` (ConfigMaps, Secrets) first, then `env` in order (later entries win);
  `valueFrom.secretKeyRef` reads the rendered Secret (base64), `configMapKeyRef` the ConfigMap,
  `fieldRef` the pod's own metadata (`metadata.name`, `metadata.namespace`, `status.podIP`, ...);
- `$(VAR)` in an env value expands with the variables defined before it; in command and args
  with all of the container's variables; `$$` is a literal `$`; an undefined `$(VAR)` stays as
  written (`expand`, after k8s.io/kubernetes third_party/forked/golang/expansion).
Kubernetes' service-link variables (`<SVC>_SERVICE_HOST`, ...) are not added.
"""
from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.helm.manifests import CHART, HELM, NAMESPACE, Doc, container, render

__all__ = ["PodSpecs", "ContainerRun", "expand", "render_chart"]


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion of one string."""
    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c != "$" or i + 1 == len(text):
            out.append(c)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":                                  # $$ -> $
            out.append("$")
            i += 2
        elif nxt == "(":
            end = text.find(")", i + 2)
            if end < 0:                                 # unterminated: "$(" kept, scanning goes on
                out.append("$(")
                i += 2
                continue
            name = text[i + 2:end]
            out.append(env[name] if name in env else text[i:end + 1])
            i = end + 1
        else:
            out.append(c + nxt)
            i += 2
    return "".join(out)


@dataclass(frozen=True, slots=True)
class ContainerRun:
    """One container as a process: argv (command + args, expanded), its environment, and the
    container spec it came from (ports and probes)."""

    pod: str
    argv: tuple[str, ...]
    env: dict[str, str]
    spec: Doc

    def port(self, name: str) -> int:
        return int(next(p["containerPort"] for p in self.spec.get("ports", []) if p["name"] == name))


class PodSpecs:
    """The rendered manifests of one release."""

    def __init__(self, docs: list[Doc], namespace: str = NAMESPACE) -> None:
        self.docs = docs
        self.namespace = namespace
        self.secrets = {d["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in d.get("data", {}).items()}
                        | dict(d.get("stringData", {})) for d in docs if d["kind"] == "Secret"}
        self.configmaps = {d["metadata"]["name"]: dict(d.get("data", {})) for d in docs if d["kind"] == "ConfigMap"}

    def workload(self, component: str) -> Doc:
        found = [d for d in self.docs if d["kind"] in ("StatefulSet", "Deployment")
                 and d["metadata"]["labels"].get("app.kubernetes.io/component") == component]
        assert len(found) == 1, f"expected one workload for {component}, found {len(found)}"
        return found[0]

    def service(self, component: str, headless: bool = False) -> Doc:
        found = [d for d in self.docs if d["kind"] == "Service"
                 and d["metadata"]["labels"].get("app.kubernetes.io/component") == component
                 and (d["spec"].get("clusterIP") == "None") == headless]
        assert len(found) == 1, f"expected one {'headless ' if headless else ''}Service for {component}"
        return found[0]

    def pod_name(self, component: str, ordinal: int = 0) -> str:
        """A StatefulSet pod is `<name>-<ordinal>`; a Deployment's pod gets a made-up
        ReplicaSet hash and suffix, as Kubernetes names them."""
        w = self.workload(component)
        name = w["metadata"]["name"]
        return f"{name}-{ordinal}" if w["kind"] == "StatefulSet" else f"{name}-5c9f7d6b8-{ordinal:05d}"[:63]

    def run(self, component: str, pod: str, pod_ip: str, node: str = "node-0") -> ContainerRun:
        w = self.workload(component)
        c = container(w)
        fields = {"metadata.name": pod, "metadata.namespace": self.namespace, "status.podIP": pod_ip,
                  "spec.nodeName": node, "spec.serviceAccountName": w["spec"]["template"]["spec"].get(
                      "serviceAccountName", "default")}
        env: dict[str, str] = {}
        for src in c.get("envFrom", []):
            prefix = src.get("prefix", "")
            if "configMapRef" in src:
                env |= {prefix + k: v for k, v in self.configmaps[src["configMapRef"]["name"]].items()}
            if "secretRef" in src:
                env |= {prefix + k: v for k, v in self.secrets[src["secretRef"]["name"]].items()}
        for e in c.get("env", []):
            env[e["name"]] = self._value(e, env, fields)
        argv = [expand(a, env) for a in [*c.get("command", []), *c.get("args", [])]]
        return ContainerRun(pod, tuple(argv), env, c)

    def _value(self, e: Doc, env: Mapping[str, str], fields: Mapping[str, str]) -> str:
        if "value" in e:
            return expand(str(e["value"]), env)
        src: Any = e.get("valueFrom", {})
        if "secretKeyRef" in src:
            return self.secrets[src["secretKeyRef"]["name"]][src["secretKeyRef"]["key"]]
        if "configMapKeyRef" in src:
            return self.configmaps[src["configMapKeyRef"]["name"]][src["configMapKeyRef"]["key"]]
        if "fieldRef" in src:
            return fields[src["fieldRef"]["fieldPath"]]
        raise AssertionError(f"env {e['name']}: unsupported source {sorted(src)}")


def render_chart(out_dir: Path, values: Doc) -> PodSpecs:
    """`helm template` of helm/kvmesh (release kvm, namespace llm) with `values`."""
    assert HELM.is_file(), f"{HELM} missing (make setup)"
    assert CHART.is_dir()
    return PodSpecs(render(HELM, out_dir, values).docs)

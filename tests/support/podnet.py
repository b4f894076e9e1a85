"""A pod network for process tests: the rendered chart run as local processes, one network
namespace per pod.

Network (`PodNet`, tests/support/podnet_ns.py): a "cluster" namespace holding a Linux bridge;
one namespace per pod, joined to the bridge by a veth pair, with its own loopback and IP
(10.77.S.N/24, S random per run);
the test process (root namespace) reaches pods through one more veth into the bridge
(10.77.S.254). Each pod namespace gets /etc/netns/<ns>/hosts, which `ip netns exec` mounts
over /etc/hosts: it stands in for cluster DNS, mapping every name the manifests use (worker
`<pod>.<headless>.<ns>.svc.cluster.local`, the Redis and router Services, which here resolve
to their one pod) to pod IPs. A pod also gets its own UTS namespace with hostname = pod name,
as a kubelet gives it (gloo resolves the hostname to pick its interface).

Processes (`PodCluster`): `tests.support.podspec` gives each container's argv and env exactly as the
manifests say; `kvmesh` runs as this repo's CLI (`.venv/bin/kvmesh`, else `python -m
kvmesh.cli`, with PYTHONPATH = this checkout), `redis-server` as installed. What differs from
a kubelet: no mount namespace (the chart's volumes are real directories: values point
modelCache/cache mountPaths at the test's tmp dir; Redis' `--dir /data` is rewritten to a tmp
dir; the worker's /tmp emptyDir is the machine's /tmp), no resource limits, root instead of the
securityContext users, no probes run by themselves (tests call `probe`), no service-link env.

Everything is named with a per-run id and removed by `close()` (processes, namespaces, veths,
/etc/netns dirs), also after a failure. `skip_reason()` says why a machine cannot run it.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helm.manifests import Doc
from tests.support.podnet_ns import PodNet, remove_stale, skip_reason
from tests.support.podspec import ContainerRun, PodSpecs, render_chart

__all__ = ["Pod", "PodCluster", "PodNet", "base_values", "remove_stale", "skip_reason"]

ROOT = Path(__file__).resolve().parents[1]
KVMESH = ROOT / ".venv" / "bin" / "kvmesh"


@dataclass
class Pod:
    name: str
    component: str
    ip: str
    run: ContainerRun
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0


@dataclass
class PodCluster:
    """The chart's Redis, router and workers as processes in a `PodNet`. `values` are Helm
    values on top of the test defaults (`base_values`)."""

    tmp: Path
    values: Doc = field(default_factory=dict)
    net: PodNet | None = None
    specs: PodSpecs | None = None
    pods: dict[str, Pod] = field(default_factory=dict)
    cuts: set[tuple[str, str]] = field(default_factory=set)
    cluster_domain: str = "cluster.local"

    def __post_init__(self) -> None:
        self.tmp.mkdir(parents=True, exist_ok=True)
        values = _merge(base_values(self.tmp), self.values)
        self.cluster_domain = str(values.get("clusterDomain", "cluster.local"))
        self.specs = render_chart(self.tmp / "render", values)
        _link_caches(self.tmp)
        self.net = PodNet()

    # -- the manifests' names -------------------------------------------------------------
    @property
    def token(self) -> str:
        assert self.specs is not None
        return next(v["token"] for k, v in self.specs.secrets.items() if k.endswith("-cluster-token"))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC metadata for a direct call to a worker (the cluster token)."""
        from contracts.cluster_token import TOKEN_METADATA
        return ((TOKEN_METADATA, self.token),)

    def worker(self, i: int) -> str:
        assert self.specs is not None
        return self.specs.pod_name("worker", i)

    @property
    def router(self) -> str:
        assert self.specs is not None
        return self.specs.pod_name("router")

    @property
    def redis(self) -> str:
        assert self.specs is not None
        return self.specs.pod_name("redis")

    def addr(self, pod: str, port: str) -> str:
        """`IP:port` of a pod's named container port, from the test process."""
        p = self.pods[pod]
        return f"{p.ip}:{p.run.port(port)}"

    def url(self, pod: str, port: str, path: str = "") -> str:
        return f"http://{self.addr(pod, port)}{path}"

    def logs(self, pod: str) -> str:
        p = self.pods.get(pod)
        return p.log.read_text(errors="replace") if p is not None and p.log.exists() else ""

    def log_tails(self, n: int = 3000) -> str:
        return "\n".join(f"--- {name} ---\n{self.logs(name)[-n:]}" for name in self.pods)

    # -- pods ------------------------------------------------------------------------------
    def start_redis(self, timeout_s: float = 30) -> str:
        return self._start("redis", self.redis, timeout_s)

    def start_router(self, timeout_s: float = 180) -> str:
        return self._start("router", self.router, timeout_s)

    def start_worker(self, i: int, timeout_s: float = 420, wait: bool = True) -> str:
        return self._start("worker", self.worker(i), timeout_s if wait else 0)

    def _start(self, component: str, pod: str, timeout_s: float) -> str:
        assert self.net is not None and self.specs is not None
        names = self._dns_names(component, pod)
        ip = self.net.add(pod, names)
        existing = self.pods.get(pod)
        run = self.specs.run(component, pod, ip)
        argv = list(run.argv)
        if argv[0] == "kvmesh":
            argv[:1] = [str(KVMESH)] if KVMESH.exists() else [sys.executable, "-m", "kvmesh.cli"]
        if argv[0] == "redis-server":
            data = self.tmp / pod / "data"
            data.mkdir(parents=True, exist_ok=True)
            argv = [str(data) if a == "/data" else a for a in argv]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), "LANG": "C.UTF-8"} | run.env
        log = self.tmp / pod / f"{pod}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            out.write(f"==== start {(existing.starts if existing else 0) + 1}: {' '.join(argv)}\n".encode())
            out.flush()
            proc = subprocess.Popen([*self.net.exec_prefix(pod), *argv], cwd=self.tmp / pod, env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        p = Pod(pod, component, ip, run, log, proc, (existing.starts if existing else 0) + 1)
        self.pods[pod] = p
        if timeout_s:
            self.wait_ready(pod, timeout_s)
        return pod

    def _dns_names(self, component: str, pod: str) -> list[str]:
        assert self.specs is not None
        suffix = f"{self.specs.namespace}.svc.{self.cluster_domain}"
        w = self.specs.workload(component)
        names = [pod]
        if w["kind"] == "StatefulSet":
            names.append(f"{pod}.{w['spec']['serviceName']}.{suffix}")
        for d in self.specs.docs:       # Services that select this component resolve to its pod
            if d["kind"] == "Service" and d["spec"].get("selector", {}).get(
                    "app.kubernetes.io/component") == component and d["spec"].get("clusterIP") != "None":
                names += [f"{d['metadata']['name']}.{suffix}", d["metadata"]["name"]]
        return names

    def wait_ready(self, pod: str, timeout_s: float) -> float:
        """Seconds until the pod's readinessProbe passes; fails with log tails after `timeout_s`."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            p = self.pods[pod]
            if p.proc is not None and p.proc.poll() is not None:
                raise AssertionError(f"{pod} exited with {p.proc.returncode}:\n{self.logs(pod)[-4000:]}")
            if self.probe(pod, "readinessProbe"):
                return time.monotonic() - t0
            time.sleep(0.5)
        raise AssertionError(f"{pod} not ready in {timeout_s} s:\n{self.log_tails()}")

    def probe(self, pod: str, which: str = "readinessProbe", timeout_s: float = 5.0) -> bool:
        """Run the container's probe (`readinessProbe`, `livenessProbe`, `startupProbe`) once,
        as the kubelet would: grpc health, httpGet, tcpSocket or exec in the pod."""
        p = self.pods[pod]
        spec = p.run.spec.get(which)
        if spec is None:
            return True

        def port_of(value: object) -> int:
            return p.run.port(value) if isinstance(value, str) else int(value)  # type: ignore[arg-type]
        try:
            if "grpc" in spec:
                with grpc.insecure_channel(f"{p.ip}:{port_of(spec['grpc']['port'])}") as ch:
                    reply = health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(service=spec["grpc"].get("service", "")), timeout=timeout_s)
                return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
            if "httpGet" in spec:
                g = spec["httpGet"]
                url = f"http://{p.ip}:{port_of(g['port'])}{g.get('path', '/')}"
                opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
                with opener.open(url, timeout=timeout_s) as r:
                    return 200 <= r.status < 400
            if "tcpSocket" in spec:
                with socket.create_connection((p.ip, port_of(spec["tcpSocket"]["port"])), timeout=timeout_s):
                    return True
            if "exec" in spec:
                assert self.net is not None
                done = subprocess.run(["ip", "netns", "exec", self.net.ns[pod], *spec["exec"]["command"]],
                                      env={"PATH": os.environ.get("PATH", "")} | p.run.env, capture_output=True,
                                      timeout=timeout_s)
                return done.returncode == 0
        except (grpc.RpcError, OSError, subprocess.TimeoutExpired):
            return False
        raise AssertionError(f"{pod}: {which} of an unknown kind {sorted(spec)}")

    def kill(self, pod: str, sig: signal.Signals = signal.SIGKILL, wait_s: float = 60) -> int:
        """Signal the pod's process; waits for it to exit (SIGKILL after `wait_s`). Its exit code."""
        p = self.pods[pod]
        assert p.proc is not None
        if p.proc.poll() is None:
            os.killpg(p.proc.pid, sig)
            try:
                p.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                os.killpg(p.proc.pid, signal.SIGKILL)
                p.proc.wait(timeout=30)
        return p.proc.returncode

    def restart(self, pod: str, timeout_s: float = 420) -> str:
        """Kill -9 (if running) and start again with the same name and IP, as a StatefulSet does."""
        self.kill(pod)
        return self._start(self.pods[pod].component, pod, timeout_s)

    def cut(self, a: str, b: str) -> None:
        """Drop every packet between pods `a` and `b` (iptables in `a`'s namespace, both ways)."""
        assert self.net is not None
        ip_b = self.pods[b].ip
        self.net.iptables(a, "-A", "INPUT", "-s", ip_b, "-j", "DROP")
        self.net.iptables(a, "-A", "OUTPUT", "-d", ip_b, "-j", "DROP")
        self.cuts.add((a, b))

    def heal(self, a: str, b: str) -> None:
        assert self.net is not None
        ip_b = self.pods[b].ip
        self.net.iptables(a, "-D", "INPUT", "-s", ip_b, "-j", "DROP")
        self.net.iptables(a, "-D", "OUTPUT", "-d", ip_b, "-j", "DROP")
        self.cuts.discard((a, b))

    def shape(self, pod: str, rate: str | None) -> None:
        """Limit what `pod` sends to `rate` (tc tbf on its eth0, e.g. "8mbit"); None removes it."""
        assert self.net is not None
        cmd = ["ip", "netns", "exec", self.net.ns[pod], "tc", "qdisc"]
        if rate is None:
            subprocess.run([*cmd, "del", "dev", "eth0", "root"], capture_output=True, timeout=30)
        else:
            subprocess.run([*cmd, "replace", "dev", "eth0", "root", "tbf", "rate", rate, "burst", "64kbit",
                            "latency", "2s"], check=True, capture_output=True, timeout=30)

    def tx_bytes(self, pod: str) -> int:
        """Bytes `pod` has sent on its eth0."""
        assert self.net is not None
        argv = ["ip", "netns", "exec", self.net.ns[pod], "cat", "/sys/class/net/eth0/statistics/tx_bytes"]
        return int(subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout)

    def close(self) -> None:
        """SIGTERM every pod (SIGKILL after 20 s), then remove the network. Idempotent."""
        for p in self.pods.values():
            if p.proc is not None and p.proc.poll() is None:
                try:
                    os.killpg(p.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 20
        for p in self.pods.values():
            if p.proc is None:
                continue
            try:
                p.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.proc.wait(timeout=30)
        if self.net is not None:
            self.net.close()
            self.net = None


def base_values(tmp: Path) -> Doc:
    """Test defaults: CPU, a small pool, volume mountPaths in `tmp`, TLS off, cluster token on."""
    return {"engine": {"model": "smollm2", "device": "cpu", "numBlocks": 128, "maxModelLen": 512, "maxNumSeqs": 16},
            "worker": {"gpu": {"count": 0}, "replicas": 2, "preStopSleepS": 0, "drainTimeoutS": 5,
                       "terminationGracePeriodSeconds": 10},
            "router": {"preStopSleepS": 0, "drainTimeoutS": 5, "terminationGracePeriodSeconds": 10},
            "modelCache": {"mountPath": str(tmp / "models")}, "cache": {"mountPath": str(tmp / "cache")},
            "security": {"tls": {"enabled": False}, "clusterToken": {"enabled": True}}}


def _merge(base: Doc, over: Doc) -> Doc:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _link_caches(tmp: Path) -> None:
    """The chart's KVMESH_CACHE_DIR (cache.mountPath/kvmesh) sees this machine's converted models
    and built kernels (`make setup` made them), so pods resolve `smollm2` as a worker does,
    without converting again."""
    from contracts.models import cache_root
    mine = cache_root()
    for sub in ("models", "kernels"):
        (tmp / "models").mkdir(parents=True, exist_ok=True)
        dst = tmp / "cache" / "kvmesh" / sub
        dst.parent.mkdir(parents=True, exist_ok=True)
        if (mine / sub).is_dir() and not dst.exists():
            dst.symlink_to(mine / sub)

"""`kvmesh serve`: the embedded default — a Redis, N workers and a router as local processes.

`LocalCluster` is a `kvmesh.serve.supervise.Cluster` whose workers are `kvmesh worker` children of
this process (`LocalPlacement`): started in parallel, each learning its port from the worker's
stdout line; with N > 1 each runs with --peer-transfer (pairs of workers form on demand, so a
restarted worker takes part again). Workers bind 127.0.0.1; Redis and the router are the
cluster's (supervise.py).

This module imports no torch: the workers load their engines in their own processes.
"""
from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

from contracts.cluster_token import masked
from kvmesh.serve.processes import Child, LaunchError, free_port, spawn, terminate
from kvmesh.serve.supervise import Cluster, PartExited, ServeConfig, Supervisor
from kvstore.metadata.registry import parse_redis_url

__all__ = ["LaunchError", "LocalCluster", "LocalPlacement", "ServeConfig", "run_serve"]

_LOOPBACK = "127.0.0.1"
_WORKER_LINE = re.compile(r"^kvmesh worker (\S+) serving on (\S+):(\d+)$", re.M)


class LocalPlacement:
    """Workers as `kvmesh worker` child processes on 127.0.0.1 (a `WorkerPlacement`)."""

    def __init__(self) -> None:
        self._workers: list[Child] = []
        self._ports: list[int] = []     # where each worker serves (and is restarted)
        self.metrics_ports: list[int] = []   # each worker's Prometheus /metrics (worker/server/metrics.py)

    def prepare(self, cfg: ServeConfig, deadline: float) -> str:
        return _LOOPBACK

    def start_workers(self, cfg: ServeConfig, redis_url: str, log_dir: Path, deadline: float) -> tuple[str, ...]:
        self.metrics_ports = [free_port(_LOOPBACK) for _ in range(cfg.workers)]
        for i in range(cfg.workers):
            argv = _worker_argv(cfg, f"worker-{i}", 0, self.metrics_ports[i], _peer_argv(cfg.workers))
            self._workers.append(spawn(log_dir, f"worker-{i}", argv, env=cfg.child_env(redis_url)))
        addresses = []
        for w in self._workers:
            m = w.wait_line(_WORKER_LINE, deadline, cfg.startup_timeout_s)
            addresses.append(f"{m.group(2)}:{m.group(3)}")
            self._ports.append(int(m.group(3)))
        return tuple(addresses)

    def poll(self, ignore: frozenset[str]) -> PartExited | None:
        return next((e for w in self._workers if w.name not in ignore and (e := PartExited.of(w)) is not None), None)

    def restart(self, name: str, cfg: ServeConfig, redis_url: str, log_dir: Path) -> None:
        """`name` again on its port; with peer transfer, as a new peer (a new generation): its
        old pairs are gone, and the next fetch with it forms new ones."""
        i = next(i for i, w in enumerate(self._workers) if w.name == name)
        self._workers[i] = spawn(log_dir, name, _worker_argv(cfg, name, self._ports[i], self.metrics_ports[i],
                                             _peer_argv(cfg.workers)),
                                 append=True, env=cfg.child_env(redis_url))

    def pids(self) -> dict[str, int]:
        return {w.name: w.proc.pid for w in self._workers}

    def stop(self, timeout_s: float) -> None:
        terminate(self._workers, timeout_s)


class LocalCluster(Cluster):
    """Redis + N local worker processes + a router; see `kvmesh.serve.supervise.Cluster`."""

    def __init__(self, cfg: ServeConfig | None = None) -> None:
        self.local_placement = LocalPlacement()
        super().__init__(cfg if cfg is not None else ServeConfig(), self.local_placement)


def _peer_argv(num_workers: int) -> list[str]:
    """Peer transfer for a cluster of more than one worker."""
    return ["--peer-transfer"] if num_workers > 1 else []


def _worker_argv(cfg: ServeConfig, name: str, port: int, metrics_port: int, peer_argv: list[str]) -> list[str]:
    """One local worker's command line; its secrets (Redis URL, cluster token) go by environment."""
    return [cfg.python, "-m", "kvmesh.cli", "worker", "--host", _LOOPBACK, "--port", str(port),
            "--metrics-port", str(metrics_port), "--log-format", cfg.log_format, "--worker-id", name,
            "--cluster-name", cfg.cluster_name,
            "--model", cfg.model, *peer_argv, *cfg.worker_tls_argv(), *_threads_argv(cfg), *cfg.engine_argv]


def _threads_argv(cfg: ServeConfig) -> list[str]:
    """Each local worker's share of the cores this process may use (`--threads`), unless the
    engine flags set it: N workers each running every core's worth of threads would make
    2N threads take turns on N cores, and a worker's prefill would stall the others' decode
    (vLLM's CPU backend binds each worker to its own cores for the same reason)."""
    if any(a.split("=", 1)[0] == "--threads" for a in cfg.engine_argv):
        return []
    return ["--threads", str(max(1, len(os.sched_getaffinity(0)) // max(1, cfg.workers)))]



def run_serve(cfg: ServeConfig) -> int:
    """Start the cluster, print where to connect, run until SIGINT/SIGTERM (exit 0), restarting
    children that die per `cfg.restart_policy` (policy never: the first death ends the run with
    exit 1); always stop every child."""
    cluster = LocalCluster(cfg)
    redis_note = "" if cfg.redis_url else " (embedded redis-server)"
    print(f"kvmesh serve: starting redis, {cfg.workers} worker(s) on {cfg.model} and a router "
          "(loading takes a while)...", flush=True)
    return Supervisor(cluster, "serve", lambda: _print_addresses(cluster, redis_note), poll_s=0.5).run()


def _print_addresses(cluster: LocalCluster, redis_note: str) -> None:
    cfg = cluster.cfg
    body = json.dumps({"model": cfg.model, "messages": [{"role": "user", "content": "What is a KV cache?"}],
                       "max_tokens": 64})
    pids = " ".join(f"{name}={pid}" for name, pid in cluster.pids.items())
    ca = cfg.tls.ca if cfg.tls.serves_tls else None
    ca_flag, ca_curl = (f" --tls-ca {ca}", f" --cacert {ca}") if ca is not None else ("", "")
    print("\n".join([
        f"kvmesh serve: ready — {cfg.workers} worker(s), cluster {cfg.cluster_name}",
        f"  gRPC     {cluster.grpc_target}",
        f"  HTTP     {cluster.http_base_url}",
        f"  redis    {parse_redis_url(cluster.redis_url).redacted()}{redis_note}",
        f"  security {_security_note(cfg)}",
        f"  workers  {' '.join(cluster.worker_addresses)}",
        f"  dashboard {cluster.http_base_url.removesuffix('/v1')}/dashboard",
        f"  metrics  {cluster.http_base_url.removesuffix('/v1')}/metrics (router)",
        *(f"           http://{_LOOPBACK}:{port}/metrics (worker-{i})"
          for i, port in enumerate(cluster.local_placement.metrics_ports)),
        f"  logs     {cluster.log_dir}",
        f"  pids     {pids}",
        "  try:",
        f"    kvmesh client generate --target {cluster.grpc_target}{ca_flag} --chat \"What is a KV cache?\"",
        f"    curl -s{ca_curl} {cluster.http_base_url}/chat/completions -H 'Content-Type: application/json' "
        f"-d {shlex.quote(body)}",
        "  Ctrl-C stops everything.",
    ]), flush=True)


def _security_note(cfg: ServeConfig) -> str:
    """What protects the cluster, for the banner (secrets masked)."""
    token = f"cluster token {masked(cfg.cluster_token)}" if cfg.cluster_token else "no cluster token"
    tls = ("mutual TLS router<->workers" if cfg.tls.ca is not None
           else "TLS on the router's ports" if cfg.tls.serves_tls else "no TLS (loopback)")
    return f"{token}; {tls}; embedded Redis with a password" if not cfg.redis_url else f"{token}; {tls}"

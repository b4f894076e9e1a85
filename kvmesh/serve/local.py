"""`kvmesh serve`: the embedded default — a Redis, N workers and a router as local processes.

`LocalCluster` is a `kvmesh.serve.supervise.Cluster` whose workers are `kvmesh worker` children of
this process (`LocalPlacement`): started in parallel, each learning its port from the worker's
stdout line; with N > 1 each runs with --peer-transfer (pairs of workers form on demand, so a
restarted worker takes part again). Each runs with its role (--role prefill|decode, none for a
mixed one) and, with `cpu_affinity_per_worker`, --cpu-affinity on its own share of the CPUs this
process may use (kvmesh.serve.roles); a restart keeps both. Workers bind 127.0.0.1; Redis and the
router are the cluster's (supervise.py).

This module imports no torch: the workers load their engines in their own processes.
"""
from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

from contracts.cluster_token import masked
from kvmesh.serve.config import ServeConfig
from kvmesh.serve.processes import Child, LaunchError, free_port, spawn, terminate
from kvmesh.serve.roles import affinity_argv, role_argv, split_cpus
from kvmesh.serve.supervise import Cluster, PartExited, Supervisor
from kvstore.metadata.registry import parse_redis_url
from worker.server.affinity import format_cpu_list

__all__ = ["LaunchError", "LocalCluster", "LocalPlacement", "ServeConfig", "run_serve"]

_LOOPBACK = "127.0.0.1"
_WORKER_LINE = re.compile(r"^kvmesh worker (\S+) serving on (\S+):(\d+)$", re.M)


class LocalPlacement:
    """Workers as `kvmesh worker` child processes on 127.0.0.1 (a `WorkerPlacement`)."""

    def __init__(self) -> None:
        self._workers: list[Child] = []
        self._ports: list[int] = []     # where each worker serves (and is restarted)
        self.cpus: tuple[tuple[int, ...], ...] | None = None   # each worker's CPUs when pinned
        self.metrics_ports: list[int] = []   # each worker's Prometheus /metrics (worker/server/metrics.py)

    def prepare(self, cfg: ServeConfig, deadline: float) -> str:
        return _LOOPBACK

    def start_workers(self, cfg: ServeConfig, redis_url: str, log_dir: Path, deadline: float) -> tuple[str, ...]:
        if cfg.cpu_affinity_per_worker:
            try:
                self.cpus = split_cpus(sorted(os.sched_getaffinity(0)), cfg.num_workers)
            except ValueError as e:
                raise LaunchError(f"--cpu-affinity-per-worker: {e}") from None
        self.metrics_ports = [free_port(_LOOPBACK) for _ in range(cfg.num_workers)]
        for i in range(cfg.num_workers):
            argv = self._worker_argv(cfg, i, 0)
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
        self._workers[i] = spawn(log_dir, name, self._worker_argv(cfg, i, self._ports[i]), append=True,
                                 env=cfg.child_env(redis_url))

    def pids(self) -> dict[str, int]:
        return {w.name: w.proc.pid for w in self._workers}

    def _worker_argv(self, cfg: ServeConfig, i: int, port: int) -> list[str]:
        """Worker i's command line: its role, its CPUs when pinned, its ports."""
        extra = [*_peer_argv(cfg.num_workers), *role_argv(cfg.roles[i], cfg.decode_step_prefill_tokens),
                 *affinity_argv(self.cpus[i] if self.cpus is not None else None)]
        return _worker_argv(cfg, f"worker-{i}", port, self.metrics_ports[i], extra)

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


def _worker_argv(cfg: ServeConfig, name: str, port: int, metrics_port: int, extra: list[str]) -> list[str]:
    """One local worker's command line; its secrets (Redis URL, cluster token) go by environment."""
    return [cfg.python, "-m", "kvmesh.cli", "worker", "--host", _LOOPBACK, "--port", str(port),
            "--metrics-port", str(metrics_port), "--log-format", cfg.log_format, "--worker-id", name,
            "--cluster-name", cfg.cluster_name,
            "--model", cfg.model, *extra, *cfg.worker_tls_argv(), *_threads_argv(cfg), *cfg.engine_argv]


def _threads_argv(cfg: ServeConfig) -> list[str]:
    """Each local worker's share of the cores this process may use (`--threads`), unless the
    engine flags set it or the workers are pinned (a pinned worker runs one thread per CPU
    it has): N workers each running every core's worth of threads would make 2N threads take
    turns on N cores, and a worker's prefill would stall the others' decode (vLLM's CPU backend
    binds each worker to its own cores for the same reason)."""
    if cfg.cpu_affinity_per_worker or any(a.split("=", 1)[0] == "--threads" for a in cfg.engine_argv):
        return []
    return ["--threads", str(max(1, len(os.sched_getaffinity(0)) // max(1, cfg.num_workers)))]


def run_serve(cfg: ServeConfig) -> int:
    """Start the cluster, print where to connect, run until SIGINT/SIGTERM (exit 0), restarting
    children that die per `cfg.restart_policy` (policy never: the first death ends the run with
    exit 1); always stop every child."""
    cluster = LocalCluster(cfg)
    redis_note = "" if cfg.redis_url else " (embedded redis-server)"
    print(f"kvmesh serve: starting redis, {_workers_note(cfg)} on {cfg.model} and a router "
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
        f"kvmesh serve: ready — {_workers_note(cfg)}, cluster {cfg.cluster_name}",
        f"  gRPC     {cluster.grpc_target}",
        f"  HTTP     {cluster.http_base_url}",
        f"  redis    {parse_redis_url(cluster.redis_url).redacted()}{redis_note}",
        f"  security {_security_note(cfg)}",
        f"  workers  {' '.join(cluster.worker_addresses)}",
        *([f"  roles    {' '.join(f'worker-{i}={r.value}' for i, r in enumerate(cfg.roles))}"]
          if cfg.prefill_workers or cfg.decode_workers else []),
        *([f"  cpus     {' '.join(f'worker-{i}={format_cpu_list(c)}' for i, c in enumerate(cpus))}"]
          if (cpus := cluster.local_placement.cpus) is not None else []),
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


def _workers_note(cfg: ServeConfig) -> str:
    """'2 worker(s)', or '1 prefill + 1 decode worker(s)' (with the mixed ones when any)."""
    if not (cfg.prefill_workers or cfg.decode_workers):
        return f"{cfg.workers} worker(s)"
    parts = [f"{cfg.prefill_workers} prefill", f"{cfg.decode_workers} decode"]
    return " + ".join(parts + ([f"{cfg.workers} mixed"] if cfg.workers else [])) + " worker(s)"


def _security_note(cfg: ServeConfig) -> str:
    """What protects the cluster, for the banner (secrets masked)."""
    token = f"cluster token {masked(cfg.cluster_token)}" if cfg.cluster_token else "no cluster token"
    tls = ("mutual TLS router<->workers" if cfg.tls.ca is not None
           else "TLS on the router's ports" if cfg.tls.serves_tls else "no TLS (loopback)")
    return f"{token}; {tls}; embedded Redis with a password" if not cfg.redis_url else f"{token}; {tls}"

"""`kvmesh serve --ray`: the same cluster as `kvmesh serve`, its workers placed by Ray.

`RayCluster` is a `kvmesh.serve.supervise.Cluster` (Redis and the router are child processes on this
driver node, as for `kvmesh serve`) whose `RayPlacement` connects to a Ray cluster (`address`:
"auto", "HOST:PORT", or None = RAY_ADDRESS when set — as under `ray job submit` — else a local
Ray started here), creates a placement group named `kvmesh-<cluster>` with one bundle per worker
(`{"GPU": g}` when the cluster has GPUs, else `{"CPU": c}`) and one named actor `worker-<i>`
per bundle running a WorkerServer. Everything Ray-side lives in the namespace
`kvmesh-<cluster>`; `stop_named_cluster` (`kvmesh serve --ray --stop`) kills exactly the named
actors and the placement group there, nothing else.

With more than one worker, each gets KVMESH_PEER_TRANSFER=1 in its environment before its
engine is built (pairs of workers form on demand, as under `kvmesh serve`). Each actor serves
with its role (kvmesh.serve.roles) and, with `cpu_affinity_per_worker`, pins itself to its share
of its node's CPUs: the workers placed on one node split that node's CPUs between them.
When every bundle lands on the driver's node, workers and redis bind 127.0.0.1; otherwise
they bind their node's IP (Ray's node address) so the other nodes can reach them.

This module imports no torch and imports ray only inside functions (Ray is optional: `kvmesh
serve` without --ray never loads it). The actors build their engines in their own processes.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contracts.cluster_token import token_from
from kvmesh.serve.config import ServeConfig
from kvmesh.serve.processes import LaunchError
from kvmesh.serve.ray_specs import WorkerSpec, worker_specs
from kvmesh.serve.roles import split_cpus
from kvmesh.serve.supervise import Cluster, PartExited, Supervisor
from kvstore.metadata.registry import parse_redis_url
from worker.cli import add_engine_arguments, engine_config_from_args
from worker.server.affinity import pin_process
from worker.server.cli import (
    PREFILL_CHUNK_TOKENS,
    peer_flags_from_env,
    role_engine_config,
)
from worker.server.service import WorkerServer, WorkerServerConfig

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_LOOPBACK = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class RayServeConfig:
    """`serve` is what to start (as for `kvmesh serve`); the rest says how Ray places it.
    `temp_dir`, `num_cpus` and `object_store_memory` apply only to a local Ray started here."""

    serve: ServeConfig = field(default_factory=ServeConfig)
    address: str | None = None
    gpus_per_worker: float = 1.0
    cpus_per_worker: float = 1.0
    placement_strategy: str = "PACK"
    temp_dir: Path | None = None                 # None: a fresh dir under /tmp, removed by stop()
    num_cpus: int | None = None                  # None: Ray counts them
    object_store_memory: int = 256 * 2**20

    def __post_init__(self) -> None:
        if self.address is not None and not self.address:
            raise ValueError("address is empty (use 'auto', HOST:PORT, or leave it unset)")
        for name in ("gpus_per_worker", "cpus_per_worker"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement_strategy={self.placement_strategy!r}; accepted: "
                             f"{', '.join(PLACEMENT_STRATEGIES)}")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ValueError(f"num_cpus={self.num_cpus!r} must be >= 1")
        if self.object_store_memory < 75 * 2**20:   # Ray's own floor
            raise ValueError(f"object_store_memory={self.object_store_memory!r} must be >= 75 MiB")

    @property
    def namespace(self) -> str:
        return namespace_for(self.serve.cluster_name)


def namespace_for(cluster_name: str) -> str:
    """The Ray namespace (and placement-group name) of a kvmesh cluster."""
    return f"kvmesh-{cluster_name}"


class WorkerActor:
    """A Ray actor (wrapped with ray.remote at launch) holding one WorkerServer. The server runs
    on an event loop in a thread of its own, so actor calls never block it."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvmesh-worker-loop", daemon=True)
        self._thread.start()
        self._server: WorkerServer | None = None

    def host(self, loopback: bool) -> str:
        import ray
        return _LOOPBACK if loopback else ray.util.get_node_ip_address()

    def start(self, spec: WorkerSpec) -> str:
        """Set the env (and the CPU affinity), load the engine, serve; returns the address the
        router dials."""
        os.environ.update(dict(spec.env))
        parser = argparse.ArgumentParser(add_help=False)
        add_engine_arguments(parser)
        args = parser.parse_args(["--model", spec.model, *spec.engine_argv])
        if spec.cpu_share is not None:
            cpus = split_cpus(sorted(os.sched_getaffinity(0)), spec.cpu_share[1])[spec.cpu_share[0]]
            pin_process(cpus)
            args.threads = args.threads or len(cpus)
        # the role's engine settings, as `kvmesh worker --role` applies them (the default prefill chunk)
        engine_cfg = role_engine_config(engine_config_from_args(args), spec.role.value, PREFILL_CHUNK_TOKENS,
                                        spec.decode_step_prefill_tokens)
        host = self.host(spec.loopback)
        peer = peer_flags_from_env(os.environ)   # KVMESH_PEER_TRANSFER, from spec.env
        self._server = server = WorkerServer(engine_cfg, WorkerServerConfig(
            host=host, port=spec.port, worker_id=spec.worker_id, redis_url=spec.redis_url,
            cluster_name=spec.cluster_name, peer_transfer=peer.peer_transfer, transfer_port=peer.transfer_port,
            cluster_token=token_from(None), tls=spec.tls, role=spec.role))   # token: spec.env

        async def go() -> int:
            port = await server.start()
            await server.wait_ready(spec.startup_timeout_s)
            return port
        port = asyncio.run_coroutine_threadsafe(go(), self._loop).result()
        return f"{host}:{port}"

    def ping(self) -> bool:
        return self._server is not None

    def peer_transfer(self) -> bool:
        """Whether this actor's worker serves with a peer plane (its spec's environment)."""
        return self._server is not None and self._server.cfg.peer_transfer

    def stop(self, grace: float) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(grace), self._loop).result()


class RayPlacement:
    """Workers as named Ray actors in a placement group (a `WorkerPlacement`). Connects to Ray
    in `prepare`; if Ray is already initialised here (ray.init by the caller) it is used as is
    and left initialised, else `stop` shuts down the Ray it connected to or started."""

    def __init__(self, cfg: RayServeConfig) -> None:
        self.cfg = cfg
        self._loopback = True
        self._gpu = False
        self._owns_ray = False
        self._ray_temp: Path | None = None
        self._pg: Any = None
        self._actors: list[Any] = []
        self._addresses: list[str] = []      # where each actor serves, by index
        self._specs: list[WorkerSpec] = []   # what each actor was started with, by index
        self._nodes: dict[int, str] = {}     # bundle (worker) index -> Ray node id

    def prepare(self, cfg: ServeConfig, deadline: float) -> str:
        """Connect, reserve one bundle per worker; Redis binds loopback if every bundle is here."""
        import ray  # optional: only `kvmesh serve --ray` needs it
        namespace = self.cfg.namespace
        self._init_ray()
        if any(a["namespace"] == namespace for a in ray.util.list_named_actors(all_namespaces=True)):
            raise LaunchError(f"Ray namespace {namespace} already has actors: a cluster named "
                              f"{cfg.cluster_name!r} is running (stop it with kvmesh serve --ray --stop "
                              f"--cluster-name {cfg.cluster_name}, or pick another --cluster-name)")
        self._gpu = ray.cluster_resources().get("GPU", 0) > 0
        bundle = {"GPU": self.cfg.gpus_per_worker} if self._gpu else {"CPU": self.cfg.cpus_per_worker}
        self._pg = ray.util.placement_group([dict(bundle) for _ in range(cfg.num_workers)],
                                            strategy=self.cfg.placement_strategy, name=namespace)
        try:
            ray.get(self._pg.ready(), timeout=max(deadline - time.monotonic(), 1.0))
        except ray.exceptions.GetTimeoutError:
            raise LaunchError(f"placement group of {cfg.num_workers} x {bundle} ({self.cfg.placement_strategy}) not "
                              f"placed within {cfg.startup_timeout_s:.0f} s; cluster has "
                              f"{ray.available_resources()}") from None
        here = ray.get_runtime_context().get_node_id()
        self._nodes = dict(ray.util.placement_group_table(self._pg)["bundles_to_node_id"])
        self._loopback = set(self._nodes.values()) == {here}
        return _LOOPBACK if self._loopback else ray.util.get_node_ip_address()

    def start_workers(self, cfg: ServeConfig, redis_url: str, log_dir: Path, deadline: float) -> tuple[str, ...]:
        import ray
        for index in range(cfg.num_workers):
            self._actors.append(self._new_actor(index))
        specs = worker_specs(cfg, redis_url, self._loopback, self._nodes)
        self._specs = specs
        started = [a.start.remote(s) for a, s in zip(self._actors, specs)]
        try:
            self._addresses = list(ray.get(started, timeout=max(deadline - time.monotonic(), 1.0)))
            return tuple(self._addresses)
        except ray.exceptions.GetTimeoutError:
            raise LaunchError(f"worker actors did not load {cfg.model} within {cfg.startup_timeout_s:.0f} s") from None
        except ray.exceptions.RayTaskError as e:
            raise LaunchError(f"a worker actor failed to start: {str(e).strip().splitlines()[-1]}") from None

    def poll(self, ignore: frozenset[str]) -> PartExited | None:
        """The first worker actor (not in `ignore`) that does not answer a ping, else None."""
        import ray
        for i, actor in enumerate(self._actors):
            if f"worker-{i}" in ignore:
                continue
            try:
                ray.get(actor.ping.remote(), timeout=30)
            except (ray.exceptions.RayError, TimeoutError) as e:
                line = str(e).splitlines()[0] if str(e) else ""
                return PartExited(f"worker-{i}", f"(Ray actor) is gone: {type(e).__name__}: {line}")
        return None

    def restart(self, name: str, cfg: ServeConfig, redis_url: str, log_dir: Path) -> None:
        """Replace the dead actor `name` with a new one in the same placement-group bundle,
        serving on the same port with the same environment (peer plane, cluster token): on the
        same HOST:PORT while its node lives (the router dials it there again); where Ray placed
        the bundle again when its node died (a surviving node's IP: it registers there in Redis,
        where the router finds it). Returns once it serves (the model load is part of the
        restart); LaunchError if it cannot."""
        import ray
        index = int(name.rsplit("-", 1)[1])
        with contextlib.suppress(ray.exceptions.RayError, ValueError):
            ray.kill(self._actors[index], no_restart=True)
        port = int(self._addresses[index].rsplit(":", 1)[1])
        spec = dataclasses.replace(self._specs[index], port=port)   # same env: peer plane, cluster token
        deadline = time.monotonic() + 30
        while True:     # the dead actor's name is released asynchronously
            try:
                self._actors[index] = self._new_actor(index)
                break
            except ValueError as e:
                if time.monotonic() > deadline:
                    raise LaunchError(f"{name}: its actor name is still taken: {e}") from None
                time.sleep(0.5)
        try:   # its bundle may have moved to another node (its node died): the router finds it in Redis
            self._addresses[index] = ray.get(self._actors[index].start.remote(spec), timeout=cfg.startup_timeout_s)
        except (ray.exceptions.RayError, TimeoutError) as e:
            raise LaunchError(f"{name}: the replacement actor did not start: "
                              f"{str(e).strip().splitlines()[-1]}") from None

    def _new_actor(self, index: int) -> Any:
        """A WorkerActor named worker-<index> in bundle `index` of the placement group."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        resources = (dict(num_gpus=self.cfg.gpus_per_worker, num_cpus=0) if self._gpu
                     else dict(num_cpus=self.cfg.cpus_per_worker))
        return ray.remote(max_restarts=0)(WorkerActor).options(  # type: ignore[attr-defined]
            name=f"worker-{index}", namespace=self.cfg.namespace, **resources,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=index),
        ).remote()

    def pids(self) -> dict[str, int]:
        return {}

    def stop(self, timeout_s: float) -> None:
        """Worker actors (drain, kill), the placement group, the Ray we started. Idempotent."""
        import ray
        if self._actors or self._pg is not None:
            pending = [a.stop.remote(timeout_s) for a in self._actors]
            ray.wait(pending, num_returns=len(pending), timeout=timeout_s + 5)
            for actor in self._actors:
                ray.kill(actor, no_restart=True)
            self._actors = []
            if self._pg is not None:
                ray.util.remove_placement_group(self._pg)
                self._pg = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
        if self._ray_temp is not None:
            shutil.rmtree(self._ray_temp, ignore_errors=True)
            self._ray_temp = None

    def _init_ray(self) -> None:
        import ray
        cfg = self.cfg
        if ray.is_initialized():
            return
        address = cfg.address or os.environ.get("RAY_ADDRESS") or None
        if address is None:     # a local Ray of our own: no auth token, a short temp dir, a capped store
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            self._ray_temp = cfg.temp_dir or Path(tempfile.mkdtemp(prefix="kvray-", dir="/tmp"))
            ray.init(namespace=cfg.namespace, num_cpus=cfg.num_cpus, object_store_memory=cfg.object_store_memory,
                     _temp_dir=str(self._ray_temp), include_dashboard=False, log_to_driver=True)
        else:
            ray.init(address=address, namespace=cfg.namespace, log_to_driver=True)
        self._owns_ray = True


class RayCluster(Cluster):
    """Ray-placed workers + Redis and a router child on this (driver) node; see
    `kvmesh.serve.supervise.Cluster`. `ray_cfg` says how Ray places them."""

    def __init__(self, cfg: RayServeConfig | None = None) -> None:
        self.ray_cfg = cfg if cfg is not None else RayServeConfig()
        self._placement = RayPlacement(self.ray_cfg)
        super().__init__(self.ray_cfg.serve, self._placement)


# -- `kvmesh serve --ray` / `--ray --stop` ----------------------------------------------------
def stop_named_cluster(address: str | None, cluster_name: str) -> list[str]:
    """Connect to the Ray cluster at `address` (None: RAY_ADDRESS, else "auto"), kill the named
    actors in namespace kvmesh-<cluster_name> and remove its placement group; returns what was
    stopped ("actor worker-0", "placement group kvmesh-x"). Touches nothing outside the namespace."""
    import ray
    namespace = namespace_for(cluster_name)
    owned = not ray.is_initialized()
    if owned:
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", namespace=namespace, log_to_driver=False)
    stopped: list[str] = []
    try:
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry["namespace"] == namespace:
                ray.kill(ray.get_actor(entry["name"], namespace=namespace), no_restart=True)
                stopped.append(f"actor {entry['name']}")
        if ray.get_runtime_context().namespace == namespace:   # placement-group names are per namespace
            try:
                pg = ray.util.get_placement_group(namespace)
            except ValueError:
                pg = None
            if pg is not None:
                ray.util.remove_placement_group(pg)
                stopped.append(f"placement group {namespace}")
    finally:
        if owned:
            ray.shutdown()
    return stopped


def run_ray_serve(cfg: RayServeConfig) -> int:
    """Start on Ray, print where to connect, run until SIGINT/SIGTERM (exit 0) or until a worker
    actor or redis goes (exit 1 — e.g. after `--stop` from elsewhere); always tear down."""
    cluster = RayCluster(cfg)
    serve = cfg.serve
    print(f"kvmesh serve --ray: placing {serve.num_workers} worker(s) on {serve.model} "
          f"(namespace {cfg.namespace}; loading takes a while)...", flush=True)

    def banner() -> None:
        import ray
        gcs = ray.get_runtime_context().gcs_address
        local = "RAY_AUTH_MODE=disabled " if cfg.address is None and "RAY_ADDRESS" not in os.environ else ""
        print("\n".join([
            f"kvmesh serve --ray: ready — {serve.num_workers} worker actor(s), cluster {serve.cluster_name}",
            f"  gRPC       {cluster.grpc_target}",
            f"  HTTP       {cluster.http_base_url}",
            f"  redis      {parse_redis_url(cluster.redis_url).redacted()}"
            f"{'' if serve.redis_url else ' (embedded redis-server)'}",
            f"  workers    {' '.join(cluster.worker_addresses)}",
            f"  roles      {' '.join(f'worker-{i}={r.value}' for i, r in enumerate(serve.roles))}",
            f"  ray        {gcs}{' (a local Ray started here)' if local else ''}",
            f"  namespace  {cfg.namespace} (actors worker-0..{serve.num_workers - 1}, "
            f"placement group {cfg.namespace})",
            f"  try:  kvmesh client generate --target {cluster.grpc_target} --chat \"What is a KV cache?\"",
            f"  Ctrl-C stops everything; from elsewhere: {local}kvmesh serve --ray --stop --ray-address {gcs} "
            f"--cluster-name {serve.cluster_name}",
        ]), flush=True)

    return Supervisor(cluster, "serve --ray", banner, poll_s=1.0).run()

"""`kvmesh serve --ray`: the same cluster as `kvmesh serve` (router.launch), placed by Ray.

`RayCluster.start()` connects to a Ray cluster (`address`: "auto", "HOST:PORT", or None =
RAY_ADDRESS when set — as under `ray job submit` — else a local Ray started here), creates a
placement group named `kvmesh-<cluster>` with one bundle per worker (`{"GPU": g}` when the cluster
has GPUs, else `{"CPU": c}`), starts a redis-server child (unless `redis_url`), one named actor
`worker-<rank>` per bundle running a WorkerServer, and the router in this (driver) process.
Everything Ray-side lives in the namespace `kvmesh-<cluster>`; `stop_named_cluster` (`kvmesh serve
--ray --stop`) kills exactly the named actors and the placement group there, nothing else.

Each worker gets KVMESH_RANK, KVMESH_WORLD_SIZE and KVMESH_DIST_INIT_ADDR (a free port on
rank 0's node) in its environment before its engine is built, for the peer-transfer group.
When every bundle lands on the driver's node, workers and redis bind 127.0.0.1; otherwise
they bind their node's IP (Ray's node address) so the other nodes can reach them.

This module imports no torch and imports ray only inside functions: `kvmesh serve` without
--ray never loads it. The actors import the engine in their own processes.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from router.launch import LaunchError, ServeConfig, _Child, _dial_host, _terminate, start_redis, supervise

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


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What one worker actor serves. `env` goes into os.environ before the engine is built."""

    worker_id: str
    model: str
    engine_argv: tuple[str, ...]
    redis_url: str
    cluster_name: str
    loopback: bool
    env: tuple[tuple[str, str], ...]
    startup_timeout_s: float


class WorkerActor:
    """A Ray actor (wrapped with ray.remote at launch) holding one WorkerServer. The server runs
    on an event loop in a thread of its own, so actor calls never block it."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvmesh-worker-loop", daemon=True)
        self._thread.start()
        self._server: Any = None    # worker.server.WorkerServer (imported here: it pulls torch)

    def host(self, loopback: bool) -> str:
        import ray
        return _LOOPBACK if loopback else ray.util.get_node_ip_address()

    def reserve_address(self, loopback: bool) -> str:
        """HOST:PORT of a port free on this actor's node (the rendezvous of rank 0)."""
        host = self.host(loopback)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return f"{host}:{s.getsockname()[1]}"

    def start(self, spec: WorkerSpec) -> str:
        """Set the env, load the engine, serve; returns the address the router dials."""
        from worker.cli import add_engine_arguments, engine_config_from_args
        from worker.server import WorkerServer, WorkerServerConfig
        from worker.server_cli import rendezvous_from_env
        os.environ.update(dict(spec.env))
        parser = argparse.ArgumentParser(add_help=False)
        add_engine_arguments(parser)
        engine_cfg = engine_config_from_args(parser.parse_args(["--model", spec.model, *spec.engine_argv]))
        host = self.host(spec.loopback)
        rdv = rendezvous_from_env(os.environ)   # the peer-transfer group (KVMESH_* set for this actor)
        self._server = server = WorkerServer(engine_cfg, WorkerServerConfig(
            host=host, port=0, worker_id=spec.worker_id, redis_url=spec.redis_url, cluster_name=spec.cluster_name,
            rank=rdv.rank, world_size=rdv.world_size, dist_init_addr=rdv.dist_init_addr))

        async def go() -> int:
            port = await server.start()
            await server.wait_ready(spec.startup_timeout_s)
            return port
        port = asyncio.run_coroutine_threadsafe(go(), self._loop).result()
        return f"{host}:{port}"

    def ping(self) -> bool:
        return self._server is not None

    def rendezvous(self) -> tuple[str | None, str | None, str | None]:
        """(KVMESH_RANK, KVMESH_WORLD_SIZE, KVMESH_DIST_INIT_ADDR) as this actor's process sees them."""
        return tuple(os.environ.get(k) for k in ("KVMESH_RANK", "KVMESH_WORLD_SIZE", "KVMESH_DIST_INIT_ADDR"))  # type: ignore[return-value]

    def stop(self, grace: float) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(grace), self._loop).result()


@dataclass(eq=False)
class RayCluster:
    """Ray-placed workers + a router in this process. Use as a context manager, or `start()`
    then `stop()` (idempotent; also after a failed start). If Ray is already initialised here
    (ray.init by the caller) it is used as is and left initialised."""

    cfg: RayServeConfig = field(default_factory=RayServeConfig)
    grpc_target: str = field(init=False, default="")
    http_base_url: str = field(init=False, default="")
    worker_addresses: tuple[str, ...] = field(init=False, default=())
    redis_url: str = field(init=False, default="")
    dist_init_addr: str = field(init=False, default="")
    _owns_ray: bool = field(init=False, default=False)
    _ray_temp: Path | None = field(init=False, default=None)
    _log_dir: Path | None = field(init=False, default=None)
    _redis: _Child | None = field(init=False, default=None)
    _pg: Any = field(init=False, default=None)
    _actors: list[Any] = field(init=False, default_factory=list)
    _router: Any = field(init=False, default=None)
    _loop: asyncio.AbstractEventLoop | None = field(init=False, default=None)
    _thread: threading.Thread | None = field(init=False, default=None)

    def start(self) -> RayCluster:
        """Start everything; raises LaunchError (after stopping what did start)."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def poll(self) -> str | None:
        """None while every worker actor answers; else a line saying which one does not."""
        import ray
        for i, actor in enumerate(self._actors):
            try:
                ray.get(actor.ping.remote(), timeout=30)
            except (ray.exceptions.RayError, TimeoutError) as e:
                return f"worker-{i} (Ray actor) is gone: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if self._redis is not None and (rc := self._redis.proc.poll()) is not None:
            return f"redis (pid {self._redis.proc.pid}) exited with code {rc}\n{self._redis.tail()}"
        return None

    def stop(self) -> None:
        """Router, then worker actors (drain, kill), placement group, redis, the Ray we started."""
        serve = self.cfg.serve
        if self._router is not None and self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._router.stop(serve.stop_timeout_s), self._loop).result()
            self._router = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            assert self._thread is not None
            self._thread.join()
            self._loop.close()
            self._loop = self._thread = None
        if self._actors or self._pg is not None:
            import ray
            pending = [a.stop.remote(serve.stop_timeout_s) for a in self._actors]
            ray.wait(pending, num_returns=len(pending), timeout=serve.stop_timeout_s + 5)
            for actor in self._actors:
                ray.kill(actor, no_restart=True)
            self._actors = []
            if self._pg is not None:
                ray.util.remove_placement_group(self._pg)
                self._pg = None
        if self._redis is not None:
            _terminate([self._redis], serve.stop_timeout_s)
            self._redis = None
        if self._owns_ray:
            import ray
            ray.shutdown()
            self._owns_ray = False
        for d in (self._log_dir if serve.log_dir is None else None, self._ray_temp):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)
        self._ray_temp = self._log_dir = None

    def __enter__(self) -> RayCluster:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- start --------------------------------------------------------------------------------
    def _start(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        cfg, serve = self.cfg, self.cfg.serve
        deadline = time.monotonic() + serve.startup_timeout_s
        self._init_ray()
        if any(a["namespace"] == cfg.namespace for a in ray.util.list_named_actors(all_namespaces=True)):
            raise LaunchError(f"Ray namespace {cfg.namespace} already has actors: a cluster named "
                              f"{serve.cluster_name!r} is running (stop it with kvmesh serve --ray --stop "
                              f"--cluster-name {serve.cluster_name}, or pick another --cluster-name)")
        gpu = ray.cluster_resources().get("GPU", 0) > 0
        bundle = {"GPU": cfg.gpus_per_worker} if gpu else {"CPU": cfg.cpus_per_worker}
        self._pg = ray.util.placement_group([dict(bundle) for _ in range(serve.workers)],
                                            strategy=cfg.placement_strategy, name=cfg.namespace)
        try:
            ray.get(self._pg.ready(), timeout=max(deadline - time.monotonic(), 1.0))
        except ray.exceptions.GetTimeoutError:
            raise LaunchError(f"placement group of {serve.workers} x {bundle} ({cfg.placement_strategy}) not placed "
                              f"within {serve.startup_timeout_s:.0f} s; cluster has {ray.available_resources()}") from None
        here = ray.get_runtime_context().get_node_id()
        nodes = set(ray.util.placement_group_table(self._pg)["bundles_to_node_id"].values())
        loopback = nodes == {here}
        self._log_dir = serve.log_dir or Path(tempfile.mkdtemp(prefix=f"kvmesh-{serve.cluster_name}-"))
        self._log_dir.mkdir(parents=True, exist_ok=True)
        if serve.redis_url is not None:
            self.redis_url = serve.redis_url
        else:
            bind = _LOOPBACK if loopback else ray.util.get_node_ip_address()
            self.redis_url, self._redis = start_redis(self._log_dir, bind, serve.stop_timeout_s)
        remote = ray.remote(max_restarts=0)(WorkerActor)
        for rank in range(serve.workers):
            resources = dict(num_gpus=cfg.gpus_per_worker, num_cpus=0) if gpu else dict(num_cpus=cfg.cpus_per_worker)
            self._actors.append(remote.options(  # type: ignore[attr-defined]
                name=f"worker-{rank}", namespace=cfg.namespace, **resources,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank),
            ).remote())
        self.dist_init_addr = ray.get(self._actors[0].reserve_address.remote(loopback))
        specs = [WorkerSpec(worker_id=f"worker-{rank}", model=serve.model, engine_argv=serve.engine_argv,
                            redis_url=self.redis_url, cluster_name=serve.cluster_name, loopback=loopback,
                            env=(("KVMESH_RANK", str(rank)), ("KVMESH_WORLD_SIZE", str(serve.workers)),
                                 ("KVMESH_DIST_INIT_ADDR", self.dist_init_addr)),
                            startup_timeout_s=serve.startup_timeout_s)
                 for rank in range(serve.workers)]
        started = [a.start.remote(s) for a, s in zip(self._actors, specs)]
        try:
            self.worker_addresses = tuple(ray.get(started, timeout=max(deadline - time.monotonic(), 1.0)))
        except ray.exceptions.GetTimeoutError:
            raise LaunchError(f"worker actors did not load {serve.model} within {serve.startup_timeout_s:.0f} s") from None
        except ray.exceptions.RayTaskError as e:
            raise LaunchError(f"a worker actor failed to start: {str(e).strip().splitlines()[-1]}") from None
        self._start_router(deadline)

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

    def _start_router(self, deadline: float) -> None:
        from router.server import RouterConfig, RouterServer
        serve = self.cfg.serve
        router = RouterServer(RouterConfig(
            worker_addresses=self.worker_addresses, host=serve.host, grpc_port=serve.grpc_port,
            http_port=serve.http_port, model=serve.model, redis_url=self.redis_url,
            cluster_name=serve.cluster_name, routing_policy=serve.routing_policy, load_factor=serve.load_factor))
        self._loop = loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name="kvmesh-router-loop", daemon=True)
        self._thread.start()

        async def go() -> tuple[int, int | None]:
            ports = await router.start()
            await router.wait_ready(max(deadline - time.monotonic(), 1.0))
            return ports
        try:
            grpc_port, http_port = asyncio.run_coroutine_threadsafe(go(), loop).result()
        except Exception as e:
            raise LaunchError(f"router failed to start on {serve.host}: {type(e).__name__}: {e}") from None
        self._router = router
        host = _dial_host(serve.host)
        self.grpc_target = f"{host}:{grpc_port}"
        self.http_base_url = f"http://{host}:{http_port}/v1"


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


def add_ray_arguments(p: argparse.ArgumentParser) -> None:
    """The --ray flags of `kvmesh serve` (imports no ray)."""
    g = p.add_argument_group("ray (kvmesh serve --ray)")
    g.add_argument("--ray", action="store_true", help="place the workers on a Ray cluster as actors")
    g.add_argument("--ray-address", default=None,
                   help="auto or HOST:PORT (default: RAY_ADDRESS if set, else start a local Ray)")
    g.add_argument("--gpus-per-worker", type=float, default=1.0, help="GPUs per worker bundle (GPU clusters)")
    g.add_argument("--cpus-per-worker", type=float, default=1.0, help="CPUs per worker bundle (CPU-only clusters)")
    g.add_argument("--placement-strategy", default="PACK", choices=PLACEMENT_STRATEGIES)
    g.add_argument("--stop", action="store_true",
                   help="with --ray: stop the actors and placement group of --cluster-name, then exit")


def ray_config_from_args(args: argparse.Namespace) -> RayServeConfig:
    from router.launch import config_from_args
    from worker.cli import CLIError, flagify
    serve = config_from_args(args)
    try:
        return RayServeConfig(serve=serve, address=args.ray_address, gpus_per_worker=args.gpus_per_worker,
                              cpus_per_worker=args.cpus_per_worker, placement_strategy=args.placement_strategy)
    except ValueError as e:
        raise CLIError(flagify(str(e)).replace("--address", "--ray-address")) from None


def run_ray_serve(cfg: RayServeConfig) -> int:
    """Start on Ray, print where to connect, run until SIGINT/SIGTERM (exit 0) or until a worker
    actor or redis goes (exit 1 — e.g. after `--stop` from elsewhere); always tear down."""
    cluster = RayCluster(cfg)
    serve = cfg.serve
    print(f"kvmesh serve --ray: placing {serve.workers} worker(s) on {serve.model} "
          f"(namespace {cfg.namespace}; loading takes a while)...", flush=True)

    def banner() -> None:
        import ray
        gcs = ray.get_runtime_context().gcs_address
        local = "RAY_AUTH_MODE=disabled " if cfg.address is None and "RAY_ADDRESS" not in os.environ else ""
        print("\n".join([
            f"kvmesh serve --ray: ready — {serve.workers} worker actor(s), cluster {serve.cluster_name}",
            f"  gRPC       {cluster.grpc_target}",
            f"  HTTP       {cluster.http_base_url}",
            f"  redis      {cluster.redis_url}{'' if serve.redis_url else ' (embedded redis-server)'}",
            f"  workers    {' '.join(cluster.worker_addresses)}",
            f"  rendezvous {cluster.dist_init_addr}",
            f"  ray        {gcs}{' (a local Ray started here)' if local else ''}",
            f"  namespace  {cfg.namespace} (actors worker-0..{serve.workers - 1}, placement group {cfg.namespace})",
            f"  try:  kvmesh client generate --target {cluster.grpc_target} --chat \"What is a KV cache?\"",
            f"  Ctrl-C stops everything; from elsewhere: {local}kvmesh serve --ray --stop --ray-address {gcs} "
            f"--cluster-name {serve.cluster_name}",
        ]), flush=True)

    return supervise(cluster, "serve --ray", banner, poll_s=1.0)


def run_ray_serve_args(args: argparse.Namespace) -> int:
    """`kvmesh serve --ray [...]` and `kvmesh serve --ray --stop`."""
    from worker.cli import CLIError
    if not args.ray:
        raise CLIError("--stop: only with --ray (a plain kvmesh serve stops with Ctrl-C or SIGTERM)")
    if args.stop:
        stopped = stop_named_cluster(args.ray_address, args.cluster_name)
        if not stopped:
            print(f"kvmesh serve --ray --stop: nothing named in namespace {namespace_for(args.cluster_name)}",
                  file=sys.stderr)
            return 1
        print(f"kvmesh serve --ray --stop: stopped {', '.join(stopped)}")
        return 0
    return run_ray_serve(ray_config_from_args(args))

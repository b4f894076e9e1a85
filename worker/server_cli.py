"""`kvmesh worker`: the flags and the process around one `WorkerServer` (worker/server.py).

The rendezvous of the peer-transfer group comes from --rank / --world-size /
--dist-init-addr, else from KVMESH_RANK / KVMESH_WORLD_SIZE / KVMESH_DIST_INIT_ADDR (set by
`kvmesh serve --ray` and the Helm chart). KVMESH_TEST_TRANSFER_FAULTS (tests only) injects
transfer faults (worker.peer.PeerConfig.faults, comma-separated). Imports no torch.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

from contracts.cli import CLIError, flagify
from contracts.logs import add_log_format_argument, configure_logging
from worker.cli import add_engine_arguments, engine_config_from_args
from worker.config import ModelLoadError
from worker.server import WorkerServer, WorkerServerConfig

if TYPE_CHECKING:
    from worker.engine import EngineConfig

log = logging.getLogger("kvmesh.worker")


class Rendezvous(NamedTuple):
    rank: int
    world_size: int
    dist_init_addr: str | None


def rendezvous_from_env(env: Mapping[str, str]) -> Rendezvous:
    """KVMESH_RANK / KVMESH_WORLD_SIZE / KVMESH_DIST_INIT_ADDR as set by `kvmesh serve --ray`
    and the Helm chart (absent: rank 0 of 1, no peer transfer); ValueError naming a bad one."""
    values = []
    for name, default in (("KVMESH_RANK", 0), ("KVMESH_WORLD_SIZE", 1)):
        raw = env.get(name, "").strip()
        if raw and not raw.isdigit():
            raise ValueError(f"{name}={raw!r} must be a non-negative integer")
        values.append(int(raw) if raw else default)
    return Rendezvous(values[0], values[1], env.get("KVMESH_DIST_INIT_ADDR") or None)


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("worker")
    g.add_argument("--host", default="127.0.0.1", help="address to bind")
    g.add_argument("--port", type=int, default=0, help="port to bind (0 = a free port, printed when serving)")
    g.add_argument("--worker-id", default="worker-0")
    g.add_argument("--advertise-address", default=None, help="HOST:PORT peers dial (default: host:port)")
    g.add_argument("--redis-url", default=None, help="metadata Redis (worker registry)")
    g.add_argument("--cluster-name", default="kvmesh")
    g.add_argument("--metrics-port", type=int, default=None,
                   help="Prometheus /metrics port (default: --port + 1000, or a free one when --port is 0; "
                        "0 = a free port; -1 = off); logged to stderr when serving")
    g.add_argument("--drain-timeout-s", "--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight streams may finish")
    add_log_format_argument(g)
    g = p.add_argument_group("peer transfer (a torch.distributed group of the workers)")
    g.add_argument("--rank", type=int, default=None, help="this worker's rank (default: $KVMESH_RANK, else 0)")
    g.add_argument("--world-size", type=int, default=None,
                   help="workers in the transfer group (default: $KVMESH_WORLD_SIZE, else 1 = no peer transfer)")
    g.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                   help="rendezvous of the group, where rank 0 listens (default: $KVMESH_DIST_INIT_ADDR)")
    add_engine_arguments(p)


def metrics_port_for(port: int, metrics_port: int | None) -> int | None:
    """--metrics-port as WorkerServerConfig.metrics_port: default gRPC port + 1000 (a free
    port when that is 0 or past 65535), -1 = off."""
    if metrics_port is None:
        return port + 1000 if 0 < port <= 65535 - 1000 else 0
    return None if metrics_port == -1 else metrics_port


def run_worker(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM, then drain. Prints one line to stdout once serving:
    `kvmesh worker <id> serving on <host>:<port>`; logs go to stderr."""
    engine_cfg = engine_config_from_args(args)
    try:
        env = rendezvous_from_env(os.environ)
    except ValueError as e:
        raise CLIError(f"environment: {e}") from None
    faults = os.environ.get("KVMESH_TEST_TRANSFER_FAULTS", "")   # tests only: worker.peer.FaultPlan
    try:
        cfg = WorkerServerConfig(host=args.host, port=args.port, worker_id=args.worker_id,
                                 advertise_address=args.advertise_address, drain_timeout_s=args.drain_timeout_s,
                                 redis_url=args.redis_url, cluster_name=args.cluster_name,
                                 rank=env.rank if args.rank is None else args.rank,
                                 world_size=env.world_size if args.world_size is None else args.world_size,
                                 dist_init_addr=args.dist_init_addr or env.dist_init_addr,
                                 transfer_faults=tuple(a for a in faults.split(",") if a),
                                 metrics_port=metrics_port_for(args.port, args.metrics_port))
    except ValueError as e:
        raise CLIError(flagify(str(e))) from None
    configure_logging(args.log_format)
    return asyncio.run(_serve_until_signal(engine_cfg, cfg))


async def _serve_until_signal(engine_cfg: EngineConfig, cfg: WorkerServerConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = WorkerServer(engine_cfg, cfg)
    try:
        try:
            port = await server.start()
        except RuntimeError as e:
            raise CLIError(f"--port: cannot bind {cfg.host}:{cfg.port}: {e}") from None
        ready = asyncio.ensure_future(server.wait_ready())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait((ready, stopping), return_when=asyncio.FIRST_COMPLETED)
        if ready.done() and not stop.is_set():
            error = ready.exception()
            if isinstance(error, ModelLoadError):
                raise CLIError(f"--model: {error}")
            if error is not None:
                raise error
            print(f"kvmesh worker {cfg.worker_id} serving on {cfg.host}:{port}", flush=True)
            await stopping
        ready.cancel()
        log.info("worker %s: signal received, shutting down", cfg.worker_id)
    finally:
        await server.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0

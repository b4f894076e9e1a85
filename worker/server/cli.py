"""`kvmesh worker`: the flags and the process around one `WorkerServer` (worker/server/service.py).

Peer transfer is on with --peer-transfer (or KVMESH_PEER_TRANSFER=1): pairs with other
workers form on demand (worker.peer.plane), through a rendezvous store this worker hosts on
--transfer-port (KVMESH_TRANSFER_PORT; 0 = a free port). KVMESH_TEST_TRANSFER_FAULTS (tests only) injects
transfer faults (worker.peer.config.PeerConfig.faults, comma-separated). KVMESH_TEST_STALL_FILE (tests
only, read once here) names a file whose existence stalls the engine thread
(worker/engine/async_engine.py), to see liveness turn. Imports no torch.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

from contracts.cli import CLIError, flagify
from contracts.cluster_token import add_cluster_auth_arguments, token_from
from contracts.logs import add_log_format_argument, configure_logging
from contracts.tls import tls_from_args
from worker.cli import add_engine_arguments, engine_config_from_args
from worker.model.config import ModelLoadError
from worker.server.affinity import parse_cpu_list, pin_process
from worker.server.service import WorkerServer, WorkerServerConfig

if TYPE_CHECKING:
    from worker.engine.engine import EngineConfig

log = logging.getLogger("kvmesh.worker")
REDIS_URL_ENV = "KVMESH_REDIS_URL"
PREFILL_CHUNK_TOKENS = 256   # a prefill-role worker's chunk: a ~1,500-token prompt streams in 6 (docs/ARCHITECTURE.md)
# A decode-role worker's prompt tokens per step beside its decodes (--decode-step-prefill-tokens):
# the largest budget whose step lasts at most about two plain decode steps on a CPU core, measured
# by kvmesh bench disagg (`decode_step_budget`, kvmesh/bench/disagg_step.py; docs/ARCHITECTURE.md)
DECODE_STEP_PREFILL_TOKENS = 4


class PeerFlags(NamedTuple):
    peer_transfer: bool
    transfer_port: int


def peer_flags(args: argparse.Namespace, env: Mapping[str, str]) -> PeerFlags:
    """--peer-transfer / --transfer-port with their KVMESH_PEER_TRANSFER / KVMESH_TRANSFER_PORT
    fallbacks; ValueError naming a bad one."""
    port_raw = env.get("KVMESH_TRANSFER_PORT", "").strip()
    if port_raw and not port_raw.isdigit():
        raise ValueError(f"KVMESH_TRANSFER_PORT={port_raw!r} must be a port number")
    on = args.peer_transfer or env.get("KVMESH_PEER_TRANSFER", "").strip().lower() in ("1", "true", "yes", "on")
    port = args.transfer_port if args.transfer_port is not None else int(port_raw or 0)
    return PeerFlags(on, port)


def peer_flags_from_env(env: Mapping[str, str]) -> PeerFlags:
    """`peer_flags` with no command-line flags (a worker started in-process, e.g. by Ray)."""
    return peer_flags(argparse.Namespace(peer_transfer=False, transfer_port=None), env)


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("worker")
    g.add_argument("--host", default="127.0.0.1", help="address to bind")
    g.add_argument("--port", type=int, default=0, help="port to bind (0 = a free port, printed when serving)")
    g.add_argument("--worker-id", default="worker-0")
    g.add_argument("--advertise-address", default=None, help="HOST:PORT peers dial (default: host:port)")
    g.add_argument("--redis-url", default=None,
                   help=f"metadata Redis (worker registry; default: ${REDIS_URL_ENV}, "
                        "which keeps a password out of ps): redis[s]://HOST:PORT/DB of one Redis or any "
                        "Redis Cluster node, or redis+sentinel://HOST:PORT[,HOST:PORT...]/PRIMARY[/DB]")
    g.add_argument("--cluster-name", default="kvmesh")
    g.add_argument("--metrics-port", type=int, default=None,
                   help="Prometheus /metrics port (default: --port + 1000, or a free one when --port is 0; "
                        "0 = a free port; -1 = off); logged to stderr when serving")
    g.add_argument("--drain-timeout-s", "--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight streams may finish")
    g.add_argument("--liveness-timeout-s", type=float, default=120.0,
                   help="not live (liveness NOT_SERVING, /livez 503, left the registry) once the engine "
                        "loop has made no progress for this long")
    g.add_argument("--max-step-failures", type=int, default=3,
                   help="not live once this many engine steps in a row raised")
    g.add_argument("--role", default="mixed", choices=["prefill", "decode", "mixed"],
                   help="disaggregated serving: prefill = computes prompts whose KV a decode worker fetches over "
                        "the peer plane; decode = streams tokens of prompts a prefill worker computed; "
                        "mixed (default) = both, for its own requests")
    g.add_argument("--prefill-chunk-tokens", type=int, default=PREFILL_CHUNK_TOKENS,
                   help="on a prefill-role worker: the prefill chunk (caps --max-num-batched-tokens), so that a "
                        "decode worker fetches each chunk's blocks while the next one computes; 0 = "
                        "--max-num-batched-tokens")
    g.add_argument("--decode-step-prefill-tokens", type=int, default=DECODE_STEP_PREFILL_TOKENS,
                   help="on a decode-role worker: prompt tokens computed per step beside its decodes (a prompt "
                        "that skipped the prefill hop, the tail of a handed-off one), so no stream waits behind a "
                        f"long chunk; 0 = no cap (default {DECODE_STEP_PREFILL_TOKENS}, measured: "
                        "kvmesh bench disagg)")
    g.add_argument("--cpu-affinity", default=None, metavar="CPUS",
                   help="pin the worker to these CPUs (e.g. 0 or 0-1,3) before its engine starts; the engine "
                        "then runs one thread per CPU unless --threads is set")
    add_cluster_auth_arguments(p, "worker",
                               "the secret shared with the router and peers: every Worker RPC then needs it")
    add_log_format_argument(g)
    g = p.add_argument_group("peer transfer (pairs of workers formed on demand)")
    g.add_argument("--peer-transfer", action="store_true",
                   help="fetch hinted prefixes from peers and send to them "
                        "(default: $KVMESH_PEER_TRANSFER=1, else off)")
    g.add_argument("--transfer-port", type=int, default=None,
                   help="port of this worker's pair rendezvous store (default: $KVMESH_TRANSFER_PORT, else a free one)")
    g.add_argument("--drain-handover", action=argparse.BooleanOptionalAction, default=True,
                   help="on SIGTERM, hand the hottest KV blocks (by recent prefix hits) to peers with free host-tier "
                        "room within --drain-timeout-s (with --peer-transfer and a Redis registry; default on)")
    g.add_argument("--warm-start-mb-s", type=float, default=256.0,
                   help="once ready, pull the peers' hottest KV blocks into free host-tier room in the background "
                        "at most this many MB/s (with --peer-transfer and a Redis registry; 0 = off; default 256)")
    add_engine_arguments(p)


def metrics_port_for(port: int, metrics_port: int | None) -> int | None:
    """--metrics-port as WorkerServerConfig.metrics_port: default gRPC port + 1000 (a free
    port when that is 0 or past 65535), -1 = off."""
    if metrics_port is None:
        return port + 1000 if 0 < port <= 65535 - 1000 else 0
    return None if metrics_port == -1 else metrics_port


def role_engine_config(engine_cfg: EngineConfig, role: str, prefill_chunk_tokens: int,
                       decode_step_prefill_tokens: int = DECODE_STEP_PREFILL_TOKENS) -> EngineConfig:
    """The engine config of a worker of `role`: a prefill worker's steps are at most
    `prefill_chunk_tokens` (0: as configured), a decode worker's carry at most
    `decode_step_prefill_tokens` prompt tokens beside their decodes (0: no cap); a mixed
    worker's as configured."""
    if role == "prefill" and prefill_chunk_tokens:
        return dataclasses.replace(engine_cfg, max_num_batched_tokens=min(engine_cfg.max_num_batched_tokens,
                                                                          prefill_chunk_tokens))
    if role == "decode":
        return dataclasses.replace(engine_cfg, step_prefill_tokens=decode_step_prefill_tokens)
    return engine_cfg


def run_worker(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM, then drain. Prints one line to stdout once serving:
    `kvmesh worker <id> serving on <host>:<port>`; logs go to stderr."""
    if args.cpu_affinity is not None:   # before torch starts its threads: they inherit the mask
        try:
            cpus = parse_cpu_list(args.cpu_affinity)
            pin_process(cpus)
        except ValueError as e:
            raise CLIError(flagify(str(e))) from None
        if not args.threads:
            args.threads = len(cpus)
    if args.prefill_chunk_tokens < 0:
        raise CLIError(f"--prefill-chunk-tokens: {args.prefill_chunk_tokens} must be >= 0")
    if args.decode_step_prefill_tokens < 0:
        raise CLIError(f"--decode-step-prefill-tokens: {args.decode_step_prefill_tokens} must be >= 0 (0: no cap)")
    engine_cfg = role_engine_config(engine_config_from_args(args), args.role, args.prefill_chunk_tokens,
                                    args.decode_step_prefill_tokens)
    try:
        peer = peer_flags(args, os.environ)
    except ValueError as e:
        raise CLIError(f"environment: {e}") from None
    faults = os.environ.get("KVMESH_TEST_TRANSFER_FAULTS", "")   # tests only: worker.peer.plan.FaultPlan
    try:
        cfg = WorkerServerConfig(host=args.host, port=args.port, worker_id=args.worker_id,
                                 advertise_address=args.advertise_address, drain_timeout_s=args.drain_timeout_s,
                                 redis_url=args.redis_url or os.environ.get(REDIS_URL_ENV) or None,
                                 cluster_name=args.cluster_name,
                                 peer_transfer=peer.peer_transfer, transfer_port=peer.transfer_port,
                                 transfer_faults=tuple(a for a in faults.split(",") if a),
                                 metrics_port=metrics_port_for(args.port, args.metrics_port),
                                 liveness_timeout_s=args.liveness_timeout_s,
                                 max_step_failures=args.max_step_failures,
                                 stall_file=os.environ.get("KVMESH_TEST_STALL_FILE") or None,
                                 drain_handover=args.drain_handover, warm_start_mb_s=args.warm_start_mb_s,
                                 cluster_token=token_from(args.cluster_token), tls=tls_from_args(args),
                                 role=args.role)
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
        except OSError as e:
            raise CLIError(f"--metrics-port: cannot bind {cfg.host}:{cfg.metrics_port}: {e}") from None
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

"""`kvmesh serve` flags → `ServeConfig` / `RayServeConfig` → the launcher (kvmesh.serve.local, or
kvmesh.serve.ray_launch with --ray). Imports no torch and no ray."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from contracts.cli import CLIError, flagify
from contracts.cluster_token import add_cluster_auth_arguments, new_token, token_from
from contracts.logs import add_log_format_argument
from contracts.tls import tls_from_args
from kvmesh.serve.config import ServeConfig
from kvmesh.serve.local import run_serve
from kvmesh.serve.ray_launch import (
    PLACEMENT_STRATEGIES,
    RayServeConfig,
    namespace_for,
    run_ray_serve,
    stop_named_cluster,
)
from kvmesh.serve.restarts import RestartPolicy
from router.flags import add_address_arguments, add_routing_arguments, routing_argv, routing_config
from worker.cli import add_engine_arguments


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("serve")
    g.add_argument("--workers", type=int, default=None,
                   help="number of mixed worker processes (default: 2, or 0 with --prefill-workers/--decode-workers)")
    g.add_argument("--prefill-workers", type=int, default=0,
                   help="workers started with --role prefill: they compute prompts and hand the KV to a decode worker")
    g.add_argument("--decode-workers", type=int, default=0,
                   help="workers started with --role decode: they take handed-off prompts and stream the tokens")
    g.add_argument("--decode-step-prefill-tokens", type=int, default=None,
                   help="the decode workers' prompt tokens per step beside their decodes (kvmesh worker "
                        "--decode-step-prefill-tokens; default: the worker's)")
    g.add_argument("--cpu-affinity-per-worker", action="store_true",
                   help="pin each worker to its own share of the CPUs (kvmesh worker --cpu-affinity), one thread "
                        "per CPU; with --ray, each share of its node's CPUs")
    add_address_arguments(g)
    g.add_argument("--redis-url", default=None,
                   help="metadata Redis (default: start a redis-server child): redis[s]://HOST:PORT/DB of "
                        "one Redis or any Redis Cluster node, or redis+sentinel://HOST:PORT[,...]/PRIMARY[/DB]")
    g.add_argument("--log-dir", type=Path, default=None, help="keep child logs here (default: a temp dir)")
    g.add_argument("--startup-timeout-s", type=float, default=180.0)
    g.add_argument("--restart-policy", default=RestartPolicy.ON_FAILURE.value, choices=[p.value for p in RestartPolicy],
                   help="restart a child that exits: always, on-failure (non-zero status; default), or never "
                        "(the first exit stops the cluster); a child dying 5 times in 60 s is given up on")
    add_log_format_argument(g)
    add_routing_arguments(p)   # the router child's: passed to it as given
    add_cluster_auth_arguments(p, "serve", "the router's and workers' shared secret, else a fresh random one per "
                                           "start; children get it by environment")
    add_engine_arguments(p)
    add_ray_arguments(p)


def add_ray_arguments(p: argparse.ArgumentParser) -> None:
    """The --ray flags of `kvmesh serve`."""
    g = p.add_argument_group("ray (kvmesh serve --ray)")
    g.add_argument("--ray", action="store_true", help="place the workers on a Ray cluster as actors")
    g.add_argument("--ray-address", default=None,
                   help="auto or HOST:PORT (default: RAY_ADDRESS if set, else start a local Ray)")
    g.add_argument("--gpus-per-worker", type=float, default=1.0, help="GPUs per worker bundle (GPU clusters)")
    g.add_argument("--cpus-per-worker", type=float, default=1.0, help="CPUs per worker bundle (CPU-only clusters)")
    g.add_argument("--placement-strategy", default="PACK", choices=PLACEMENT_STRATEGIES)
    g.add_argument("--stop", action="store_true",
                   help="with --ray: stop the actors and placement group of --cluster-name, then exit")


def engine_argv_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The engine flags the user changed (all but --model), spelled back as worker argv."""
    reference = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(reference)
    argv: list[str] = []
    for action in reference._actions:
        value = getattr(args, action.dest)
        if action.dest == "model" or value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return tuple(argv)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The `ServeConfig` of `kvmesh serve`'s flags. The routing flags are checked as the router
    reads them (a bad value fails here, before anything starts) and handed to it as given."""
    try:
        routing_config(args)
        return ServeConfig(workers=_mixed_workers(args), prefill_workers=args.prefill_workers,
                           decode_workers=args.decode_workers, cpu_affinity_per_worker=args.cpu_affinity_per_worker,
                           decode_step_prefill_tokens=args.decode_step_prefill_tokens,
                           model=args.model, host=args.host, grpc_port=args.grpc_port,
                           http_port=args.http_port, redis_url=args.redis_url, cluster_name=args.cluster_name,
                           engine_argv=engine_argv_from_args(args), log_dir=args.log_dir,
                           startup_timeout_s=args.startup_timeout_s,
                           restart_policy=RestartPolicy(args.restart_policy),
                           router_argv=routing_argv(args),
                           cluster_token=token_from(args.cluster_token) or new_token(), tls=tls_from_args(args),
                           log_format=args.log_format)
    except ValueError as e:
        raise CLIError(flagify(str(e)).replace("--api-keys:", "--api-key:")) from None


def _mixed_workers(args: argparse.Namespace) -> int:
    """--workers, defaulting to 2 mixed workers unless prefill or decode workers are asked for."""
    if args.workers is not None:
        return int(args.workers)
    return 0 if args.prefill_workers or args.decode_workers else 2


def ray_config_from_args(args: argparse.Namespace) -> RayServeConfig:
    serve = config_from_args(args)
    try:
        return RayServeConfig(serve=serve, address=args.ray_address, gpus_per_worker=args.gpus_per_worker,
                              cpus_per_worker=args.cpus_per_worker, placement_strategy=args.placement_strategy)
    except ValueError as e:
        raise CLIError(flagify(str(e)).replace("--address", "--ray-address")) from None


def run_serve_args(args: argparse.Namespace) -> int:
    """The `kvmesh serve` entry point: local processes, `--ray`, or `--ray --stop`."""
    if args.stop and not args.ray:
        raise CLIError("--stop: only with --ray (a plain kvmesh serve stops with Ctrl-C or SIGTERM)")
    if args.stop:
        stopped = stop_named_cluster(args.ray_address, args.cluster_name)
        if not stopped:
            print(f"kvmesh serve --ray --stop: nothing named in namespace {namespace_for(args.cluster_name)}",
                  file=sys.stderr)
            return 1
        print(f"kvmesh serve --ray --stop: stopped {', '.join(stopped)}")
        return 0
    if args.ray:
        return run_ray_serve(ray_config_from_args(args))
    return run_serve(config_from_args(args))

"""`kvmesh` — the one command: the composition root of router, worker and kvstore commands.

Every subcommand module imports no torch at import time (tests/contracts/test_tokenizer.py pins
it); the engine is imported when a command builds one.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from contracts.cli import CLIError
from kvmesh import client, plan
from kvmesh.bench import (
    chaos as bench_chaos,
    docs as bench_docs,
    engine as bench,
    routing as router_bench,
    scale as bench_scale,
    tenants as bench_tenants,
    transfer as bench_transfer,
)
from kvmesh.serve import cli as serve_cli
from router import flags as router_flags, server
from worker import cli as wcli
from worker.server import cli as server_cli


def _plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="KV-cache capacity planner (the primer's formula)")
    plan.add_arguments(p)
    p.set_defaults(run=plan.main)


def _generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with one local engine")
    wcli.add_generate_arguments(p)
    p.set_defaults(run=wcli.run_generate)


def _bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks against a baseline measured in the same run")
    bsub = p.add_subparsers(dest="bench", required=True,
                            metavar="{engine,prefix,memory,accuracy,transfer,router,service}")
    bench.register(bsub)
    bench_transfer.register(bsub)
    router_bench.register(bsub)
    bench_chaos.register(bsub)
    bench_docs.register(bsub)
    bench_tenants.register(bsub)
    bench_scale.register(bsub)


def _worker(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="serve one engine over gRPC (kvmesh.v1.Worker) until SIGTERM")
    server_cli.add_worker_arguments(p)
    p.set_defaults(run=server_cli.run_worker)


def _router(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="serve the router: gRPC + OpenAI HTTP in front of workers")
    router_flags.add_router_arguments(p)
    p.set_defaults(run=server.run_router)


def _client(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("client", help="gRPC client of a router or worker")
    client.add_client_arguments(p)
    p.set_defaults(run=client.run_client)


def _serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run redis, N workers and a router as local processes (the embedded default)")
    serve_cli.add_serve_arguments(p)
    p.set_defaults(run=serve_cli.run_serve_args)


COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_plan, _generate, _bench, _worker,
                                                                      _router, _client, _serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh",
                                     description="kvmesh — a distributed KV-cache service for LLM inference")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except CLIError as e:
        print(f"kvmesh {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

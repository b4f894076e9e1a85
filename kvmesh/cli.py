"""`kvmesh` — the one command: the composition root of router, worker and kvstore commands.

Every subcommand module imports no torch at import time (tests/contracts/test_tokenizer.py pins
it); the engine is imported when a command builds one.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

from contracts.cli import CLIError
from kvmesh import client, plan
from kvmesh.bench import (
    chaos as bench_chaos,
    disagg as bench_disagg,
    docs as bench_docs,
    engine as bench,
    restart as bench_restart,
    routing as router_bench,
    scale as bench_scale,
    tenants as bench_tenants,
    transfer as bench_transfer,
)
from kvmesh.bench.report import check_json_path
from kvmesh.serve import cli as serve_cli
from router import flags as router_flags, server
from worker import cli as wcli
from worker.server import cli as server_cli


class _Command(NamedTuple):
    """One subcommand: its name, help line, the function adding its flags and the one running it."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]


COMMANDS: tuple[_Command, ...] = (
    _Command("plan", "KV-cache capacity planner (the primer's formula)", plan.add_arguments, plan.main),
    _Command("generate", "generate text with one local engine", wcli.add_generate_arguments, wcli.run_generate),
    _Command("worker", "serve one engine over gRPC (kvmesh.v1.Worker) until SIGTERM",
             server_cli.add_worker_arguments, server_cli.run_worker),
    _Command("router", "serve the router: gRPC + OpenAI HTTP in front of workers",
             router_flags.add_router_arguments, server.run_router),
    _Command("client", "gRPC client of a router or worker", client.add_client_arguments, client.run_client),
    _Command("serve", "run redis, N workers and a router as local processes (the embedded default)",
             serve_cli.add_serve_arguments, serve_cli.run_serve_args),
)

# Each bench module adds its `kvmesh bench` subcommands with `register(subparsers)`.
BENCHES: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    bench.register, bench_transfer.register, router_bench.register, bench_chaos.register, bench_docs.register,
    bench_tenants.register, bench_scale.register, bench_disagg.register,
    bench_restart.register)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh",
                                     description="kvmesh — a distributed KV-cache service for LLM inference")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help)
        command.add_arguments(p)
        p.set_defaults(run=command.run)
    p = sub.add_parser("bench", help="benchmarks against a baseline measured in the same run")
    benches = p.add_subparsers(dest="bench", required=True)
    for register in BENCHES:
        register(benches)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "bench" and getattr(args, "json", None) is not None:
            check_json_path(args.json)
        return int(args.run(args) or 0)
    except CLIError as e:
        print(f"kvmesh {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""`kvmesh` — the one command. Subcommands import their (possibly torch-heavy) code lazily."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def _plan(sub: argparse._SubParsersAction) -> None:
    from kvstore import plan
    p = sub.add_parser("plan", help="KV-cache capacity planner (the primer's formula)")
    plan.add_arguments(p)
    p.set_defaults(run=plan.main)


def _generate(sub: argparse._SubParsersAction) -> None:
    from worker import cli as wcli
    p = sub.add_parser("generate", help="generate text with one local engine")
    wcli.add_generate_arguments(p)
    p.set_defaults(run=wcli.run_generate)


def _bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks against a baseline measured in the same run")
    bsub = p.add_subparsers(dest="bench", required=True, metavar="{engine,prefix,memory}")
    from worker import bench
    bench.register(bsub)


COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_plan, _generate, _bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh", description="kvmesh — a distributed KV-cache service for LLM inference")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from worker.cli import CLIError
    try:
        return int(args.run(args) or 0)
    except CLIError as e:
        print(f"kvmesh {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

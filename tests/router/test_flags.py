"""The router flags `kvmesh router` and `kvmesh serve` share (router/flags.py): one declaration,
one default, and `kvmesh serve` hands its router child exactly the routing flags it was given."""
from __future__ import annotations

import argparse

import pytest

from contracts.cli import CLIError
from kvmesh.cli import build_parser
from kvmesh.serve.cli import config_from_args
from kvmesh.serve.supervise import Cluster
from router.config import RouterConfig
from router.flags import add_address_arguments, add_routing_arguments, router_config_from_args, routing_config
from router.routing.policy import make_policy
from router.routing.scorers import DEFAULT_LOAD_FACTOR, BoundedLoadFilter


def _actions(add: object) -> dict[str, argparse.Action]:
    p = argparse.ArgumentParser(add_help=False)
    add(p)  # type: ignore[operator]
    return {a.dest: a for a in p._actions}


def _subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _router_child(serve_argv: list[str]) -> argparse.Namespace:
    """The `kvmesh router` arguments `kvmesh serve <serve_argv>` starts its router with."""
    cfg = config_from_args(build_parser().parse_args(["serve", *serve_argv]))
    argv = Cluster(cfg, placement=None)._router_argv(0, 0)  # type: ignore[arg-type]
    return build_parser().parse_args(argv[3:])          # after `python -m kvmesh.cli`


def test_both_commands_take_the_shared_flags_as_declared_once() -> None:
    shared = _actions(add_address_arguments) | _actions(add_routing_arguments)
    for command in ("router", "serve"):
        actions = {a.dest: a for a in _subparser(command)._actions}
        for dest, want in shared.items():
            got = actions[dest]
            assert (got.option_strings, got.default, got.type, got.choices, type(got)) == \
                (want.option_strings, want.default, want.type, want.choices, type(want)), (command, dest)


def test_the_load_factor_default_is_one_constant() -> None:
    assert DEFAULT_LOAD_FACTOR == 1.25
    assert RouterConfig().load_factor == BoundedLoadFilter().load_factor == DEFAULT_LOAD_FACTOR
    for command in ("router", "serve"):
        assert build_parser().parse_args([command]).load_factor == DEFAULT_LOAD_FACTOR
    assert make_policy("prefix_hash").filters == (BoundedLoadFilter(DEFAULT_LOAD_FACTOR),)


def test_defaults_are_the_router_configs() -> None:
    cfg = router_config_from_args(build_parser().parse_args(["router"]))
    assert cfg == RouterConfig(grpc_port=50051, http_port=8000)


@pytest.mark.parametrize("given", [
    [],
    ["--routing-policy", "prefix_hash", "--load-factor", "2.5", "--migration-limit", "0"],
    ["--api-key", "k1", "--api-key", "k2", "--metrics-require-key", "--max-concurrent-per-tenant", "3",
     "--max-tokens-limit", "7"],
])
def test_serve_hands_its_router_the_routing_flags_it_was_given(given: list[str]) -> None:
    serve_args = build_parser().parse_args(["serve", *given])
    child = _router_child(given)
    for dest in _actions(add_routing_arguments):
        assert getattr(child, dest) == getattr(serve_args, dest), dest
    assert routing_config(child) == routing_config(serve_args)


def test_a_bad_routing_flag_fails_serve_before_anything_starts() -> None:
    for argv, flag in ((["--load-factor", "0.5"], "--load-factor"), (["--migration-limit", "-1"], "--migration-limit"),
                       (["--max-tokens-limit", "0"], "--max-tokens-limit")):
        with pytest.raises(CLIError, match=flag):
            config_from_args(build_parser().parse_args(["serve", *argv]))


def test_serve_config_defaults_are_the_serve_commands() -> None:
    from kvmesh.serve.config import ServeConfig
    parsed = config_from_args(build_parser().parse_args(["serve"]))
    default = ServeConfig()
    for name in ("workers", "model", "host", "grpc_port", "http_port", "redis_url", "cluster_name", "engine_argv",
                 "router_argv", "log_dir", "startup_timeout_s", "restart_policy", "tls", "log_format"):
        assert getattr(parsed, name) == getattr(default, name), name


def test_the_helm_charts_router_defaults_are_the_routers() -> None:
    """helm/kvmesh/values.yaml spells the router's defaults again (YAML cannot import them):
    they must agree with `kvmesh router`'s."""
    from pathlib import Path

    import yaml
    values = yaml.safe_load((Path(__file__).parents[2] / "helm/kvmesh/values.yaml").read_text())["router"]
    args = build_parser().parse_args(["router"])
    assert (values["routingPolicy"], values["loadFactor"], values["migrationLimit"], values["drainTimeoutS"],
            values["grpcPort"], values["httpPort"], values["maxTokensLimit"], values["maxConcurrentPerTenant"],
            values["logFormat"]) == \
        (args.routing_policy, args.load_factor, args.migration_limit, args.drain_timeout_s, args.grpc_port,
         args.http_port, args.max_tokens_limit, args.max_concurrent_per_tenant, args.log_format)

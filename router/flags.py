"""Every flag of `kvmesh router` (`add_router_arguments`, `router_config_from_args`; served by
router/server.py `run_router`), among them those `kvmesh serve` (kvmesh/serve/cli.py) takes too,
declared once here:

- where the router serves: `add_address_arguments` (--host, --grpc-port, --http-port,
  --cluster-name), which `kvmesh serve` also reads itself (it binds nothing but names its
  Redis keys and prints the addresses);
- how it routes and whom it serves: `add_routing_arguments` (--routing-policy, --load-factor,
  --migration-limit, the client-auth flags, --max-tokens-limit), which `kvmesh serve` does not
  read but hands to its router child as given (`routing_argv`).

Each flag's default is the `RouterConfig` field's default (the ports: the CLI's own), and
`routing_config` applies the routing flags to a `RouterConfig`: one spelling, one default and
one conversion for both commands.
"""
from __future__ import annotations

import argparse
import dataclasses
import os

from contracts.cluster_token import add_cluster_auth_arguments, token_from
from contracts.logs import add_log_format_argument
from contracts.tls import tls_from_args
from router.config import RouterConfig, TokenizerSource
from router.observe.picklog import check_pick_log_path
from router.routing.types import RoutingPolicy
from router.security.auth import add_auth_arguments, keys_from_args
from router.security.tenancy import add_limit_arguments

REDIS_URL_ENV = "KVMESH_REDIS_URL"   # --redis-url's default: keeps a password out of ps

GRPC_PORT = 50051      # the CLI's ports (RouterConfig's default, 0, binds a free one)
HTTP_PORT = 8000

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RouterConfig)}
_CONFIG_FIELDS = frozenset(_DEFAULTS)


def add_address_arguments(p: argparse._ActionsContainer) -> None:
    """--host, --grpc-port, --http-port, --cluster-name."""
    p.add_argument("--host", default=_DEFAULTS["host"],
                   help="address the router binds (gRPC and HTTP; kvmesh serve's workers stay on 127.0.0.1)")
    p.add_argument("--grpc-port", type=int, default=GRPC_PORT, help="router gRPC port (0 = a free port)")
    p.add_argument("--http-port", type=int, default=HTTP_PORT, help="router OpenAI HTTP port (0 = a free port)")
    p.add_argument("--cluster-name", default=_DEFAULTS["cluster_name"],
                   help="the cluster's name: its Redis keys and streams are named after it")


def add_routing_arguments(p: argparse.ArgumentParser) -> None:
    """--routing-policy, --load-factor, --migration-limit, client auth (router/security/auth.py)
    and limits (router/security/tenancy.py): the flags `kvmesh serve` passes to its router."""
    policy: RoutingPolicy = _DEFAULTS["routing_policy"]
    p.add_argument("--routing-policy", default=policy.value, choices=[r.value for r in RoutingPolicy],
                   help="how a request picks its worker (docs/routing.md)")
    p.add_argument("--load-factor", type=float, default=_DEFAULTS["load_factor"],
                   help="bounded load c (>= 1): no worker takes more than ceil(c x average) in-flight requests")
    p.add_argument("--migration-limit", type=int, default=_DEFAULTS["migration_limit"],
                   help="re-submit a request to another worker at most N times when its worker dies or "
                        "becomes unreachable mid-stream; the client's stream continues (0 = off)")
    p.add_argument("--share-pending", action="store_true", default=_DEFAULTS["share_pending"],
                   help="for router replicas behind one Service: share each request's pending blocks with the "
                        "other routers through Redis, so that all predict as one (docs/operations.md)")
    p.add_argument("--disagg-min-prompt-tokens", type=int, default=_DEFAULTS["disagg_min_prompt_tokens"],
                   help="disaggregated serving (prefill and decode workers live): a prompt with fewer uncached "
                        "tokens on its decode worker skips the prefill hop and is computed there, "
                        "--decode-step-prefill-tokens a step beside its decodes (default: where the hop starts to "
                        "beat that on TTFT, measured by kvmesh bench disagg: skip_crossover)")
    p.add_argument("--disagg-transfer-timeout-s", type=float, default=_DEFAULTS["disagg_transfer_timeout_s"],
                   help="disaggregated serving: the longest the prefill hop may go without progress (the "
                        "prefill worker's first chunk, each next chunk, each next block the decode worker "
                        "fetches); past it, or when the prefill worker dies, the decode worker computes the rest")
    p.add_argument("--pick-log", default=_DEFAULTS["pick_log"], metavar="PATH",
                   help="append a JSON line per routing decision (what the policy saw of every worker) and per "
                        "finished request (cached tokens served) to PATH: a routing trace (docs/operations.md)")
    add_auth_arguments(p)
    add_limit_arguments(p)


def _routing_actions() -> list[argparse.Action]:
    reference = argparse.ArgumentParser(add_help=False)
    add_routing_arguments(reference)
    return reference._actions


def routing_argv(args: argparse.Namespace) -> tuple[str, ...]:
    """The routing flags set in `args` to other than their defaults, spelled back as `kvmesh
    router` argv (what `kvmesh serve` hands its router child)."""
    argv: list[str] = []
    for action in _routing_actions():
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            argv.append(flag)
        elif isinstance(action, argparse._AppendAction):
            argv += [a for v in value for a in (flag, str(v))]
        else:
            argv += [flag, str(value)]
    return tuple(argv)


def routing_config(args: argparse.Namespace, base: RouterConfig | None = None) -> RouterConfig:
    """`base` (default: a default RouterConfig) with the routing flags of `args` applied: each
    flag whose name is a RouterConfig field sets it, and the keys (--api-key, --api-keys-file,
    else $KVMESH_API_KEYS_FILE) set `api_keys`. Raises ValueError naming a bad value."""
    values = {a.dest: getattr(args, a.dest) for a in _routing_actions() if a.dest in _CONFIG_FIELDS}
    if values.get("pick_log") is not None:
        check_pick_log_path(values["pick_log"])
    return dataclasses.replace(base if base is not None else RouterConfig(), api_keys=keys_from_args(args),
                               **values)


def add_router_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of `kvmesh router`."""
    add_address_arguments(p)
    p.add_argument("--no-http", action="store_true", help="serve no HTTP")
    p.add_argument("--worker", action="append", default=[], metavar="HOST:PORT", help="a worker (repeatable)")
    p.add_argument("--model", default=_DEFAULTS["model"],
                   help="the workers' model: alias or HF dir to read the tokenizer from (--tokenizer-source "
                        "local), or just its name (worker)")
    source: TokenizerSource = _DEFAULTS["tokenizer_source"]
    p.add_argument("--tokenizer-source", default=source.value, choices=[s.value for s in TokenizerSource],
                   help="where the tokenizer comes from: local = --model's files; worker = fetched from the first "
                        "ready worker (GetTokenizer), checked and cached in $KVMESH_CACHE_DIR/tokenizers (no model "
                        "storage needed); auto (default) = local when --model is a local model, else worker")
    p.add_argument("--served-model-name", default=None, help="model id on the HTTP API (default: --model)")
    p.add_argument("--redis-url", default=None,
                   help=f"metadata Redis (block index; default: ${REDIS_URL_ENV}, which keeps a password out of ps): "
                        "redis[s]://HOST:PORT/DB of one Redis or any Redis Cluster node, or "
                        "redis+sentinel://HOST:PORT[,HOST:PORT...]/PRIMARY[/DB]")
    add_routing_arguments(p)
    p.add_argument("--drain-timeout-s", "--drain-timeout", type=float, default=_DEFAULTS["drain_timeout_s"],
                   help="on SIGTERM: readiness turns 503 at once, open streams get this long to finish")
    add_cluster_auth_arguments(p, "router", "the secret shared with the workers: workers are admitted only "
                                            "after proving they hold it")
    add_log_format_argument(p)


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The `RouterConfig` of `kvmesh router`'s flags (`add_router_arguments`); raises ValueError."""
    base = RouterConfig(worker_addresses=tuple(args.worker), host=args.host, grpc_port=args.grpc_port,
                        http_port=None if args.no_http else args.http_port, model=args.model,
                        served_model_name=args.served_model_name, tokenizer_source=args.tokenizer_source,
                        redis_url=args.redis_url or os.environ.get(REDIS_URL_ENV) or None,
                        cluster_name=args.cluster_name, tls=tls_from_args(args),
                        cluster_token=token_from(args.cluster_token), drain_timeout_s=args.drain_timeout_s)
    return routing_config(args, base)

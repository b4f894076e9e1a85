"""`ServeConfig`: what `kvmesh serve` starts (worker counts and roles, model, ports, Redis, child
flags, timeouts, restart policy, cluster token and TLS), checked once when it is built, and the
secrets and TLS flags each child gets from it. Used by every launcher (kvmesh.serve.supervise,
local, ray_launch). Imports no torch and no ray.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from contracts.cluster_token import TOKEN_ENV, check_token
from contracts.logs import LogFormat
from contracts.tls import PLAINTEXT, TlsConfig, tls_argv
from kvmesh.serve.restarts import RestartConfig, RestartPolicy
from kvmesh.serve.roles import Role, worker_roles
from kvstore.metadata.registry import parse_redis_url
from router.flags import GRPC_PORT, HTTP_PORT

REDIS_URL_ENV = "KVMESH_REDIS_URL"     # read by `kvmesh router` and `kvmesh worker` when --redis-url is unset


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """What `kvmesh serve` starts, wherever its workers are placed. Ports 0 bind free ports.
    `engine_argv` are worker engine flags passed verbatim to every worker (e.g.
    ("--kv-cache-memory-gib", "0.25")); `model` goes to the workers and the router (its
    tokenizer). `redis_url=None` starts an embedded redis-server. `log_dir=None` keeps child
    logs in a temp dir removed by stop(). `workers` mixed workers, `prefill_workers` with
    --role prefill and `decode_workers` with --role decode (kvmesh.serve.roles: the order);
    `cpu_affinity_per_worker` pins each to its own share of the CPUs it is placed on;
    `decode_step_prefill_tokens` is the decode workers' --decode-step-prefill-tokens (None: the
    worker's default)."""

    workers: int = 2
    prefill_workers: int = 0
    decode_workers: int = 0
    cpu_affinity_per_worker: bool = False
    decode_step_prefill_tokens: int | None = None
    model: str = "smollm2"
    host: str = "127.0.0.1"
    grpc_port: int = GRPC_PORT
    http_port: int = HTTP_PORT
    redis_url: str | None = None
    cluster_name: str = "kvmesh"
    engine_argv: tuple[str, ...] = ()
    # `kvmesh router` flags passed to the router child as given: routing, client auth, limits
    # (router/flags.py `add_routing_arguments`; e.g. ("--routing-policy", "prefix_hash"))
    router_argv: tuple[str, ...] = ()
    log_dir: Path | None = None
    startup_timeout_s: float = 180.0
    stop_timeout_s: float = 30.0            # SIGTERM → SIGKILL per child; the router drains for half of it
    python: str = sys.executable
    restart_policy: RestartPolicy = RestartPolicy.ON_FAILURE
    # Cluster authentication (README: Security): the token every child gets by environment
    # (`kvmesh serve` makes a fresh one per start), and TLS flags passed through to the router
    # (with --tls-ca also to every worker: mutual TLS between them).
    cluster_token: str | None = field(default=None, repr=False)
    tls: TlsConfig = PLAINTEXT
    log_format: str = "text"                # every child's --log-format (contracts/logs.py)

    def __post_init__(self) -> None:
        RestartConfig(policy=self.restart_policy)   # raises ValueError naming restart_policy
        if self.cluster_token is not None:
            check_token(self.cluster_token)
        if self.tls.ca is not None and not self.tls.serves_tls:
            raise ValueError("tls_cert: with --tls-ca, --tls-cert/--tls-key are needed too (mutual TLS)")
        if self.log_format not in [f.value for f in LogFormat]:
            raise ValueError(f"log_format={self.log_format!r}; accepted: {', '.join(f.value for f in LogFormat)}")
        object.__setattr__(self, "engine_argv", tuple(self.engine_argv))
        object.__setattr__(self, "router_argv", tuple(self.router_argv))
        for name in ("workers", "prefill_workers", "decode_workers"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int) \
                    or getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be an integer >= 0")
        d = self.decode_step_prefill_tokens
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 0):
            raise ValueError(f"decode_step_prefill_tokens={d!r} must be an integer >= 0 (0: no cap)")
        if self.num_workers < 1:
            raise ValueError(f"workers={self.workers!r} must be >= 1 (with no --prefill-workers/--decode-workers)")
        if self.prefill_workers and not (self.decode_workers or self.workers):
            raise ValueError(f"prefill_workers={self.prefill_workers}: a prefill worker hands its requests to a "
                             "decode (or mixed) worker; add --decode-workers")
        if not self.model:
            raise ValueError("model is empty")
        if not self.host:
            raise ValueError("host is empty")
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            if not isinstance(port, int) or not 0 <= port <= 65535:
                raise ValueError(f"{name}={port!r} must be in [0, 65535] (0 = a free port)")
        if self.grpc_port and self.grpc_port == self.http_port:
            raise ValueError(f"http_port={self.http_port} is also the grpc_port")
        if self.redis_url is not None:   # redis://, rediss:// (one node or any cluster node), redis+sentinel://
            try:
                parse_redis_url(self.redis_url)
            except ValueError as e:
                raise ValueError(f"redis_url: {e}") from None
        if not self.cluster_name or any(c.isspace() for c in self.cluster_name):
            raise ValueError(f"cluster_name={self.cluster_name!r} must be non-empty without spaces")
        owned = ("--model", "--worker-id", "--port", "--host", "--cluster-token", "--tls-cert", "--tls-key",
                 "--tls-ca", "--redis-url", "--role", "--cpu-affinity")
        if any(a.split("=", 1)[0] in owned for a in self.engine_argv):
            raise ValueError(f"engine_argv={self.engine_argv!r} may not set {'/'.join(owned)}")
        for name in ("startup_timeout_s", "stop_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")

    @property
    def num_workers(self) -> int:
        """Workers of every role."""
        return self.prefill_workers + self.decode_workers + self.workers

    @property
    def roles(self) -> tuple[Role, ...]:
        """The role of each worker, by index (worker-<i>)."""
        return worker_roles(self.prefill_workers, self.decode_workers, self.workers)

    def child_env(self, redis_url: str) -> dict[str, str]:
        """The secrets a router or worker child gets, by environment (never argv)."""
        env = {REDIS_URL_ENV: redis_url}
        if self.cluster_token is not None:
            env[TOKEN_ENV] = self.cluster_token
        return env

    def worker_tls_argv(self) -> tuple[str, ...]:
        """TLS flags of every worker: only with --tls-ca (workers then serve mutual TLS)."""
        return tls_argv(self.tls) if self.tls.ca is not None else ()

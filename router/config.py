"""`RouterConfig`: everything the router core, its registry and its fronts are built from
(built once at the edge: `kvmesh router` flags, `kvmesh serve`, the Ray launcher)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from contracts.cluster_token import check_token
from contracts.tls import PLAINTEXT, TlsConfig
from router.routing.scorers import DEFAULT_LOAD_FACTOR, check_load_factor
from router.routing.types import RoutingPolicy
from router.security.auth import ApiKey


class TokenizerSource(enum.Enum):
    """Where the router gets the model's tokenizer (`--tokenizer-source`; the value is the CLI
    spelling): LOCAL reads `--model`'s dir (converting a GGUF in a child), WORKER fetches the files
    from a ready worker (router/workers/tokenizer.py), AUTO is LOCAL when `--model` resolves to a
    local model with a tokenizer, else WORKER."""

    AUTO = "auto"
    LOCAL = "local"
    WORKER = "worker"

    @classmethod
    def parse(cls, value: TokenizerSource | str) -> TokenizerSource:
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"tokenizer_source={value!r}; accepted: {', '.join(s.value for s in cls)}") from None


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """`http_port=None` serves no HTTP; port 0 binds a free port. `model` names the model: with
    `tokenizer_source` LOCAL (or AUTO resolving to it) the dir of its tokenizer (an alias or HF dir,
    as for workers), with WORKER only the model's name (the tokenizer comes from a worker);
    `redis_url` / `cluster_name` are kept for the index.
    `routing_policy` takes a `RoutingPolicy` or its CLI spelling (stored as the member)."""

    worker_addresses: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    grpc_port: int = 0
    http_port: int | None = 0
    model: str = "smollm2"
    served_model_name: str | None = None    # the HTTP model id; None: `model`
    tokenizer_source: TokenizerSource = TokenizerSource.AUTO   # a member or its CLI spelling
    request_timeout_s: float = 600.0        # upstream deadline when the client sets none
    max_message_bytes: int = 4 * 2**20      # gRPC receive limit and HTTP body limit
    health_interval_s: float = 1.0          # how often workers are probed
    redis_url: str | None = None
    cluster_name: str = "kvmesh"
    routing_policy: RoutingPolicy = RoutingPolicy.KV_AWARE
    load_factor: float = DEFAULT_LOAD_FACTOR
    api_keys: tuple[ApiKey, ...] = ()       # client keys (router/security/auth.py); () = no authentication
    http_read_timeout_s: float = 30.0       # reading one HTTP request body (router/fronts/openai/guard.py)
    http_idle_timeout_s: float = 75.0       # an idle HTTP keep-alive connection is closed after this
    max_concurrent_per_tenant: int | None = None   # requests in flight per tenant; None = unlimited
    max_tokens_limit: int | None = None     # --max-tokens-limit: default and cap of max_tokens; None = the context
    grpc_idle_timeout_s: float = 300.0      # a gRPC connection with no call is closed after this
    migration_limit: int = 3                # re-submissions per request when its worker is lost; 0 = off
    # Disaggregated serving (router/routing/disagg.py): prompts with fewer uncached tokens on their decode
    # worker skip the prefill hop; the hop (prefill + hand-off) takes at most the timeout. The threshold
    # follows kvmesh bench disagg's skip_crossover at the decode worker's default step budget: the hop's
    # TTFT beat computing the prompt on the decode worker, 4 tokens a step, from 128 tokens on in both
    # --quick runs (from 64 in one) (docs/ARCHITECTURE.md, Disaggregated serving).
    disagg_min_prompt_tokens: int = 128
    disagg_transfer_timeout_s: float = 10.0
    share_pending: bool = False             # replicas: share pending blocks through Redis (router/routing/replicas.py)
    pick_log: str | None = None             # --pick-log: a JSON line per pick and finish (router/observe/picklog.py)
    drain_timeout_s: float = 30.0           # on SIGTERM: how long open streams may take to finish
    metrics_require_key: bool = False       # /metrics needs an API key too (default: open, like /health)
    metrics_tenant_names: bool = False      # an open /metrics shows tenant names (default: opaque ids)
    # Cluster authentication (router/security/attest.py): TLS of both fronts and to the workers, and the
    # token workers must prove they hold before they are admitted (and that every call to them carries).
    tls: TlsConfig = PLAINTEXT
    cluster_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "worker_addresses", tuple(self.worker_addresses))
        object.__setattr__(self, "routing_policy", RoutingPolicy.parse(self.routing_policy))
        object.__setattr__(self, "tokenizer_source", TokenizerSource.parse(self.tokenizer_source))
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        if self.cluster_token is not None:
            check_token(self.cluster_token)
        if not all(isinstance(k, ApiKey) for k in self.api_keys):
            raise ValueError("api_keys: every entry must be an ApiKey")
        m = self.max_concurrent_per_tenant
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"max_concurrent_per_tenant={m!r} must be a positive integer")
        t = self.max_tokens_limit
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ValueError(f"max_tokens_limit={t!r} must be a positive integer")
        if isinstance(self.migration_limit, bool) or not isinstance(self.migration_limit, int) \
                or self.migration_limit < 0:
            raise ValueError(f"migration_limit={self.migration_limit!r} must be an integer >= 0")
        d = self.disagg_min_prompt_tokens
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"disagg_min_prompt_tokens={d!r} must be an integer >= 0")
        if not self.disagg_transfer_timeout_s > 0:
            raise ValueError(f"disagg_transfer_timeout_s={self.disagg_transfer_timeout_s!r} must be > 0")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s={self.drain_timeout_s!r} must be >= 0")
        check_load_factor(self.load_factor)
        if self.share_pending and self.redis_url is None:
            raise ValueError("share_pending needs redis_url: router replicas share pending blocks through Redis")
        for a in self.worker_addresses:
            if not isinstance(a, str) or ":" not in a:
                raise ValueError(f"worker_addresses: {a!r} is not HOST:PORT")
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            if port is not None and (not isinstance(port, int) or not 0 <= port <= 65535):
                raise ValueError(f"{name}={port!r} must be in [0, 65535]")
        for name in ("request_timeout_s", "health_interval_s", "http_read_timeout_s", "http_idle_timeout_s",
                     "grpc_idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if not isinstance(self.max_message_bytes, int) or self.max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes={self.max_message_bytes!r} must be a positive integer")

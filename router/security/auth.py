"""Client authentication on the router's fronts: API keys (each naming a tenant) checked on
HTTP `Authorization: Bearer KEY` and on gRPC `authorization: Bearer KEY` metadata.

Owns: the key set (`ApiKey`, parsed from `--api-key` / `--api-keys-file` /
`KVMESH_API_KEYS_FILE` by `keys_from_args`), the constant-time check (`Authenticator`), the
aiohttp middleware (401 with an OpenAI-style body) and the gRPC server interceptor
(UNAUTHENTICATED). With no keys configured every request passes (loopback default);
`warn_if_open` logs loudly when such a router binds a non-loopback host. The probes (`/health`,
`/readyz`, `/live`, `/livez`) and gRPC health/reflection stay open; `/metrics` too unless
`--metrics-require-key` (an open `/metrics` labels tenants by an opaque id unless
`--metrics-tenant-names`: router/observe/metrics.py). `viewer` says whose view a request of the
cluster state gets. docs/threat-model.md says what each caller can learn where. Torch-free.
"""
from __future__ import annotations

import argparse
import hmac
import ipaddress
import logging
import os
import weakref
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NewType

import grpc
from aiohttp import web

from contracts.grpc_auth import refusing

TenantId = NewType("TenantId", str)

KEYS_FILE_ENV = "KVMESH_API_KEYS_FILE"
PRIORITY_DENIED = "priority: this tenant may not set priority (the keys file marks the tenants that may)"
DEFAULT_TENANT = TenantId("default")
PRIORITY_FLAG = "priority"
# admin: may call POST /reset_prefix_cache, sees every tenant in /v1/cluster, the dashboard and
# /metrics (names, prompt previews); a key without it sees only its own tenant there
ADMIN_FLAG = "admin"
SALT_OPTION = "salt="                             # keys file: the tenant's explicit cache_salt
TENANT_KEY = web.RequestKey("kvmesh_tenant", "ApiKey")   # the caller's key on an authenticated request
# The tenant slot of a counted HTTP request, released once (`release_slot`): a streaming
# handler frees it before its last bytes, so a client that sends its next request the moment
# this one ends is not refused for a slot the finished request still held.
SLOT_KEY = web.RequestKey("kvmesh_tenant_slot", "Callable[[], None]")
# the probes, and /dashboard (a page without data)
_OPEN_HTTP_PATHS = frozenset({"/health", "/readyz", "/live", "/livez", "/dashboard"})
_METRICS_PATH = "/metrics"                        # open too unless --metrics-require-key
_OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_LIMITED_HTTP_PREFIX = "/v1/"                     # POSTs here generate: counted per tenant
_LIMITED_GRPC_METHODS = frozenset({"/kvmesh.v1.Router/Generate"})

log = logging.getLogger("kvmesh.router.auth")


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One client key: the secret, the tenant it names, and whether that tenant may set
    `priority`. The secret never appears in repr or logs. `salt`: the tenant's explicit
    default cache_salt from the keys file (None: derived, router/security/tenancy.py)."""

    key: str
    tenant: TenantId = DEFAULT_TENANT
    priority: bool = False
    admin: bool = False
    salt: str | None = None
    weight: float = 1.0                    # share of a worker's compute (worker/engine/fairness.py)
    max_cached_blocks: int | None = None   # cap on a worker's cached blocks (kvstore/quota.py); None: its default

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key or any(c.isspace() for c in self.key):
            raise ValueError("api_keys: a key must be a non-empty string without whitespace")
        if not isinstance(self.tenant, str) or not self.tenant or any(c.isspace() for c in self.tenant):
            raise ValueError(f"api_keys: tenant {self.tenant!r} must be a non-empty word")

    def __repr__(self) -> str:
        salt = "<set>" if self.salt is not None else None
        return (f"ApiKey(key=<redacted>, tenant={self.tenant!r}, priority={self.priority}, admin={self.admin}, "
                f"salt={salt})")


# Without keys every client is this one tenant, trusted like the loopback default it is.
ANONYMOUS = ApiKey("anonymous", DEFAULT_TENANT, priority=True, admin=True)


def parse_keys_file(path: Path) -> tuple[ApiKey, ...]:
    """`key tenant [priority] [admin] [salt=SALT] [weight=W] [max_cached_blocks=N]` per line
    (weight: the tenant's share of a worker's compute; max_cached_blocks: its cap on a worker's
    cached blocks); blank lines and `#` comments ignored. Raises ValueError naming the file and
    line (never echoing a key)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"api_keys_file: cannot read {path}: {e}") from None
    keys: list[ApiKey] = []
    for n, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        keys.append(_parse_key_line(words, f"api_keys_file: {path}:{n}"))
    if not keys:
        raise ValueError(f"api_keys_file: {path} holds no keys")
    salts: dict[TenantId, str | None] = {}
    for k in keys:
        if salts.setdefault(k.tenant, k.salt) != k.salt:
            raise ValueError(f"api_keys_file: {path}: tenant {k.tenant!r} has lines with different salt=")
    return tuple(keys)


def _parse_key_line(words: list[str], where: str) -> ApiKey:
    options, share = _share_options(words[2:], where)
    salts = [w[len(SALT_OPTION):] for w in options if w.startswith(SALT_OPTION)]
    flags = [w for w in options if not w.startswith(SALT_OPTION)]
    if (len(words) < 2 or not set(flags) <= {PRIORITY_FLAG, ADMIN_FLAG} or len(set(flags)) != len(flags)
            or len(salts) > 1 or "" in salts):
        raise ValueError(f"{where}: expected 'KEY TENANT [{PRIORITY_FLAG}] [{ADMIN_FLAG}] [{SALT_OPTION}SALT]'")
    return ApiKey(words[0], TenantId(words[1]), priority=PRIORITY_FLAG in flags, admin=ADMIN_FLAG in flags,
                  salt=salts[0] if salts else None, **share)


WEIGHT_OPTION, MAX_CACHED_OPTION = "weight=", "max_cached_blocks="   # keys file: the tenant's share


def _share_options(options: list[str], where: str) -> tuple[list[str], dict[str, float | int]]:
    """`weight=W` (> 0, default 1) and `max_cached_blocks=N` (>= 0) taken out of a line's options."""
    rest, share = [], {}
    for word in options:
        for option, name, kind in ((WEIGHT_OPTION, "weight", float), (MAX_CACHED_OPTION, "max_cached_blocks", int)):
            if word.startswith(option):
                try:
                    value = kind(word[len(option):])
                except ValueError:
                    value = -1
                if name in share or not (value > 0 if kind is float else value >= 0) or value != value:
                    raise ValueError(f"{where}: {option}{word[len(option):]!r}: expected one {name}, "
                                     f"{'> 0' if kind is float else 'an integer >= 0'}")
                share[name] = value
                break
        else:
            rest.append(word)
    return rest, share


def add_auth_arguments(p: argparse.ArgumentParser) -> None:
    """The client-auth flags of `kvmesh router` and `kvmesh serve` (router/flags.py)."""
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="accept this client key (repeatable; tenant 'default')")
    p.add_argument("--api-keys-file", type=Path, default=None, metavar="FILE",
                   help=f"'KEY TENANT [{PRIORITY_FLAG}] [{ADMIN_FLAG}] [{SALT_OPTION}SALT]' per line (default: "
                        f"${KEYS_FILE_ENV} if set); {ADMIN_FLAG}: every tenant's view of /v1/cluster and /metrics")
    p.add_argument("--metrics-require-key", action="store_true",
                   help="/metrics needs an API key like /v1 (default: open, like /health)")
    p.add_argument("--metrics-tenant-names", action="store_true",
                   help="an open /metrics scraped without a key labels tenants by name (default: by an "
                        "opaque id, t-<hex>, stable for a key set; an admin key always sees names)")
    p.add_argument("--max-concurrent-per-tenant", type=int, default=None, metavar="N",
                   help="requests in flight per tenant (429 / RESOURCE_EXHAUSTED beyond; without keys: all "
                        "clients are one tenant); default unlimited")


def keys_from_args(args: argparse.Namespace) -> tuple[ApiKey, ...]:
    """--api-key values plus the keys file (flag, else the environment). Raises ValueError."""
    keys = [ApiKey(k) for k in args.api_key]
    path = args.api_keys_file or (Path(os.environ[KEYS_FILE_ENV]) if os.environ.get(KEYS_FILE_ENV) else None)
    if path is not None:
        keys += parse_keys_file(path)
    return tuple(keys)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_open(host: str, keys: Iterable[ApiKey]) -> bool:
    """Log a loud warning when `host` is reachable from other machines and no key is set;
    returns whether it warned."""
    if any(True for _ in keys) or is_loopback(host):
        return False
    log.warning("!!! kvmesh router binds %s WITHOUT client authentication: anyone who can reach this "
                "address can generate. Set --api-key or --api-keys-file (or %s). !!!", host, KEYS_FILE_ENV)
    return True


class TenantLimiter:
    """Requests in flight per tenant, shared by both fronts of one router (one event loop):
    `acquire` is False when the tenant is at `limit` (None: unlimited)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._in_flight: dict[TenantId, int] = {}
        self.admitted: dict[TenantId, int] = {}   # requests per tenant since start (router/observe/metrics.py)
        self.rejected: dict[TenantId, int] = {}

    def acquire(self, tenant: TenantId) -> bool:
        n = self._in_flight.get(tenant, 0)
        if self.limit is not None and n >= self.limit:
            self.rejected[tenant] = self.rejected.get(tenant, 0) + 1
            return False
        self._in_flight[tenant] = n + 1
        self.admitted[tenant] = self.admitted.get(tenant, 0) + 1
        return True

    def release(self, tenant: TenantId) -> None:
        n = self._in_flight.get(tenant, 0) - 1
        if n > 0:
            self._in_flight[tenant] = n
        else:
            self._in_flight.pop(tenant, None)

    def hold(self, tenant: TenantId) -> Callable[[], None] | None:
        """A slot for `tenant` and the callable that frees it (a second call does nothing),
        or None when the tenant is at its limit."""
        if not self.acquire(tenant):
            return None
        held = [True]

        def release() -> None:
            if held[0]:
                held[0] = False
                self.release(tenant)
        return release

    def too_many(self, tenant: TenantId) -> str:
        return f"tenant {tenant!r} has {self.limit} requests in flight (--max-concurrent-per-tenant)"


class Authenticator:
    """The key check shared by both fronts. Compares the presented key against every
    configured key with `hmac.compare_digest` (no early exit on a match). With a
    `TenantLimiter`, also caps each tenant's requests in flight on the generating paths."""

    def __init__(self, keys: Iterable[ApiKey], limiter: TenantLimiter | None = None,
                 metrics_require_key: bool = False) -> None:
        self.keys = tuple(keys)
        self.limiter = limiter or TenantLimiter(None)
        self.open_paths = _OPEN_HTTP_PATHS if metrics_require_key else _OPEN_HTTP_PATHS | {_METRICS_PATH}

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def viewer(self, request: web.Request) -> ApiKey | None:
        """Whose view of the cluster state `request` gets: ANONYMOUS (everything) without keys;
        the key the middleware accepted; on an open path (an open /metrics) the key presented,
        if valid; else None (an unauthenticated caller)."""
        if not self.enabled:
            return ANONYMOUS
        key = request.get(TENANT_KEY)
        return key if key is not None else self.check(request.headers.get("Authorization"))

    def check(self, authorization: str | None) -> ApiKey | None:
        """The key named by an `Authorization` value (`Bearer KEY`), or None."""
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        presented = token.strip().encode("utf-8", "surrogatepass")
        found: ApiKey | None = None
        for k in self.keys:
            if hmac.compare_digest(presented, k.key.encode("utf-8")) and found is None:
                found = k
        return found

    # -- HTTP ---------------------------------------------------------------------------------
    def http_middleware(self) -> Callable[..., Awaitable[web.StreamResponse]]:
        @web.middleware
        async def authenticate(request: web.Request,
                               handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
            if request.path in self.open_paths:
                return await handler(request)
            key = self.check(request.headers.get("Authorization")) if self.enabled else ANONYMOUS
            if key is None:
                return unauthorized_response()
            request[TENANT_KEY] = key
            if request.method != "POST" or not request.path.startswith(_LIMITED_HTTP_PREFIX):
                return await handler(request)
            release = self.limiter.hold(key.tenant)
            if release is None:
                return _error_response(429, self.limiter.too_many(key.tenant), "too_many_requests",
                                       "rate_limit_error")
            request[SLOT_KEY] = release
            try:
                return await handler(request)
            finally:
                release()
        return authenticate

    # -- gRPC ---------------------------------------------------------------------------------
    def grpc_interceptor(self) -> grpc.aio.ServerInterceptor:
        return _GrpcAuth(self)


_PER_ROUTER: weakref.WeakKeyDictionary[Any, Authenticator] = weakref.WeakKeyDictionary()


def authenticator_for(router: Any) -> Authenticator:
    """The one Authenticator (keys + tenant limiter) of a routing core, shared by its gRPC and
    HTTP fronts so a tenant's in-flight count spans both. `router.cfg` is its RouterConfig."""
    auth = _PER_ROUTER.get(router)
    if auth is None:
        cfg = router.cfg
        auth = _PER_ROUTER[router] = Authenticator(cfg.api_keys, TenantLimiter(cfg.max_concurrent_per_tenant),
                                                   cfg.metrics_require_key)
    return auth


def unauthorized_response() -> web.Response:
    return _error_response(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                           "invalid_api_key", "invalid_request_error",
                           headers={"WWW-Authenticate": 'Bearer realm="kvmesh"'})


def _error_response(status: int, message: str, code: str, kind: str,
                    headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return web.json_response(body, status=status, headers=headers)


class _GrpcAuth(grpc.aio.ServerInterceptor):
    """Rejects calls without a valid `authorization: Bearer KEY` with UNAUTHENTICATED before
    the request body is parsed; health and reflection stay open."""

    def __init__(self, auth: Authenticator) -> None:
        self._auth = auth

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith(_OPEN_GRPC_PREFIXES):
            return await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        value = metadata.get("authorization")
        if not self._auth.enabled:
            key: ApiKey | None = ANONYMOUS
        else:
            key = self._auth.check(value) if isinstance(value, str) else None
        handler = await continuation(details)
        if key is None:
            return refusing(handler, grpc.StatusCode.UNAUTHENTICATED,
                            "missing or invalid API key (authorization: Bearer <key>)")
        if details.method in _LIMITED_GRPC_METHODS and handler is not None and handler.response_streaming:
            return _limited_stream(handler, self._auth.limiter, key)
        return handler


class _ReleasingContext:
    """A servicer context whose `abort` frees the tenant slot before the status goes out."""

    def __init__(self, context: grpc.aio.ServicerContext, release: Callable[[], None]) -> None:
        self._context, self._release = context, release

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> Any:
        self._release()
        return await self._context.abort(code, details, trailing_metadata)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def release_slot(request: web.Request) -> None:
    """Frees the request's tenant slot now (a no-op on requests not counted)."""
    release = request.get(SLOT_KEY)
    if release is not None:
        release()


def _limited_stream(handler: grpc.RpcMethodHandler, limiter: TenantLimiter, key: ApiKey) -> grpc.RpcMethodHandler:
    """`handler` (unary-stream Generate) counted against the key's tenant for as long as its
    stream runs; a `priority` from a tenant not flagged for it is PERMISSION_DENIED."""
    inner, tenant = handler.unary_stream, key.tenant

    async def behavior(request: object, context: grpc.aio.ServicerContext) -> Any:
        message = getattr(request, "message", None)   # a ParsedRequest (contracts.wire)
        if not key.priority and message is not None and message.priority:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, PRIORITY_DENIED)
        release = limiter.hold(tenant)
        if release is None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, limiter.too_many(tenant))
            return
        # The slot is freed before the client can see the call end: before the finished
        # response is sent, and before an abort's status (grpc.aio sends it inside `abort`).
        try:
            async for response in inner(request, _ReleasingContext(context, release)):
                if getattr(response, "finished", False):
                    release()
                yield response
        finally:
            release()
    return grpc.unary_stream_rpc_method_handler(behavior, request_deserializer=handler.request_deserializer,
                                                response_serializer=handler.response_serializer)

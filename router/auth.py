"""Client authentication on the router's fronts: API keys (each naming a tenant) checked on
HTTP `Authorization: Bearer KEY` and on gRPC `authorization: Bearer KEY` metadata.

Owns: the key set (`ApiKey`, parsed from `--api-key` / `--api-keys-file` /
`KVMESH_API_KEYS_FILE` by `keys_from_args`), the constant-time check (`Authenticator`), the
aiohttp middleware (401 with an OpenAI-style body) and the gRPC server interceptor
(UNAUTHENTICATED). With no keys configured every request passes (loopback default);
`warn_if_open` logs loudly when such a router binds a non-loopback host. `/health` and gRPC
health/reflection stay open. Torch-free.
"""
from __future__ import annotations

import argparse
import hmac
import ipaddress
import logging
import os
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NewType

import grpc
from aiohttp import web

TenantId = NewType("TenantId", str)

KEYS_FILE_ENV = "KVMESH_API_KEYS_FILE"
DEFAULT_TENANT = TenantId("default")
PRIORITY_FLAG = "priority"
TENANT_KEY = web.RequestKey("kvmesh_tenant", "ApiKey")   # the caller's key on an authenticated request
_OPEN_HTTP_PATHS = frozenset({"/health", "/live"})
_OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

log = logging.getLogger("kvmesh.router.auth")


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One client key: the secret, the tenant it names, and whether that tenant may set
    `priority`. The secret never appears in repr or logs."""

    key: str
    tenant: TenantId = DEFAULT_TENANT
    priority: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key or any(c.isspace() for c in self.key):
            raise ValueError("api_keys: a key must be a non-empty string without whitespace")
        if not isinstance(self.tenant, str) or not self.tenant or any(c.isspace() for c in self.tenant):
            raise ValueError(f"api_keys: tenant {self.tenant!r} must be a non-empty word")

    def __repr__(self) -> str:
        return f"ApiKey(key=<redacted>, tenant={self.tenant!r}, priority={self.priority})"


def parse_keys_file(path: Path) -> tuple[ApiKey, ...]:
    """`key tenant [priority]` per line; blank lines and `#` comments ignored. Raises
    ValueError naming the file and line (never echoing a key)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"api_keys_file: cannot read {path}: {e}") from None
    keys: list[ApiKey] = []
    for n, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) not in (2, 3) or (len(words) == 3 and words[2] != PRIORITY_FLAG):
            raise ValueError(f"api_keys_file: {path}:{n}: expected 'KEY TENANT [{PRIORITY_FLAG}]'")
        keys.append(ApiKey(words[0], TenantId(words[1]), priority=len(words) == 3))
    if not keys:
        raise ValueError(f"api_keys_file: {path} holds no keys")
    return tuple(keys)


def add_auth_arguments(p: argparse.ArgumentParser) -> None:
    """The client-auth flags of `kvmesh router` and `kvmesh serve`."""
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="accept this client key (repeatable; tenant 'default')")
    p.add_argument("--api-keys-file", type=Path, default=None, metavar="FILE",
                   help=f"'KEY TENANT [{PRIORITY_FLAG}]' per line (default: ${KEYS_FILE_ENV} if set)")


def keys_from_args(args: argparse.Namespace) -> tuple[ApiKey, ...]:
    """--api-key values plus the keys file (flag, else the environment). Raises ValueError."""
    keys = [ApiKey(k) for k in args.api_key]
    path = args.api_keys_file or (Path(os.environ[KEYS_FILE_ENV]) if os.environ.get(KEYS_FILE_ENV) else None)
    if path is not None:
        keys += parse_keys_file(path)
    return tuple(keys)


def auth_argv(args: argparse.Namespace) -> tuple[str, ...]:
    """The auth flags spelled back for a `kvmesh router` child (`kvmesh serve`)."""
    argv: list[str] = []
    for k in args.api_key:
        argv += ["--api-key", k]
    if args.api_keys_file is not None:
        argv += ["--api-keys-file", str(args.api_keys_file)]
    return tuple(argv)


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


class Authenticator:
    """The key check shared by both fronts. Compares the presented key against every
    configured key with `hmac.compare_digest` (no early exit on a match)."""

    def __init__(self, keys: Iterable[ApiKey]) -> None:
        self.keys = tuple(keys)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

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
            if not self.enabled or request.path in _OPEN_HTTP_PATHS:
                return await handler(request)
            key = self.check(request.headers.get("Authorization"))
            if key is None:
                return unauthorized_response()
            request[TENANT_KEY] = key
            return await handler(request)
        return authenticate

    # -- gRPC ---------------------------------------------------------------------------------
    def grpc_interceptor(self) -> grpc.aio.ServerInterceptor:
        return _GrpcAuth(self)


def unauthorized_response() -> web.Response:
    body = {"error": {"message": "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                      "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    return web.json_response(body, status=401, headers={"WWW-Authenticate": 'Bearer realm="kvmesh"'})


class _GrpcAuth(grpc.aio.ServerInterceptor):
    """Rejects calls without a valid `authorization: Bearer KEY` with UNAUTHENTICATED before
    the request body is parsed; health and reflection stay open."""

    def __init__(self, auth: Authenticator) -> None:
        self._auth = auth

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        if not self._auth.enabled or details.method.startswith(_OPEN_GRPC_PREFIXES):
            return await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        value = metadata.get("authorization")
        if isinstance(value, str) and self._auth.check(value) is not None:
            return await continuation(details)
        handler = await continuation(details)
        return _denying(handler)


async def _deny(request: object, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key (authorization: Bearer <key>)")


def _denying(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    """A handler of the same shape as `handler` that aborts UNAUTHENTICATED without
    deserializing the request (bytes stay bytes)."""
    if handler is None:
        return None
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_deny)
    return grpc.unary_unary_rpc_method_handler(_deny)

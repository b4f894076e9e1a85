"""gRPC plumbing of the cluster token (contracts/cluster_token.py), shared by the router (a client
of workers) and the workers (servers, and clients of their peers).

`TokenMetadata`: a client interceptor adding `x-kvmesh-cluster-token` to every call while
`token()` returns one (the router returns None until the worker it dials has been admitted).
`ClusterTokenGuard`: a server interceptor refusing (UNAUTHENTICATED, before the request is
parsed) every call of `service` without the token, except `open_methods`.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from typing import Any

import grpc

from contracts.cluster_token import TOKEN_METADATA, token_matches

TokenSource = Callable[[], str | None]


def _with_token(details: grpc.aio.ClientCallDetails, token: str | None) -> grpc.aio.ClientCallDetails:
    if token is None:
        return details
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata.add(TOKEN_METADATA, token)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: TokenSource) -> None:
        self._token = token

    async def intercept_unary_unary(self, continuation: Any, details: grpc.aio.ClientCallDetails,
                                    request: Any) -> Any:
        return await continuation(_with_token(details, self._token()), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: TokenSource) -> None:
        self._token = token

    async def intercept_unary_stream(self, continuation: Any, details: grpc.aio.ClientCallDetails,
                                     request: Any) -> Any:
        return await continuation(_with_token(details, self._token()), request)


def token_interceptors(token: TokenSource) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors for an asyncio channel (unary and server-streaming calls)."""
    return [_UnaryUnary(token), _UnaryStream(token)]


class ClusterTokenGuard(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for calls of `service` that lack the token (constant-time check)."""

    def __init__(self, token: str, service: str, open_methods: Collection[str] = ()) -> None:
        self._token = token
        self._prefix = f"/{service}/"
        self._open = frozenset(f"/{service}/{m}" for m in open_methods)

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if not details.method.startswith(self._prefix) or details.method in self._open:
            return handler
        presented = dict(details.invocation_metadata or ()).get(TOKEN_METADATA)
        if token_matches(presented, self._token):
            return handler
        return refusing(handler, grpc.StatusCode.UNAUTHENTICATED,
                        f"{details.method} serves the cluster only: missing or wrong cluster token")


def refusing(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode,
             details: str) -> grpc.RpcMethodHandler | None:
    """A handler of the same shape as `handler` that aborts with `code` without deserializing
    the request (bytes stay bytes)."""
    if handler is None:
        return None

    async def _deny(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, details)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_deny)
    return grpc.unary_unary_rpc_method_handler(_deny)

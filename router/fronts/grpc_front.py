"""The router's gRPC front: the `Router` service (Generate, Abort, GetModelInfo), gRPC
health and reflection, over the routing core (router/routing/core.py).

The one place in router/ that maps errors to gRPC status codes (`_status_for`).
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from contracts.grpc_options import grpc_server_options
from contracts.health import LIVENESS_SERVICE
from contracts.requests import BadRequest
from contracts.wire import ParsedRequest, parse_generate_request, to_generate_input
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.routing.core import Router
from router.routing.errors import NoWorkerAvailable, RouterError, UpstreamError
from router.security.auth import authenticator_for
from router.security.tenancy import grpc_caller

ROUTER_SERVICE = pb.DESCRIPTOR.services_by_name["Router"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _status_for(error: BadRequest | RouterError) -> tuple[grpc.StatusCode, str]:
    if isinstance(error, BadRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, NoWorkerAvailable):
        return grpc.StatusCode.UNAVAILABLE, str(error)
    if isinstance(error, UpstreamError):
        return error.code, error.details
    return grpc.StatusCode.INTERNAL, str(error)


class GrpcFront:
    """The gRPC server of one router: bind with `start`, report readiness with
    `set_health`, drain with `stop`. Health: the Router service (and "") is readiness;
    `LIVENESS_SERVICE` is SERVING from `start` on (the loop answers)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None   # made in `start`, on the serving loop

    async def start(self, host: str, port: int) -> int:
        """Bind (NOT_SERVING until `set_health(True)`) and serve; returns the bound port.
        Raises RuntimeError when the port cannot be bound."""
        cfg = self.router.cfg
        opts = grpc_server_options(cfg.max_message_bytes, cfg.grpc_idle_timeout_s)
        auth = authenticator_for(self.router)
        self._server = server = grpc.aio.server(options=opts, interceptors=[auth.grpc_interceptor()])
        server.add_generic_rpc_handlers((self._router_handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection((ROUTER_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        await self.set_health(False)
        await self._health.set(LIVENESS_SERVICE, _SERVING)
        bound = cfg.tls.add_port(server, f"{host}:{port}", require_client_cert=False)   # TLS with --tls-cert
        await server.start()
        return bound

    async def stop(self, grace: float | None) -> None:
        if self._server is not None:
            await self._server.stop(grace)

    async def set_health(self, ready: bool) -> None:
        status = _SERVING if ready and not self.router.draining else _NOT_SERVING
        for service in (health.OVERALL_HEALTH, ROUTER_SERVICE):
            await self._health.set(service, status)

    def _router_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(ROUTER_SERVICE, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self._generate, request_deserializer=parse_generate_request,
                response_serializer=pb.GenerateResponse.SerializeToString),
            "Abort": grpc.unary_unary_rpc_method_handler(
                self._abort, request_deserializer=_parse_or_none(pb.AbortRequest),
                response_serializer=pb.AbortResponse.SerializeToString),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self._model_info, request_deserializer=_parse_or_none(pb.ModelInfoRequest),
                response_serializer=pb.ModelInfo.SerializeToString),
        })

    async def _generate(self, parsed: ParsedRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        if parsed.message is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, parsed.error or "malformed request")
        try:
            caller = grpc_caller(authenticator_for(self.router), context)
            prepared = await self.router.prepare(to_generate_input(parsed.message), caller)  # type: ignore[arg-type]
            async with contextlib.aclosing(self.router.generate(prepared, context.time_remaining())) as stream:
                async for response in stream:
                    yield response
        except (BadRequest, RouterError) as e:
            await context.abort(*_status_for(e))

    async def _abort(self, request: pb.AbortRequest | None, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if request is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed AbortRequest")
            raise AssertionError("unreachable")
        try:
            tenant = grpc_caller(authenticator_for(self.router), context).tenant   # only its own requests
            return pb.AbortResponse(found=await self.router.abort(request.request_id, tenant))
        except RouterError as e:
            await context.abort(*_status_for(e))
            raise AssertionError("unreachable") from None

    async def _model_info(self, request: pb.ModelInfoRequest | None,
                          context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        if request is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed ModelInfoRequest")
        info = self.router.model_info
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is ready")
        return info  # type: ignore[return-value]


M = TypeVar("M", bound=Message)


def _parse_or_none(cls: type[M]) -> Callable[[bytes], M | None]:
    """A request deserializer that yields None for bytes that are not a `cls` (the handler
    answers INVALID_ARGUMENT) instead of raising inside grpc (UNKNOWN and a logged traceback)."""
    def parse(data: bytes) -> M | None:
        try:
            return cls.FromString(data)
        except (DecodeError, RuntimeWarning, ValueError):
            return None
    return parse

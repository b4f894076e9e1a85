"""The per-tenant in-flight slot (`--max-concurrent-per-tenant`) is free before a client can
see its request end: a client that sends its next request the moment the last one ends must
not be refused (429 / RESOURCE_EXHAUSTED) for a slot the finished request still held."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from router.security.auth import (
    ApiKey,
    Authenticator,
    TenantId,
    TenantLimiter,
    _limited_stream,
    release_slot,
)

TENANT = TenantId("t")


class _Aborted(Exception):
    pass


class _Context:
    """Records how many requests the tenant had in flight when the status went out."""

    def __init__(self, limiter: TenantLimiter) -> None:
        self.limiter, self.in_flight_at_abort = limiter, -1

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        self.in_flight_at_abort = self.limiter._in_flight.get(TENANT, 0)
        raise _Aborted(code)


def _stream(inner: Any, limiter: TenantLimiter) -> Any:
    handler = SimpleNamespace(unary_stream=inner, request_deserializer=None, response_serializer=None)
    return _limited_stream(handler, limiter, ApiKey("k", TENANT)).unary_stream  # type: ignore[arg-type]


def test_hold_releases_once() -> None:
    lim = TenantLimiter(2)
    a, b = lim.hold(TENANT), lim.hold(TENANT)
    assert a is not None and b is not None and lim.hold(TENANT) is None
    a()
    a()                                         # a second call frees nothing more
    assert lim._in_flight[TENANT] == 1
    b()
    assert TENANT not in lim._in_flight


def test_grpc_abort_frees_the_slot_before_its_status_goes_out() -> None:
    lim = TenantLimiter(1)

    async def inner(request: object, context: Any) -> AsyncIterator[object]:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty prompt")
        yield None

    async def run() -> _Context:
        ctx = _Context(lim)
        try:
            async for _ in _stream(inner, lim)(SimpleNamespace(message=None), ctx):
                pass
        except _Aborted:
            pass
        return ctx
    ctx = asyncio.run(run())
    assert ctx.in_flight_at_abort == 0
    assert lim.hold(TENANT) is not None


def test_grpc_finished_response_is_sent_with_the_slot_free() -> None:
    lim = TenantLimiter(1)
    seen: list[tuple[bool, int]] = []

    async def inner(request: object, context: Any) -> AsyncIterator[object]:
        yield SimpleNamespace(finished=False)
        yield SimpleNamespace(finished=True)

    async def run() -> None:
        async for r in _stream(inner, lim)(SimpleNamespace(message=None), _Context(lim)):
            seen.append((r.finished, lim._in_flight.get(TENANT, 0)))
    asyncio.run(run())
    assert seen == [(False, 1), (True, 0)]
    assert TENANT not in lim._in_flight          # and the finally did not free it twice


def test_http_stream_frees_the_slot_before_its_last_bytes() -> None:
    lim = TenantLimiter(1)
    auth = Authenticator((ApiKey("sk-0123456789abcdef", TENANT),), lim, False)
    in_flight: list[int] = []

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"data: 1\n\n")
        release_slot(request)
        in_flight.append(lim._in_flight.get(TENANT, 0))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        await asyncio.sleep(0.3)                 # the handler lingers after its last byte
        return resp

    async def run() -> list[int]:
        app = web.Application(middlewares=[auth.http_middleware()])
        app.router.add_post("/v1/completions", stream)
        statuses = []
        async with TestClient(TestServer(app)) as client:
            hdr = {"Authorization": "Bearer sk-0123456789abcdef"}
            for _ in range(2):
                r = await client.post("/v1/completions", headers=hdr)
                assert (await r.read()).endswith(b"[DONE]\n\n")
                statuses.append(r.status)
        return statuses
    assert asyncio.run(run()) == [200, 200]
    assert in_flight == [0, 0]

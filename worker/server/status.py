"""The one place worker exceptions become gRPC status codes (`status_for`); `RpcGate`, what every
Worker handler passes through (UNAVAILABLE while loading or once not live, an exception answered
with its status); and the request deserializer that turns undecodable bytes into None rather than
an exception inside grpc. Torch-free at import: the engine's errors are looked up when the engine
is loaded."""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError

from contracts.requests import BadRequest
from contracts.sampling import SamplingParamsError
from contracts.tokenizer import TokenizerError, TokenizerFilesTooLarge
from worker.peer.errors import InvalidPeerRequest, PeerTransferOff

if TYPE_CHECKING:
    from worker.engine.async_engine import AsyncEngine
    from worker.server.liveness import Liveness

log = logging.getLogger("kvmesh.worker")
T = TypeVar("T")


def status_for(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The gRPC code and details a handler answers `error` with (INTERNAL: a bug)."""
    from worker.engine.request import InvalidRequest, QueueFull  # loaded with the engine
    if isinstance(error, (BadRequest, InvalidRequest, SamplingParamsError, InvalidPeerRequest)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, TokenizerFilesTooLarge):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)
    if isinstance(error, TokenizerError):     # GetTokenizer of a model without one
        return grpc.StatusCode.FAILED_PRECONDITION, str(error)
    if isinstance(error, PeerTransferOff):
        return grpc.StatusCode.FAILED_PRECONDITION, str(error)
    if isinstance(error, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"queue full: {error}"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"


def parse_or_none(cls: Any) -> Callable[[bytes], Any]:
    """A request deserializer that yields None for bytes that are not a `cls` instead of
    raising inside grpc (UNKNOWN and a logged traceback)."""
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except DecodeError:
            return None
    return parse


class RpcGate:
    """What the Worker's handlers pass through. `engine()` is the loaded AsyncEngine, None while
    loading; `liveness` says whether the engine thread still beats. Every method that refuses a
    call aborts `context` (raises grpc.aio.AbortError)."""

    def __init__(self, worker_id: str, liveness: Liveness, engine: Callable[[], AsyncEngine | None]) -> None:
        self.worker_id = worker_id
        self._liveness = liveness
        self._engine = engine

    async def loaded(self, context: grpc.aio.ServicerContext) -> AsyncEngine:
        """The engine: UNAVAILABLE while loading."""
        ae = self._engine()
        if ae is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_id} is loading its model")
        assert ae is not None
        return ae

    async def ready(self, context: grpc.aio.ServicerContext) -> AsyncEngine:
        """The engine, for RPCs that need it: UNAVAILABLE while loading or once not live."""
        ae = await self.loaded(context)
        dead = self._liveness.check()
        if dead is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_id} is not live: {dead}")
        return ae

    async def guard(self, context: grpc.aio.ServicerContext, work: Awaitable[T]) -> T:
        """`work`'s result; an exception it raises is answered with its status (`fail`)."""
        try:
            return await work
        except Exception as e:  # noqa: BLE001 - mapped to a status; the server keeps serving
            await self.fail(context, e)

    async def fail(self, context: grpc.aio.ServicerContext, error: Exception) -> NoReturn:
        """Abort with `status_for(error)` (an AbortError passes through); INTERNAL ones are logged."""
        if isinstance(error, grpc.aio.AbortError):
            raise error
        code, details = status_for(error)
        if code is grpc.StatusCode.INTERNAL:
            log.error("worker %s: unexpected error in a handler", self.worker_id, exc_info=error)
        await context.abort(code, details)
        raise AssertionError("context.abort returned")   # it always raises

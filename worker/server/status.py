"""The one place worker exceptions become gRPC status codes (`status_for`), and the request
deserializer that turns undecodable bytes into None rather than an exception inside grpc.
Torch-free at import: the engine's errors are looked up when the engine is loaded."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from contracts.requests import BadRequest
from contracts.sampling import SamplingParamsError
from contracts.tokenizer import TokenizerError, TokenizerFilesTooLarge
from worker.peer.errors import InvalidPeerRequest, PeerTransferOff


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

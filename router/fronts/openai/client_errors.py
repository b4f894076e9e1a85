"""Client-caused HTTP errors on the router's HTTP front: counted, and logged as one WARNING
line without a traceback, at most once per kind every `WARN_EVERY_S` seconds.

aiohttp's request handler reports what goes wrong with a connection through its `logger`
(aiohttp.web_protocol.RequestHandler: `log_exception` → `logger.exception(...)`, with the
exception as `exc_info`): malformed framing (`Content-Length: -5`, a header line over the
limit, a bad request line) from its parser, and a handler that failed writing to a client
that went away (`ClientConnectionResetError`). By default that logger is `aiohttp.server` and
every such request is an ERROR with a full traceback, so a hostile client can flood the log.
`ClientErrors` is passed as that logger (`web.AppRunner(logger=...)`, router/fronts/openai/app.py):
an exception the client caused becomes a count under its `ClientErrorKind` and a rate-limited
WARNING on `kvmesh.router.http`; anything else (a bug on our side) keeps its ERROR and traceback.

The counts are `kvmesh:router_client_errors_total{kind}` (router/observe/metrics.py reads
`counts` through the app key `CLIENT_ERRORS`). Torch-free.
"""
from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, MutableMapping
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import (
    BadHttpMessage,
    BadStatusLine,
    ContentLengthError,
    HttpProcessingError,
    InvalidHeader,
    LineTooLong,
    TransferEncodingError,
)

WARN_EVERY_S = 10.0
log = logging.getLogger("kvmesh.router.http")


class ClientErrorKind(enum.Enum):
    """What the client did wrong (the `kind` label)."""

    LINE_TOO_LONG = "line_too_long"          # a request or header line over aiohttp's limit
    BAD_REQUEST_LINE = "bad_request_line"    # not an HTTP request line (method, target, version)
    BAD_HEADER = "bad_header"                # a malformed header (Content-Length: -5, bad characters)
    INCOMPLETE_BODY = "incomplete_body"      # a body shorter than its Content-Length, broken chunking
    BAD_FRAMING = "bad_framing"              # any other framing the parser refused
    DISCONNECT = "disconnect"                # the client went away while its response was written


def client_error_kind(exc: BaseException | None) -> ClientErrorKind | None:
    """The kind of a client-caused exception; None for one the server caused."""
    if isinstance(exc, LineTooLong):
        return ClientErrorKind.LINE_TOO_LONG
    if isinstance(exc, BadStatusLine):
        return ClientErrorKind.BAD_REQUEST_LINE
    if isinstance(exc, InvalidHeader):
        return ClientErrorKind.BAD_HEADER
    if isinstance(exc, (ContentLengthError, TransferEncodingError)):
        return ClientErrorKind.INCOMPLETE_BODY
    if isinstance(exc, BadHttpMessage) or (isinstance(exc, HttpProcessingError) and 400 <= exc.code < 500):
        return ClientErrorKind.BAD_FRAMING
    if isinstance(exc, ConnectionError):        # ConnectionResetError, BrokenPipeError, aiohttp's reset error
        return ClientErrorKind.DISCONNECT
    return None


class ClientErrors(logging.LoggerAdapter):
    """aiohttp's server logger for one HTTP front (see the module docstring). `counts`: per
    kind, since start. `clock` is for tests."""

    def __init__(self, server_logger: logging.Logger | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(server_logger or logging.getLogger("aiohttp.server"), {})
        self.counts: dict[str, int] = {k.value: 0 for k in ClientErrorKind}
        self._clock = clock
        self._last_warned: dict[ClientErrorKind, float] = {}
        self._unwarned: dict[ClientErrorKind, int] = {}

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return msg, kwargs

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else None
        kind = client_error_kind(exc)
        if kind is None:
            self.logger.exception(msg, *args, exc_info=exc_info, **kwargs)
            return
        self.record(kind, exc)

    def debug(self, msg: object, *args: object, **kwargs: Any) -> None:
        """aiohttp logs a bad method on a connection's first request (a port scan, TLS sent to
        plain HTTP) at debug: counted, and kept at debug without the traceback."""
        exc = kwargs.get("exc_info")
        kind = client_error_kind(exc) if isinstance(exc, BaseException) else None
        if kind is None:
            self.logger.debug(msg, *args, **kwargs)
            return
        self.counts[kind.value] += 1
        log.debug("client error (%s): %s", kind.value, type(exc).__name__)

    def record(self, kind: ClientErrorKind, exc: BaseException | None) -> None:
        """Count one client error of `kind`; log it unless one of its kind was logged within
        `WARN_EVERY_S` (those are counted in the next line)."""
        self.counts[kind.value] += 1
        now = self._clock()
        last = self._last_warned.get(kind)
        if last is not None and now - last < WARN_EVERY_S:
            self._unwarned[kind] = self._unwarned.get(kind, 0) + 1
            return
        self._last_warned[kind] = now
        more = self._unwarned.pop(kind, 0)
        detail = " ".join(str(exc).split())[:200] if exc is not None else ""
        log.warning("client error (%s): %s: %s%s", kind.value, type(exc).__name__ if exc else "-", detail,
                    f" (+{more} more of this kind since the last line)" if more else "")


CLIENT_ERRORS = web.AppKey("kvmesh_client_errors", ClientErrors)

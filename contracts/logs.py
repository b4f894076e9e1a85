"""Logging of every kvmesh process: the request id of the request being
served on every log line, and `--log-format text|json`.

- `REQUEST_ID` is a contextvar: a front sets it when a request arrives (router/fronts/openai/app.py from the
  `x-request-id` header or the id it generates, router/routing/core.py `Router.generate`, the worker's
  Generate handler from the `x-request-id` gRPC metadata) and every line logged by that task
  carries it, because `RequestIdFilter` copies it into each record on the handler.
- `configure_logging` installs one stderr handler on the root logger, with that filter and
  either the text format or `JsonFormatter` (one JSON object per line: ts, level, logger, msg,
  request_id when set, exc when an exception is attached).

Torch-free and free of router/worker imports: every CLI takes it.
"""
from __future__ import annotations

import argparse
import contextvars
import enum
import json
import logging
import sys
from datetime import datetime, timezone
from typing import IO

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvmesh_request_id", default=None)
REQUEST_ID_HEADER = "x-request-id"   # HTTP header and gRPC metadata key (lower case, as gRPC wants)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(request_tag)s: %(message)s"


class LogFormat(enum.Enum):
    TEXT = "text"
    JSON = "json"


class RequestIdFilter(logging.Filter):
    """Adds `request_id` (None when no request is being served) and `request_tag` (` [id]`
    or empty, for the text format) to every record; never drops one."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = REQUEST_ID.get()
        record.request_id = rid
        record.request_tag = f" [{rid}]" if rid else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        rid = getattr(record, "request_id", None)
        if rid:
            doc["request_id"] = rid
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


def make_handler(fmt: LogFormat | str, stream: IO[str] | None = None) -> logging.Handler:
    """A stream handler (stderr by default) with the request-id filter and `fmt`."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if LogFormat(fmt) is LogFormat.JSON else logging.Formatter(TEXT_FORMAT))
    return handler


def configure_logging(fmt: LogFormat | str = LogFormat.TEXT, level: int = logging.INFO,
                      stream: IO[str] | None = None) -> None:
    """Replace the root logger's handlers with one `make_handler(fmt, stream)` at `level`."""
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(make_handler(fmt, stream))
    root.setLevel(level)


def add_log_format_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--log-format", default=LogFormat.TEXT.value, choices=[f.value for f in LogFormat],
                   help="stderr log lines: text, or json (one object per line: ts, level, logger, msg, "
                        "request_id) for log pipelines")


def valid_request_id(value: str) -> bool:
    """1-128 printable ASCII characters without spaces (what the fronts accept from clients)."""
    return 0 < len(value) <= 128 and all(33 <= ord(c) <= 126 for c in value)


def trace_id(context: object, fallback: str) -> str:
    """The `x-request-id` of a gRPC call's metadata (`context.invocation_metadata()`) when it is
    a valid id, else `fallback` (the request's own id)."""
    metadata = getattr(context, "invocation_metadata", None)
    for key, value in (metadata() or ()) if callable(metadata) else ():
        if key == REQUEST_ID_HEADER and isinstance(value, str) and valid_request_id(value):
            return value
    return fallback

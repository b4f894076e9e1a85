"""Capture what the process logs, as `--log-format json` writes it (tests of request tracing)."""
from __future__ import annotations

import contextlib
import io
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from contracts.logs import make_handler


@dataclass
class JsonLogs:
    handler: logging.Handler
    lines: list[dict[str, Any]] = field(default_factory=list)   # filled when the block exits


@contextlib.contextmanager
def json_logs() -> Iterator[JsonLogs]:
    """Every INFO+ record logged inside the block, one parsed JSON object per line."""
    out = io.StringIO()
    logs = JsonLogs(make_handler("json", out))
    root = logging.getLogger()
    root.addHandler(logs.handler)
    old_level = root.level
    root.setLevel(logging.INFO)
    try:
        yield logs
    finally:
        root.removeHandler(logs.handler)
        root.setLevel(old_level)
        logs.lines.extend(json.loads(line) for line in out.getvalue().splitlines())

"""The one writer of benchmark results, torch-free so that `kvmesh bench router` (router)
and the worker's benches (`kvmesh.bench.engine`) print and save their JSON the same way."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["emit"]


def emit(result: dict[str, Any], path: Path | None) -> int:
    """Print a benchmark's JSON and, with --json PATH, write it there; returns exit status 0."""
    text = json.dumps(result, indent=2)
    print(text)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return 0

"""`kvmesh router --pick-log PATH`: one JSON line per routing decision and per finished request,
appended to PATH, so a routing trace comes from the router itself (`kvmesh bench routing-live
--log-dir` keeps one per cluster) instead of a probe patched into the process.

Lines (`event` first; `t`: Unix time, seconds):
- `pick`: `request_id`, `prefix` (the prompt's first block hash, 16 hex digits: which prefix,
  never text; "" under one block), `blocks` (the prompt's full blocks), `worker` (the choice,
  a resubmission's too), `cluster_committed` (`R`) and `workers`: per live worker what the
  policy saw — `cached` (leading blocks held or computing, less a prefix it is evicting),
  `fetchable`, `in_flight`, `queued_tokens`, `mean_in_flight`, `shared_blocks`, `free_blocks`.
- `finish`: `request_id`, `worker`, `prompt_tokens`, `cached_tokens`, `peer_cached_tokens`.

A write that fails (a full disk) stops the log with one warning; routing goes on.
The state is read again right after the pick (`Router.routing_state`, no await between: the
same figures the pick saw), once per request: O(workers), paid only with the flag. Writes are
line-buffered on the router's loop; the file is for an operator's diagnosis, not for a fleet
at full rate. `PickLog` forwards every event to the observer it wraps (the metrics).
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import IO, Any, Protocol

from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.routing.observer import RouteObserver
from router.routing.types import RouteRequest

log = logging.getLogger("kvmesh.router")


class _Core(Protocol):
    """What the log reads of the router core (router/routing/core.py `Router`)."""

    def routing_state(self, route: RouteRequest) -> Any: ...


def check_pick_log_path(path: str) -> None:
    """ValueError naming --pick-log unless `path` can be opened for appending."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"--pick-log: {path!r} is a directory")
    if not target.parent.is_dir():
        raise ValueError(f"--pick-log: the folder of {path!r} does not exist")
    try:
        with target.open("a", encoding="utf-8"):
            pass
    except OSError as e:
        raise ValueError(f"--pick-log: cannot write {path!r}: {e.strerror or e}") from None


class PickLog(RouteObserver):
    """The `inner` observer's events, with a `pick` and a `finish` line each written to `path`."""

    def __init__(self, inner: RouteObserver, core: _Core, path: str) -> None:
        self.inner = inner
        self.core = core
        self._file: IO[str] | None = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (closed by close)

    def _write(self, line: dict[str, Any]) -> None:
        """One line; a write that fails (disk full, file gone) stops the log with one warning and
        never fails the request being routed."""
        if self._file is None:
            return
        try:
            self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        except OSError as e:
            log.warning("--pick-log: writing failed (%s); the pick log stops here", e.strerror or e)
            self._file = None

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):   # the last buffered line may not fit either
                self._file.close()
            self._file = None

    def picked(self, request_id: str, route: RouteRequest, worker_id: str) -> None:
        self.inner.picked(request_id, route, worker_id)
        state = self.core.routing_state(route)
        workers = {}
        for wid, load in state.loads.items():
            workers[wid] = {"cached": state.cached_blocks.get(wid, 0), "fetchable": state.fetchable_blocks.get(wid, 0),
                            "in_flight": load.in_flight, "queued_tokens": state.queued_tokens.get(wid, 0),
                            "mean_in_flight": round(state.mean_in_flight.get(wid, 0.0), 4),
                            "shared_blocks": round(load.shared_blocks, 2), "free_blocks": load.free_blocks}
        first = route.block_hashes[0] if route.block_hashes else None
        self._write({"event": "pick", "t": round(time.time(), 4), "request_id": request_id,
                     "prefix": f"{first:032x}"[:16] if first is not None else "", "blocks": len(route.block_hashes),
                     "worker": worker_id, "cluster_committed": round(state.cluster_committed, 4), "workers": workers})

    def finished(self, request_id: str, worker_id: str, final: pb.GenerateResponse, ttft_s: float,
                 total_s: float) -> None:
        self.inner.finished(request_id, worker_id, final, ttft_s, total_s)
        self._write({"event": "finish", "t": round(time.time(), 4), "request_id": request_id, "worker": worker_id,
                     "prompt_tokens": final.prompt_tokens, "cached_tokens": final.cached_tokens,
                     "peer_cached_tokens": final.peer_cached_tokens, "ttft_s": round(ttft_s, 4),
                     "total_s": round(total_s, 4)})

    # every other event goes to the wrapped observer as it is
    def decided(self, seconds: float) -> None:
        self.inner.decided(seconds)

    def aborted(self, request_id: str, worker_id: str | None, tokens: int) -> None:
        self.inner.aborted(request_id, worker_id, tokens)

    def first_response(self, request_id: str, worker_id: str, seconds: float) -> None:
        self.inner.first_response(request_id, worker_id, seconds)

    def failed(self, request_id: str, worker_id: str) -> None:
        self.inner.failed(request_id, worker_id)

    def hit_predicted(self, worker_id: str, error: float) -> None:
        self.inner.hit_predicted(worker_id, error)

    def migrated(self, request_id: str, worker_id: str, tokens: int) -> None:
        self.inner.migrated(request_id, worker_id, tokens)

"""What the routing core (router/routing/core.py) reports: the running hash-agreement figures
(`RoutingStats`) and the per-request events a metrics layer hears (`RouteObserver`, the null
observer; router/observe/metrics.py subclasses it). torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass

from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.routing.types import RouteRequest


@dataclass
class RoutingStats:
    """Did the router's idea of each worker's cache (the block index) match what the worker
    found? `mismatches` counts requests where the two differ (the hash-agreement metric)."""

    requests: int = 0
    routed_hit_tokens: int = 0
    actual_hit_tokens: int = 0
    mismatches: int = 0
    peer_hints: int = 0         # requests forwarded with a hint to a peer holding more blocks

    def record(self, predicted: int, actual: int) -> None:
        self.requests += 1
        self.routed_hit_tokens += predicted
        self.actual_hit_tokens += actual
        self.mismatches += predicted != actual


class RouteObserver:
    """What the core tells a metrics layer (router/observe/metrics.py) about each request; this base
    is the null observer. Called on the router's loop; must not block."""

    def decided(self, seconds: float) -> None:
        """A pick took `seconds`."""

    def picked(self, request_id: str, route: RouteRequest, worker_id: str) -> None:
        """`route` goes to `worker_id` (the dashboard's hottest prefixes, router/observe/cluster_view.py)."""

    def aborted(self, request_id: str, worker_id: str | None, tokens: int) -> None:
        """The client went away (cancelled, disconnected) after `tokens` streamed tokens, before
        the request finished; `worker_id` is the worker it ran on (None: not picked yet)."""

    def first_response(self, request_id: str, worker_id: str, seconds: float) -> None:
        """The first response from `worker_id` came `seconds` after `generate` began."""

    def finished(self, request_id: str, worker_id: str, final: pb.GenerateResponse, ttft_s: float,
                 total_s: float) -> None:
        """`worker_id` sent its first response `ttft_s` and the `final` one `total_s` after
        `generate` began."""

    def failed(self, request_id: str, worker_id: str) -> None:
        """The call to `worker_id` failed."""

    def hit_predicted(self, worker_id: str, error: float) -> None:
        """A request finished on `worker_id` (not migrated): (predicted − served hit tokens) /
        prompt tokens (router/routing/predictions.py)."""

    def migrated(self, request_id: str, worker_id: str, tokens: int) -> None:
        """The request moves off `worker_id` after `tokens` streamed tokens (router/routing/migrate.py)."""

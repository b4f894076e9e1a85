"""The worker's health checks: readiness and liveness, over gRPC health and plain HTTP.

Two checks (contracts/health.py names them):
- liveness — `LIVENESS_SERVICE`: SERVING unless `Liveness` found the engine loop stuck or
  failing (worker/server/liveness.py). SERVING while loading and while draining.
- readiness — `kvmesh.v1.Worker` and "": SERVING once the model is loaded, while live and not
  draining.
`WorkerHealth` holds that state, publishes it to the gRPC health servicer (`publish`) and answers
the HTTP probes (`live_reason` / `ready_reason`, served as /livez and /readyz next to /metrics by
worker/server/metrics_http.py's `MetricsHTTP`, for kubelets that cannot speak gRPC health over mutual TLS).
"""
from __future__ import annotations

from grpc_health.v1 import health, health_pb2

from contracts.health import LIVENESS_SERVICE
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from worker.server.liveness import Liveness

WORKER_SERVICE = pb.DESCRIPTOR.services_by_name["Worker"].full_name   # "kvmesh.v1.Worker"
READINESS_SERVICES = ("", WORKER_SERVICE)
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class WorkerHealth:
    """Readiness and liveness of one worker. The flags change on the server's event loop
    (`loaded`, `draining`, then `publish`); the reasons may be read from any thread."""

    def __init__(self, liveness: Liveness) -> None:
        self.servicer = health.aio.HealthServicer()
        self.liveness = liveness
        self._loaded = False
        self._draining = False

    def live_reason(self) -> str | None:
        """None while live, else why not (sticky)."""
        return self.liveness.check()

    def ready_reason(self) -> str | None:
        """None while the worker should get traffic, else why not."""
        dead = self.liveness.check()
        if dead is not None:
            return f"not live: {dead}"
        if self._draining:
            return "draining"
        if not self._loaded:
            return "loading the model"
        return None

    async def loaded(self) -> None:
        self._loaded = True
        await self.publish()

    async def draining(self) -> None:
        self._draining = True
        await self.publish()

    async def publish(self) -> None:
        """Set the gRPC health statuses from the state now."""
        await self.servicer.set(LIVENESS_SERVICE, _SERVING if self.live_reason() is None else _NOT_SERVING)
        ready = _SERVING if self.ready_reason() is None else _NOT_SERVING
        for service in READINESS_SERVICES:
            await self.servicer.set(service, ready)

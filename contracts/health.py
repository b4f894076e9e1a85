"""Health-service names shared by router, worker and the Helm chart's probes.

Readiness and liveness are separate checks (grpc.health.v1, one servicer per process):

- readiness — the process's main service name (`kvmesh.v1.Worker` on a worker, `kvmesh.v1.Router`
  on a router): SERVING while it should get traffic (model loaded, registered, not draining; for a
  router: at least one worker ready).
- liveness — `LIVENESS_SERVICE`: SERVING while the process makes progress (a worker's engine loop
  beats; a router's event loop answers). NOT_SERVING means "restart me".
"""
from __future__ import annotations

LIVENESS_SERVICE = "kvmesh.v1.Liveness"

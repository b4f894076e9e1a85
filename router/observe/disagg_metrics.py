"""The router's metrics of disaggregated serving (router/routing/disagg.py), in the router's
registry: prefill hops (count and seconds, per prefill worker), hops that failed by cause,
requests that skipped the hop by reason, and per role the workers' queues (requests waiting for
admission, from their last probe) and the router's in-flight requests. Built by `RouterMetrics`;
torch-free."""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from contracts.roles import WorkerRole
from router.routing.core import Router
from router.routing.disagg import DisaggObserver, FailCause, SkipReason

_HOP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


class DisaggMetrics(DisaggObserver):
    """Fed by the router's `Disaggregation` (its observer); the role gauges are read at scrape time."""

    def __init__(self, router: Router, registry: CollectorRegistry) -> None:
        r = registry
        self.handoffs = Counter("kvmesh:router_disagg_handoffs", "Requests whose prompt a prefill worker computed "
                                "and handed to their decode worker, by prefill worker", ("prefill_worker_id",),
                                registry=r)
        self.seconds = Histogram("kvmesh:router_disagg_prefill_seconds", "The prefill hop as the router saw it: "
                                 "the prompt sent to the prefill worker to its final response", buckets=_HOP_BUCKETS,
                                 registry=r)
        self.failures = Counter("kvmesh:router_disagg_failures", "Prefill hops that brought the decode worker "
                                "nothing (it computed the prompt), by prefill worker and cause",
                                ("prefill_worker_id", "cause"), registry=r)
        self.skipped = Counter("kvmesh:router_disagg_skipped", "Requests of a disaggregated cluster that skipped "
                               "the prefill hop, by reason", ("reason",), registry=r)
        r.register(_RoleCollector(router))

    def hop_skipped(self, reason: SkipReason) -> None:
        self.skipped.labels(reason.value).inc()

    def hop_prefilled(self, prefill_worker_id: str, seconds: float) -> None:
        self.handoffs.labels(prefill_worker_id).inc()
        self.seconds.observe(seconds)

    def hop_failed(self, prefill_worker_id: str, cause: FailCause) -> None:
        self.failures.labels(prefill_worker_id, cause.value).inc()


class _RoleCollector(Collector):
    """Per role, over the live workers: their queues and the router's open requests; and each
    live worker's role."""

    def __init__(self, router: Router) -> None:
        self._router = router

    def collect(self) -> Iterator[Metric]:
        waiting = GaugeMetricFamily("kvmesh:router_role_queue_length", "Requests waiting for admission on the live "
                                    "workers of each role (their last probe): the prefill and decode queues",
                                    labels=["role"])
        in_flight = GaugeMetricFamily("kvmesh:router_role_in_flight_requests", "Requests the router has open on "
                                      "the live workers of each role (prefill hops count on prefill workers)",
                                      labels=["role"])
        roles = GaugeMetricFamily("kvmesh:router_worker_role", "Each live worker's role (value 1)",
                                  labels=["worker_id", "role"])
        live = [w for w in self._router.registry.live() if w.info is not None]
        for role in WorkerRole:
            of_role = [w for w in live if w.info is not None and w.info.role is role]
            waiting.add_metric([role.value], sum(w.num_waiting for w in of_role))
            in_flight.add_metric([role.value], sum(w.in_flight for w in of_role))
        for w in live:
            assert w.info is not None
            roles.add_metric([w.info.worker_id, w.info.role.value], 1.0)
        yield from (waiting, in_flight, roles)

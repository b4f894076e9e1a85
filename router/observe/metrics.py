"""Prometheus metrics of the router, served on the router HTTP port's `/metrics`.

Owner: `RouterServer` builds one `RouterMetrics` per router (its own `CollectorRegistry`, no
globals), sets it as the core's `observer` (router/routing/core.py `RouteObserver`: the core calls it
on each decision, pick, first response, finish and failure) and adds the `/metrics` and
`/v1/cluster` routes to the HTTP app. What the core already keeps (`RoutingStats`, live
workers), the tenant limiter's counts (router/security/auth.py), the HTTP front's client-error counts
(router/fronts/openai/client_errors.py) and the Redis event consumer's counters are read at scrape
time; each scrape also asks Redis how far the block index lags behind each worker's event stream.

Tenants on `/metrics` (`kvmesh:router_tenant_requests_total{tenant,outcome}`), by who scrapes:
without API keys the one tenant `default`; an `admin` key: every tenant by name; another key:
its own tenant only, by name; no key (an open /metrics): every tenant by an opaque id
(`TenantSalts.label_for`: t-<16 hex>, a keyed hash of the name), or by name with
`--metrics-tenant-names`. No other router metric carries a tenant. docs/threat-model.md.
A request the client gives up on (cancelled, disconnected before it finished) counts as
`kvmesh:router_requests_total{outcome="abort"}` with one INFO line naming its id. torch-free.
"""
from __future__ import annotations

import logging
import urllib.request
from collections.abc import Iterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from contracts.wire import FINISH_REASON_NAMES
from kvstore.metadata.registry import MetadataError
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.fronts.openai.client_errors import CLIENT_ERRORS, ClientErrors
from router.observe.cluster_view import ClusterView, RequestKey
from router.observe.dashboard import add_dashboard_routes
from router.observe.disagg_metrics import DisaggMetrics
from router.routing.core import RouteObserver, Router
from router.routing.types import RouteRequest
from router.security.auth import ANONYMOUS, ApiKey, TenantId, authenticator_for

log = logging.getLogger("kvmesh.router")
_DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
_PREDICTION_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class RouterMetrics(RouteObserver):
    """Counters and histograms fed by the core, plus a collector over its `RoutingStats`."""

    def __init__(self, router: Router, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.policy = router.cfg.routing_policy.value
        r = self.registry
        self.requests = Counter("kvmesh:router_requests", "Requests by worker, routing policy and outcome",
                                ("worker_id", "policy", "outcome"), registry=r)
        self.prompt_tokens = Counter("kvmesh:router_prompt_tokens", "Prompt tokens of finished requests, by worker "
                                     "(router_served_hit_tokens_total / this: the hit rate)",
                                     ("worker_id",), registry=r)
        self.decision = Histogram("kvmesh:router_routing_decision_seconds", "Time to pick a worker",
                                  buckets=_DECISION_BUCKETS, registry=r)
        self.ttft = Histogram("kvmesh:router_time_to_first_token_seconds",
                              "Router receipt of a request to its first streamed response, as clients see it",
                              ("worker_id",), buckets=_TTFT_BUCKETS, registry=r)
        self.event_lag = Gauge("kvmesh:router_kv_event_lag_seconds",
                               "How far the block index is behind each worker's Redis event stream (stream time)",
                               ("worker_id",), registry=r)
        self.prediction_error = Histogram(
            "kvmesh:router_hit_prediction_error",
            "Per worker, |predicted − served hit tokens| / prompt tokens of each finished request (the "
            "block index's error about the worker's cache; a persistent over-prediction corrects the index)",
            ("worker",), buckets=_PREDICTION_BUCKETS, registry=r)
        self.migrations = Counter("kvmesh:router_migrations", "Requests moved to another worker mid-stream "
                                  "(their worker died or became unreachable)", ("worker_id",), registry=r)
        r.register(_CoreCollector(router))
        self.disagg = DisaggMetrics(router, r)   # the prefill hop's observer (router/routing/disagg.py)
        router.disagg.observer = self.disagg
        self.request_counts: dict[RequestKey, int] = {}   # (tenant, worker_id, policy, outcome), for /v1/cluster
        self.cluster = ClusterView(router, self.request_counts)
        self._router = router

    # -- RouteObserver --------------------------------------------------------------------
    def decided(self, seconds: float) -> None:
        self.decision.observe(seconds)

    def picked(self, request_id: str, route: RouteRequest, worker_id: str) -> None:
        info = self._router.model_info
        self.cluster.prefixes.add(route, worker_id, info.block_size if info is not None else 0,
                                  self._tenant(request_id))

    def first_response(self, request_id: str, worker_id: str, seconds: float) -> None:
        self.ttft.labels(worker_id).observe(seconds)
        self.cluster.ttft.add(worker_id, seconds)

    def finished(self, request_id: str, worker_id: str, final: pb.GenerateResponse, ttft_s: float,
                 total_s: float) -> None:
        """Count it, and write the request's one access-log line."""
        reason = FINISH_REASON_NAMES.get(final.finish_reason, "unknown")
        self._count(request_id, worker_id, reason)
        self.prompt_tokens.labels(worker_id).inc(final.prompt_tokens)
        log.info("request %s finished on %s: prompt_tokens=%d cached_tokens=%d completion_tokens=%d "
                 "ttft_s=%.4f total_s=%.4f finish_reason=%s", request_id, worker_id, final.prompt_tokens,
                 final.cached_tokens, final.completion_tokens, ttft_s, total_s, reason)

    def failed(self, request_id: str, worker_id: str) -> None:
        self._count(request_id, worker_id, "error")

    def aborted(self, request_id: str, worker_id: str | None, tokens: int) -> None:
        """Count it as outcome `abort`, and write the request's one access-log line."""
        self._count(request_id, worker_id or "none", "abort")
        log.info("request %s aborted on %s: the client went away after %d tokens", request_id,
                 worker_id or "no worker", tokens)

    def hit_predicted(self, worker_id: str, error: float) -> None:
        self.prediction_error.labels(worker_id).observe(abs(error))

    def migrated(self, request_id: str, worker_id: str, tokens: int) -> None:
        self.migrations.labels(worker_id).inc()

    def _tenant(self, request_id: str) -> TenantId:
        tenant = self._router.tenant_of(request_id)
        return tenant if tenant is not None else ANONYMOUS.tenant

    def _count(self, request_id: str, worker_id: str, outcome: str) -> None:
        self.requests.labels(worker_id, self.policy, outcome).inc()
        key = (self._tenant(request_id), worker_id, self.policy, outcome)
        self.request_counts[key] = self.request_counts.get(key, 0) + 1

    # -- HTTP -----------------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.Response:
        """The registry, then the tenant family as this scraper may see it (module docstring)."""
        await self._refresh_event_lag()
        viewer = authenticator_for(self._router).viewer(request)
        body = generate_latest(self.registry) + generate_latest(self.tenant_registry(viewer))
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def tenant_registry(self, viewer: ApiKey | None) -> CollectorRegistry:
        """The per-tenant family as `viewer` may see it (None: an unauthenticated scrape)."""
        tenants = CollectorRegistry()
        tenants.register(_TenantCollector(self._router, viewer))
        return tenants

    async def _refresh_event_lag(self) -> None:
        consumer = self._router.registry.consumer
        if consumer is None:
            return
        try:
            lag = await consumer.lag_s()
        except MetadataError as e:      # Redis down: the gauges keep their last value
            log.warning("kv event lag: %s", e)
            return
        for worker_id, seconds in lag.items():
            self.event_lag.labels(worker_id).set(seconds)

    def add_routes(self, app: web.Application) -> None:
        """`/metrics`, `/v1/cluster` and `/dashboard` on the HTTP front's `app`, and its
        client-error counts (`CLIENT_ERRORS`) in this registry."""
        app.add_routes([web.get("/metrics", self.handle), web.get("/v1/cluster", self.cluster.handle)])
        add_dashboard_routes(app)
        errors = app.get(CLIENT_ERRORS)
        if errors is not None:
            self.registry.register(_ClientErrorCollector(errors))


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str, timeout_s: float = 10.0) -> Samples:
    """GET a Prometheus text endpoint: (sample name, labels) -> value (for `make demo` and people)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def sample_sum(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


class _CoreCollector(Collector):
    """Predicted vs served hit tokens and mismatches (`Router.stats`), and which workers are up
    (a worker once seen live and now not reads 0)."""

    def __init__(self, router: Router) -> None:
        self._router = router
        self._seen: set[str] = set()

    def collect(self) -> Iterator[Metric]:
        s = self._router.stats
        for name, doc, value in (
                ("router_predicted_hit_tokens", "Prompt tokens the block index said the chosen worker holds",
                 s.routed_hit_tokens),
                ("router_served_hit_tokens", "Prompt tokens the worker found in its own cache",
                 s.actual_hit_tokens),
                ("router_hit_mismatches", "Requests where predicted and served hit tokens differ", s.mismatches),
                ("router_peer_hints", "Requests forwarded with a peer hint", s.peer_hints)):
            yield CounterMetricFamily(f"kvmesh:{name}", doc, value=value)
        live = {w.info.worker_id for w in self._router.registry.live() if w.info is not None}
        self._seen |= live
        up = GaugeMetricFamily("kvmesh:router_worker_up", "1 while the worker is ready", labels=["worker_id"])
        for worker_id in sorted(self._seen):
            up.add_metric([worker_id], 1.0 if worker_id in live else 0.0)
        yield up
        yield from self._kv_events()

    def _kv_events(self) -> Iterator[Metric]:
        consumer = self._router.registry.consumer
        if consumer is None:
            return
        c = consumer.stats()
        for name, doc, value in (
                ("router_kv_events", "KV events applied to the block index", c.entries),
                ("router_kv_event_gaps", "Holes or repeats seen in a worker's event sequence", c.gaps),
                ("router_kv_event_resyncs", "Full inventories asked of workers (gaps, restarts, new workers)",
                 c.resyncs_requested),
                ("router_redis_restarts", "Redis restarts noticed (every stream reread)", c.redis_restarts)):
            yield CounterMetricFamily(f"kvmesh:{name}", doc, value=value)
        yield GaugeMetricFamily("kvmesh:router_block_index_degraded",
                                "1 while Redis is unreachable (routing on the last known index)",
                                value=1.0 if c.degraded else 0.0)


class _TenantCollector(Collector):
    """Requests per tenant as `viewer` may see them (module docstring); built per scrape."""

    def __init__(self, router: Router, viewer: ApiKey | None) -> None:
        self._router, self._viewer = router, viewer

    def collect(self) -> Iterator[Metric]:
        auth = authenticator_for(self._router)
        viewer, limiter = self._viewer, auth.limiter
        tenants = CounterMetricFamily("kvmesh:router_tenant_requests",
                                      "Generating requests per tenant (API keys file), admitted or rejected by "
                                      "--max-concurrent-per-tenant; an unauthenticated scrape sees opaque tenant "
                                      "ids unless --metrics-tenant-names", labels=["tenant", "outcome"])
        names = viewer is not None or self._router.cfg.metrics_tenant_names
        for outcome, counts in (("admitted", limiter.admitted), ("rejected", limiter.rejected)):
            for tenant, n in sorted(counts.items()):
                if viewer is not None and not viewer.admin and tenant != viewer.tenant:
                    continue
                tenants.add_metric([tenant if names else self._router.salts.label_for(tenant), outcome], n)
        yield tenants


class _ClientErrorCollector(Collector):
    """Client-caused HTTP errors (malformed framing, a client gone mid-response) by kind."""

    def __init__(self, errors: ClientErrors) -> None:
        self._errors = errors

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("kvmesh:router_client_errors",
                                     "HTTP requests the client broke (bad framing, over-long lines, an incomplete "
                                     "body, a disconnect while the response was written), by kind",
                                     labels=["kind"])
        for kind, n in sorted(self._errors.counts.items()):
            family.add_metric([kind], n)
        yield family

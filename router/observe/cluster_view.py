"""`GET /v1/cluster`: the cluster at a glance as JSON, for people and for the
dashboard (router/observe/dashboard.py). Per worker (one `GetLoad` per live worker at request time):
its role (prefill | decode | mixed), device pool and host-tier usage, blocks by tier,
running/waiting, prompt and cached tokens and hit rate, preemptions, peer fetches, and its TTFT
p50/p99 over the last minute as the router's clients saw it. The router: requests by
worker/policy/outcome, predicted vs served hit tokens, prefill hops (disaggregated serving:
handed off, skipped, failed), requests per tenant, the block index's event stream (with Redis),
and the hottest prompt prefixes with the workers that hold them (block index) and the workers
they were routed to.

Scoped to the caller (`Authenticator.viewer`): without API keys, and for a key flagged `admin`,
every tenant, with a text preview of each hot prefix; for any other key only its own tenant's
requests, tenant counts and prefixes (their hashes are salted per tenant), without text
previews. The per-worker figures are cluster-wide totals that name no tenant and no prompt
(docs/threat-model.md).

Owner: `RouterMetrics` (router/observe/metrics.py) builds one, feeds `TtftWindow` and `HotPrefixes`
from the core's observer calls and registers the route. It changes nothing. torch-free.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import grpc
from aiohttp import web

from kvstore.events import Tier, WorkerId
from kvstore.keys import BlockHash
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.routing.core import Router
from router.routing.types import RouteRequest
from router.security.auth import ApiKey, TenantId, authenticator_for, unauthorized_response
from router.workers.registry import WorkerEntry

Json = dict[str, Any]
RequestKey = tuple[TenantId, str, str, str]     # (tenant, worker_id, policy, outcome)
_LOAD_TIMEOUT_S = 2.0
WINDOW_S = 60.0            # TTFT percentiles over this many seconds
PREFIX_BLOCKS = 2          # a "prefix" is a prompt's first (up to) this many full blocks (a system prompt)
HOT_PREFIXES = 8           # how many /v1/cluster lists
_MAX_TRACKED = 512         # prefixes remembered; beyond, the least requested half is dropped


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]) of `values`; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))          # ceil(n q / 100), at least 1
    return ordered[int(rank) - 1]


class TtftWindow:
    """Time to first token per worker over the last `window_s` seconds (as the router saw it)."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s, self._clock = window_s, clock
        self._samples: dict[str, deque[tuple[float, float]]] = {}

    def add(self, worker_id: str, seconds: float) -> None:
        self._samples.setdefault(worker_id, deque()).append((self._clock(), seconds))

    def recent(self, worker_id: str) -> list[float]:
        samples = self._samples.get(worker_id)
        if samples is None:
            return []
        horizon = self._clock() - self.window_s
        while samples and samples[0][0] < horizon:
            samples.popleft()
        return [s for _, s in samples]


class HotPrefix(NamedTuple):
    """One tracked prefix: the tenant that sent it, its name (the chained hash of its last
    block), requests, block hashes, token ids and requests routed per worker."""

    tenant: TenantId
    key: BlockHash
    requests: int
    hashes: tuple[BlockHash, ...]
    tokens: tuple[int, ...]
    routed: dict[str, int]


PrefixKey = tuple[TenantId, BlockHash]


class HotPrefixes:
    """Requests per (tenant, prompt prefix) — a prefix is its first `PREFIX_BLOCKS` full blocks,
    named by the chained hash of the last of them — and the workers each was routed to. Two
    tenants sending one prefix with one explicit salt are two entries."""

    def __init__(self) -> None:
        self._count: dict[PrefixKey, int] = {}
        self._hashes: dict[PrefixKey, tuple[BlockHash, ...]] = {}
        self._tokens: dict[PrefixKey, tuple[int, ...]] = {}
        self._routed: dict[PrefixKey, dict[str, int]] = {}

    def add(self, route: RouteRequest, worker_id: str, block_size: int, tenant: TenantId) -> None:
        hashes = route.block_hashes[:PREFIX_BLOCKS]
        if not hashes or block_size <= 0:
            return
        key = (tenant, hashes[-1])
        if key not in self._count and len(self._count) >= _MAX_TRACKED:
            self._forget_coldest()
        self._count[key] = self._count.get(key, 0) + 1
        self._hashes[key] = tuple(hashes)
        self._tokens[key] = tuple(route.token_ids[:len(hashes) * block_size])
        routed = self._routed.setdefault(key, {})
        routed[worker_id] = routed.get(worker_id, 0) + 1

    def top(self, n: int = HOT_PREFIXES, tenant: TenantId | None = None) -> list[HotPrefix]:
        """The `n` most requested, of `tenant` only (None: of every tenant)."""
        keys = sorted((k for k in self._count if tenant is None or k[0] == tenant),
                      key=lambda k: (-self._count[k], k[1], k[0]))[:n]
        return [HotPrefix(k[0], k[1], self._count[k], self._hashes[k], self._tokens[k], dict(self._routed[k]))
                for k in keys]

    def _forget_coldest(self) -> None:
        for key in sorted(self._count, key=self._count.__getitem__)[:len(self._count) // 2]:
            for table in (self._count, self._hashes, self._tokens, self._routed):
                table.pop(key, None)


class ClusterView:
    """Builds the `/v1/cluster` document; `requests` maps (tenant, worker_id, policy, outcome)
    to a count."""

    def __init__(self, router: Router, requests: Mapping[RequestKey, int]) -> None:
        self._router = router
        self._requests = requests
        self.ttft = TtftWindow()
        self.prefixes = HotPrefixes()

    async def handle(self, request: web.Request) -> web.Response:
        viewer = authenticator_for(self._router).viewer(request)
        if viewer is None:        # the auth middleware lets none through; kept for a route added elsewhere
            return unauthorized_response()
        return web.json_response(await self.document(viewer))

    async def document(self, viewer: ApiKey) -> Json:
        """The document as `viewer` may see it: every tenant for an `admin` key (ANONYMOUS
        without keys is one), else only `viewer.tenant`'s requests, counts and prefixes."""
        only = None if viewer.admin else viewer.tenant
        entries = [w for w in self._router.registry.live() if w.info is not None]
        workers = await asyncio.gather(*(self._worker(w) for w in entries))
        s = self._router.stats
        limiter = authenticator_for(self._router).limiter
        requests: dict[tuple[str, str, str], int] = {}
        for (tenant, w, p, o), n in self._requests.items():
            if only is None or tenant == only:
                requests[(w, p, o)] = requests.get((w, p, o), 0) + n
        tenants = sorted(t for t in set(limiter.admitted) | set(limiter.rejected) if only is None or t == only)
        return {
            "object": "kvmesh.cluster", "time": time.time(), "window_s": self.ttft.window_s,
            "policy": self._router.cfg.routing_policy.value,
            "scope": {"tenant": only, "admin": viewer.admin},
            "workers": sorted(workers, key=lambda w: str(w["worker_id"])),
            "router": {
                "requests": [{"worker_id": w, "policy": p, "outcome": o, "count": n}
                             for (w, p, o), n in sorted(requests.items())],
                "predicted_hit_tokens": s.routed_hit_tokens, "served_hit_tokens": s.actual_hit_tokens,
                "hit_mismatches": s.mismatches, "peer_hints": s.peer_hints,
                "disagg": {"handoffs": self._router.disagg.handoffs, "skipped": self._router.disagg.skips,
                           "failures": self._router.disagg.failures},
                "tenants": [{"tenant": t, "admitted": limiter.admitted.get(t, 0),
                             "rejected": limiter.rejected.get(t, 0)}
                            for t in tenants],
                "kv_events": self._kv_events(),
            },
            "hot_prefixes": self._hot_prefixes([str(w["worker_id"]) for w in workers], only, viewer.admin),
        }

    def _kv_events(self) -> Json | None:
        consumer = self._router.registry.consumer
        if consumer is None:
            return None
        c = consumer.stats()
        return {"degraded": c.degraded, "entries": c.entries, "gaps": c.gaps, "resyncs": c.resyncs_requested,
                "redis_restarts": c.redis_restarts}

    def _hot_prefixes(self, worker_ids: list[str], tenant: TenantId | None, text: bool) -> list[Json]:
        """The hottest prefixes of `tenant` (None: of all); `text`: with the decoded preview
        (else `text` is null)."""
        index, tok = self._router.registry.index, self._router.tokenizer
        out = []
        for p in self.prefixes.top(tenant=tenant):
            held = index.match_prefix(p.hashes, [WorkerId(w) for w in worker_ids])
            preview = (tok.decode(p.tokens) if tok is not None else "") if text else None
            out.append({"prefix": f"{p.key:032x}"[:16], "tenant": p.tenant, "requests": p.requests,
                        "num_blocks": len(p.hashes), "text": preview,
                        "held_blocks": {w: int(held.get(WorkerId(w), 0)) for w in worker_ids} if index.fed else None,
                        "routed": p.routed})
        return out

    async def _worker(self, w: WorkerEntry) -> Json:
        assert w.info is not None
        worker_id = w.info.worker_id
        recent = self.ttft.recent(worker_id)
        out: Json = {"worker_id": worker_id, "address": w.address, "role": w.info.role.value,
                     "in_flight": w.in_flight,
                     "ttft_p50_s": percentile(recent, 50), "ttft_p99_s": percentile(recent, 99),
                     "ttft_samples": len(recent), "index_blocks": self._index_blocks(worker_id),
                     "hit_prediction": self._router.predictions.shown(worker_id)._asdict()}
        try:
            load = await w.stub.GetLoad(pb.LoadRequest(), timeout=_LOAD_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:      # a worker that does not answer is shown, not fatal
            return out | {"up": False, "error": f"{e.code().name}: {e.details()}"}
        return out | _load_json(load)

    def _index_blocks(self, worker_id: str) -> Json | None:
        """What the router's block index believes the worker holds, per tier (None where no event
        stream feeds the index), to set beside the worker's own `blocks` (an exact index shows the
        same counts)."""
        index = self._router.registry.index
        if not index.fed:
            return None
        tiers = index.holdings(WorkerId(worker_id)).values()
        return {"device": sum(Tier.DEVICE in t for t in tiers), "host": sum(Tier.HOST in t for t in tiers)}


def _load_json(load: pb.Load) -> Json:
    doc: Json = {
        "up": True, "num_running": load.num_running, "num_waiting": load.num_waiting,
        "num_blocks": load.num_blocks, "num_used_blocks": load.num_used_blocks,
        "kv_cache_usage": load.num_used_blocks / load.num_blocks if load.num_blocks else 0.0,
        "host_num_blocks": load.host_num_blocks, "num_host_blocks": load.num_host_blocks,
        "host_tier_usage": load.num_host_blocks / load.host_num_blocks if load.host_num_blocks else 0.0,
        "blocks": {"device_used": load.num_used_blocks, "device_cached": load.num_cached_blocks,
                   "device_free": load.num_free_blocks, "host": load.num_host_blocks},
        "prompt_tokens": load.prompt_tokens, "cached_prompt_tokens": load.cached_prompt_tokens,
        "hit_rate": load.cached_prompt_tokens / load.prompt_tokens if load.prompt_tokens else 0.0,
        "num_preemptions": load.num_preemptions, "num_onloaded_blocks": load.num_onloaded_blocks,
        "num_offloaded_blocks": load.num_offloaded_blocks, "peer": None,
    }
    if load.HasField("peer"):
        p = load.peer
        doc["peer"] = {"fetch_decisions": p.fetch_decisions, "recompute_decisions": p.recompute_decisions,
                       "blocks_fetched": p.blocks_fetched, "bytes_fetched": p.bytes_fetched,
                       "blocks_bad": p.blocks_bad, "fetch_failures": p.fetch_failures,
                       "fetch_seconds": p.fetch_seconds}
    return doc

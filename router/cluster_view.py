"""`GET /v1/cluster`: the cluster at a glance as JSON (issue #19 item 4), for people and for a
dashboard: per worker its block usage, host tier, running/waiting, prompt and cached tokens and
hit rate (asked with one `GetLoad` per live worker at request time), and the router's own view
(requests by worker/policy/outcome, predicted vs served hit tokens).

Owner: `RouterMetrics.add_routes` registers it next to `/metrics`; it reads the core and the
metrics' request counts and changes nothing. torch-free.
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import grpc
from aiohttp import web

from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.core import Router
from router.registry import WorkerEntry

Json = dict[str, Any]
_LOAD_TIMEOUT_S = 2.0


class ClusterView:
    """Builds the `/v1/cluster` document; `requests` maps (worker_id, policy, outcome) to a count."""

    def __init__(self, router: Router, requests: Mapping[tuple[str, str, str], int]) -> None:
        self._router = router
        self._requests = requests

    async def handle(self, request: web.Request) -> web.Response:
        return web.json_response(await self.document())

    async def document(self) -> Json:
        entries = [w for w in self._router.registry.live() if w.info is not None]
        workers = await asyncio.gather(*(self._worker(w) for w in entries))
        s = self._router.stats
        return {
            "object": "kvmesh.cluster",
            "policy": self._router.cfg.routing_policy.value,
            "workers": sorted(workers, key=lambda w: str(w["worker_id"])),
            "router": {
                "requests": [{"worker_id": w, "policy": p, "outcome": o, "count": n}
                             for (w, p, o), n in sorted(self._requests.items())],
                "predicted_hit_tokens": s.routed_hit_tokens, "served_hit_tokens": s.actual_hit_tokens,
                "hit_mismatches": s.mismatches, "peer_hints": s.peer_hints,
            },
        }

    async def _worker(self, w: WorkerEntry) -> Json:
        assert w.info is not None
        out: Json = {"worker_id": w.info.worker_id, "address": w.address, "in_flight": w.in_flight}
        try:
            load = await w.stub.GetLoad(pb.LoadRequest(), timeout=_LOAD_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:      # a worker that does not answer is shown, not fatal
            return out | {"up": False, "error": f"{e.code().name}: {e.details()}"}
        return out | {
            "up": True, "num_running": load.num_running, "num_waiting": load.num_waiting,
            "num_blocks": load.num_blocks, "num_used_blocks": load.num_used_blocks,
            "kv_cache_usage": load.num_used_blocks / load.num_blocks if load.num_blocks else 0.0,
            "host_num_blocks": load.host_num_blocks, "num_host_blocks": load.num_host_blocks,
            "host_tier_usage": load.num_host_blocks / load.host_num_blocks if load.host_num_blocks else 0.0,
            "prompt_tokens": load.prompt_tokens, "cached_prompt_tokens": load.cached_prompt_tokens,
            "hit_rate": load.cached_prompt_tokens / load.prompt_tokens if load.prompt_tokens else 0.0,
            "num_preemptions": load.num_preemptions, "num_onloaded_blocks": load.num_onloaded_blocks,
        }

"""What `kvmesh bench routing-live` reads from a running cluster around a measured phase: the
machine's load, each local process's CPU seconds, the workers' GetLoad counters and the
routers' own counters (`/v1/cluster` and `/metrics`), each with what the bench subtracts."""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import grpc

from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc

SUMMED = ("requests", "predicted_hit_tokens", "served_hit_tokens", "hit_mismatches", "peer_hints",
          "prediction_error_sum", "prediction_error_count")


def load_avg() -> float | None:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None  # the 1-minute load


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds of each of `pids` so far (its threads included), from
    /proc/PID/stat; a process that is gone or unreadable (not Linux) is left out."""
    out: dict[str, float] = {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime, stime
    return out


def since(now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """The router's counters (`router_view`) since `before` (the whole run if empty)."""
    return now | {k: now[k] - before[k] for k in SUMMED
                  if isinstance(now.get(k), int) and isinstance(before.get(k), int)}


async def worker_loads(addresses: Sequence[str], timeout: float = 60.0) -> list[pb.Load]:
    """Each worker's GetLoad, asked straight at its gRPC address (a local cluster's workers)."""
    loads = []
    for address in addresses:
        async with grpc.aio.insecure_channel(address) as ch:
            loads.append(await pb_grpc.WorkerStub(ch).GetLoad(pb.LoadRequest(), timeout=timeout))
    return loads


class WorkerCounters(NamedTuple):
    """One worker's GetLoad counters that the bench reads before and after a phase."""
    peer_fetches: int           # hinted requests fetched from a peer (`peer.fetch_decisions`)
    peer_fetch_s: float         # those fetches' wall time (`peer.fetch_seconds`)
    preemptions: int            # running requests whose blocks were freed, recomputed later

    def __sub__(self, before: WorkerCounters) -> WorkerCounters:   # the counts in between
        return WorkerCounters(self.peer_fetches - before.peer_fetches, self.peer_fetch_s - before.peer_fetch_s,
                              self.preemptions - before.preemptions)


async def worker_counters(addresses: Sequence[str], timeout: float = 10.0) -> dict[str, WorkerCounters]:
    """`WorkerCounters` of each worker at `addresses` so far (one without a peer plane counts no
    fetches); a worker that does not answer GetLoad (killed, restarting) is left out."""
    out: dict[str, WorkerCounters] = {}
    for address in addresses:
        try:
            [load] = await worker_loads([address], timeout)
        except grpc.aio.AioRpcError:
            continue
        peer = load.peer if load.HasField("peer") else pb.PeerStats()
        out[address] = WorkerCounters(peer.fetch_decisions, peer.fetch_seconds, load.num_preemptions)
    return out


def counted_since(now: dict[str, WorkerCounters], before: dict[str, WorkerCounters]) -> tuple[WorkerCounters, int]:
    """The counts between two `worker_counters` readings, summed over the workers read both
    times, and how many workers were missing from either (their counts are not in the sum)."""
    both = now.keys() & before.keys()
    diffs = [now[a] - before[a] for a in both]
    total = WorkerCounters(sum(d.peer_fetches for d in diffs), sum(d.peer_fetch_s for d in diffs),
                           sum(d.preemptions for d in diffs))
    return total, len((now.keys() | before.keys()) - both)


async def routers_view(urls: list[str]) -> dict[str, Any]:
    """`router_view` of the first router, its counters summed over every router at `urls`."""
    views = [await router_view(url) for url in urls]
    return views[0] | {k: sum(int(v.get(k, 0)) if k != "prediction_error_sum" else float(v.get(k, 0.0))
                              for v in views) for k in SUMMED}


async def router_view(http_base_url: str) -> dict[str, Any]:
    """The router's own counters from `/v1/cluster`: requests, predicted/served hits, mismatches."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(f"{http_base_url}/cluster") as resp:
            doc = await resp.json()
        async with session.get(http_base_url.removesuffix("/v1") + "/metrics") as resp:
            metrics = await resp.text()
    view = doc["router"]
    view["requests"] = sum(r["count"] for r in view.pop("requests", []))
    sums = {name: float(value) for name, value in (line.split()[:2] for line in metrics.splitlines()
                                                   if line.startswith("kvmesh:router_routing_decision_seconds_"))
            if name.endswith(("_sum", "_count"))}
    count = sums.get("kvmesh:router_routing_decision_seconds_count", 0.0)
    view["decision_mean_s"] = sums.get("kvmesh:router_routing_decision_seconds_sum", 0.0) / count if count else None
    # |predicted − served| / prompt tokens per finished request, summed over the workers' series
    errors = [(line.split("{")[0], float(line.split()[-1])) for line in metrics.splitlines()
              if line.startswith("kvmesh:router_hit_prediction_error_")]
    view["prediction_error_sum"] = sum(v for name, v in errors if name.endswith("_sum"))
    view["prediction_error_count"] = int(sum(v for name, v in errors if name.endswith("_count")))
    return view

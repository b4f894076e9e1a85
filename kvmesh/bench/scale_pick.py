"""The routing decision alone at N workers, without Redis: a synthetic router whose registry
holds N ready workers and whose compact block index is filled as `kvmesh bench scale`'s fleet
fills it (every pool full: the trace's system prompts on a ring-placed share of the workers,
unique blocks for the rest), with in-flight requests recorded as the router records them.
Used to profile `Router.pick` (`python -m kvmesh.bench.scale_pick N`) and by the tests that
hold the fast pick to the reference policy over a real registry and index.
"""
from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmesh.bench.sim import SimConfig, make_trace
from kvstore.events import Tier, WorkerId
from kvstore.keys import BlockHash
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.config import RouterConfig
from router.routing.core import Router
from router.routing.inflight import InFlightPrefills
from router.routing.types import RouteRequest, WorkerInfo
from router.workers.registry import WorkerRegistry


@dataclass(frozen=True, slots=True)
class SyntheticConfig:
    workers: int = 1000
    pool_blocks: int = 1000
    trace_requests: int = 600
    in_flight: int = 40             # requests dispatched and not done when picks are timed
    peer_plane: float = 0.5         # the share of workers reporting a peer plane
    seed: int = 0


async def _noop(ready: bool) -> None:
    return None


def synthetic_router(cfg: SyntheticConfig, clock: Callable[[], float] = time.monotonic
                     ) -> tuple[Router, list[RouteRequest]]:
    """A router with `cfg.workers` ready workers and a full index; call on an event loop (the
    registry opens a gRPC channel per worker, never dialled). `clock`: its in-flight table's."""
    rng = random.Random(cfg.seed)
    sim = SimConfig(num_prompts=64, system_blocks=32, suffix_blocks=(1, 6), num_requests=cfg.trace_requests,
                    block_size=16, seed=cfg.seed)
    trace = make_trace(sim)
    registry = WorkerRegistry(RouterConfig(redis_url="redis://unused:1", http_port=None), _noop)
    registry.model_info = pb.ModelInfo(model="scale-model", block_size=16, hash_salt_hex="5ca1e",
                                       vocab_size=50000, max_model_len=8192)
    ids = {f"127.0.0.1:{20000 + i}": WorkerId(f"scale-{i:05d}") for i in range(cfg.workers)}
    registry.set_workers(ids, probe=False, worker_ids=ids)
    for address, wid in ids.items():
        entry = registry.entry(address)
        entry.info = WorkerInfo(wid, address)
        entry.num_blocks = cfg.pool_blocks
        entry.free_blocks = rng.randrange(0, cfg.pool_blocks // 10)
        entry.peer_plane = rng.random() < cfg.peer_plane
    router = Router(registry.cfg, registry)
    router.prefills = InFlightPrefills(clock=clock)
    index = registry.index
    index.set_capacity(cfg.workers * cfg.pool_blocks)
    wids = list(ids.values())
    # the system prompts (distinct first blocks of the trace) on a ring-placed share of the workers
    systems: dict[BlockHash, tuple[BlockHash, ...]] = {}
    for route in trace:
        systems.setdefault(route.block_hashes[0], route.block_hashes[:32])
    held: dict[WorkerId, list[BlockHash]] = {w: [] for w in wids}
    for k, blocks in enumerate(systems.values()):
        replicas = max(1, round(cfg.workers / (k + 1) ** 1.1 / 4))
        start = rng.randrange(cfg.workers)
        for j in range(replicas):
            held[wids[(start + j) % cfg.workers]].extend(blocks)
    for w in wids:
        mine = list(dict.fromkeys(held[w]))[:cfg.pool_blocks]
        mine += [BlockHash(rng.getrandbits(128)) for _ in range(cfg.pool_blocks - len(mine))]
        index.add(w, mine, Tier.DEVICE)
    # traffic the index has counted (shared blocks), and requests in flight now
    for i, route in enumerate(trace):
        pick = router.pick(route, set())
        assert pick.worker.info is not None
        router.prefills.dispatched(index, f"warm-{i}", pick.worker.info.worker_id, route, pick.predicted_tokens)
        if i < len(trace) - cfg.in_flight:
            router.prefills.done(index, f"warm-{i}", streamed=True)
        else:
            pick.worker.in_flight += 1
    return router, trace


def time_picks(router: Router, trace: Sequence[RouteRequest], n: int) -> list[float]:
    """Milliseconds of `n` picks over the trace (nothing dispatched)."""
    out = []
    for i in range(n):
        t = time.perf_counter()
        router.pick(trace[i % len(trace)], set())
        out.append((time.perf_counter() - t) * 1000)
    return out


def main(argv: list[str]) -> None:
    import asyncio
    import cProfile
    import pstats

    n = int(argv[0]) if argv else 1000

    async def go() -> None:
        t = time.perf_counter()
        router, trace = synthetic_router(SyntheticConfig(workers=n))
        print(f"built {n} workers, {router.registry.index.stats()} in {time.perf_counter() - t:.1f} s")
        times = sorted(time_picks(router, trace, 200))
        print(f"pick ms: p50 {times[len(times) // 2]:.3f} p99 {times[int(0.99 * len(times))]:.3f} max {times[-1]:.3f}")
        prof = cProfile.Profile()
        prof.enable()
        time_picks(router, trace, 100)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)

    asyncio.run(go())


if __name__ == "__main__":
    main(sys.argv[1:])

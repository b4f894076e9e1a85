"""`kvmesh bench router`: routing policies, simulated at scale and live on real workers.

1. Simulation (kvmesh/bench/sim.py): a Zipf multi-tenant trace over 4, 8 and 16 workers with
   the workers' block pools, FIFO prefill queues and the router's pending blocks; prefix-cache
   hit rate, load imbalance and TTFT p50 per policy, against an oracle single pool of the
   combined size. The headline figures are for 8 workers. Then `kvmesh bench routing-live`'s
   three scenarios (no pressure, pressure, shift) simulated, averaged over 10 traces.
2. Live: a fresh cluster of 3 real worker processes on the default model per policy, behind
   an in-process router of that policy, every policy with the same system prompts and request
   sequence (so the policies are compared and not their order); the fraction of prompt tokens
   served from cache, from the workers' own GetLoad counters.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc

from contracts.wire import to_generate_input
from kvmesh.bench import routing_live as bench_live
from kvmesh.bench.report import emit
from kvmesh.bench.routing_live_probes import worker_loads
from kvmesh.bench.sim import SimConfig, SimResult, _Sim, make_trace, oracle_hit_rate, simulate
from kvmesh.serve.local import LocalCluster, ServeConfig
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.routing.types import RoutingPolicy
from router.server import RouterServer

POLICY_ORDER = (RoutingPolicy.ROUND_ROBIN, RoutingPolicy.LEAST_LOADED, RoutingPolicy.PREFIX_HASH,
                RoutingPolicy.KV_AWARE)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="routing policies: simulated hit rate/imbalance and a live run")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--quick", action="store_true", help="a small run")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--no-live", action="store_true", help="simulation only")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run)

    q = sub.add_parser("service", help="load run: requests/s and TTFT through the router vs straight to a worker")
    q.add_argument("--json", type=Path, default=None, help="write the results here")
    q.add_argument("--quick", action="store_true", help="a small run")
    q.add_argument("--model", default="smollm2")
    q.add_argument("--seed", type=int, default=0)
    q.set_defaults(run=run_service)
    bench_live.register(sub)


def run_service(args: argparse.Namespace) -> int:
    return emit(asyncio.run(service_load(args.model, args.quick, args.seed)), args.json)


async def service_load(model: str, quick: bool, seed: int) -> dict[str, Any]:
    """The same closed-loop load (C concurrent clients, short chat requests) once through the
    router of a 2-worker cluster and once straight to one of its workers, same run."""

    rng = random.Random(seed)
    num_requests, concurrency, max_tokens = (24, 4, 8) if quick else (96, 8, 16)
    topics = ["rivers", "kernels", "caches", "routers", "tea", "chess", "volcanoes", "jazz"]

    async def load(target: str, service: str) -> dict[str, float]:
        async with grpc.aio.insecure_channel(target) as ch:
            stub = (pb_grpc.RouterStub if service == "Router" else pb_grpc.WorkerStub)(ch)
            ttfts: list[float] = []
            sem = asyncio.Semaphore(concurrency)

            async def one(i: int) -> None:
                req = pb.GenerateRequest(chat=pb.ChatMessages(messages=[
                    pb.ChatMessage(role="system", content="You are a helpful assistant. Answer briefly."),
                    pb.ChatMessage(role="user", content=f"Tell me one fact about {rng.choice(topics)} ({i}).")]),
                    sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
                async with sem:
                    t0 = time.perf_counter()
                    first = None
                    async for _ in stub.Generate(req, timeout=300):
                        first = first or time.perf_counter() - t0
                    ttfts.append(first or 0.0)

            t = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(num_requests)))
            wall = time.perf_counter() - t
        qs = statistics.quantiles(ttfts, n=100)
        return {"requests_per_s": num_requests / wall, "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": qs[98]}

    with LocalCluster(ServeConfig(workers=2, model=model, grpc_port=0, http_port=0,
                                  cluster_name=f"load-{rng.randrange(10**6)}")) as cluster:
        await load(cluster.grpc_target, "Router")            # warm-up both workers
        direct = await load(cluster.worker_addresses[0], "Worker")
        routed = await load(cluster.grpc_target, "Router")
    return {"router_2_workers": routed, "direct_1_worker": direct,
            "config": {"requests": num_requests, "concurrency": concurrency, "max_tokens": max_tokens}}


def run(args: argparse.Namespace) -> int:
    result: dict[str, Any] = {"simulation": run_simulation(args.quick, args.seed)}
    if not args.no_live:
        result["live"] = asyncio.run(run_live(args.model, args.quick, args.seed))
    return emit(result, args.json)


def run_simulation(quick: bool, seed: int) -> dict[str, Any]:
    sizes = (4, 8, 16)
    out: dict[str, Any] = {"by_workers": {}}
    for n in sizes:
        cfg = SimConfig(num_workers=n, num_requests=1500 if quick else 4000, seed=seed)
        trace = make_trace(cfg)
        row: dict[str, Any] = {"oracle_hit_rate": oracle_hit_rate(cfg, trace)}
        for policy in POLICY_ORDER:
            r = simulate(policy, cfg, trace)
            row[policy.value] = {"hit_rate": r.hit_rate, "imbalance": r.imbalance, "ttft_p50": r.ttft_p50,
                                 "hit_rate_vs_oracle": r.hit_rate / row["oracle_hit_rate"]}
        out["by_workers"][str(n)] = row
    # kv_aware at 8 workers as the bounded-load factor (`--load-factor`) varies: cache hits vs balance.
    cfg8 = SimConfig(num_workers=8, num_requests=1500 if quick else 4000, seed=seed)
    trace8 = make_trace(cfg8)
    oracle8 = oracle_hit_rate(cfg8, trace8)
    out["kv_aware_load_factor_sweep"] = {}
    for c in (1.25, 1.5, 2.0):
        r = simulate(RoutingPolicy.KV_AWARE, replace(cfg8, load_factor=c), trace8)
        out["kv_aware_load_factor_sweep"][str(c)] = {"hit_rate_vs_oracle": r.hit_rate / oracle8,
                                                     "imbalance": r.imbalance}
    out["live_scenarios"] = simulate_live_scenarios(quick)
    head = out["by_workers"]["8"]
    out.update({p.value: {k: head[p.value][k] for k in ("hit_rate", "imbalance", "ttft_p50", "hit_rate_vs_oracle")}
                for p in POLICY_ORDER})
    out["oracle_hit_rate"] = head["oracle_hit_rate"]
    c = SimConfig()
    out["config"] = {"headline_workers": 8, "cache_blocks_per_worker": c.cache_blocks, "prompts": c.num_prompts,
                     "zipf_s": c.zipf_s, "system_blocks": c.system_blocks, "suffix_blocks": list(c.suffix_blocks),
                     "mean_in_flight_per_worker": c.mean_in_flight, "load_factor": c.load_factor,
                     "prefill_tokens_per_s": c.prefill_tokens_per_s, "ttft_unit": "mean decode time"}
    return out


def live_sim_config(live: bench_live.LiveConfig, scenario: str, seed: int) -> SimConfig:
    """`kvmesh bench routing-live`'s workload as a simulation: its workers, uniform shared
    prefixes, a question plus the output as the unique tail, its pool size under pressure (a
    pool holding every prefix without), its concurrency as the mean load. The prefill speed
    (a 288-token prompt in about 0.3 of the mean decode time) is a rough CPU figure."""
    bs = SimConfig().block_size
    pressed = scenario in ("pressure", "shift")
    prefixes = live.pressure_prefixes if pressed else live.prefixes
    system_blocks = live.prefix_tokens // bs
    tail = -(-(live.question_tokens + live.output_tokens) // bs)
    pool = live.num_blocks if pressed else prefixes * system_blocks + 4 * live.concurrency * tail
    return SimConfig(num_workers=live.workers, cache_blocks=pool, num_prompts=prefixes, zipf_s=0.0,
                     system_blocks=system_blocks, suffix_blocks=(tail, tail), num_requests=live.requests,
                     mean_in_flight=live.concurrency / live.workers, prefill_tokens_per_s=1024.0, seed=seed)


def simulate_live_scenario(policy: RoutingPolicy, live: bench_live.LiveConfig, scenario: str, seed: int,
                           **fields: float | None) -> SimResult:
    """One routing-live scenario simulated; `shift`: the second phase's figures, after a fill
    by a trace of other prefixes on the same pools and router index. `fields`: SimConfig fields
    to change (`ask_half_life`, `protect_turnovers`)."""
    cfg = replace(live_sim_config(live, scenario, seed), **fields)  # type: ignore[arg-type]
    if scenario != "shift":
        return simulate(policy, cfg, make_trace(cfg))
    fill, shifted = make_trace(cfg), make_trace(replace(cfg, seed=seed + 100_003))
    first = _Sim(cfg, policy)
    first.run(fill)
    both = _Sim(cfg, policy)      # the same fill again (same seeds), then the shift
    result = both.run(fill + shifted)
    return SimResult((both.hit - first.hit) / (both.total - first.total), result.imbalance,
                     statistics.median(both.ttfts[len(fill):]), both.cold - first.cold)


def prompts_asked(live: bench_live.LiveConfig, scenario: str, seed: int) -> int:
    """The shared prefixes the measured trace of `simulate_live_scenario` asks for (its
    minimum of cold requests: a seeded draw may leave one out; `shift`: the second trace's)."""
    cfg = live_sim_config(live, scenario, seed)
    trace = make_trace(replace(cfg, seed=seed + 100_003) if scenario == "shift" else cfg)
    head = cfg.system_blocks * cfg.block_size
    return len({r.token_ids[:head] for r in trace})


def simulate_live_scenarios(quick: bool, seeds: int = 10) -> dict[str, Any]:
    """The routing-live scenarios (its --quick or default sizes) simulated, each policy's
    figures averaged over `seeds` traces: what the live bench should show, in the same run."""
    live = bench_live.QUICK if quick else bench_live.LiveConfig()
    out: dict[str, Any] = {}
    for scenario in bench_live.SCENARIOS:
        out[scenario] = {}
        for policy in POLICY_ORDER:
            runs = [simulate_live_scenario(policy, live, scenario, seed) for seed in range(seeds)]
            asked = [prompts_asked(live, scenario, seed) for seed in range(seeds)]
            out[scenario][policy.value] = {"hit_rate": statistics.mean(r.hit_rate for r in runs),
                                           "cold_requests": statistics.mean(r.cold_requests for r in runs),
                                           "min_cold_requests": statistics.mean(asked),
                                           "ttft_p50": statistics.mean(r.ttft_p50 for r in runs)}
    out["config"] = {"routing_live": "quick" if quick else "default", "traces": seeds,
                     "prefill_tokens_per_s": 1024.0, "ttft_unit": "mean decode time"}
    return out


async def run_live(model: str, quick: bool, seed: int) -> dict[str, Any]:
    """Same kind of trace, real processes: cached prompt-token fraction per policy. Every
    policy sees the same system prompts and request sequence on a fresh cluster."""

    rng = random.Random(seed)
    num_prompts, num_requests = (8, 32) if quick else (12, 96)
    words = "alpha beta gamma delta kernel cache block router worker token prefix budget".split()
    systems = [" ".join(rng.choices(words, k=120)) + f" [tenant {i}]" for i in range(num_prompts)]
    weights = [1.0 / (k + 1) ** 1.1 for k in range(num_prompts)]
    picks = [rng.choices(range(num_prompts), weights)[0] for _ in range(num_requests)]
    out: dict[str, Any] = {}
    # Small KV pools (48 blocks of 16 tokens: about four system prompts each) so that, as in
    # production, no worker can hold every tenant and where a request goes matters.
    for policy in POLICY_ORDER:
        with LocalCluster(ServeConfig(workers=3, model=model, grpc_port=0, http_port=0,
                                      engine_argv=("--num-blocks", "48"),
                                      cluster_name=f"bench-{policy.value.replace('_', '-')}-{rng.randrange(10**6)}")
                          ) as cluster:
            out[policy.value] = await _live_policy(cluster, model, policy, systems, picks)
    out["config"] = {"workers": 3, "num_blocks_per_worker": 48, "system_prompts": num_prompts,
                     "requests": num_requests, "max_tokens": 1, "concurrency": 6}
    return out


async def _live_policy(cluster: LocalCluster, model: str, policy: RoutingPolicy, systems: list[str],
                       picks: list[int]) -> dict[str, Any]:
    """`picks` (system prompt per request) through an in-process router of `policy` on `cluster`."""
    server = RouterServer(RouterConfig(worker_addresses=tuple(cluster.worker_addresses), model=model,
                                       http_port=None, redis_url=cluster.redis_url,
                                       cluster_name=cluster.cfg.cluster_name, routing_policy=policy))
    await server.start()
    await server.wait_ready(60)
    router = server.core
    before = await _worker_counters(cluster.worker_addresses)
    sem = asyncio.Semaphore(6)
    served: Counter[str] = Counter()

    async def one(i: int) -> None:
        req = pb.GenerateRequest(chat=pb.ChatMessages(messages=[
            pb.ChatMessage(role="system", content=systems[picks[i]]),
            pb.ChatMessage(role="user", content=f"Question {i}: summarise in one word.")]),
            sampling=pb.SamplingParams(max_tokens=1, temperature=0.0))
        async with sem:
            prepared = await router.prepare(_to_input(req))
            async for response in router.generate(prepared, 120):
                if response.finished:
                    served[response.worker_id] += 1
            await asyncio.sleep(0.05)      # let KV events reach the index

    await asyncio.gather(*(one(i) for i in range(len(picks))))
    after = await _worker_counters(cluster.worker_addresses)
    prompt = sum(a[0] - b[0] for a, b in zip(after, before))
    cached = sum(a[1] - b[1] for a, b in zip(after, before))
    await server.stop(1)
    return {"cached_token_frac": cached / prompt if prompt else 0.0,
            "prompt_tokens": prompt, "routed_hit_tokens": router.stats.routed_hit_tokens,
            "hit_mismatches": router.stats.mismatches, "requests_per_worker": dict(sorted(served.items()))}


def _to_input(req: pb.GenerateRequest) -> Any:
    return to_generate_input(req)


async def _worker_counters(addresses: Sequence[str]) -> list[tuple[int, int]]:
    return [(load.prompt_tokens, load.cached_prompt_tokens)
            for load in await worker_loads(addresses, timeout=10)]

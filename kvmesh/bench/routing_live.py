"""`kvmesh bench routing-live`: the routing policies through the real service, as a user sees them.

For each scenario (`no_pressure`: the default KV pool, `--prefixes` shared prefixes; `pressure`:
`--num-blocks` per worker and `--pressure-prefixes` prefixes; `shift`: the pressure pools, filled by
`--requests` requests over one set of `--pressure-prefixes` prefixes, then measured over
`--requests` more on a new set: yesterday's prompts in the pools, today's traffic) and each policy,
a fresh `LocalCluster` (Redis, `--workers` workers, a router child) is started and driven through
its OpenAI HTTP API with the `openai` SDK: `--requests` completions, at most `--concurrency` at a
time (a closed loop: each request is sent as one finishes; with `--request-rate R` an open loop
instead: request i is sent at its seeded Poisson arrival time, `R` a second on average — the same
times for every policy — still at most `--concurrency` in flight, as vLLM's `benchmark_serving
--request-rate` with `--max-concurrency`), each a token-id prompt of one shared prefix
(`--prefix-tokens`) and a unique question (`--question-tokens`), greedy with `ignore_eos` and
`max_tokens = --output-tokens`, so every policy does the same work. Every policy sees the same
request sequence (same seed). Measured per policy: TTFT and inter-token latency percentiles (client
side, streamed), requests/s and output tokens/s over the run's wall time (an open loop's follow its
rate), the fraction of prompt tokens served from cache
(`usage.prompt_tokens_details.cached_tokens`) and its ceiling (`max_cached_token_frac`: every
request but the first of its prefix finds the prefix's full blocks, as a perfect router would),
cold requests (a request whose cached tokens do not cover its prefix's full blocks: it computed the
prefix itself) and their minimum (`min_cold_requests`: the prefixes the requests asked for, each
computed once; a phase's draw may leave one of its prefixes out), the requests each worker served per
prefix and in all (`requests_per_worker`), and the router's hit-mismatch rate (`/v1/cluster`:
requests whose predicted cache hit differed from the served one). A `shift` entry measures its
second phase only (the router's counters too) and keeps the fill's cached fraction, cold requests
and placement under `fill`.

With `--routers N` (N > 1) each policy runs three times on the same workload
(kvmesh/bench/routing_replicas.py): one router, N router replicas (requests dealt round robin
over them, as a Service spreads connections), and N replicas sharing pending blocks
(`--share-pending`); the router counters are summed over the replicas. `--log-dir DIR` keeps each
cluster's logs (router, workers, Redis) and the router's pick log (`picks.jsonl`, router/observe/picklog.py)
in a folder under DIR, and with one router adds the log's classes of the measured requests to the
diagnostics (`pick_log`: cold, peer-fetched, warm with a prefill queued on the worker at the pick,
warm without; kvmesh/bench/routing_live_figures.py `pick_log_figures`); `--repeats N`:
kvmesh/bench/routing_repeats.py. `diagnostics.peer_fetches` / `peer_fetch_s_mean`: the workers'
peer fetches in the measured phase and their mean seconds (GetLoad's peer counters, read by
kvmesh/bench/routing_live_probes.py with the machine's load, CPU seconds and the routers' counters);
`diagnostics.preemptions`: the running requests they preempted in it (GetLoad's `num_preemptions`);
a worker that does not answer GetLoad at the phase's start or end (killed, restarting) is left
out of those sums and counted in `diagnostics.workers_unread`.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import grpc

from contracts.cli import CLIError
from kvmesh.bench.report import emit
from kvmesh.bench.routing_live_figures import BLOCK_SIZE as _BLOCK_SIZE, _Served, pick_log_figures, summarize
from kvmesh.bench.routing_live_probes import (
    counted_since,
    cpu_seconds,
    load_avg,
    routers_view,
    since,
    worker_counters,
)
from kvmesh.bench.routing_repeats import rounds
from kvmesh.serve.local import LocalCluster, ServeConfig
from kvmesh.serve.supervise import Cluster
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from router.routing.types import RoutingPolicy

POLICY_ORDER = (RoutingPolicy.ROUND_ROBIN, RoutingPolicy.LEAST_LOADED, RoutingPolicy.PREFIX_HASH,
                RoutingPolicy.KV_AWARE)
SCENARIOS = ("no_pressure", "pressure", "shift")
_TOKEN_RANGE = (1000, 40000)   # plain vocabulary ids of the default model (49,152 ids)
_UNAVAILABLE_RETRIES = 60
_RETRIES = [0]     # 503 retries in the current policy's run (one run at a time)
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class LiveConfig:
    prefixes: int = 4
    pressure_prefixes: int = 16
    prefix_tokens: int = 512
    question_tokens: int = 32
    output_tokens: int = 32
    requests: int = 120
    concurrency: int = 8
    num_blocks: int = 320          # per worker, in the pressure scenario
    workers: int = 2
    model: str = "smollm2"
    seed: int = 0
    policies: tuple[RoutingPolicy, ...] = POLICY_ORDER
    scenarios: tuple[str, ...] = SCENARIOS
    routers: int = 1
    log_dir: Path | None = None    # keep each cluster's logs under here (a folder per run)
    repeats: int = 1               # rounds of the policies, every other one reversed (routing_repeats.py)
    request_rate: float = 0.0      # requests/s of an open loop (Poisson arrivals, seeded); 0: a closed loop

    def __post_init__(self) -> None:
        for name in ("prefixes", "pressure_prefixes", "prefix_tokens", "question_tokens", "output_tokens",
                     "requests", "concurrency", "num_blocks", "workers", "routers", "repeats"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise CLIError(f"--{name.replace('_', '-')}: {value!r} must be a positive integer")
        if not (isinstance(self.request_rate, (int, float)) and math.isfinite(self.request_rate)
                and self.request_rate >= 0):
            raise CLIError(f"--request-rate: {self.request_rate!r} must be a finite number of requests/s >= 0 "
                           "(0: a closed loop)")
        if not self.scenarios or any(x not in SCENARIOS for x in self.scenarios):
            raise CLIError(f"--scenarios: {','.join(self.scenarios)!r}; accepted: {', '.join(SCENARIOS)}")
        if self.prefix_tokens < _BLOCK_SIZE:
            raise CLIError(f"--prefix-tokens: {self.prefix_tokens} is less than one block ({_BLOCK_SIZE} tokens)")


QUICK = LiveConfig(prefixes=4, pressure_prefixes=12, prefix_tokens=256, question_tokens=32, output_tokens=16,
                   requests=48, concurrency=8, num_blocks=112)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("routing-live", help="routing policies through the real HTTP API, fresh cluster per policy")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--quick", action="store_true", help="a run of a few minutes (the defaults below are smaller)")
    d = LiveConfig()
    for name, doc in (("prefixes", "shared prefixes without pressure"),
                      ("pressure-prefixes", "shared prefixes under pressure"),
                      ("prefix-tokens", "tokens per shared prefix"), ("question-tokens", "unique tokens per request"),
                      ("output-tokens", "tokens generated per request (ignore_eos)"),
                      ("requests", "requests per policy and scenario"), ("concurrency", "requests in flight at most"),
                      ("num-blocks", "KV pool blocks per worker under pressure"), ("workers", "workers per cluster"),
                      ("routers", "router replicas; > 1: also one router and shared pending blocks, same workload"),
                      ("repeats", "rounds of the policies, every other one in reverse order; entries combined")):
        p.add_argument(f"--{name}", type=int, default=None,
                       help=f"{doc} (default {getattr(d, name.replace('-', '_'))}; --quick: "
                            f"{getattr(QUICK, name.replace('-', '_'))})")
    p.add_argument("--request-rate", type=float, default=0.0,
                   help="an open loop: requests/s, sent at seeded Poisson arrival times (the same for every "
                        "policy), at most --concurrency in flight; 0 (default): a closed loop")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default=",".join(x.value for x in POLICY_ORDER),
                   help="comma-separated routing policies to run")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated scenarios to run")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="keep each cluster's router, worker and Redis logs and the router's pick log "
                        "(picks.jsonl) in a folder under here")
    p.set_defaults(run=run)


def config_from_args(args: argparse.Namespace) -> LiveConfig:
    base = QUICK if args.quick else LiveConfig()
    given = {f: getattr(args, f) for f in ("prefixes", "pressure_prefixes", "prefix_tokens", "question_tokens",
                                           "output_tokens", "requests", "concurrency", "num_blocks", "workers",
                                           "routers", "repeats")
             if getattr(args, f) is not None}
    try:
        policies = tuple(RoutingPolicy.parse(p.strip()) for p in args.policies.split(",") if p.strip())
    except ValueError as e:
        raise CLIError(f"--policies: {e}") from None
    if not policies:
        raise CLIError("--policies: no policy given")
    scenarios = tuple(x.strip() for x in args.scenarios.split(",") if x.strip())
    if args.log_dir is not None:
        try:
            args.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CLIError(f"--log-dir: cannot create {str(args.log_dir)!r}: {e.strerror or e}") from None
    return replace(base, model=args.model, seed=args.seed, policies=policies, scenarios=scenarios,
                   log_dir=args.log_dir, request_rate=args.request_rate, **given)


def run(args: argparse.Namespace) -> int:
    return emit(run_live(config_from_args(args)), args.json)


def run_live(cfg: LiveConfig) -> dict[str, Any]:
    """Both scenarios, every policy on a fresh cluster; the JSON described in the module docstring."""
    shown = asdict(cfg) | {"policies": [p.value for p in cfg.policies], "log_dir": cfg.log_dir and str(cfg.log_dir)}
    print(f"kvmesh bench routing-live: {json.dumps(shown)}", file=sys.stderr)
    out: dict[str, Any] = {}
    pressure = ("--num-blocks", str(cfg.num_blocks))
    for scenario, phases, engine_argv in (
            ("no_pressure", (make_workload(cfg, cfg.prefixes),), ()),
            ("pressure", (make_workload(cfg, cfg.pressure_prefixes),), pressure),
            ("shift", (make_workload(cfg, cfg.pressure_prefixes, phase=1),
                       make_workload(cfg, cfg.pressure_prefixes, phase=2)), pressure)):
        if scenario not in cfg.scenarios:
            continue
        runner = run_policy if cfg.routers == 1 else run_replicas
        done = rounds(cfg.policies, cfg.repeats, functools.partial(runner, cfg, phases=phases, engine_argv=engine_argv))
        out[scenario] = {policy.value: entry for policy, entry in done.items()}
    return out


@dataclass(frozen=True, slots=True)
class Workload:
    prefixes: tuple[tuple[int, ...], ...]
    requests: tuple[tuple[int, tuple[int, ...]], ...]    # (prefix index, question tokens)
    arrivals: tuple[float, ...] = ()    # each request's send time, seconds after the phase starts; (): closed loop


def make_workload(cfg: LiveConfig, num_prefixes: int, phase: int = 0) -> Workload:
    """`cfg.requests` requests over `num_prefixes` prefixes; each `phase` draws its own prefixes.
    With `cfg.request_rate`, their arrival times: a Poisson process of that rate, drawn from a
    generator of its own (the prompts are the same with and without a rate)."""
    seed = cfg.seed * 1000 + num_prefixes + 100_003 * phase
    rng = random.Random(seed)
    prefixes = tuple(tuple(rng.randrange(*_TOKEN_RANGE) for _ in range(cfg.prefix_tokens)) for _ in range(num_prefixes))
    requests = tuple((rng.randrange(num_prefixes),
                      tuple(rng.randrange(*_TOKEN_RANGE) for _ in range(cfg.question_tokens)))
                     for _ in range(cfg.requests))
    return Workload(prefixes, requests, arrival_times(cfg.request_rate, cfg.requests, seed))


def arrival_times(rate: float, n: int, seed: int) -> tuple[float, ...]:
    """`n` send times of a Poisson process of `rate` a second (exponential gaps, the first
    after one gap as well); () for rate 0 (a closed loop)."""
    if rate <= 0:
        return ()
    rng, t, out = random.Random(seed ^ 0x5EED), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return tuple(out)


async def send_all(sends: Sequence[Callable[[], Awaitable[_T]]], arrivals: Sequence[float],
                   sem: asyncio.Semaphore) -> list[_T]:
    """Each of `sends` under `sem`, all at once (a closed loop: each waits for a free slot), or
    with `arrivals` send i no earlier than `arrivals[i]` seconds from now (an open loop; a send
    that finds every slot taken then waits for one too, and its TTFT counts from when it goes
    out, as vLLM's `--max-concurrency` counts it)."""
    start = time.perf_counter()

    async def one(i: int) -> _T:
        if arrivals:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        async with sem:
            return await sends[i]()

    return list(await asyncio.gather(*(one(i) for i in range(len(sends)))))


def run_policy(cfg: LiveConfig, policy: RoutingPolicy, phases: tuple[Workload, ...],
               engine_argv: tuple[str, ...], routers: int = 1, router_argv: tuple[str, ...] = ()) -> dict[str, Any]:
    """`phases` in turn on one fresh cluster of `routers` routers (each given `router_argv`); the last's figures."""
    serve = ServeConfig(workers=cfg.workers, model=cfg.model, grpc_port=0, http_port=0, engine_argv=engine_argv,
                        startup_timeout_s=900.0, router_argv=("--routing-policy", policy.value, *router_argv),
                        cluster_name=f"live-{policy.value.replace('_', '-')}-{random.randrange(10**9)}")
    if cfg.log_dir is not None:     # the cluster's logs, and the router's pick log beside them
        logs = cfg.log_dir / f"{serve.cluster_name}-{len(phases)}-phase"
        logs.mkdir(parents=True, exist_ok=True)
        serve = replace(serve, log_dir=logs, router_argv=(*serve.router_argv, "--pick-log", str(logs / "picks.jsonl")))
    with LocalCluster(serve) as cluster:
        urls = [cluster.http_base_url] + [cluster.start_router_replica(f"router-{i}").http_base_url
                                          for i in range(1, routers)]
        out, since = asyncio.run(_drive(cfg, phases, cluster, urls))
    if cfg.log_dir is not None and routers == 1:    # the router stopped: its pick log is whole
        with open(logs / "picks.jsonl", encoding="utf-8") as f:
            out["diagnostics"]["pick_log"] = pick_log_figures(f, cfg.prefix_tokens // _BLOCK_SIZE * _BLOCK_SIZE,
                                                              since)
    return out


def run_replicas(cfg: LiveConfig, policy: RoutingPolicy, phases: tuple[Workload, ...],
                 engine_argv: tuple[str, ...]) -> dict[str, Any]:
    """One router, `cfg.routers` replicas, and replicas sharing pending blocks (routing_replicas.py)."""
    from kvmesh.bench.routing_replicas import compare_replicas
    return compare_replicas(cfg.routers, lambda n, argv: run_policy(cfg, policy, phases, engine_argv, n, argv))


async def _drive(cfg: LiveConfig, phases: tuple[Workload, ...], cluster: Cluster,
                 urls: list[str]) -> tuple[dict[str, Any], float]:
    """Each phase's requests in turn, dealt round robin over the routers at `urls`; the last phase's
    figures with the routers' counters (summed) since it began, and a fill's cached fraction and placement."""
    from openai import AsyncOpenAI  # imported here: only this bench needs it

    await _warm_workers(cluster.worker_addresses)
    clients = [AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600) for url in urls]
    sem = asyncio.Semaphore(cfg.concurrency)
    _RETRIES[0] = 0
    fill: dict[str, Any] | None = None
    before: dict[str, Any] = {}
    for i, workload in enumerate(phases):
        sends = [functools.partial(_complete, clients[n % len(clients)], cfg, prefix,
                                   list(workload.prefixes[prefix] + question))
                 for n, (prefix, question) in enumerate(workload.requests)]

        since_t, counted0 = time.time(), await worker_counters(cluster.worker_addresses)
        start, load0, cpu0 = time.perf_counter(), load_avg(), cpu_seconds(cluster.pids)
        served = await send_all(sends, workload.arrivals, sem)
        wall, cpu1 = time.perf_counter() - start, cpu_seconds(cluster.pids)
        if i < len(phases) - 1:
            done = summarize(cfg, len(workload.prefixes), served, wall, {})
            fill = {k: done[k] for k in ("cached_token_frac", "cold_requests", "requests_per_worker", "req_s")}
            await asyncio.sleep(1.0)     # the fill's last KV events reach the router's index
            before = await routers_view(urls)
    for client in clients:
        await client.close()
    router = since(await routers_view(urls), before)
    out = summarize(cfg, len(phases[-1].prefixes), served, wall, router) | {"unavailable_retries": _RETRIES[0]}
    # the machine's 1-minute load average as the measured phase began and ended: other work on the
    # shared cores slows every step (itl_p50_s) and shows here, not in the placement
    out["diagnostics"]["load_avg"] = [load0, load_avg()]
    # CPU seconds each local process (the router, each worker, Redis) spent in the measured phase:
    # on shared cores, what the router's own work per pick takes from the workers' steps
    out["diagnostics"]["cpu_s"] = {name: round(cpu1[name] - cpu0[name], 3) for name in sorted(cpu1.keys() & cpu0)}
    # the workers' peer fetches in the measured phase and their mean wall time (control RPC and
    # transfer, as the peer plane counts it): what a replica by fetch cost here
    counted, unread = counted_since(await worker_counters(cluster.worker_addresses), counted0)
    if unread:   # a worker killed or restarting in the phase: its counts are not in the sums below
        out["diagnostics"]["workers_unread"] = unread
    out["diagnostics"]["peer_fetches"] = counted.peer_fetches
    out["diagnostics"]["peer_fetch_s_mean"] = (counted.peer_fetch_s / counted.peer_fetches
                                               if counted.peer_fetches else None)
    # running requests the workers preempted in the measured phase (a pool too full for them)
    out["diagnostics"]["preemptions"] = counted.preemptions
    return out | ({"fill": fill} if fill is not None else {}), since_t


async def _complete(client: Any, cfg: LiveConfig, prefix: int, prompt: list[int]) -> _Served:
    from openai import InternalServerError

    t0 = time.perf_counter()
    stamps: list[float] = []
    worker_id, usage = "", None
    for attempt in range(_UNAVAILABLE_RETRIES + 1):
        try:
            stream = await client.completions.create(
                model=cfg.model, prompt=prompt, max_tokens=cfg.output_tokens, temperature=0.0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            break
        except InternalServerError as e:
            # 503: the router sees no ready worker for a moment (health probes time out on a
            # saturated machine); the wait counts in this request's TTFT.
            if e.status_code != 503 or attempt == _UNAVAILABLE_RETRIES:
                raise
            _RETRIES[0] += 1
            await asyncio.sleep(1.0)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
        extra = chunk.model_extra or {}
        worker_id = (extra.get("kvmesh") or {}).get("worker_id", worker_id)
        usage = chunk.usage or usage
    if usage is None or not stamps:
        raise RuntimeError(f"a completion ended without tokens or usage (worker {worker_id!r})")
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return _Served(prefix, worker_id, t0, time.perf_counter(), stamps[0] - t0,
                   [b - a for a, b in zip(stamps, stamps[1:])],
                   usage.prompt_tokens, cached or 0, usage.completion_tokens)


async def _warm_workers(addresses: tuple[str, ...]) -> None:
    """One short unrelated generation straight to each worker (first-call costs out of the run)."""
    for i, address in enumerate(addresses):
        async with grpc.aio.insecure_channel(address) as ch:
            req = pb.GenerateRequest(request_id=f"warm-{i}", token_ids=pb.TokenIds(ids=[500 + i, 501, 502, 503]),
                                     sampling=pb.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
            async for _ in pb_grpc.WorkerStub(ch).Generate(req, timeout=300):
                pass

"""One measurement window of `kvmesh bench disagg` (kvmesh/bench/disagg.py) against a running
cluster: closed-loop decoding streams while long prompts arrive at a steady rate, all greedy
through the router's gRPC API; what the clients saw (`Served`), and the hand-off counters
scraped from the workers' and the router's /metrics before and after. torch-free.
"""
from __future__ import annotations

import asyncio
import math
import random
import re
import statistics
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import grpc

from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc

_TOKEN_RANGE = (1000, 40000)   # plain vocabulary ids of the default model
_RETRIES = 30                  # UNAVAILABLE (no ready worker for a moment) retries per request, 1 s apart
_TIMEOUT_S = 600.0
# Summed over label sets: the decode workers' hand-offs, the router's prefill hops.
_WORKER_SERIES = ("kvmesh:handoff_seconds_sum", "kvmesh:handoff_seconds_count")
_ROUTER_SERIES = ("kvmesh:router_disagg_prefill_seconds_sum", "kvmesh:router_disagg_prefill_seconds_count",
                  "kvmesh:router_disagg_failures_total", "kvmesh:router_disagg_skipped_total")
STALL_FACTOR = 5.0   # a token gap this many times the window's ITL p50: a stream stalled (a prefill beside it)
SLOW_FACTOR = 2.0    # a token gap this many times the ITL p50: a slow step (what `slow_gaps_during` sorts)


class LoadShape(Protocol):
    """What a window's streams and arriving prompts look like (kvmesh.bench.disagg.DisaggConfig)."""

    @property
    def streams(self) -> int: ...
    @property
    def stream_prompt_tokens(self) -> int: ...
    @property
    def stream_output_tokens(self) -> int: ...
    @property
    def long_output_tokens(self) -> int: ...
    @property
    def prompt_tokens(self) -> int: ...


class Load(NamedTuple):
    """Long prompts of `prompt_tokens` tokens arriving `rate` per second for `window_s` seconds."""

    prompt_tokens: int
    rate: float
    window_s: float


@dataclass(frozen=True, slots=True)
class Served:
    """One request as its client saw it; `kind` is "long" (an arriving prompt) or "stream";
    `key` names its prompt (the same in every mode)."""

    kind: str
    key: str
    start: float
    end: float
    ttft_s: float
    gaps: tuple[float, ...]       # seconds between consecutive token messages
    tokens: tuple[int, ...]
    worker_id: str


@dataclass(slots=True)
class Window:
    served: list[Served]
    wall_s: float
    workers: dict[str, float] = field(default_factory=dict)   # _WORKER_SERIES deltas
    router: dict[str, float] = field(default_factory=dict)    # _ROUTER_SERIES deltas

    def summary(self) -> dict[str, Any]:
        """The figures `kvmesh bench disagg` reports per mode (its KEYS first)."""
        long = [s for s in self.served if s.kind == "long"]
        ttfts = sorted(s.ttft_s for s in long)
        gaps = sorted(g for s in self.served for g in s.gaps)
        tokens = sum(len(s.tokens) for s in self.served)
        handoffs = self.workers.get("kvmesh:handoff_seconds_count", 0.0)
        hops = self.router.get("kvmesh:router_disagg_prefill_seconds_count", 0.0)
        per_worker: dict[str, int] = {}
        for s in self.served:
            per_worker[s.worker_id] = per_worker.get(s.worker_id, 0) + 1
        return {
            "ttft_p50_s": statistics.median(ttfts) if ttfts else None, "ttft_p99_s": quantile(ttfts, 0.99),
            "itl_p50_s": statistics.median(gaps) if gaps else None, "itl_p99_s": quantile(gaps, 0.99),
            "output_tok_s": tokens / self.wall_s, "req_s": len(self.served) / self.wall_s,
            "handoff_s_mean": self.workers.get("kvmesh:handoff_seconds_sum", 0.0) / handoffs if handoffs else 0.0,
            "handoffs": int(handoffs),
            "prefill_hop_s_mean": (self.router.get("kvmesh:router_disagg_prefill_seconds_sum", 0.0) / hops
                                   if hops else 0.0),
            "handoff_failures": int(self.router.get("kvmesh:router_disagg_failures_total", 0.0)),
            "skipped_hop": int(self.router.get("kvmesh:router_disagg_skipped_total", 0.0)),
            "itl_max_s": gaps[-1] if gaps else None,
            "long_requests": len(long), "stream_requests": len(self.served) - len(long),
            "output_tokens": tokens, "wall_s": self.wall_s, "requests_per_worker": dict(sorted(per_worker.items())),
            **stalls(self.served),
        }

    def equal_frac(self, other: Window) -> float | None:
        """Of the prompts both windows served, the fraction whose greedy tokens are identical."""
        mine = {s.key: s.tokens for s in self.served}
        common = [(mine[s.key], s.tokens) for s in other.served if s.key in mine]
        return sum(a == b for a, b in common) / len(common) if common else None


def stalls(served: list[Served]) -> dict[str, Any]:
    """Why the window's ITL p99 is what it is. `stall_gap_frac`: the share of token gaps over
    STALL_FACTOR x the ITL p50 (the p99 is a stall when it is above 1%); `streams_per_worker`:
    the stream requests open on each worker, averaged over the window; per arriving prompt, the
    streams on its worker while it waited for its first token (`streams_on_worker_per_long`)
    and those of them stalled then (`streams_stalled_per_long`; a mixed worker computes the
    prompt in one step, so each stalls once, for the whole prefill). `slow_gaps_during`: the
    gaps over SLOW_FACTOR x the p50 by what else ran on their worker meanwhile (an arriving
    prompt before its first token: `long_prefill`, its prefill or hop, hand-off and admission;
    `long_decode`; another stream's prompt: `stream_prompt`; none of these: `none`), a gap
    counted under each that overlapped it."""
    gaps = sorted(g for s in served for g in s.gaps)
    if not gaps:
        return {"gaps": 0, "stall_gap_frac": None}
    p50 = statistics.median(gaps)
    stall_s, slow_s = STALL_FACTOR * p50, SLOW_FACTOR * p50
    streams = [s for s in served if s.kind == "stream"]
    t0, t1 = min(s.start for s in served), max(s.end for s in served)
    open_s: dict[str, float] = {}
    for s in streams:
        open_s[s.worker_id] = open_s.get(s.worker_id, 0.0) + s.end - s.start
    on_worker, stalled = [], []
    for long in (s for s in served if s.kind == "long"):
        a, b = long.start, long.start + long.ttft_s
        near = [s for s in streams if s.worker_id == long.worker_id and s.start < b and s.end > a]
        on_worker.append(len({_loop(s) for s in near}))
        stalled.append(len({_loop(s) for s in near if any(y - x > stall_s and x < b and y > a for x, y in _spans(s))}))
    during = dict.fromkeys(("long_prefill", "long_decode", "stream_prompt", "none"), 0)
    for s in served:
        others = [o for o in served if o is not s and o.worker_id == s.worker_id]
        for x, y in _spans(s):
            if y - x <= slow_s:
                continue
            tags = {tag for o in others for tag in _phases(o, x, y)}
            for tag in tags or {"none"}:
                during[tag] += 1
    return {"gaps": len(gaps), "stall_factor": STALL_FACTOR, "stall_gaps": sum(g > stall_s for g in gaps),
            "stall_gap_frac": sum(g > stall_s for g in gaps) / len(gaps),
            "streams_per_worker": {w: v / (t1 - t0) for w, v in sorted(open_s.items())} if t1 > t0 else {},
            "streams_on_worker_per_long": on_worker, "streams_stalled_per_long": stalled,
            "slow_gaps": sum(g > slow_s for g in gaps), "slow_gaps_during": during}


def _spans(s: Served) -> list[tuple[float, float]]:
    """The (from, to) clock times of `s`'s token gaps."""
    out, t = [], s.start + s.ttft_s
    for g in s.gaps:
        out.append((t, t + g))
        t += g
    return out


def _phases(o: Served, x: float, y: float) -> list[str]:
    """What `o` was doing on its worker during (x, y): waiting for its first token (an
    arriving prompt's `long_prefill`, a stream's `stream_prompt`) and/or decoding (`long_decode`;
    a stream's decoding is not named)."""
    first = o.start + o.ttft_s
    out = []
    if x < first and y > o.start:
        out.append("long_prefill" if o.kind == "long" else "stream_prompt")
    if o.kind == "long" and x < o.end and y > first:
        out.append("long_decode")
    return out


def _loop(s: Served) -> str:
    """The closed-loop stream a stream request came from (its key: s<seed>-<stream>-<n>)."""
    return s.key.split("-")[1] if s.kind == "stream" else s.key


def quantile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank quantile of an ascending list (None when empty)."""
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]


def prompt(key: str, num_tokens: int) -> list[int]:
    """The token ids of prompt `key` (the same in every process and mode)."""
    rng = random.Random(key)
    return [rng.randrange(*_TOKEN_RANGE) for _ in range(num_tokens)]


async def generate(stub: pb_grpc.RouterStub, kind: str, key: str, ids: list[int], max_tokens: int) -> Served:
    """One greedy stream of exactly `max_tokens` tokens; raises RuntimeError if it fails."""
    req = pb.GenerateRequest(request_id=f"bench-{key}", token_ids=pb.TokenIds(ids=ids),
                             sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    for attempt in range(_RETRIES + 1):
        t0 = time.perf_counter()
        stamps: list[float] = []
        tokens: list[int] = []
        last = None
        try:
            async for r in stub.Generate(req, timeout=_TIMEOUT_S):
                if r.token_ids:
                    stamps.append(time.perf_counter())
                    tokens.extend(r.token_ids)
                last = r
            break
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or tokens or attempt == _RETRIES:
                raise RuntimeError(f"{key}: {e.code().name}: {e.details()}") from None
            await asyncio.sleep(1.0)
    if last is None or not last.finished or len(tokens) != max_tokens:
        raise RuntimeError(f"{key}: ended with {len(tokens)} of {max_tokens} tokens")
    return Served(kind, key, t0, time.perf_counter(), stamps[0] - t0,
                  tuple(b - a for a, b in zip(stamps, stamps[1:])), tuple(tokens), last.worker_id)


async def warm_up(target: str, shape: LoadShape) -> None:
    """One long prompt and one stream through the router, one after the other: first-call costs
    (and the first hand-off) out of the measurement."""
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.RouterStub(ch)
        await generate(stub, "long", "warm-long", prompt("warm-long", shape.prompt_tokens), 2)
        await generate(stub, "stream", "warm-stream", prompt("warm-stream", shape.stream_prompt_tokens), 4)


async def run_window(target: str, http_base: str, worker_metrics: tuple[str, ...], shape: LoadShape, load: Load,
                     seed: int) -> Window:
    """`shape.streams` closed-loop streams while long prompts arrive every 1/`load.rate` s for
    `load.window_s` s; returns once every request has finished."""
    router_metrics = http_base.removesuffix("/v1") + "/metrics"
    before_w = await asyncio.to_thread(scrape, worker_metrics, _WORKER_SERIES)
    before_r = await asyncio.to_thread(scrape, (router_metrics,), _ROUTER_SERIES)
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.RouterStub(ch)
        t0 = time.perf_counter()
        end = t0 + load.window_s

        async def stream_loop(c: int) -> list[Served]:
            done, j = [], 0
            while time.perf_counter() < end:
                key = f"s{seed}-{c}-{j}"
                done.append(await generate(stub, "stream", key, prompt(key, shape.stream_prompt_tokens),
                                           shape.stream_output_tokens))
                j += 1
            return done

        async def arrival(k: int) -> Served:
            await asyncio.sleep(max(0.0, t0 + k / load.rate - time.perf_counter()))
            key = f"l{seed}-{load.prompt_tokens}-{k}"
            return await generate(stub, "long", key, prompt(key, load.prompt_tokens), shape.long_output_tokens)

        arrivals = max(1, math.ceil(load.window_s * load.rate))
        streams = await asyncio.gather(*(stream_loop(c) for c in range(shape.streams)),
                                       *(asyncio.gather(*(arrival(k) for k in range(arrivals))),))
    served = [s for group in streams for s in group]
    wall = max(s.end for s in served) - t0
    after_w = await asyncio.to_thread(scrape, worker_metrics, _WORKER_SERIES)
    after_r = await asyncio.to_thread(scrape, (router_metrics,), _ROUTER_SERIES)
    return Window(served, wall, {k: after_w[k] - before_w[k] for k in after_w},
                  {k: after_r[k] - before_r[k] for k in after_r})


def scrape(urls: tuple[str, ...], names: tuple[str, ...]) -> dict[str, float]:
    """Each series in `names` summed over its label sets and over the /metrics pages at `urls`
    (0 where absent)."""
    totals = dict.fromkeys(names, 0.0)
    pattern = re.compile(rf"^({'|'.join(re.escape(n) for n in names)})(?:\{{[^}}]*\}})? (\S+)$", re.M)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # loopback: never a proxy
    for url in urls:
        with opener.open(url, timeout=30) as r:
            body = r.read().decode()
        for m in pattern.finditer(body):
            totals[m.group(1)] += float(m.group(2))
    return totals

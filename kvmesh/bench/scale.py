"""`kvmesh bench scale`: one router's block index and event ingest against N synthetic workers.

Per N (`--workers 16,128,1000`): a real `redis-server` (kvmesh/serve/processes.py `start_redis`),
a child process of N synthetic workers publishing real records, heartbeats, inventories and KV
event streams (kvmesh/bench/scale_workers.py), and in this process the router's real consumer,
index and pick (kvmesh/bench/scale_router.py), once per router variant (`--index`), one after
the other against the same fleet: `legacy` — router/index/blocks.py `BlockIndex`, the consumer
reading back to back (`read_interval_s=0`) and the pick over per-worker dicts (router/routing/pick.py
`reference_view` + `Policy.pick`) —, `compact-dicts` — router/index/compact.py, the consumer's
batched reads (its default), the same dict pick —, `compact-tracked` — the column pick
(router/routing/fastpick.py) over the compact index as it was while the garbage collector
traversed it (kvmesh/bench/scale_baseline.py) —, `compact-per-pick` — the router as it is but for
the live workers' columns, built afresh at every pick as the view was before they were kept
between picks (router/workers/live.py) —, `compact-asks-loop` — the router as it is but for a
routed prompt's asks counted on each holder of each block in Python, not in numpy (the bookkeeping
after a pick, `dispatch_*` in `details`) — and `compact` — the router as it is: the compact
index out of the collector's sight, its start-up heap frozen (router/heap.py), those reads and the
column pick over the kept columns. `runs` holds the last variant
named, `baseline` the others, measured in the same run. Picks may take at most half the router loop's time (the rest
is the consumer's); decisions due beyond that are shed and counted (`details`).

Pinning (`--pin split`, the default; kvmesh/bench/scale_pin.py): this process — the router's
consumer and its picks — runs on one core, the fleet child and redis-server on the others, as a
deployed router has cores of its own; `config.pinning` records the split (none on a 1-core
machine). The fleet then shares its core with Redis: `details[].fleet.requests_per_s` is the
request rate it achieved, beside `requests_per_s_demanded`.

The modelled event rate (the derivation):
- A worker computes `tokens_per_s` tokens a second whose blocks it stores: its measured prefill
  rate, read from `docs/results/prefix-quick.json` (`kvmesh bench prefix`: prefix + suffix
  tokens / cold TTFT on this machine's CPU worker) when present, else `MEASURED_TOKENS_PER_S`,
  that file's figure when this was written (1,056 tokens in 6.28 s). A GPU worker is ~100x
  faster: pass `--tokens-per-s`.
- A request's new blocks: its unique suffix (the sim trace's 1–6 blocks, mean 3.5) and its
  output (`output_blocks`, 2 = 32 tokens; a worker caches full decode blocks); its system prompt
  is cached on the worker it goes to. So a worker serves tokens_per_s / (block_size × 5.5)
  requests a second and stores as many × 5.5 blocks; its pool is full (`pool_blocks`, sized so
  that 1,000 workers index the issue's 10^6 blocks), so it removes as many: ~2 × tokens_per_s /
  block_size hash events a second, in ~2 stream entries per request (a stored chain, a removed
  batch; a live worker splits decode blocks over steps, so its entries are smaller and more).
- The router decides for every request: N × that rate, capped at `--decision-rate`.

Measured per N and structure: decision p50/p99 (`Router.pick`, perf_counter), event lag p99
(router wall clock at apply − the entry's stream id time, steady phase), index bytes per
(block, worker) entry and in total (a size walk: sys.getsizeof over every object reachable
from the index, each once), hash events ingested per second of router CPU (process CPU time
less the decisions' thread CPU, steady phase; `details` also gives the fill: inventories at
full speed), Redis CPU (INFO cpu, fraction of one core) and memory (INFO memory used_memory).
`details` also gives each routed request's bookkeeping after its pick (`dispatch_p50_ms` /
`dispatch_p99_ms`: `InFlightPrefills.dispatched`, its pending blocks and asks; router CPU per
request that the decision time leaves out, and the steady phase's consumer has to share the
core with), the garbage collector's passes in the steady phase (all, full ones, the longest),
the picks with a pass inside them and the decision p99 less the collector's time in each pick,
and one full collection timed once the index is full and the fleet paused
(`gc_collect_full_index_ms`, best of 3; `gc_tracked_objects`: the containers it traverses).
The oracle: once the fleet pauses and the index has caught up, its entries equal the blocks
the fleet's workers hold (published stored minus removed).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts.cli import CLIError
from kvmesh.bench.report import emit
from kvmesh.bench.scale_pin import MODES, Pinning, pin_children, pin_router, plan, unpin_router
from kvmesh.bench.scale_router import INDEXES, PassConfig, PassResult, RouterPass
from kvmesh.bench.scale_workers import FleetConfig, fleet_argv
from kvmesh.bench.sim import make_trace
from kvmesh.serve.processes import start_redis, terminate

MEASURED_TOKENS_PER_S = 1056 / 6.28
RESULT_OF_PREFIX = Path("docs/results/prefix-quick.json")
TARGETS = {"decision_p99_ms": 2.0, "event_lag_p99_ms": 250.0, "index_bytes_per_entry": 200.0}
TARGET_WORKERS = 1000       # the targets are set for 1,000 workers with 10^6 blocks indexed


@dataclass(frozen=True, slots=True)
class ScaleConfig:
    workers: tuple[int, ...] = (16, 128, 1000)
    indexes: tuple[str, ...] = ("legacy", "compact-dicts", "compact-tracked", "compact-per-pick", "compact-asks-loop",
                                "compact")
    pool_blocks: int = 1000
    tokens_per_s: float = MEASURED_TOKENS_PER_S
    tokens_source: str = "constant"
    output_blocks: int = 2
    steady_s: float = 20.0
    decision_rate: float = 50.0
    service_s: float = 2.0
    trace_requests: int = 2000
    fill_timeout_s: float = 300.0
    pin: str = "split"              # kvmesh/bench/scale_pin.py MODES

    def __post_init__(self) -> None:
        if not self.workers or any(n <= 0 for n in self.workers):
            raise ValueError(f"workers={self.workers!r} must be positive counts")
        if not self.indexes or any(k not in INDEXES for k in self.indexes):
            raise ValueError(f"indexes={self.indexes!r}; accepted: {sorted(INDEXES)}")
        if self.pool_blocks < 64:
            raise ValueError(f"pool_blocks={self.pool_blocks!r} must be >= 64 (a request takes up to 40)")
        if self.pin not in MODES:
            raise ValueError(f"pin={self.pin!r}; accepted: {', '.join(MODES)}")
        for name in ("tokens_per_s", "steady_s", "decision_rate", "service_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")

    def fleet(self, redis_url: str, n: int) -> FleetConfig:
        suffix = (1, 6)
        new_blocks = (suffix[0] + suffix[1]) / 2 + self.output_blocks
        return FleetConfig(redis_url=redis_url, cluster_name="scale", workers=n, pool_blocks=self.pool_blocks,
                           requests_per_s=self.tokens_per_s / (16 * new_blocks), output_blocks=self.output_blocks,
                           heartbeat_ttl_s=10.0, heartbeat_interval_s=2.0, poll_interval_s=1.0, num_prompts=64,
                           zipf_s=1.1, system_blocks=32, suffix_blocks=suffix, block_size=16,
                           trace_requests=self.trace_requests, seed=0)


def measured_tokens_per_s(path: Path = RESULT_OF_PREFIX) -> tuple[float, str]:
    """The CPU worker's cold prefill rate from `kvmesh bench prefix`'s result, and its source."""
    try:
        r = json.loads(path.read_text())
        tokens = r["config"]["prefix_tokens"] + r["config"]["suffix_tokens"]
        return tokens / r["cold_ttft_s"], f"{path} ({tokens} tokens / cold_ttft_s {r['cold_ttft_s']:.2f})"
    except (OSError, KeyError, ValueError, TypeError, ZeroDivisionError):
        return MEASURED_TOKENS_PER_S, "MEASURED_TOKENS_PER_S (docs/results/prefix-quick.json unreadable)"


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


class _FleetProcess:
    def __init__(self, cfg: FleetConfig) -> None:
        self.proc = subprocess.Popen(fleet_argv(cfg), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=os.environ | {"PYTHONUNBUFFERED": "1"})

    def expect(self, word: str) -> dict[str, int]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(word + " "):
                return dict(json.loads(line[len(word) + 1:]))
        raise RuntimeError(f"the worker fleet exited (code {self.proc.wait()}) before '{word}'")

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise RuntimeError(f"the worker fleet exited (code {self.proc.wait()}) before '{command}'") from None

    def pause(self) -> int:
        self.send("pause")
        return self.expect("paused")["held"]

    def close(self) -> dict[str, int]:
        """Its summary (`{}` if it has exited already: the error that ended the run is raised)."""
        if self.proc.poll() is not None:
            return {}
        try:
            self.send("quit")
            summary = self.expect("bye")
        finally:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return summary


def run_point(cfg: ScaleConfig, n: int, log_dir: Path,
              pinning: Pinning | None = None) -> list[tuple[str, PassResult, dict[str, Any]]]:
    """Every index structure at `n` workers, against one Redis and one fleet (both on
    `pinning.others`, this process on `pinning.router`: kvmesh/bench/scale_pin.py)."""
    pinning = pinning if pinning is not None else Pinning()
    redis_url, redis_child = start_redis(log_dir)
    pin_children(pinning, [redis_child.proc.pid])
    fleet_cfg = cfg.fleet(redis_url, n)
    trace = make_trace(fleet_cfg.sim())
    out: list[tuple[str, PassResult, dict[str, Any]]] = []
    try:
        fleet = _FleetProcess(fleet_cfg)
        pin_children(pinning, [fleet.proc.pid])
        try:
            ready = fleet.expect("ready")
            for kind in cfg.indexes:
                fleet.send("resume")
                pass_cfg = PassConfig(fleet_cfg.redis, kind, ready["held"], cfg.steady_s,
                                      min(cfg.decision_rate, n * fleet_cfg.requests_per_s), cfg.service_s,
                                      cfg.pool_blocks, fleet_cfg.block_size, cfg.fill_timeout_s)
                result = asyncio.run(RouterPass(pass_cfg, trace).run(fleet.pause, lambda: fleet.proc.poll() is None))
                out.append((kind, result, {"held": result.held, "decision_rate": pass_cfg.decision_rate,
                                           "requests_per_s_demanded": round(n * fleet_cfg.requests_per_s, 1)}))
        finally:
            summary = fleet.close()
        for _, _, extra in out:
            extra["fleet"] = summary
    finally:
        terminate([redis_child], 10.0)
    return out


def _run_row(n: int, r: PassResult) -> dict[str, Any]:
    cpu = r.ingest_cpu_s
    return {"workers": n, "blocks": r.index_blocks,
            "decision_p50_ms": round(statistics.median(r.decision_ms), 3) if r.decision_ms else None,
            "decision_p99_ms": round(_pct(r.decision_ms, 0.99), 3) if r.decision_ms else None,
            "event_lag_p99_ms": round(_pct(r.lag_ms, 0.99), 1),
            "index_bytes_per_entry": round(r.index_bytes / r.index_entries, 1) if r.index_entries else None,
            "events_per_s_per_core": round(r.hash_events / cpu) if cpu > 0 else None,
            "redis_cpu_frac": round(r.redis_cpu_s / r.wall_s, 3),
            "redis_mem_bytes": r.redis_mem_bytes}


def _detail(n: int, kind: str, r: PassResult, extra: dict[str, Any]) -> dict[str, Any]:
    return {"workers": n, "index": kind, "index_entries": r.index_entries, "index_bytes": r.index_bytes,
            "oracle_held": extra["held"], "oracle_ok": r.index_entries == extra["held"],
            "decisions": len(r.decision_ms), "decisions_shed": r.decisions_shed,
            "decision_rate": round(extra["decision_rate"], 1),
            "requests_per_s_demanded": extra["requests_per_s_demanded"],
            "decision_cpu_s": round(r.decision_cpu_s, 3), "decision_parts_ms": r.decision_parts_ms,
            "decision_cpu_p50_ms": round(_pct(r.decision_cpu_ms, 0.5), 3),
            "decision_cpu_p99_ms": round(_pct(r.decision_cpu_ms, 0.99), 3),
            "dispatch_p50_ms": round(_pct(r.dispatch_ms, 0.5), 3),
            "dispatch_p99_ms": round(_pct(r.dispatch_ms, 0.99), 3),
            "gc_passes": len(r.gc_pauses_ms), "gc_pause_max_ms": round(max(r.gc_pauses_ms, default=0.0), 1),
            "gc_pause_total_ms": round(sum(r.gc_pauses_ms), 1), "gc_full_passes": len(r.gc_full_ms),
            "gc_full_pause_max_ms": round(max(r.gc_full_ms, default=0.0), 1),
            "gc_collect_full_index_ms": round(r.full_gc_ms, 1), "gc_tracked_objects": r.gc_tracked,
            "decisions_with_gc": sum(1 for g in r.decision_gc_ms if g > 0),
            "decision_p99_less_gc_ms": round(_pct([d - g for d, g in zip(r.decision_ms, r.decision_gc_ms)], 0.99), 3),
            "first_pick_ms": round(r.warm_pick_ms, 1),
            "steady_s": round(r.wall_s, 2), "steady_hash_events": r.hash_events, "steady_entries": r.entries,
            "ingest_cpu_s": round(r.ingest_cpu_s, 3), "event_lag_p50_ms": round(_pct(r.lag_ms, 0.5), 1),
            "fill_s": round(r.fill_s, 2), "fill_hash_events": r.fill_hash_events,
            "fill_events_per_s_per_core": round(r.fill_hash_events / r.fill_cpu_s) if r.fill_cpu_s > 0 else None,
            "consumer_gaps": r.consumer_gaps, "fleet": extra["fleet"],
            "load_avg": [round(x, 2) for x in os.getloadavg()]}


def bottleneck(runs: list[dict[str, Any]], details: list[dict[str, Any]]) -> str:
    """The first target missed, by N ascending, among the sizes the targets are set for
    (`TARGET_WORKERS` and up); then what the smaller sizes miss, named as such: at 16 workers
    a per-entry size or a p99 against the 1,000-worker limits says little about growth."""
    at_scale = [r for r in runs if r["workers"] >= TARGET_WORKERS]
    below = [r for r in runs if r["workers"] < TARGET_WORKERS]
    first = _first_miss(at_scale, details)
    if first is None and at_scale:
        first = f"none of the targets missed at {TARGET_WORKERS:,}+ workers"
    elif first is None:
        first = f"no size at the targets' scale ({TARGET_WORKERS:,}+ workers) was run"
    small = _first_miss(below, details)
    return first if small is None else f"{first}; below that scale: {small}"


def _first_miss(runs: list[dict[str, Any]], details: list[dict[str, Any]]) -> str | None:
    for row in sorted(runs, key=lambda r: r["workers"]):
        n = row["workers"]
        d = next(x for x in details if x["workers"] == n and x["index"] == row.get("_index"))
        for key, limit in TARGETS.items():
            value = row[key]
            if value is not None and value > limit:
                why = ""
                if key == "decision_p99_ms":
                    parts = d["decision_parts_ms"]
                    wholes = ("routing_state", "routing_view")    # they contain the other view parts
                    top = max((k for k in parts if k not in wholes), key=lambda k: parts[k])
                    why = ("; per pick (ms, each part timed alone): "
                           + ", ".join(f"{k} {v}" for k, v in parts.items())
                           + f"; largest part: {top}; decision p50 {row['decision_p50_ms']} ms, "
                           f"decision CPU p99 {d.get('decision_cpu_p99_ms')} ms, "
                           f"p99 less the collector's time in each pick {d.get('decision_p99_less_gc_ms')} ms "
                           f"({d.get('gc_full_passes')} full collections, the longest "
                           f"{d.get('gc_full_pause_max_ms')} ms)")
                elif key == "event_lag_p99_ms":
                    why = (f"; steady ingest {row['events_per_s_per_core']} hash events per router CPU s, "
                           f"Redis CPU {row['redis_cpu_frac']} of a core")
                return f"{key} {value} > {limit} at {n} workers ({d['index']} index){why}"
    return None


def run(cfg: ScaleConfig) -> dict[str, Any]:
    load0 = [round(x, 2) for x in os.getloadavg()]
    by_kind: dict[str, list[dict[str, Any]]] = {k: [] for k in cfg.indexes}
    details: list[dict[str, Any]] = []
    pinning = plan(cfg.pin)
    pin_router(pinning)
    try:
        with tempfile.TemporaryDirectory(prefix="kvmesh-scale-") as tmp:
            for n in cfg.workers:
                log_dir = Path(tmp) / f"n{n}"
                log_dir.mkdir()
                for kind, result, extra in run_point(cfg, n, log_dir, pinning):
                    by_kind[kind].append(_run_row(n, result))
                    details.append(_detail(n, kind, result, extra))
    finally:
        unpin_router(pinning)
    main_kind = cfg.indexes[-1]
    runs = by_kind[main_kind]
    text = bottleneck([dict(r, _index=main_kind) for r in runs], details)
    return {"runs": runs, "bottleneck": text,
            "index": main_kind,
            "baseline": {k: v for k, v in by_kind.items() if k != main_kind},
            "baseline_bottleneck": {k: bottleneck([dict(r, _index=k) for r in v], details)
                                    for k, v in by_kind.items() if k != main_kind},
            "targets": {"workers": TARGET_WORKERS, "blocks": 10**6, **TARGETS},
            "details": details,
            "config": {"workers": list(cfg.workers), "indexes": list(cfg.indexes), "pool_blocks": cfg.pool_blocks,
                       "tokens_per_s": round(cfg.tokens_per_s, 1), "tokens_per_s_source": cfg.tokens_source,
                       "output_blocks": cfg.output_blocks, "steady_s": cfg.steady_s,
                       "max_decision_rate": cfg.decision_rate, "service_s": cfg.service_s,
                       "router": "in the bench process (one asyncio loop: consumer + picks)",
                       "workers_process": "one child process for all N workers",
                       "pinning": pinning.describe(),
                       "load_avg_start": load0, "load_avg_end": [round(x, 2) for x in os.getloadavg()]}}


def _counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--workers {text!r}: comma-separated counts, e.g. 16,128,1000") from None


def config_from_args(args: argparse.Namespace) -> ScaleConfig:
    """The run's config; CLIError naming the flag for a bad value."""
    tokens, source = (args.tokens_per_s, "--tokens-per-s") if args.tokens_per_s else measured_tokens_per_s()
    default = ScaleConfig()
    steady_s, rate, trace = (8.0, 20.0, 600) if args.quick else (default.steady_s, default.decision_rate,
                                                                 default.trace_requests)
    try:
        return ScaleConfig(workers=args.workers, indexes=tuple(args.index.split(",")), pool_blocks=args.pool_blocks,
                           tokens_per_s=tokens, tokens_source=source, trace_requests=trace, pin=args.pin,
                           steady_s=args.steady_s if args.steady_s is not None else steady_s,
                           decision_rate=args.decision_rate if args.decision_rate is not None else rate)
    except ValueError as e:
        field = str(e).split("=", 1)[0]
        flag = {"indexes": "--index"}.get(field, "--" + field.replace("_", "-"))
        raise CLIError(f"bench scale: {flag}: {e}") from None


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    t0 = time.monotonic()
    try:
        result = run(cfg)
    except RuntimeError as e:       # a child of the bench died (the fleet, Redis): said in one line
        print(f"kvmesh bench scale: {e}", file=sys.stderr)
        return 1
    result["config"]["wall_s"] = round(time.monotonic() - t0, 1)
    return emit(result, args.json)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scale", help="one router's index and event ingest against N synthetic workers on a real Redis")
    p.add_argument("--quick", action="store_true",
                   help="shorter steady phase, fewer decisions (1,000 workers included)")
    p.add_argument("--json", type=Path, default=None, help="write the result JSON here")
    p.add_argument("--workers", type=_counts, default=(16, 128, 1000), help="worker counts (default 16,128,1000)")
    p.add_argument("--index", default="legacy,compact-dicts,compact-tracked,compact-per-pick,compact-asks-loop,compact",
                   help="router variants (index structure, reads, pick: kvmesh/bench/scale_router.py INDEXES), "
                        "comma-separated, the last one reported in runs "
                        "(default legacy,compact-dicts,compact-tracked,compact-per-pick,compact-asks-loop,compact)")
    p.add_argument("--pool-blocks", type=int, default=1000, help="blocks per worker pool (default 1000: 10^6 at 1,000)")
    p.add_argument("--tokens-per-s", type=float, default=None,
                   help="tokens a worker computes per second (default: the measured prefill rate)")
    p.add_argument("--steady-s", type=float, default=None, help="seconds of traffic and decisions per pass "
                   "(default 20, --quick 8)")
    p.add_argument("--decision-rate", type=float, default=None,
                   help="routing decisions per second, at most (default 50, --quick 20)")
    p.add_argument("--pin", choices=MODES, default="split",
                   help="split (default): this process (the router: consumer and picks) on one core, the worker "
                        "fleet and redis-server on the others, as a deployed router has cores of its own "
                        "(skipped on a 1-core machine); none: no pinning")
    p.set_defaults(run=main)

"""`kvmesh bench restart`: does the cluster's cache survive a restart, a drain and a scale-out?

A cluster as `kvmesh serve` runs it, parts started one by one so they can be killed and added:
a `redis-server`, a router on it, and two `kvmesh worker --peer-transfer` processes (w-0, w-1)
registered there. `clients` clients stream greedy one-token requests through the router: each
prompt is one of `num_prefixes` shared prefixes of `prefix_tokens` token ids plus a fresh
suffix of `suffix_tokens`. Every request's end time, worker and cached prompt tokens (the
router's GenerateResponse) are recorded. After a warm-up (every prefix asked twice) and a
window, three events, `2 × window_s` apart (the drain at least `window_s` after the restarted
worker serves again):

1. restart: w-1 is killed with -9 and started again at once (same id, same disk directory);
2. drain: w-0 gets SIGTERM and is not started again (scale in to one worker);
3. scale out: a new worker w-2 starts.

Per event: the cached-token fraction (Σ cached ÷ Σ prompt tokens of the requests that ended
in the window) in the `window_s` after the event ÷ the one in the `window_s` before it
(`cached_ratio`), and the time from the event to the first cached request the event's worker
served (`first_hit_s`: the restarted w-1; for the drain, w-1 as the receiver; for w-2, from
the moment it was serving). A restart's window includes the time the worker takes to load
(`restart_s`), when the other worker serves everything: `cached_ratio_after_ready` and
`first_hit_after_ready_s` count from the moment it serves again. For the scale-out,
`first20_cached_ratio`: the fraction of w-2's first 20 requests ÷ the cluster's in the window
before it started.

The whole run is done twice, on fresh clusters: `with` (the workers' disk tier, written
through, the drain hand-over and the warm start: the defaults) and `without` (no disk tier,
`--no-drain-handover`, `--warm-start-mb-s 0`). Top-level keys: `restart.cached_ratio`,
`drain.cached_ratio`, `scale_out.first20_cached_ratio` of `with`; the same under `without`.
Targets (issue): restart >= 0.9, drain >= 0.9, scale-out first 20 >= 0.8. The issue names
60 s windows (the default); `--quick` uses 20 s windows and says so (`window_s`).
"""
from __future__ import annotations

import argparse
import asyncio
import random
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from kvmesh.bench.report import emit
from kvmesh.serve.processes import Child, free_port, spawn, start_redis, terminate
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc

_ROUTER_LINE = re.compile(r"^kvmesh router serving grpc on (\S+):(\d+) http on (\S+):(\d+)$", re.M)
_WORKER_LINE = re.compile(r"^kvmesh worker (\S+) serving on (\S+):(\d+)$", re.M)
_TOKENS = (1000, 20000)
_CLUSTER = "bench-restart"
TARGETS = {"restart": 0.9, "drain": 0.9, "scale_out_first20": 0.8}


@dataclass(frozen=True, slots=True)
class RestartConfig:
    window_s: float = 60.0
    num_prefixes: int = 8
    prefix_tokens: int = 256
    suffix_tokens: int = 16
    clients: int = 3
    kv_offload_gib: float = 0.25
    num_blocks: int | None = None     # each worker's device pool (None: the engine's default); small = KV pressure
    kv_disk_gib: float = 2.0
    startup_timeout_s: float = 600.0
    model: str = "smollm2"
    seed: int = 0
    log_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("window_s", "kv_offload_gib", "kv_disk_gib"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        for name in ("num_prefixes", "prefix_tokens", "suffix_tokens", "clients"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 1")


QUICK = RestartConfig(window_s=20.0)


class Record(NamedTuple):
    end: float               # time.monotonic() when the stream ended
    worker_id: str
    prompt_tokens: int
    cached_tokens: int
    error: str = ""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("restart", help="cached-token fraction after a kill -9, a drain and a scale-out, with and "
                                       "without the disk tier + hand-over + warm start")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--quick", action="store_true", help="20 s windows instead of the issue's 60 s")
    p.add_argument("--window-s", type=float, default=None)
    p.add_argument("--clients", type=int, default=None)
    p.add_argument("--num-prefixes", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="each worker's device pool in blocks (default: the engine's); with a small --kv-offload-gib, "
                        "KV pressure: one worker cannot hold every prefix")
    p.add_argument("--kv-offload-gib", type=float, default=None)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="the parts' logs (default: a temporary directory, kept)")
    p.add_argument("--modes", default="with,without", help="comma-separated: with, without")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    base = QUICK if args.quick else RestartConfig()
    cfg = replace(base, model=args.model, seed=args.seed, log_dir=args.log_dir,
                  **{k: v for k, v in (("window_s", args.window_s), ("clients", args.clients),
                                       ("num_prefixes", args.num_prefixes), ("num_blocks", args.num_blocks),
                                       ("kv_offload_gib", args.kv_offload_gib)) if v is not None})
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    return emit(run_restart(cfg, modes, quick=args.quick), args.json)


def run_restart(cfg: RestartConfig, modes: tuple[str, ...] = ("with", "without"),
                quick: bool = False) -> dict[str, Any]:
    log_root = Path(cfg.log_dir) if cfg.log_dir else Path(tempfile.mkdtemp(prefix="kvmesh-bench-restart-"))
    out: dict[str, Any] = {"bench": "restart", "config": asdict(cfg), "quick": quick, "window_s": cfg.window_s,
                           "window_note": ("--quick: 20 s windows, not the issue's 60 s" if quick else
                                           f"{cfg.window_s:g} s windows"),
                           "targets": TARGETS, "logs": str(log_root)}
    for mode in modes:
        if mode not in ("with", "without"):
            raise ValueError(f"mode {mode!r}: with | without")
        log_dir = log_root / mode
        log_dir.mkdir(parents=True, exist_ok=True)
        print(f"kvmesh bench restart: {mode} (logs: {log_dir})", file=sys.stderr, flush=True)
        out[mode] = asyncio.run(_scenario(cfg, mode == "with", log_dir))
    if "with" in out:
        for key in ("restart", "drain", "scale_out"):
            out[key] = out["with"][key]
    return out


class _Cluster:
    """Redis, a router and named workers, each a child process (kvmesh.serve.processes)."""

    def __init__(self, cfg: RestartConfig, on: bool, log_dir: Path) -> None:
        self.cfg, self.on, self.log_dir = cfg, on, log_dir
        self.redis_url, self.redis = start_redis(log_dir)
        self.workers: dict[str, tuple[Child, int, int]] = {}   # name -> (child, port, its log's start)
        self.router: Child | None = None
        self.target = ""

    def _env(self) -> dict[str, str]:
        return {"KVMESH_REDIS_URL": self.redis_url}

    def start_worker(self, name: str, port: int | None = None, append: bool = False) -> Child:
        port = port if port is not None else free_port("127.0.0.1")
        argv = [sys.executable, "-m", "kvmesh.cli", "worker", "--host", "127.0.0.1", "--port", str(port),
                "--worker-id", name, "--cluster-name", _CLUSTER, "--model", self.cfg.model, "--peer-transfer",
                "--metrics-port", "-1", "--threads", "1", "--drain-timeout-s", str(self.cfg.window_s / 2),
                "--kv-offload-gib", str(self.cfg.kv_offload_gib)]
        if self.cfg.num_blocks is not None:
            argv += ["--num-blocks", str(self.cfg.num_blocks)]
        if self.on:
            argv += ["--kv-disk-path", str(self.log_dir / "kv-disk"), "--kv-disk-gib", str(self.cfg.kv_disk_gib)]
        else:
            argv += ["--no-drain-handover", "--warm-start-mb-s", "0"]
        out = self.log_dir / f"{name}.out"
        start = out.stat().st_size if append and out.exists() else 0   # a restart appends to its log
        child = spawn(self.log_dir, name, argv, append=append, env=self._env())
        self.workers[name] = (child, port, start)
        return child

    def wait_worker(self, name: str) -> float:
        """Wait for this start's serving line (not an earlier run's, above it in the log)."""
        child, _, start = self.workers[name]
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while not _WORKER_LINE.search(child.stdout.read_bytes()[start:].decode(errors="replace")):
            if child.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start (rc {child.proc.poll()}, log {child.stderr})")
            time.sleep(0.2)
        return time.monotonic()

    def start_router(self) -> None:
        grpc_port, http_port = free_port("127.0.0.1"), free_port("127.0.0.1")
        argv = [sys.executable, "-m", "kvmesh.cli", "router", "--host", "127.0.0.1", "--grpc-port", str(grpc_port),
                "--http-port", str(http_port), "--cluster-name", _CLUSTER, "--model", self.cfg.model]
        self.router = spawn(self.log_dir, "router", argv, env=self._env())
        m = self.router.wait_line(_ROUTER_LINE, time.monotonic() + self.cfg.startup_timeout_s,
                                  self.cfg.startup_timeout_s)
        self.target = f"127.0.0.1:{m.group(2)}"

    def signal(self, name: str, sig: signal.Signals) -> None:
        self.workers[name][0].proc.send_signal(sig)

    def stop(self) -> None:
        parts = [c for c, _, _ in self.workers.values()] + ([self.router] if self.router else []) + [self.redis]
        terminate(parts, 30.0)


async def _client(stub: pb_grpc.RouterStub, prompts: list[list[int]], cfg: RestartConfig, rng: random.Random,
                  records: list[Record], stop: asyncio.Event) -> None:
    while not stop.is_set():
        prefix = prompts[rng.randrange(len(prompts))]
        ids = prefix + [rng.randrange(*_TOKENS) for _ in range(cfg.suffix_tokens)]
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                                 sampling=pb.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        last = None
        try:
            async for msg in stub.Generate(req, timeout=120):
                last = msg
        except grpc.aio.AioRpcError as e:
            records.append(Record(time.monotonic(), "", len(ids), 0, e.code().name))
            await asyncio.sleep(0.2)
            continue
        if last is None or not last.finished:
            records.append(Record(time.monotonic(), "", len(ids), 0, "no final message"))
            continue
        records.append(Record(time.monotonic(), last.worker_id, last.prompt_tokens, last.cached_tokens))


def _fraction(records: list[Record]) -> float | None:
    ok = [r for r in records if not r.error]
    prompt = sum(r.prompt_tokens for r in ok)
    return sum(r.cached_tokens for r in ok) / prompt if prompt else None


def _window(records: list[Record], a: float, b: float) -> list[Record]:
    return [r for r in records if a <= r.end < b]


def _ratio(after: float | None, before: float | None) -> float | None:
    return after / before if after is not None and before else None


def _first_hit(records: list[Record], since: float, worker_id: str) -> float | None:
    return next((r.end - since for r in records if r.end >= since and r.worker_id == worker_id
                 and r.cached_tokens > 0), None)


def _event(records: list[Record], t: float, window_s: float, worker_id: str) -> dict[str, Any]:
    before, after = _window(records, t - window_s, t), _window(records, t, t + window_s)
    fb, fa = _fraction(before), _fraction(after)
    return {"cached_before": fb, "cached_after": fa, "cached_ratio": _ratio(fa, fb),
            "requests_before": len(before), "requests_after": len(after),
            "errors_after": sum(1 for r in after if r.error), "first_hit_s": _first_hit(records, t, worker_id)}


async def _until(check: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        await asyncio.sleep(0.5)


async def _scenario(cfg: RestartConfig, on: bool, log_dir: Path) -> dict[str, Any]:
    rng = random.Random(cfg.seed)
    prompts = [[rng.randrange(*_TOKENS) for _ in range(cfg.prefix_tokens)] for _ in range(cfg.num_prefixes)]
    cluster = await asyncio.to_thread(_Cluster, cfg, on, log_dir)
    records: list[Record] = []
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    w = cfg.window_s
    try:
        for name in ("w-0", "w-1"):
            cluster.start_worker(name)
        for name in ("w-0", "w-1"):
            await asyncio.to_thread(cluster.wait_worker, name)
        await asyncio.to_thread(cluster.start_router)
        async with grpc.aio.insecure_channel(cluster.target) as channel:
            stub = pb_grpc.RouterStub(channel)
            tasks = [asyncio.create_task(_client(stub, prompts, cfg, random.Random(cfg.seed * 100 + c), records, stop))
                     for c in range(cfg.clients)]
            await _until(lambda: sum(1 for r in records if not r.error) >= 2 * cfg.num_prefixes, 10 * w)
            await asyncio.sleep(w)                               # the window before the restart
            t1 = time.monotonic()
            cluster.signal("w-1", signal.SIGKILL)
            await asyncio.to_thread(cluster.workers["w-1"][0].proc.wait)
            cluster.start_worker("w-1", port=cluster.workers["w-1"][1], append=True)
            t1_ready = await asyncio.to_thread(cluster.wait_worker, "w-1")
            # the drain's window before starts once w-1 serves again (a slow restart delays it)
            await asyncio.sleep(max(0.0, max(t1 + 2 * w, t1_ready + w) - time.monotonic()))
            t2 = time.monotonic()
            cluster.signal("w-0", signal.SIGTERM)
            await asyncio.sleep(max(0.0, t2 + 2 * w - time.monotonic()))
            drained_rc = cluster.workers["w-0"][0].proc.poll()
            t3 = time.monotonic()
            cluster.start_worker("w-2")
            t3_ready = await asyncio.to_thread(cluster.wait_worker, "w-2")
            await _until(lambda: sum(1 for r in records if r.end >= t3 and r.worker_id == "w-2") >= 20
                         and time.monotonic() >= t3 + w, 3 * w)
            stop.set()
            await asyncio.gather(*tasks)
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.to_thread(cluster.stop)
    ready = _event(records, t1_ready, w, "w-1")
    restart = _event(records, t1, w, "w-1") | {
        "restart_s": t1_ready - t1, "cached_after_ready": ready["cached_after"],
        "cached_ratio_after_ready": _ratio(ready["cached_after"], _fraction(_window(records, t1 - w, t1))),
        "first_hit_after_ready_s": ready["first_hit_s"]}
    drain = _event(records, t2, w, "w-1") | {"drained_exit_code": drained_rc}
    first20 = [r for r in records if r.end >= t3 and r.worker_id == "w-2"][:20]
    cluster_before = _fraction(_window(records, t3 - w, t3))
    scale_out = {"cluster_cached_before": cluster_before, "first20_cached": _fraction(first20),
                 "first20_cached_ratio": _ratio(_fraction(first20), cluster_before), "first20_requests": len(first20),
                 "ready_s": t3_ready - t3, "first_hit_s": _first_hit(records, t3_ready, "w-2"),
                 **{k: v for k, v in _event(records, t3, w, "w-2").items() if k != "first_hit_s"}}
    errors = Counter(r.error for r in records if r.error)
    return {"disk_tier": on, "drain_handover": on, "warm_start": on, "restart": restart, "drain": drain,
            "scale_out": scale_out, "requests": len(records), "errors": sum(errors.values()),
            "errors_by_code": dict(errors)}

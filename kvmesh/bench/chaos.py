"""`kvmesh bench chaos`: a fixed kill/partition schedule against a 3-worker `kvmesh serve`
(restart policy always) under steady load; what the clients saw, as JSON:
`{"requests", "completed", "failed", "hung", "migrated", "outputs_equal_frac", "recovery_s": {...}}`.

Load: `concurrency` closed-loop clients, each sending greedy streams (ignore_eos, `max_tokens`
tokens) of one of a fixed set of prompts through the router. The baseline, measured in the
same run before any fault: each prompt once through the same cluster, nothing failing; a
stream's output is "equal" when its tokens equal that prompt's baseline tokens exactly.

The schedule (seconds after the load starts; `--quick` halves the gaps, full runs it twice):
kill -9 a worker (its streams migrate; recovery: until the router routes to it again), kill -9
Redis (recovery: until it answers PING), partition the router from a worker for a while (only
inside a private network namespace, which the bench creates with `ip netns` and runs itself in;
recovery: heal → back in routing), SIGTERM a worker (it drains; restarted under `always`).

`--disagg` runs the disaggregated scenario instead (kvmesh/bench/chaos_disagg.py): 1 prefill + 2
decode workers, the prefill worker killed mid-hand-off, a decode worker killed mid-stream.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import redis

from contracts.cli import CLIError, flagify
from kvmesh.bench import chaos_disagg
from kvmesh.bench.chaos_harness import (
    Outcome,
    Partition,
    ServeProcess,
    in_private_netns,
    run_streams,
    stream_once,
    wait_until,
    workers_up,
)
from kvmesh.bench.report import emit
from proto.kvmesh.v1 import kvmesh_pb2_grpc as pb_grpc

FAULTS = ("kill9_worker", "kill9_redis", "partition_router_worker", "sigterm_worker")
PROMPTS = ("The history of the lighthouse begins", "A recipe for bread needs", "The three laws of motion say",
           "In a small village by the sea,", "The best way to learn a language is", "Rivers of Europe include",
           "A paged KV cache works by", "The chess opening called the Sicilian")


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    quick: bool = True
    workers: int = 3
    concurrency: int = 6
    max_tokens: int = 16
    gap_s: float = 8.0           # between faults
    partition_s: float = 8.0
    partitions: bool = True      # only inside a private network namespace
    request_timeout_s: float = 120.0
    only: tuple[str, ...] = ()   # run just these faults of the schedule (by name); () = all

    def __post_init__(self) -> None:
        if self.workers < 3:
            raise ValueError(f"workers={self.workers} must be >= 3 (the schedule hits three)")
        for name in ("concurrency", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        unknown = set(self.only) - set(FAULTS)
        if unknown:
            raise ValueError(f"only: unknown fault(s) {sorted(unknown)}; known: {', '.join(FAULTS)}")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chaos", help="kill/partition schedule on a 3-worker cluster under load: failed, hung, "
                                     "migrated, outputs equal to a fault-free run, recovery seconds")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--quick", action="store_true", help="one pass of the schedule with shorter gaps")
    p.add_argument("--no-partitions", action="store_true", help="skip the partition (no network namespace)")
    p.add_argument("--disagg", action="store_true",
                   help="the disaggregated scenario: 1 prefill + 2 decode workers, the prefill worker killed "
                        "mid-hand-off, a decode worker killed mid-stream (no partitions)")
    p.add_argument("--only", action="append", default=[], choices=FAULTS + chaos_disagg.FAULTS, metavar="FAULT",
                   help=f"run only this fault of the schedule (repeatable): {', '.join(FAULTS)}; with --disagg: "
                        f"{', '.join(chaos_disagg.FAULTS)}")
    p.add_argument("--in-netns", action="store_true", help=argparse.SUPPRESS)   # set when re-run inside one
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    scenario = chaos_disagg.FAULTS if args.disagg else FAULTS
    wrong = [f for f in args.only if f not in scenario]
    if wrong:
        raise CLIError(f"--only: {wrong[0]} is not in this scenario's schedule ({', '.join(scenario)})")
    if args.disagg:
        return emit(chaos_disagg.run_disagg_chaos(args.quick, concurrency=6 if args.quick else 12, max_tokens=32,
                                                  gap_s=8.0 if args.quick else 15.0, request_timeout_s=120.0,
                                                  only=tuple(args.only)), args.json)
    if not args.no_partitions and not args.in_netns and not in_private_netns():
        result = _run_in_new_netns(args)
        if result is not None:
            return result
        args.no_partitions = True     # namespaces refused: run without the partition, say so
        print("kvmesh bench chaos: cannot create a network namespace (ip netns); running without partitions",
              file=sys.stderr)
    try:
        cfg = ChaosConfig(quick=args.quick, gap_s=8.0 if args.quick else 15.0, partitions=not args.no_partitions,
                          concurrency=6 if args.quick else 12, only=tuple(args.only))
    except ValueError as e:
        raise CLIError(flagify(str(e))) from None
    return emit(run_chaos(cfg), args.json)


def _run_in_new_netns(args: argparse.Namespace) -> int | None:
    """Re-run this bench inside a fresh network namespace (its own loopback); None if refused."""
    name = f"kvm-{uuid.uuid4().hex[:8]}"
    if shutil.which("ip") is None or subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode:
        return None
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, capture_output=True)
        argv = [sys.executable, "-m", "kvmesh.cli", "bench", "chaos", "--in-netns",
                *(["--quick"] if args.quick else []), *(["--json", str(args.json)] if args.json else []),
                *[a for f in args.only for a in ("--only", f)]]
        return subprocess.run(["ip", "netns", "exec", name, *argv], cwd=Path(__file__).resolve().parents[2],
                              env=os.environ.copy()).returncode
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def run_chaos(cfg: ChaosConfig) -> dict[str, Any]:
    log_dir = Path(tempfile.mkdtemp(prefix="kvmesh-chaos-"))
    serve = ServeProcess(cfg.workers, log_dir, ("--restart-policy", "always", "--routing-policy", "kv_aware"))
    try:
        serve.start()
        baseline = asyncio.run(run_streams(serve.grpc_target, list(PROMPTS), cfg.max_tokens, cfg.request_timeout_s,
                                           list(range(len(PROMPTS)))))
        assert all(o.ok for o in baseline), [o for o in baseline if not o.ok]
        outcomes, recovery = asyncio.run(_under_load(serve, cfg))
        survived = serve.proc is not None and serve.proc.poll() is None
    finally:
        serve.stop()
        shutil.rmtree(log_dir, ignore_errors=True)
    expected = {o.prompt: o.tokens for o in baseline}
    done = [o for o in outcomes if o.ok]
    return {
        "requests": len(outcomes), "completed": len(done), "failed": sum(bool(o.error) for o in outcomes),
        "hung": sum(o.hung for o in outcomes), "migrated": sum(o.migrations > 0 for o in done),
        "outputs_equal_frac": (sum(o.tokens == expected[o.prompt] for o in done) / len(done)) if done else 0.0,
        "recovery_s": recovery, "cluster_survived": survived,
        "errors": sorted({o.error for o in outcomes if o.error}),
        "config": {"quick": cfg.quick, "workers": cfg.workers, "concurrency": cfg.concurrency,
                   "max_tokens": cfg.max_tokens, "gap_s": cfg.gap_s, "partitions": cfg.partitions,
                   "schedule": [name for name, _ in _schedule(cfg)] * (1 if cfg.quick else 2)},
    }


async def _under_load(serve: ServeProcess, cfg: ChaosConfig) -> tuple[list[Outcome], dict[str, Any]]:
    outcomes: list[Outcome] = []
    stop = asyncio.Event()

    async def client(c: int) -> None:
        async with grpc.aio.insecure_channel(serve.grpc_target) as ch:
            stub = pb_grpc.RouterStub(ch)
            i = c
            while not stop.is_set():
                p = i % len(PROMPTS)
                outcomes.append(await stream_once(stub, p, PROMPTS[p], cfg.max_tokens, cfg.request_timeout_s))
                i += cfg.concurrency

    clients = [asyncio.create_task(client(c)) for c in range(cfg.concurrency)]
    recovery: dict[str, list[float | None]] = {}
    try:
        for _ in range(1 if cfg.quick else 2):
            for name, fault in _schedule(cfg):
                await asyncio.sleep(cfg.gap_s)
                recovery.setdefault(name, []).append(await asyncio.to_thread(fault, serve))
        await asyncio.sleep(cfg.gap_s / 2)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*clients), cfg.request_timeout_s + 30)
    return outcomes, {k: (v[0] if len(v) == 1 else v) for k, v in recovery.items()}


def _schedule(cfg: ChaosConfig) -> list[tuple[str, Any]]:
    """(name, fault): each fault runs in a thread and returns its recovery seconds (None: none
    within 120 s)."""
    faults: list[tuple[str, Any]] = [("kill9_worker", lambda s: _kill_worker(s, 0)), ("kill9_redis", _kill_redis)]
    if cfg.partitions:
        faults.append(("partition_router_worker", lambda s: _partition(s, 1, cfg.partition_s)))
    faults.append(("sigterm_worker", lambda s: _kill_worker(s, 2, signal.SIGTERM)))
    return [f for f in faults if not cfg.only or f[0] in cfg.only]


def _kill_worker(serve: ServeProcess, i: int, sig: signal.Signals = signal.SIGKILL) -> float | None:
    name = f"worker-{i}"
    before = serve.restarts(name)
    serve.kill(name, sig)
    t0 = time.monotonic()
    if wait_until(lambda: serve.restarts(name) > before, 120) is None:
        return None
    back = wait_until(lambda: workers_up(serve.http_base).get(name, False), 120)
    return None if back is None else round(time.monotonic() - t0, 2)


def _kill_redis(serve: ServeProcess) -> float | None:
    serve.kill("redis")
    t0 = time.monotonic()
    time.sleep(0.5)

    def ping() -> bool:
        with redis.Redis.from_url(serve.redis_url, socket_timeout=1.0) as r:
            return bool(r.ping())
    back = wait_until(lambda: _quiet(ping), 120)
    return None if back is None else round(time.monotonic() - t0, 2)


def _partition(serve: ServeProcess, i: int, seconds: float) -> dict[str, float | None]:
    """Cut router <-> worker i for `seconds`: how long until it left routing, and from the
    heal until it was back."""
    name = f"worker-{i}"
    # in routing first (and so listed in the router's metrics, which only name workers seen up)
    if wait_until(lambda: workers_up(serve.http_base).get(name, False), 120) is None:
        return {"left_routing_s": None, "back_after_heal_s": None}
    cut = Partition(serve.worker_port(i))
    cut.cut()
    try:
        left = wait_until(lambda: not workers_up(serve.http_base).get(name, True), seconds + 30)
        time.sleep(max(seconds - (left or 0.0), 0.0))
    finally:
        cut.heal()
    back = wait_until(lambda: workers_up(serve.http_base).get(name, False), 120)
    return {"left_routing_s": None if left is None else round(left, 2),
            "back_after_heal_s": None if back is None else round(back, 2)}


def _quiet(check: Any) -> bool:
    try:
        return bool(check())
    except (redis.RedisError, OSError):
        return False
